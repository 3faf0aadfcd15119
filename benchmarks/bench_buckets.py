"""Benchmark: length-bucketed offline training batches vs fixed [B, T] batches, real tokens/s.

  python benchmarks/bench_buckets.py --features=STORE --widths=128,256 --batch=8 --seq_len=512

On a feature store (experiments/extract_features.py) of the real target of `--config` (default SmolLM2-135M-
Instruct), the offline train step (`train_step_offline`, K = `--k`, V_d = `--vocab`) runs on fixed [B, T]
batches and on length-bucketed batches (`train.bucket_widths`: B * T token slots each, as [B * T / w, w]),
steps alternated (fixed, bucketed, ...) so both modes see the same machine load; every width compiles in
the warm-up first. Reports, for each mode, the share of token slots that hold real tokens over a whole epoch
(from the store's lengths), the real tokens/s of the timed steps (their real tokens / their summed time), the
median step time, and the ratio bucketed / fixed. Writes `W/bench_buckets.json` and prints a markdown table.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import os

from absl import app
from absl import flags
from ml_collections import config_flags

import jax
import numpy as np

import harness
from layerwave import layer_ids
from layerwave import metrics as metrics_lib
from layerwave import options as options_lib
from layerwave import sharding
from layerwave.training import features
from layerwave.training import loop
from layerwave.training import sources
from layerwave.training import step as step_lib
from layerwave.training.options import DraftModelOptions, TrainOptions

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2_135m.py", lock_config=True)
_FEATURES = flags.DEFINE_string("features", None, "Feature store to read.", required=True)
_WORKDIR = flags.DEFINE_string("workdir", "out/bench_buckets", "Where the JSON result goes.")
_LAYERS = flags.DEFINE_string("layers", "2,15,27", "The draft's layers (stored in the store).")
_WIDTHS = flags.DEFINE_string("widths", "128,256", "Length buckets (seq_len is always added).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 512, "T of the fixed batches (the store's max).")
_BATCH = flags.DEFINE_integer("batch", 8, "B of the fixed batches.")
_K = flags.DEFINE_integer("k", 3, "TTT depth K.")
_VOCAB = flags.DEFINE_integer("vocab", 8192, "Draft vocabulary V_d.")
_STEPS = flags.DEFINE_integer("steps", 12, "Timed steps per mode (after the warm-up).")


def main(argv):
  config = _CONFIG.value
  target = harness.start(argv, config)
  mesh = target.mesh
  store = features.open_store(_FEATURES.value)
  layers = layer_ids.parse_layer_ids(_LAYERS.value)
  t, b = _SEQ_LEN.value, _BATCH.value
  split = store.split("train", t)
  pad_id = int(target.tokenizer.pad_token_id or 0)
  widths = tuple(int(w) for w in _WIDTHS.value.split(",") if w)
  its = {mode: features.FeatureBatchIterator(split, store.layer_slots(layers), batch_size=b, seq_len=t,
                                             pad_id=pad_id, seed=0, widths=w)
         for mode, w in (("fixed", ()), ("bucketed", widths))}
  record = layer_ids.LayerSelection(ids=tuple(layers), num_layers=target.config.num_layers)
  train = options_lib.from_section(TrainOptions, config.train, "train", batch_size=b, ttt_steps=_K.value)
  model = options_lib.from_section(DraftModelOptions, config.draft_model, "draft_model", vocab_size=_VOCAB.value)
  draft = loop.new_draft(model, train, 0, target, record, split)
  graphdef, params, vocab, embed = step_lib.split_draft(draft)
  embed = jax.tree.map(lambda _: target.params["embed_tokens"]["embedding"][...], embed)
  ids = np.arange(draft.config.draft_vocab_size) + np.asarray(jax.device_get(vocab["d2t"][...]))
  rep = sharding.replicated(mesh)
  head = jax.device_put(sources.target_head(target)[:, ids], rep)
  vocab, embed = jax.device_put(vocab, rep), jax.device_put(embed, rep)
  optimizer = step_lib.OptimizerSettings(1e-3, 2, 1000)
  kw = dict(program=step_lib.StepProgram(graphdef, step_lib.LossSettings(steps=_K.value, decay=0.8, assistant_only=True),
                                         optimizer=optimizer))
  states = {m: jax.device_put(step_lib.init_state(jax.tree.map(np.copy, params), optimizer), rep) for m in its}

  def step(mode, batch):
    arrays = features.device_arrays(batch, mesh)
    states[mode], m = step_lib.train_step_offline(states[mode], vocab, embed, head, arrays, **kw)
    return m["loss"]

  rows, ratio = metrics_lib.fixed_vs_buckets(its, step, _STEPS.value, t)
  machine = metrics_lib.machine()
  result = {"model": config.model, "store": os.path.abspath(_FEATURES.value), "layers": list(layers), "K": _K.value,
            "V_d": draft.config.draft_vocab_size, "batch": b, "seq_len": t, "machine": machine, "modes": rows,
            "bucketed_over_fixed": ratio}
  harness.write_result(_WORKDIR.value, "bench_buckets.json", result)
  print(f"\n{config.model}, layers {list(layers)}, K={_K.value}, V_d={result['V_d']}, {b} x {t} token slots per "
        f"step, {_STEPS.value} alternated steps per mode, {machine['cpus']} CPUs\n")
  print(metrics_lib.buckets_table(rows, ratio))


if __name__ == "__main__":
  app.run(main)
