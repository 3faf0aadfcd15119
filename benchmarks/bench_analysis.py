"""Benchmark: the analysis step on length-bucketed batches vs fixed [B, T] batches, real tokens/s.

  python benchmarks/bench_analysis.py --config=configs/smollm2_135m.py:paper \
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

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
from absl import app
from absl import flags
from ml_collections import config_flags

import numpy as np

import harness
from layerwave import data as data_lib
from layerwave import metrics as metrics_lib
from layerwave import options as options_lib
from layerwave.analysis import collect
from layerwave.data.options import DataOptions

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2_135m.py", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "out/bench_analysis", "Where the JSON result goes.")
_WIDTHS = flags.DEFINE_string("widths", "64,128,256", "Length buckets (data.max_length is always added).")
_STEPS = flags.DEFINE_integer("steps", 8, "Timed steps per mode (after the warm-up).")


def main(argv):
  config = _CONFIG.value
  target = harness.start(argv, config)
  mesh = target.mesh
  data_options = options_lib.from_section(DataOptions, config.data, "data")
  ds = data_options.build(target.tokenizer)
  source = ds.source(options_lib.convert(config.analysis.split, str, "analysis.split"))
  b, t = options_lib.convert(config.analysis.batch_size, int, "analysis.batch_size"), data_options.max_length
  widths = tuple(int(w) for w in _WIDTHS.value.split(",") if w and int(w) < t)
  pad_id = int(target.tokenizer.pad_token_id or 0)
  its = {mode: data_lib.BatchIterator(source, batch_size=b, seq_len=t, pad_id=pad_id, seed=0, widths=w)
         for mode, w in (("fixed", ()), ("bucketed", widths))}
  options = collect.options_from_config(config.analysis)
  step_fn = collect.stats_step_jit(target.graphdef, target.config, options, mesh)
  states = {m: collect.init_state(target, options, mesh) for m in its}
  threshold = np.float32(1.0)  # any cut: the work does not depend on it

  def step(mode, batch):
    arrays = collect.put_batch(batch, mesh)
    states[mode] = step_fn(target.params, states[mode], *arrays, threshold, np.int32(0))
    return states[mode]["tokens"]["kept"]

  rows, ratio = metrics_lib.fixed_vs_buckets(its, step, _STEPS.value, t)
  machine = metrics_lib.machine()
  result = {"model": config.model, "data": ds.name, "source": data_options.source, "batch": b, "seq_len": t,
            "dtype": config.dtype, "machine": machine, "modes": rows, "bucketed_over_fixed": ratio}
  harness.write_result(_WORKDIR.value, "bench_analysis.json", result)
  print(f"\n{config.model} ({config.dtype}) on {ds.name}, the analysis step, {b} x {t} token slots per step, "
        f"{_STEPS.value} alternated steps per mode, {machine['cpus']} CPUs\n")
  print(metrics_lib.buckets_table(rows, ratio))


if __name__ == "__main__":
  app.run(main)
