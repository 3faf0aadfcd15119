"""Benchmark: offline draft training from a feature store vs online training, and extraction vs the bare forward.

  python benchmarks/bench_features.py --workdir=out/bench_features
  python benchmarks/bench_features.py --workdir=B --config=configs/smollm2_135m.py --seq_len=256 --ks=3

Side by side in one process, on the real target of `--config` (default SmolLM2-135M-Instruct) and real
ShareGPT sequences of `--seq_len` tokens:

1. the bare target forward (tokens → logits, jitted) vs the extraction (`layerwave.training.features.extract`
   end to end: forward + argmax, device → host, ragged shards written to disk), real tokens/s; the store it
   writes (bfloat16, the depths of `--layers` + h_L) is what step 2 reads, and its bytes per token are
   reported;
2. the online train step (target in the step) vs the offline step (features from the store) at the same K
   and V_d, on the same batches, steps alternated (online, offline, ...) after `--warmup` steps each; median
   step time → real tokens/s and the ratio (BENCHMARKS.md, "Feature store", compares it with its goal).

Writes `W/bench_features.json` and prints a markdown table.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import dataclasses
import os
import shutil
import statistics

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import harness
from layerwave import data as data_lib
from layerwave import layer_ids
from layerwave import metrics as metrics_lib
from layerwave import options as options_lib
from layerwave import sharding
from layerwave.data.options import DataOptions
from layerwave.inference import forward_fn
from layerwave.models.draft import Draft, DraftConfig
from layerwave.training import features
from layerwave.training.features import extraction as extraction_lib
from layerwave.training import sources
from layerwave.training import step as step_lib
from layerwave.training import vocab as vocab_lib

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2_135m.py", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (holds the store).", required=True)
_LAYERS = flags.DEFINE_string("layers", "2,15,27", "The draft's layers (and the store's depths).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 384, "Tokens per sequence (T).")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per step (B).")
_KS = flags.DEFINE_string("ks", "3,7", "TTT depths K to time.")
_VOCAB = flags.DEFINE_integer("vocab", 8192, "Draft vocabulary V_d.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps per mode and K (after the warm-up).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps per mode and K (the first compiles).")
_RECORDS = flags.DEFINE_integer("records", 200, "ShareGPT conversations read (the store's train split).")
_DTYPE = flags.DEFINE_string("store_dtype", "bfloat16", "Store dtype.")
_PARTS = flags.DEFINE_string("parts", "extraction,steps", "What to measure (the steps read the extracted store).")


def bench_forward_and_extraction(target, dataset, store_dir, layers, batch):
  """Bare forward vs extraction, real tokens/s; returns (results, the store).

  Paired: per batch, the bare forward (tokens → logits) and the extraction's forward (hidden states of the
  stored depths, h_L and the argmax, brought to the host) alternate, so both see the same machine. End to end:
  `features.extract` over the whole train split (data loading, ragged packing and disk writes included),
  against bare forwards of the same batches timed just before and after it.
  """
  it = data_lib.BatchIterator(dataset.source("train"), batch_size=batch, seq_len=_SEQ_LEN.value,
                              pad_id=int(target.tokenizer.pad_token_id or 0), shuffle=False)
  rows = sharding.batch_sharding(target.mesh)
  batches = [next(it) for _ in range(_WARMUP.value + _STEPS.value)]
  stored = tuple(d for d in layers if d != target.config.num_layers)
  dtype = jnp.bfloat16 if _DTYPE.value == "bfloat16" else jnp.float32
  extract_fn = extraction_lib.forward_step(target.mesh, target.graphdef, stored, dtype)

  def bare(b):
    ids, mask = jax.device_put(b.input_ids, rows), jax.device_put(b.attention_mask, rows)
    return metrics_lib.timed(lambda: forward_fn(target.graphdef, target.params, ids, mask).logits)

  def extracted(b):
    ids, mask = jax.device_put(b.input_ids, rows), jax.device_put(b.attention_mask, rows)
    return metrics_lib.timed(lambda: [np.asarray(x) for x in extract_fn(target.params, ids, mask)])

  paired = {"bare": [], "extract": []}
  tokens = 0
  for i, b in enumerate(batches):
    t_bare, t_extract = bare(b), extracted(b)
    if i >= _WARMUP.value:
      paired["bare"].append(t_bare)
      paired["extract"].append(t_extract)
      tokens += int(b.attention_mask.sum())
  per_batch = tokens / _STEPS.value
  before = [bare(b) for b in batches[_WARMUP.value:]]
  # The heldout split first (it compiles the whole extraction path), then the timed train split.
  kw = dict(depths=layers, dtype=_DTYPE.value, batch_size=batch, shard_sequences=64, model=_CONFIG.value.model,
            data=None)
  features.extract(target, dataset, store_dir, splits=("heldout",), **kw)
  result = features.extract(target, dataset, store_dir, splits=("train",), **kw)
  after = [bare(b) for b in batches[_WARMUP.value:]]
  bare_around = tokens / (sum(before) + sum(after)) * 2
  store = features.open_store(store_dir)
  sequences, stored_tokens = store.counts("train")
  shard_bytes = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(store_dir)
                    for f in files if "train-p" in root)
  med = {k: statistics.median(v) for k, v in paired.items()}
  out = {"bare_forward_tokens_per_s": per_batch / med["bare"],
         "extraction_forward_tokens_per_s": per_batch / med["extract"],
         "extraction_forward_over_bare": med["bare"] / med["extract"],
         "extraction_tokens_per_s": result["tokens_per_s"], "bare_forward_around_tokens_per_s": bare_around,
         "extraction_over_forward": result["tokens_per_s"] / bare_around,
         "extracted_tokens": result["tokens_computed"], "extraction_seconds": result["seconds"],
         "store_train_sequences": sequences, "store_train_tokens": stored_tokens,
         "store_bytes_per_token": shard_bytes / max(stored_tokens, 1),
         "manifest_bytes_per_token": store.header["bytes_per_token"], "paired_times": paired}
  return out, store


def bench_steps(target, dataset, store, layers, k, batch):
  """Online vs offline train step at TTT depth k on the same batches; median step time → real tokens/s."""
  t = _SEQ_LEN.value
  pad_id = int(target.tokenizer.pad_token_id or 0)
  n = _WARMUP.value + _STEPS.value
  online_it = data_lib.BatchIterator(dataset.source("train"), batch_size=batch, seq_len=t, pad_id=pad_id,
                                     shuffle=False)
  offline_it = features.FeatureBatchIterator(store.split("train", t), store.layer_slots(layers), batch_size=batch,
                                             seq_len=t, pad_id=pad_id, shuffle=False)
  pairs = [(next(online_it), next(offline_it)) for _ in range(n)]
  for a, b in pairs:
    np.testing.assert_array_equal(a.input_ids, b.input_ids)  # the same data, both ways
  source = dataset.source("train")
  counts = vocab_lib.count_tokens((source[i] for i in range(len(source))), target.config.vocab_size)
  v_d = min(_VOCAB.value, target.config.vocab_size)
  d2t, t2d = vocab_lib.build_vocab(counts, v_d)
  cfg = DraftConfig.from_target(target.config, layers, draft_vocab_size=v_d)
  draft = Draft(cfg, embedding=target.params["embed_tokens"]["embedding"][...], rngs=nnx.Rngs(0))
  draft.d2t[...], draft.t2d[...] = jnp.asarray(d2t), jnp.asarray(t2d)
  graphdef, params, vocab, embed = step_lib.split_draft(draft)
  optimizer = step_lib.OptimizerSettings(1e-3, 2, 100)
  rep = sharding.replicated(target.mesh)
  ids = np.arange(v_d) + d2t
  head_rows = jax.device_put(jnp.take(sources.target_head(target), jnp.asarray(ids), axis=1), rep)
  vocab, embed = jax.device_put(vocab, rep), jax.device_put(embed, rep)
  states = {m: jax.device_put(step_lib.init_state(jax.tree.map(jnp.copy, params), optimizer), rep)
            for m in ("online", "offline")}
  program = step_lib.StepProgram(graphdef, step_lib.LossSettings(steps=k, decay=0.8, assistant_only=True),
                                 optimizer=optimizer)
  online_program = dataclasses.replace(program, target_graphdef=target.graphdef)
  rows = sharding.batch_sharding(target.mesh)
  times = {"online": [], "offline": []}
  tokens = 0
  for i, (a, b) in enumerate(pairs):
    on = jax.device_put({key: v for key, v in a.arrays().items() if key != "example_mask"}, rows)
    off = features.device_arrays(b, target.mesh)

    def online():
      states["online"], m = step_lib.train_step(states["online"], vocab, embed, target.params, on,  # noqa: B023
                                                program=online_program)
      return m["loss"]

    def offline():
      states["offline"], m = step_lib.train_step_offline(states["offline"], vocab, embed, head_rows,  # noqa: B023
                                                         off, program=program)
      return m["loss"]

    t_on, t_off = metrics_lib.timed(online), metrics_lib.timed(offline)
    if i >= _WARMUP.value:
      times["online"].append(t_on)
      times["offline"].append(t_off)
      tokens += int(a.attention_mask.sum())
    logging.info("K=%d step %d: online %.2fs, offline %.2fs", k, i, t_on, t_off)
  per_step = tokens / _STEPS.value
  med = {m: statistics.median(v) for m, v in times.items()}
  gflop = step_gflop(target, states["online"], vocab, embed, head_rows, pairs[0], k, program)
  return {"K": k, "V_d": v_d, "batch": batch, "seq_len": t, "real_tokens_per_step": per_step,
          "online_s": med["online"], "offline_s": med["offline"],
          "online_tokens_per_s": per_step / med["online"], "offline_tokens_per_s": per_step / med["offline"],
          "offline_over_online": med["online"] / med["offline"], "online_gflop": gflop["online"],
          "offline_gflop": gflop["offline"], "flop_ratio": gflop["online"] / gflop["offline"], "times": times}


def step_gflop(target, state, vocab, embed, head_rows, pair, k, program):
  """Each step's GFLOP by XLA's cost analysis (which counts a loop body once): K = 1 + (K - 1) * (K=2 - K=1)."""
  online_batch = {key: v for key, v in pair[0].arrays().items() if key != "example_mask"}

  def flops(fn, *args, **kwargs):
    cost = fn.lower(*args, **kwargs).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"] / 1e9

  out = {}
  for mode in ("online", "offline"):
    one_two = []
    for steps in (1, 2):
      at = dataclasses.replace(program, loss=dataclasses.replace(program.loss, steps=steps))
      if mode == "online":
        one_two.append(flops(step_lib.train_step, state, vocab, embed, target.params, online_batch,
                             program=dataclasses.replace(at, target_graphdef=target.graphdef)))
      else:
        one_two.append(flops(step_lib.train_step_offline, state, vocab, embed, head_rows, pair[1].arrays(),
                             program=at))
    out[mode] = one_two[0] + (k - 1) * (one_two[1] - one_two[0])
  return out


def main(argv):
  config = _CONFIG.value
  target = harness.start(argv, config)
  layers = layer_ids.parse_layer_ids(_LAYERS.value)
  batch = _BATCH.value
  data = options_lib.from_section(DataOptions, config.data, "data", max_length=_SEQ_LEN.value,
                                  max_records=_RECORDS.value)
  dataset = data.build(target.tokenizer)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  store_dir = os.path.join(_WORKDIR.value, f"store_T{_SEQ_LEN.value}_{_DTYPE.value}")
  parts = _PARTS.value.split(",")
  if "extraction" in parts:
    shutil.rmtree(store_dir, ignore_errors=True)  # a fresh store: the extraction is timed from scratch
    extraction, store = bench_forward_and_extraction(target, dataset, store_dir, layers, batch)
  else:
    extraction, store = None, features.open_store(store_dir)
  steps = [bench_steps(target, dataset, store, layers, int(k), batch) for k in _KS.value.split(",")
           if "steps" in parts]
  machine = {**metrics_lib.machine(), "dtype": config.dtype}
  result = {"model": config.model, "layers": list(layers), "store_dtype": _DTYPE.value, "machine": machine,
            "extraction": extraction, "steps": steps}
  harness.write_result(_WORKDIR.value, f"bench_features_{'_'.join(parts)}.json", result)
  print(f"\n{config.model}, layers {list(layers)}, B={batch} x T={_SEQ_LEN.value}, {machine['cpus']} CPUs, "
        f"median of {_STEPS.value} steps after {_WARMUP.value} warm-up (real tokens/s)\n")
  print("| K | V_d | online step (s) | offline step (s) | online tok/s | offline tok/s | offline / online | "
        "GFLOP online / offline (XLA) | FLOP ratio |")
  print("|---|---|---|---|---|---|---|---|---|")
  for s in steps:
    print(f"| {s['K']} | {s['V_d']} | {s['online_s']:.2f} | {s['offline_s']:.2f} | "
          f"{s['online_tokens_per_s']:.0f} | {s['offline_tokens_per_s']:.0f} | {s['offline_over_online']:.2f}x | "
          f"{s['online_gflop']:.0f} / {s['offline_gflop']:.0f} | {s['flop_ratio']:.2f}x |")
  e = extraction
  if e:
    print("\n| | bare forward tok/s | extraction tok/s | extraction / forward |\n|---|---|---|---|")
    print(f"| paired, per batch (forward + features to host) | {e['bare_forward_tokens_per_s']:.0f} | "
          f"{e['extraction_forward_tokens_per_s']:.0f} | {e['extraction_forward_over_bare']:.2f}x |")
    print(f"| end to end (`extract`: + data, packing, disk) | {e['bare_forward_around_tokens_per_s']:.0f} | "
          f"{e['extraction_tokens_per_s']:.0f} | {e['extraction_over_forward']:.2f}x |")
    print(f"\nStore: {e['store_train_tokens']} train tokens, {e['store_bytes_per_token']:.0f} bytes/token on disk "
          f"({_DTYPE.value}).")


if __name__ == "__main__":
  app.run(main)
