"""Metric writing with one naming scheme (`train/loss`, `draft/acc_0`, `spec/tau`, ...).

Each write goes to the log, to `metrics.jsonl` in the workdir (what notebooks read) and, when tensorboardX is
installed, to TensorBoard event files. Only process 0 writes files on multi-host runs. (clu's writers need
TensorFlow, which this project does not install.)
"""

from __future__ import annotations

import json
import logging as std_logging
import os
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
