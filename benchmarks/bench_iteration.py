"""Benchmark: where one speculative iteration's time goes at batch 1, against one plain decode step.

  python benchmarks/bench_iteration.py [--draft=smollm2-135m-instruct-eagle3] [--chains=1,2,3,4]

Speculative decoding pays at batch 1 when τ exceeds the iteration's cost in plain decode steps (the break-even
τ, `timing` module docstring). This splits that cost into its parts, each jitted alone on the real target and
draft with a cache filled to `--context` tokens, alternated round by round so all see the same machine load
(medians of `--repeats` rounds):

- plain: one decode step (1 token: the layers and the LM head, argmax);
- verify(T): the target's forward over T = K + 1 tokens with the draft's layers' hidden states, as the loop's
  verification of a chain of K;
- draft chain K: the draft's K proposals from its feature (K - 1 draft-layer steps, K heads);
- draft commit(T): the draft's layer over the T accepted positions (its cache and next feature).

Then whole iterations: `layerwave.speculative.generate` and plain `layerwave.generate` of `--new_tokens` on
one real chat prompt (EOS ignored, compilation outside the clock), giving ms per iteration, the measured
iteration cost and the break-even τ per chain (and per EAGLE-2 tree of `--trees`, depth x top-k x tokens); the
parts' sum shows what the loop's bookkeeping adds. Each decode's tokens shared with plain decoding's are
counted: all of them in float32; a bfloat16 `--dtype` may flip near-ties between a T-token forward and a
1-token one, which changes the text from there on (each output is still the bf16 target's own greedy decoding
of a verified prefix).

  python benchmarks/bench_iteration.py --dtype=bfloat16 --chains=2,3 --trees=3x3x8

  python benchmarks/bench_iteration.py --chains=2,3 --trees=4x4x16,3x2x6
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import platform
import statistics

import jax
import jax.numpy as jnp
from absl import app
from absl import flags
from flax import nnx

import layerwave
from layerwave import metrics as metrics_lib
from layerwave.inference import cached_forward, compute_dtype, load_target, new_cache
from layerwave.models.kv_cache import causal_mask
from layerwave.sampling import SamplingParams
from layerwave.speculative import decode

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Target model.")
_DRAFT = flags.DEFINE_string("draft", "smollm2-135m-instruct-eagle3", "Draft (a release name, workdir or directory).")
_CHAINS = flags.DEFINE_list("chains", ["1", "2", "3", "4"], "Chain lengths K.")
_TREES = flags.DEFINE_list("trees", [], "EAGLE-2 tree budgets DEPTHxTOPKxTOKENS for the whole decodes, e.g. 4x4x16.")
_CONTEXT = flags.DEFINE_integer("context", 200, "Tokens already in the caches for the parts.")
_NEW = flags.DEFINE_integer("new_tokens", 128, "New tokens of the whole-iteration runs.")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed rounds of the parts (median).")
_RUNS = flags.DEFINE_integer("runs", 3, "Timed whole decodes per setting (median).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "The target's parameter and compute dtype (its caches and the features follow it).")
PROMPT = "Explain how a hash map works, with a short example in Python."


def _parts(target, draft, chains):
  """name -> zero-argument function, each one jitted part of an iteration at batch 1."""
  cfg = target.config
  slots = _CONTEXT.value + 64
  dtype = compute_dtype(target.graphdef, target.params)
  cache = new_cache(cfg, 1, slots, dtype, target.mesh)
  lengths = jnp.asarray([_CONTEXT.value], jnp.int32)
  merged = nnx.merge(draft.graphdef, draft.params)
  dcache = new_cache(merged.config.model, 1, slots, merged.compute_dtype, target.mesh)
  layer_ids = tuple(draft.config.layer_ids)
  greedy = SamplingParams(0.0, 0, 1.0)
  h = jnp.zeros((1, cfg.hidden_size), merged.compute_dtype)  # the draft's own state

  def verify_fn(t, hidden):
    @jax.jit
    def fn(params, cache, lengths):
      out = cached_forward(target.graphdef, params, jnp.ones((1, t), jnp.int32), lengths[:, None] + jnp.arange(t),
                           causal_mask(jnp.ones((1, t), jnp.int32)), cache, lengths,
                           return_hidden_states=hidden, hidden_layers=layer_ids if hidden else None)
      return jnp.argmax(out.logits, -1), out.hidden_states
    return lambda: fn(target.params, cache, lengths)

  def chain_fn(k):
    options = decode.SpecOptions(method="chain", num_draft_tokens=k)
    fn = jax.jit(lambda p, h, lengths, c, rng: decode.draft_chain(
        nnx.merge(draft.graphdef, p), h, lengths, c, rng, options, greedy)[0])
    return lambda: fn(draft.params, h, lengths, dcache, jax.random.key(0))

  def commit_fn(t):
    feats = jnp.zeros((len(layer_ids), 1, t, cfg.hidden_size), dtype)
    fn = jax.jit(lambda p, f, c, lengths: decode.draft_commit(
        nnx.merge(draft.graphdef, p), f, jnp.ones((1, t), jnp.int32), lengths, lengths * 0 + t - 1, c))
    return lambda: fn(draft.params, feats, dcache, lengths)

  parts = {"plain step": verify_fn(1, False)}
  for k in chains:
    parts[f"verify(T={k + 1})"] = verify_fn(k + 1, True)
    parts[f"draft chain K={k}"] = chain_fn(k)
    parts[f"draft commit(T={k + 1})"] = commit_fn(k + 1)
  return parts


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  chains = [int(k) for k in _CHAINS.value]
  if any(k < 1 for k in chains):
    raise app.UsageError(f"--chains must be positive integers, got {_CHAINS.value}.")
  trees = [tuple(int(x) for x in t.split("x")) for t in _TREES.value
           if len(t.split("x")) == 3 and all(x.isdigit() and int(x) > 0 for x in t.split("x"))]
  if len(trees) != len(_TREES.value):
    raise app.UsageError(f"--trees must be DEPTHxTOPKxTOKENS with positive integers (e.g. 4x4x16), got "
                         f"{_TREES.value}.")
  target = load_target(_MODEL.value, _DTYPE.value)
  draft = decode.as_loaded_draft(layerwave.load_draft(_DRAFT.value, target), target.mesh)
  parts = _parts(target, draft, chains)
  for fn in parts.values():
    metrics_lib.timed(fn)  # compile
  times = {name: [] for name in parts}
  for _ in range(_REPEATS.value):
    for name, fn in parts.items():
      times[name].append(metrics_lib.timed(fn) * 1e3)
  ms = {name: statistics.median(t) for name, t in times.items()}
  step = ms["plain step"]
  print(f"## Parts at batch 1 (target in {_DTYPE.value}; context {_CONTEXT.value} tokens; medians of "
        f"{_REPEATS.value} alternated rounds; {platform.machine()}, {jax.devices()[0].platform})\n")
  print("| part | ms | ÷ plain step |\n|---|---|---|")
  for name, value in ms.items():
    print(f"| {name} | {value:.2f} | {value / step:.2f} |")

  ids = target.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
  runs = {"plain": lambda: layerwave.generate(target, [ids], _NEW.value, ignore_eos=True, return_stats=True)}
  for k in chains:
    runs[f"chain{k}"] = lambda k=k: decode.generate(target, draft, [ids], _NEW.value, ignore_eos=True,
                                                    method="chain", num_draft_tokens=k)
  for depth, top_k, tokens in trees:
    runs[f"tree {depth}x{top_k}x{tokens}"] = lambda d=depth, k=top_k, n=tokens: decode.generate(
        target, draft, [ids], _NEW.value, ignore_eos=True, method="tree", tree_depth=d, tree_top_k=k, tree_tokens=n)
  for fn in runs.values():
    fn()  # compile
  seconds = {name: [] for name in runs}
  stats = {}
  for _ in range(_RUNS.value):
    for name, fn in runs.items():
      seconds[name].append(metrics_lib.timed(lambda fn=fn, name=name: stats.__setitem__(name, fn())))
  tokens = {name: [int(t) for t in out[0][0]] for name, out in stats.items()}
  stats = {name: out[1] for name, out in stats.items()}
  per_step = statistics.median(seconds["plain"]) * 1e3 / stats["plain"]["steps"]
  print(f"\n## Whole decodes ({_NEW.value} new tokens, one prompt, EOS ignored; medians of {_RUNS.value} "
        "alternated runs)\n")
  print(f"plain: {per_step:.2f} ms per decode step\n")
  print("| setting | τ | ms / iteration | iteration cost (break-even τ) | parts' sum ÷ plain step | speedup | "
        "tokens equal to plain's |")
  print("|---|---|---|---|---|---|---|")
  for name in runs:
    if name == "plain":
      continue
    m = stats[name]
    per_iter = statistics.median(seconds[name]) * 1e3 / m["steps"]
    parts = "–"
    if name.startswith("chain"):
      k = int(name.removeprefix("chain"))
      parts = f"{(ms[f'verify(T={k + 1})'] + ms[f'draft chain K={k}'] + ms[f'draft commit(T={k + 1})']) / step:.2f}"
    print(f"| {name} | {m['tau']:.2f} | {per_iter:.2f} | {per_iter / per_step:.2f} | {parts} | "
          f"{statistics.median(seconds['plain']) / statistics.median(seconds[name]):.2f}x | "
          f"{_common_prefix(tokens[name], tokens['plain'])} of {len(tokens['plain'])} |")


def _common_prefix(a, b):
  """How many leading tokens two decodes share."""
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


if __name__ == "__main__":
  app.run(main)
