"""Metric writing with one naming scheme (`train/loss`, `draft/acc_0`, `spec/tau`, ...).

Each write goes to the log, to `metrics.jsonl` in the workdir (what notebooks read) and, when tensorboardX is
installed, to TensorBoard event files. Only process 0 writes files on multi-host runs. (clu's writers need
TensorFlow, which this project does not install.)
"""

from __future__ import annotations

import json
import logging as std_logging
import os
import platform
import statistics
import time
from typing import Mapping

import jax
import numpy as np
from absl import logging


def flatten(prefix: str, metrics: Mapping) -> dict[str, float]:
  """`{'acc_j': [a, b]}` → `{'prefix/acc_0': a, 'prefix/acc_1': b}`; scalars kept as floats."""
  out = {}
  for key, value in metrics.items():
    arr = np.asarray(value)
    name = key[:-2] if key.endswith("_j") else key
    if arr.ndim == 0:
      out[f"{prefix}/{name}"] = float(arr)
    else:
      for i, v in enumerate(arr.reshape(-1)):
        out[f"{prefix}/{name}_{i}"] = float(v)
  return out


class MetricWriter:
  """Writes scalars to the log, `workdir/metrics.jsonl` and TensorBoard."""

  def __init__(self, workdir: str | None, just_logging: bool | None = None):
    just_logging = jax.process_index() > 0 if just_logging is None else just_logging
    self._path = None
    self._tb = None
    if workdir and not just_logging:
      os.makedirs(workdir, exist_ok=True)
      self._path = os.path.join(workdir, "metrics.jsonl")
      try:
        import tensorboardX  # pylint: disable=g-import-not-at-top
        self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"))
      except ImportError:
        self._tb = None

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    scalars = {k: float(v) for k, v in scalars.items()}
    logging.info("[%d] %s", step, ", ".join(f"{k}={v:.4g}" for k, v in sorted(scalars.items())))
    if self._path:
      with open(self._path, "a") as f:
        f.write(json.dumps({"step": int(step), "time": time.time(), **scalars}) + "\n")
    if self._tb is not None:
      for k, v in scalars.items():
        self._tb.add_scalar(k, v, int(step))

  def flush(self) -> None:
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


class _DropLibraryInfo(std_logging.Filter):
  """Drops INFO records emitted from inside orbax (it logs every file operation at INFO)."""

  def filter(self, record) -> bool:
    return record.levelno > 20 or "/orbax/" not in record.pathname


def quiet_library_logs() -> None:
  """Keeps absl INFO logging readable: orbax's per-file INFO messages are dropped."""
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _DropLibraryInfo) for f in handler.filters):
    handler.addFilter(_DropLibraryInfo())


def timed(fn) -> float:
  """Wall seconds of `fn()` until its result is ready on device (`jax.block_until_ready`): benchmarks time
  side by side with it."""
  tic = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - tic


def fixed_vs_buckets(iterators: Mapping, step, num_steps: int, seq_len: int) -> dict:
  """Times a step on fixed batches against length-bucketed ones, side by side (the length-bucket benchmarks).

  Args:
    iterators: {"fixed": BatchIterator without widths, "bucketed": one with widths}, over the same data.
    step: step(mode, batch) -> a device value; it runs the benchmarked step on `batch`.
    num_steps: timed steps per mode, alternated (fixed, bucketed, ...) so both see the same machine load,
      after a warm-up that compiles the fixed shape and every bucket width once.
    seq_len: T of the fixed batches.

  Returns:
    ({mode: {widths, slot_share_epoch, steps_per_epoch, median_step_s, real_tokens_per_s, times, real_tokens}},
     the ratio bucketed / fixed of the real tokens/s).
  """
  timed(lambda: step("fixed", next(iterators["fixed"])))
  pending = set(iterators["bucketed"].widths)
  for _ in range(iterators["bucketed"].steps_per_epoch):  # a width without a full batch never comes
    if not pending:
      break
    batch = next(iterators["bucketed"])
    if batch.input_ids.shape[1] in pending:
      pending.discard(batch.input_ids.shape[1])
      timed(lambda batch=batch: step("bucketed", batch))
  times = {m: [] for m in iterators}
  tokens = {m: 0 for m in iterators}
  for i in range(num_steps):
    for mode, it in iterators.items():
      batch = next(it)
      times[mode].append(timed(lambda mode=mode, batch=batch: step(mode, batch)))
      tokens[mode] += int(batch.attention_mask.sum())
      logging.info("step %d %s %s: %.2fs, %d real tokens", i, mode, batch.input_ids.shape, times[mode][-1],
                   int(batch.attention_mask.sum()))
  rows = {mode: {"widths": list(it.widths) or [seq_len], "slot_share_epoch": it.epoch_fill(),
                 "steps_per_epoch": it.steps_per_epoch, "median_step_s": statistics.median(times[mode]),
                 "real_tokens_per_s": tokens[mode] / sum(times[mode]), "times": times[mode],
                 "real_tokens": tokens[mode]} for mode, it in iterators.items()}
  return rows, rows["bucketed"]["real_tokens_per_s"] / rows["fixed"]["real_tokens_per_s"]


def buckets_table(rows: Mapping, ratio: float) -> str:
  """`fixed_vs_buckets`' rows and ratio as a markdown table and a line."""
  lines = ["| batches | widths | real tokens / slots (epoch) | steps / epoch | median step (s) | real tokens/s |",
           "|---|---|---|---|---|---|"]
  for mode, r in rows.items():
    lines.append(f"| {mode} | {','.join(map(str, r['widths']))} | {r['slot_share_epoch']:.2f} | "
                 f"{r['steps_per_epoch']} | {r['median_step_s']:.2f} | {r['real_tokens_per_s']:.0f} |")
  return "\n".join(lines) + f"\n\nbucketed / fixed real tokens/s: {ratio:.2f}x"


def machine() -> dict:
  """What a benchmark ran on: processor, CPU count, jax version, devices."""
  return {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "jax": jax.__version__,
          "devices": [str(d) for d in jax.devices()]}
