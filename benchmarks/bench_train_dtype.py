"""Benchmark: the offline draft-training step in float32 against bfloat16 compute, side by side.

  python benchmarks/bench_train_dtype.py --batch=8 --seq_len=256 --k=3 --vocab=4096

On the real target of `--config` (default SmolLM2-135M-Instruct: its embedding and LM-head rows), an EAGLE-3
draft on `--layers` trains offline (`step.train_step_offline`, K = `--k`, V_d = `--vocab`) on batches shaped
as a feature store yields them ([k, B, T, D] bfloat16 features, h_L, the target's argmax; random values: the
step's time depends on the shapes only). The two compute dtypes (`train.compute_dtype`) alternate step by step
(float32, bfloat16, ...) so both see the same machine load; each compiles in a warm-up first. It also reports
whether XLA kept the draft's matmuls in bfloat16 (dots with bf16 operands in the optimized HLO) or converted
them to float32. Prints, as its last line, `step time: float32 X s, bfloat16 Y s, ratio R` (medians, R =
float32 / bfloat16: above 1 means bfloat16 is faster) and writes `W/bench_train_dtype.json`.

With `--online`, the online step instead (`step.train_step`: the target runs inside it on real-shaped random
tokens): the draft in `--config`'s `train.compute_dtype`, the target's forward in float32 against bfloat16
(`train.target_dtype`: the float32 target cast, `inference.with_dtype`), alternated the same way; the last
line then reads `online step time (target forward): float32 X s, bfloat16 Y s, ratio R`.

  python benchmarks/bench_train_dtype.py --online --batch=8 --seq_len=256 --k=3 --vocab=2048

Whether bfloat16 should be the default also needs the held-out τ of drafts trained both ways on the same
store (`--config.train.compute_dtype=bfloat16` in experiments/train_draft.py); BENCHMARKS.md has both.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import json
import re
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
from layerwave import layer_ids
from layerwave import metrics as metrics_lib
from layerwave import sharding
from layerwave.inference import with_dtype
from layerwave.models.draft import Draft, DraftConfig
from layerwave.training import loop
from layerwave.training import sources
from layerwave.training import step as step_lib

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2_135m.py", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "out/bench_train_dtype", "Where the JSON result goes.")
_LAYERS = flags.DEFINE_string("layers", "2,15,27", "The draft's layers.")
_BATCH = flags.DEFINE_integer("batch", 8, "B.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "T.")
_K = flags.DEFINE_integer("k", 3, "TTT depth K.")
_VOCAB = flags.DEFINE_integer("vocab", 4096, "Draft vocabulary V_d.")
_STEPS = flags.DEFINE_integer("steps", 12, "Timed steps per dtype (after the warm-up).")
_ONLINE = flags.DEFINE_bool("online", False, "Time the online step, the target's forward in float32 against "
                            "bfloat16 (train.target_dtype), instead of the offline step's draft compute dtype.")

DTYPES = ("float32", "bfloat16")


def _dots(hlo: str) -> dict[str, int]:
  """The optimized HLO's dots (and convolutions) by the type of their operands: "bf16" where XLA kept the
  bfloat16 operands (its library matmul accumulates them in float32), "f32" where they are float32 (or were
  converted to it)."""
  types = dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", hlo))
  out = {"bf16": 0, "f32": 0}
  for line in hlo.splitlines():
    call = re.search(r"\b(?:dot|convolution)\((%[\w.\-]+), (%[\w.\-]+)\)", line)
    if call:
      out["bf16" if "bf16" in (types.get(call.group(1)), types.get(call.group(2))) else "f32"] += 1
  return out


def main(argv):
  config = _CONFIG.value
  target = harness.start(argv, config)
  mesh = target.mesh
  c = target.config
  ids = layer_ids.parse_layer_ids(_LAYERS.value)
  b, t, k = _BATCH.value, _SEQ_LEN.value, len(ids)
  sharding.check_batch(mesh, b)
  embedding = target.params["embed_tokens"]["embedding"][...]
  draft = Draft(DraftConfig.from_target(c, ids, draft_vocab_size=_VOCAB.value), embedding=embedding,
                rngs=nnx.Rngs(0))
  loop.init_head_from_target(draft, target)
  graphdef, params, vocab, embed = step_lib.split_draft(draft)
  embed = jax.tree.map(lambda _: embedding, embed)
  rep = sharding.replicated(mesh)
  head = jax.device_put(sources.target_head(target)[:, :_VOCAB.value], rep)
  vocab, embed = jax.device_put(vocab, rep), jax.device_put(embed, rep)
  optimizer = step_lib.OptimizerSettings(1e-3, 2, 1000)
  rng = np.random.default_rng(0)
  batch = {"input_ids": rng.integers(0, c.vocab_size, (b, t)).astype(np.int32),
           "attention_mask": np.ones((b, t), np.int32), "assistant_mask": np.ones((b, t), np.int32),
           "features": jnp.asarray(rng.normal(size=(k, b, t, c.hidden_size)), jnp.bfloat16),
           "final": jnp.asarray(rng.normal(size=(b, t, c.hidden_size)), jnp.bfloat16),
           "argmax": rng.integers(0, _VOCAB.value, (b, t)).astype(np.int32)}
  data = sharding.batch_sharding(mesh)
  batch = {key: jax.device_put(v, data if key != "features" else jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(None, "data"))) for key, v in batch.items()}
  states = {d: jax.device_put(step_lib.init_state(jax.tree.map(np.copy, params), optimizer), rep) for d in DTYPES}
  if _ONLINE.value:  # the same draft step; the target's forward in each dtype
    forward = {d: with_dtype(target, d) for d in DTYPES}
    online = {key: batch[key] for key in ("input_ids", "attention_mask", "assistant_mask")}
    loss = step_lib.LossSettings(steps=_K.value, decay=0.8, assistant_only=True,
                                 compute_dtype=str(config.train.compute_dtype))
    kw = {d: dict(program=step_lib.StepProgram(graphdef, loss, optimizer=optimizer,
                                               target_graphdef=forward[d].graphdef)) for d in DTYPES}
    args = {d: (vocab, embed, forward[d].params, online) for d in DTYPES}
    step_fn = step_lib.train_step
  else:
    kw = {d: dict(program=step_lib.StepProgram(graphdef, step_lib.LossSettings(
        steps=_K.value, decay=0.8, assistant_only=True, compute_dtype=d), optimizer=optimizer)) for d in DTYPES}
    args = {d: (vocab, embed, head, batch) for d in DTYPES}
    step_fn = step_lib.train_step_offline
  dots = {d: _dots(step_fn.lower(states[d], *args[d], **kw[d]).compile().as_text()) for d in DTYPES}

  def step(d):
    states[d], m = step_fn(states[d], *args[d], **kw[d])
    return m["loss"]

  compile_s = {d: metrics_lib.timed(lambda d=d: step(d)) for d in DTYPES}
  times = {d: [] for d in DTYPES}
  for i in range(_STEPS.value):
    for d in DTYPES:
      times[d].append(metrics_lib.timed(lambda d=d: step(d)))
    logging.info("step %d: %s", i, ", ".join(f"{d} {times[d][-1]:.3f}s" for d in DTYPES))
  median = {d: statistics.median(times[d]) for d in DTYPES}
  ratio = median["float32"] / median["bfloat16"]
  machine = metrics_lib.machine()
  result = {"model": config.model, "layers": list(ids), "K": _K.value, "V_d": _VOCAB.value, "batch": b,
            "step": ("online (dtype = the target's forward)" if _ONLINE.value else
                     "offline (dtype = the draft's compute)"),
            "seq_len": t, "machine": machine, "median_step_s": median, "times": times,
            "first_step_s": compile_s, "dots_in_optimized_hlo": dots, "ratio_f32_over_bf16": ratio,
            "tokens_per_s": {d: b * t / median[d] for d in DTYPES}}
  harness.write_result(_WORKDIR.value, "bench_train_dtype.json", result)
  print(json.dumps({k_: result[k_] for k_ in ("median_step_s", "dots_in_optimized_hlo", "tokens_per_s")}))
  label = "online step time (target forward)" if _ONLINE.value else "step time"
  print(f"{label}: float32 {median['float32']:.3f} s, bfloat16 {median['bfloat16']:.3f} s, ratio {ratio:.2f}")


if __name__ == "__main__":
  app.run(main)
