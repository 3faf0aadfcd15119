"""Benchmark: the analysis step on length-bucketed batches vs fixed [B, T] batches, real tokens/s.

  python experiments/bench_analysis.py --config=configs/smollm2_135m.py:paper \
      --config.data.source=distilled:DIR --widths=64,128,256 --steps=8

On the analysis data of `--config` (its `data` section and `analysis` settings, the real target of
`config.model`), the jitted analysis step (`analysis.collect.stats_step`: the forward with every hidden state,
the token entropy, the filter and both accumulators' updates) runs on fixed [`analysis.batch_size`,
`data.max_length`] batches and on length-bucketed ones (`analysis.bucket_widths` = `--widths`: the same token
slots each, as [B * T / w, w]), steps alternated (fixed, bucketed, ...) so both modes see the same machine
load; the fixed shape and every bucket width compile in the warm-up first. Reports, for each mode, the share of
an epoch's token slots that hold real tokens, the real tokens/s of the timed steps (their real tokens / their
summed time), the median step time, and the ratio bucketed / fixed. Writes `W/bench_analysis.json` and prints
a markdown table.
"""

import layerwave  # noqa: F401  # first: it sets OPENBLAS_NUM_THREADS before numpy and jax load OpenBLAS

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import functools
import json
import os
import platform
import statistics

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

import jax
import numpy as np

from layerwave import data as data_lib
from layerwave import metrics as metrics_lib
from layerwave import options as options_lib
from layerwave import sharding
from layerwave.analysis import collect
from layerwave.data.options import DataOptions
from layerwave.inference import load_target

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2_135m.py", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "out/bench_analysis", "Where the JSON result goes.")
_WIDTHS = flags.DEFINE_string("widths", "64,128,256", "Length buckets (data.max_length is always added).")
_STEPS = flags.DEFINE_integer("steps", 8, "Timed steps per mode (after the warm-up).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.INFO)
  config = _CONFIG.value
  mesh = sharding.make_mesh(config.mesh)
  target = load_target(config.model, dtype=config.dtype, mesh=mesh)
  data_options = options_lib.from_section(DataOptions, config.data, "data")
  ds = data_options.build(target.tokenizer)
  source = ds.source(options_lib.convert(config.analysis.split, str, "analysis.split"))
  b, t = options_lib.convert(config.analysis.batch_size, int, "analysis.batch_size"), data_options.max_length
  widths = tuple(int(w) for w in _WIDTHS.value.split(",") if w and int(w) < t)
  pad_id = int(target.tokenizer.pad_token_id or 0)
  its = {mode: data_lib.BatchIterator(source, batch_size=b, seq_len=t, pad_id=pad_id, seed=0, widths=w)
         for mode, w in (("fixed", ()), ("bucketed", widths))}
  options = collect.options_from_config(config.analysis)
  step_fn = jax.jit(functools.partial(collect.stats_step, target.graphdef, options=options), donate_argnums=(1,),
                    out_shardings=sharding.replicated(mesh))
  states = {m: collect.init_state(target, options, mesh) for m in its}
  threshold = np.float32(1.0)  # any cut: the work does not depend on it

  def step(mode, batch, index):
    arrays = collect._put_batch(batch, mesh)  # pylint: disable=protected-access
    states[mode] = step_fn(target.params, states[mode], *arrays, threshold, np.int32(index))
    return states[mode]["tokens"]["kept"]

  # Warm-up: one step of the fixed shape and one of every bucket width (each compiles once).
  metrics_lib.timed(lambda: step("fixed", next(its["fixed"]), 0))
  pending = set(its["bucketed"].widths)
  for _ in range(its["bucketed"].steps_per_epoch):  # a width without a full batch never comes
    if not pending:
      break
    batch = next(its["bucketed"])
    if batch.input_ids.shape[1] in pending:
      pending.discard(batch.input_ids.shape[1])
      metrics_lib.timed(lambda batch=batch: step("bucketed", batch, 0))
  times = {m: [] for m in its}
  tokens = {m: 0 for m in its}
  for i in range(_STEPS.value):
    for mode in its:
      batch = next(its[mode])
      times[mode].append(metrics_lib.timed(lambda mode=mode, batch=batch, i=i: step(mode, batch, i + 1)))
      tokens[mode] += int(batch.attention_mask.sum())
      logging.info("step %d %s %s: %.2fs, %d real tokens", i, mode, batch.input_ids.shape, times[mode][-1],
                   int(batch.attention_mask.sum()))
  rows = {}
  for mode, it in its.items():
    rows[mode] = {"widths": list(it.widths) or [t], "slot_share_epoch": it.epoch_fill(),
                  "steps_per_epoch": it.steps_per_epoch, "median_step_s": statistics.median(times[mode]),
                  "real_tokens_per_s": tokens[mode] / sum(times[mode]), "times": times[mode],
                  "real_tokens": tokens[mode]}
  ratio = rows["bucketed"]["real_tokens_per_s"] / rows["fixed"]["real_tokens_per_s"]
  machine = {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
             "jax": jax.__version__, "devices": [str(d) for d in jax.devices()]}
  result = {"model": config.model, "data": ds.name, "source": data_options.source, "batch": b, "seq_len": t,
            "dtype": config.dtype, "machine": machine, "modes": rows, "bucketed_over_fixed": ratio}
  os.makedirs(_WORKDIR.value, exist_ok=True)
  with open(os.path.join(_WORKDIR.value, "bench_analysis.json"), "w") as f:
    json.dump(result, f, indent=1)
  print(f"\n{config.model} ({config.dtype}) on {ds.name}, the analysis step, {b} x {t} token slots per step, "
        f"{_STEPS.value} alternated steps per mode, {machine['cpus']} CPUs\n")
  print("| batches | widths | real tokens / slots (epoch) | steps / epoch | median step (s) | real tokens/s |")
  print("|---|---|---|---|---|---|")
  for mode, r in rows.items():
    print(f"| {mode} | {','.join(map(str, r['widths']))} | {r['slot_share_epoch']:.2f} | {r['steps_per_epoch']} | "
          f"{r['median_step_s']:.2f} | {r['real_tokens_per_s']:.0f} |")
  print(f"\nbucketed / fixed real tokens/s: {ratio:.2f}x")


if __name__ == "__main__":
  app.run(main)
