"""Speculative decoding: draft → verify → accept → commit as one jitted `lax.while_loop` per call.

The last stage of the pipeline: an EAGLE-3 draft reading the selected target layers proposes tokens, the
target verifies them, and the output is exactly what the target alone would produce (docs/METHOD.md §8).
One `generate` call is one jitted function, like `layerwave.generate`:

* prefill: the target reads the (right-padded, ragged) prompts into its `KVCache`, returning the selected
  layers' hidden states and the first token; the draft then reads those features over the prompt.
* loop, while some row is unfinished (`SpecState` through `lax.while_loop`):
  1. draft: a chain of K tokens (`num_draft_tokens`), or an EAGLE-2 dynamic tree (`tree.py`);
  2. verify: one target call over the pending token plus every candidate, causal or tree mask, returning
     logits and the selected layers' hidden states;
  3. accept (`verify.py`): greedy, or lossless rejection sampling; m drafted tokens plus the bonus;
  4. commit, per row: the target cache keeps the accepted path's keys/values (a tree's path is gathered
     into contiguous slots first) by advancing `lengths` by m + 1, rejected entries are left beyond
     `lengths` and overwritten later; the draft re-reads the accepted tokens with their target features,
     which commits its own cache and yields the feature the next draft starts from.

Invariant at the top of each iteration, per row with committed length n: the target cache holds tokens
0..n-1; `last` (token n) is sampled but uncached; the draft cache holds positions 0..n-1 (position t read
(target feature at t, token t+1)); `h` is the draft's feature at position n-1, whose logits propose token
n+1. Rows that finish (EOS or `max_new_tokens`) freeze; the batch runs until every row has finished.

Legend (`layerwave.axes`): B batch, T tokens, S cache slots, k selected layers, D target width, d draft width,
K draft depth.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import struct

from layerwave import sharding
from layerwave.generate import (logits_fn, cache_slots, check_lengths, compute_dtype, cut_after_eos,
                                is_eos)
from layerwave.inference import Target, cached_forward, new_cache, pad_prompts
from layerwave.models.draft import Draft, DraftConfig
from layerwave.models import kv_cache
from layerwave.models.kv_cache import KVCache, causal_mask
from layerwave.models.target import CausalKernel
from layerwave.sampling import SamplingParams, log_probs, sample
from layerwave.speculative import tree as tree_lib
from layerwave.speculative import verify

METHODS = ("chain", "tree")


@dataclasses.dataclass(frozen=True)
class SpecOptions:
  """How to draft. Hashable: a static argument of the jitted loop.

  Attributes:
    method: "chain" (K tokens in a row) or "tree" (EAGLE-2 dynamic tree).
    num_draft_tokens: K, the chain length.
    tree_depth, tree_top_k, tree_tokens: the tree's static budget (`tree.TreeBudget`).
    draft_sample: chain only: sample drafted tokens from the draft's processed distribution (same
      temperature / top-k / top-p as the target) instead of taking its argmax. Ignored when greedy.
  """

  method: str = "chain"
  num_draft_tokens: int = 5
  tree_depth: int = 5
  tree_top_k: int = 8
  tree_tokens: int = 48
  draft_sample: bool = False

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"method must be one of {METHODS}, got {self.method!r}.")
    if self.method == "chain":
      k = self.num_draft_tokens
      if int(k) != k or k < 1:
        raise ValueError(f"num_draft_tokens (K) must be a positive integer, got {k}.")
    else:
      self.budget  # validates  # pylint: disable=pointless-statement
      if self.draft_sample:
        raise ValueError("draft_sample applies to method='chain'; the tree drafts its top-k "
                         "deterministically (the multi-draft rule for one-hot proposals).")

  @property
  def budget(self) -> tree_lib.TreeBudget:
    return tree_lib.TreeBudget(self.tree_depth, self.tree_top_k, self.tree_tokens)

  @property
  def max_depth(self) -> int:
    """K: the most drafted tokens one verification can accept (the chain length or the tree depth)."""
    return self.num_draft_tokens if self.method == "chain" else self.tree_depth

  @property
  def scratch_slots(self) -> int:
    """Cache slots beyond the committed length that one iteration writes."""
    if self.method == "chain":
      return self.num_draft_tokens + 1
    return max(self.tree_tokens, (self.tree_depth - 1) * self.tree_top_k) + 1


@dataclasses.dataclass
class LoadedDraft:
  """A draft ready for the jitted loop: `nnx.split` of an EAGLE-3 `Draft`, placed on the target's mesh."""

  config: DraftConfig
  graphdef: Any
  params: Any


def as_loaded_draft(draft: Any, mesh) -> LoadedDraft:
  """Accepts an NNX `Draft` or any object with `config`, `graphdef` and `params` (e.g. `LoadedDraft`)."""
  if isinstance(draft, Draft):
    graphdef, params = nnx.split(draft)
    config = draft.config
  elif all(hasattr(draft, a) for a in ("config", "graphdef", "params")):
    config, graphdef, params = draft.config, draft.graphdef, draft.params
  else:
    raise TypeError(f"draft must be a layerwave Draft or a loaded draft with config/graphdef/params, "
                    f"got {type(draft).__name__}.")
  if not isinstance(config, DraftConfig):
    raise TypeError(f"draft.config must be a DraftConfig, got {type(config).__name__}.")
  # Split over 'model' as the target is (`sharding.param_spec`): at batch 1 each drafted token reads the draft's
  # weights once, and a replicated 8B-target draft (~0.4B parameters) would cost every chip a fifth of its
  # share of the target per drafted token.
  return LoadedDraft(config, graphdef, jax.device_put(params, sharding.param_shardings(params, mesh)))


@struct.dataclass
class SpecState:
  """The while-loop carry: fixed-size buffers only.

  Attributes:
    step: verification calls so far.
    tokens: `[B, max_new_tokens + K + 1]` emitted tokens (row b's first `out_len[b]` are real).
    out_len: `[B]` tokens emitted per row.
    last: `[B]` the pending token (sampled by the target, in neither cache yet).
    lengths: `[B]` committed length of both caches.
    done: `[B]` row has emitted EOS or reached max_new_tokens.
    target_cache, draft_cache: the two `KVCache`s, `[B, S, ...]` per layer.
    h: `[B, d]` the draft's feature at position lengths - 1, read from the accepted tokens' target
      features of the selected layers; the next draft starts from it.
    rng: PRNG key.
    accept_hist: `[B, K+1]` per row, how many verifications accepted m = 0..K drafted tokens.
    accept_trace: `[B, max_new_tokens]` per row, m of verification i at index i (-1 once the row is done).
  """

  step: jax.Array
  tokens: jax.Array
  out_len: jax.Array
  last: jax.Array
  lengths: jax.Array
  done: jax.Array
  target_cache: KVCache
  draft_cache: KVCache
  h: jax.Array
  rng: jax.Array
  accept_hist: jax.Array
  accept_trace: jax.Array


def draft_commit(draft, features, next_tokens, lengths, last_index, cache, valid=None, kernel=None):
  """Draft positions `lengths + i` read (fused target features, next token); returns h at `last_index`.

  Args:
    draft: the merged `Draft`.
    features: `[k, B, T, D]` the selected target layers at positions lengths .. lengths + T - 1.
    next_tokens: `[B, T]` the token after each of those positions.
    lengths: `[B]` committed draft-cache length (the entries are written from there).
    last_index: `[B]` which of the T positions is the last real one.
    cache: the draft `KVCache`.
    valid: optional `[B, T]` real positions (the prompt's padding), for the mask.
    kernel: with `valid`, a prefill into an empty cache: its attention through this kernel (the target's
      `attention_impl`, on the target's mesh; `Draft.__call__`).

  Returns:
    (h `[B, d]` at `last_index`, updated draft cache).
  """
  t = next_tokens.shape[1]
  valid = jnp.ones(next_tokens.shape, jnp.int32) if valid is None else valid
  positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
  causal = None if kernel is None or kernel.impl == "xla" else dataclasses.replace(kernel, valid=valid)
  h, _, cache = draft(draft.fuse(features), next_tokens, positions, causal_mask(valid), cache, lengths, causal)
  return jnp.take_along_axis(h, last_index[:, None, None], axis=1)[:, 0], cache


def draft_chain(draft, h, lengths, cache, rng, options: SpecOptions, sampling: SamplingParams):
  """Drafts K tokens in a row from feature `h [B, d]`; returns target ids `[B, K]` and q (or None)."""
  sampled = options.draft_sample and not sampling.greedy
  vocab = draft.config.target_vocab_size

  def pick(logits, key):
    ids = sample(logits, key, sampling) if sampled else jnp.argmax(logits, -1).astype(jnp.int32)
    q = None
    if sampled:  # the draft's processed distribution, moved onto the target vocabulary
      q_d = jnp.exp(log_probs(logits, sampling))
      q = jnp.zeros(q_d.shape[:-1] + (vocab,), q_d.dtype).at[..., draft.draft_token_ids()].set(q_d)
    return draft.draft_to_target(ids).astype(jnp.int32), q

  keys = jax.random.split(rng, options.num_draft_tokens)
  first, q0 = pick(draft.logits(h), keys[0])
  b = h.shape[0]

  def step(carry, inputs):
    h, tok, cache = carry
    j, key = inputs
    at = lengths + j  # position of the previous drafted token, written into scratch slots
    h, logits, cache = draft(h[:, None], tok[:, None], at[:, None], jnp.ones((b, 1, 1), bool), cache,
                             at)
    tok, q = pick(logits[:, 0], key)
    return (h[:, 0], tok, cache), (tok, q)

  _, (rest, q_rest) = jax.lax.scan(step, (h, first, cache),
                                   (jnp.arange(options.num_draft_tokens - 1), keys[1:]))
  drafted = jnp.concatenate([first[:, None], rest.T], axis=1)
  q = None if q0 is None else jnp.concatenate([q0[:, None], jnp.swapaxes(q_rest, 0, 1)], axis=1)
  return drafted, q


def _commit_path(cache: KVCache, path, lengths) -> KVCache:
  """Moves the accepted path's entries (slots `lengths + path[:, j]`) to slots `lengths + j`."""
  idx = (lengths[:, None] + path)[:, :, None, None]

  def move(buffer):
    return kv_cache.write(buffer, jnp.take_along_axis(buffer, idx, axis=1), lengths)

  return KVCache(tuple(move(x) for x in cache.keys), tuple(move(x) for x in cache.values))


# Everything that fixes the loop's shapes and code; equal values reuse one compilation.
SPECULATE_STATIC = ("target_graphdef", "draft_graphdef", "config", "mesh", "layer_ids", "max_new_tokens",
                    "slots", "sampling", "options", "eos_ids")


@functools.partial(jax.jit, static_argnames=SPECULATE_STATIC)
def _speculate(target_graphdef, target_params, draft_graphdef, draft_params, tokens, lengths, rng, *,
               config, mesh, layer_ids, max_new_tokens, slots, sampling, options, eos_ids):
  """Jitted prefill + speculative loop. Returns the final `SpecState`."""
  b, width = tokens.shape
  depth = options.max_depth
  draft = nnx.merge(draft_graphdef, draft_params)
  target_cache = new_cache(config, b, slots, compute_dtype(target_graphdef, target_params), mesh)
  draft_cache = new_cache(draft.config.model, b, slots, draft.compute_dtype, mesh)
  valid = (jnp.arange(width)[None, :] < lengths[:, None]).astype(jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width))
  out = cached_forward(target_graphdef, target_params, tokens, positions, causal_mask(valid),
                       target_cache, jnp.zeros((b,), jnp.int32), return_hidden_states=True,
                       hidden_layers=layer_ids, compute_logits=False, valid=valid)
  last_h = jnp.take_along_axis(out.last_hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
  rng, key = jax.random.split(rng)
  first = sample(logits_fn(target_graphdef, target_params)(last_h), key, sampling)
  shifted = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)  # token t+1 at position t
  shifted = shifted.at[jnp.arange(b), lengths - 1].set(first)
  target = nnx.merge(target_graphdef, target_params)  # its kernel reads the draft's prompt too
  h, draft_cache = draft_commit(draft, out.hidden_states, shifted, jnp.zeros((b,), jnp.int32),
                                 lengths - 1, draft_cache, valid, CausalKernel(valid, target.attention_impl,
                                                                               target.mesh))
  state = SpecState(
      step=jnp.asarray(0, jnp.int32),
      tokens=jnp.zeros((b, max_new_tokens + depth + 1), jnp.int32).at[:, 0].set(first),
      out_len=jnp.ones((b,), jnp.int32), last=first, lengths=lengths,
      done=is_eos(first, eos_ids) | (max_new_tokens <= 1), target_cache=out.cache,
      draft_cache=draft_cache, h=h, rng=rng, accept_hist=jnp.zeros((b, depth + 1), jnp.int32),
      accept_trace=jnp.full((b, max_new_tokens), -1, jnp.int32))

  def cond(s: SpecState):
    return ~jnp.all(s.done)

  def body(s: SpecState):
    draft = nnx.merge(draft_graphdef, draft_params)
    rng, key_draft, key_accept = jax.random.split(s.rng, 3)
    q = None
    if options.method == "chain":
      drafted, q = draft_chain(draft, s.h, s.lengths, s.draft_cache, key_draft, options, sampling)
      cand = tree_lib.chain(s.last, drafted)
    else:
      cand = tree_lib.dynamic_tree(draft, s.last, s.h, s.lengths, s.draft_cache, options.budget)
    o = cached_forward(target_graphdef, target_params, cand.tokens, s.lengths[:, None] + cand.depths,
                       cand.mask, s.target_cache, s.lengths, return_hidden_states=True,
                       hidden_layers=layer_ids)
    if q is not None:
      acc = verify.accept_sampled_chain(cand, o.logits, q, key_accept, sampling)
    else:
      acc = verify.accept_deterministic(cand, o.logits, key_accept, sampling, depth)
    target_cache = o.cache if options.method == "chain" else _commit_path(o.cache, acc.path, s.lengths)
    features = jnp.take_along_axis(o.hidden_states, acc.path[None, :, :, None], axis=2)
    h, draft_cache = draft_commit(draft, features, acc.new_tokens, s.lengths, acc.num_accepted,
                                   s.draft_cache)
    active = ~s.done
    n_new = acc.num_accepted + 1
    j = jnp.arange(depth + 1)[None]
    at = jnp.where(active[:, None], s.out_len[:, None] + j, s.tokens.shape[1])  # inactive: dropped
    tokens = s.tokens.at[jnp.arange(b)[:, None], at].set(acc.new_tokens, mode="drop")
    out_len = jnp.where(active, s.out_len + n_new, s.out_len)
    hit_eos = jnp.any(is_eos(acc.new_tokens, eos_ids) & (j < n_new[:, None]), axis=1)
    return SpecState(
        step=s.step + 1, tokens=tokens, out_len=out_len, last=jnp.where(active, acc.bonus, s.last),
        lengths=jnp.where(active, s.lengths + n_new, s.lengths),
        done=s.done | (active & (hit_eos | (out_len >= max_new_tokens))),
        target_cache=target_cache, draft_cache=draft_cache, h=jnp.where(active[:, None], h, s.h),
        rng=rng, accept_hist=s.accept_hist + (active[:, None] & (j == acc.num_accepted[:, None])),
        # Each iteration emits >= 1 token per active row, so fewer than max_new_tokens iterations run.
        accept_trace=s.accept_trace.at[:, s.step].set(jnp.where(active, acc.num_accepted, -1),
                                                      mode="drop"))

  return jax.lax.while_loop(cond, body, state)


def generate(target: Target, draft: Any, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             ignore_eos: bool = False, prompt_width: int = 0, **draft_options):
  """Speculative decoding of a batch of prompts; same output as `layerwave.generate`.

  Args:
    target: a loaded `Target`.
    draft: an EAGLE-3 `Draft` made for this target (or a `LoadedDraft`).
    prompt_ids: one list of token ids per prompt (lengths may differ).
    max_new_tokens: the most tokens to generate per prompt.
    temperature: 0 for greedy decoding, otherwise the sampling temperature.
    top_k: sample among the k most likely tokens (0 = off).
    top_p: nucleus sampling mass in (0, 1] (1 = off).
    seed: PRNG seed.
    ignore_eos: decode exactly `max_new_tokens` per row (benchmarks).
    prompt_width: pad prompts to at least this many tokens (one compilation for batches of any width
      up to it).
    **draft_options: `SpecOptions` fields: method ("chain" | "tree"), num_draft_tokens, tree_depth,
      tree_top_k, tree_tokens, draft_sample.

  Returns:
    (one list of new tokens per prompt, cut after its first EOS; metrics dict with `tau` (new tokens per
    verification, bonus included), `acceptance` (per depth i, the rate at which a drafted token at depth
    i + 1 was accepted given its path so far was), `accept_length_hist`, `verify_calls`, `steps`,
    `new_tokens`, `seconds` (this process's wall time, compilation included on the first call; the callers that
    time, `run_batches` and `timing`, take the slowest process's outside the call), `tokens_per_s`,
    `accept_lengths` (per prompt, the drafted tokens accepted by each of its verifications, in order)).
  """
  sampling = SamplingParams(float(temperature), int(top_k), float(top_p))
  unknown = set(draft_options) - {f.name for f in dataclasses.fields(SpecOptions)}
  if unknown:
    raise ValueError(f"Unknown draft options {sorted(unknown)}; valid: "
                     f"{[f.name for f in dataclasses.fields(SpecOptions)]}.")
  options = SpecOptions(**draft_options)
  if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens}.")
  loaded = as_loaded_draft(draft, target.mesh)
  config = target.config
  loaded.config.check_target(config)
  if options.method == "tree":
    options.budget.check_vocab(loaded.config.draft_vocab_size)
  tokens, lengths, n = pad_prompts(prompt_ids, config.vocab_size, sharding.data_size(target.mesh),
                                   min_width=prompt_width)
  check_lengths(lengths, max_new_tokens, config)
  slots = cache_slots(tokens.shape[1], int(max_new_tokens) + options.scratch_slots)
  eos_ids = () if ignore_eos else target.eos_token_ids
  start = time.perf_counter()
  state = _speculate(
      target.graphdef, target.params, loaded.graphdef, loaded.params,
      sharding.from_host(tokens, sharding.batch_sharding(target.mesh)),
      sharding.from_host(lengths, sharding.batch_sharding(target.mesh, 1)), jax.random.key(seed),
      config=config, mesh=target.mesh, layer_ids=tuple(loaded.config.layer_ids),
      max_new_tokens=int(max_new_tokens), slots=slots, sampling=sampling, options=options,
      eos_ids=eos_ids)
  # Gathered whole on every process (a multi-host mesh splits the rows over 'data'): all return the same.
  out, hist, trace, steps = map(sharding.to_host, (state.tokens, state.accept_hist, state.accept_trace,
                                                   state.step))
  seconds = time.perf_counter() - start
  result = cut_after_eos(out[:n], int(max_new_tokens), eos_ids)
  metrics = acceptance_metrics(hist[:n])
  new_tokens = sum(len(r) for r in result)
  metrics.update(steps=int(steps), new_tokens=new_tokens, seconds=seconds,
                 tokens_per_s=new_tokens / seconds, method=options.method,
                 accept_lengths=[[int(m) for m in row if m >= 0] for row in np.asarray(trace)[:n]])
  return result, metrics


def run_batches(fn, prompts: Sequence[Sequence[int]], batch_size: int, warmup: bool = True):
  """Decodes `prompts` in batches of `batch_size` with `fn(batch) -> (outputs, metrics)`, timing each call.

  `fn` is `layerwave.generate` (with `return_stats=True`) or `layerwave.speculative.generate` bound to a
  target, draft and settings. With `warmup`, the first batch is decoded once first so that compilation stays
  outside the clock. A call's seconds are the slowest process's (`sharding.process_max`). Its seconds are one
  function's throughput at the time it ran, not a speedup: dividing them by another run's seconds compares two
  states of the machine. Speedups come from
  `layerwave.speculative.timing.paired_speedup`, which times both on the same batches in alternation.

  Returns:
    (outputs per prompt, summed `accept_length_hist` or None for plain decoding, decode seconds,
     per-batch rows {seconds, new_tokens[, tau, verify_calls, prompt_stats]}).
  """
  batches = [list(prompts[i:i + batch_size]) for i in range(0, len(prompts), batch_size)]
  if warmup:
    fn(batches[0])
  outs, hist, seconds, per_batch = [], None, 0.0, []
  for ids in batches:
    start = time.perf_counter()
    out, m = fn(ids)
    dt = sharding.process_max(time.perf_counter() - start)
    seconds += dt
    outs.extend(out)
    row = {"seconds": dt, "new_tokens": sum(len(o) for o in out)}
    if "accept_length_hist" in m:
      h = np.asarray(m["accept_length_hist"], np.int64)
      hist = h if hist is None else hist + h
      row.update(tau=m["tau"], verify_calls=m["verify_calls"])
    if "accept_lengths" in m:
      row["prompt_stats"] = prompt_stats(m["accept_lengths"])
    per_batch.append(row)
  return outs, hist, seconds, per_batch


def prompt_stats(accept_lengths: Sequence[Sequence[int]]) -> list[list[int]]:
  """Per prompt [emitted tokens, verifications] from `generate`'s `accept_lengths` (bonus tokens included, as
  in τ): summed over prompts they are the histogram's, so τ of any subset of prompts is Σ emitted / Σ calls."""
  return [[int(sum(m + 1 for m in row)), len(row)] for row in accept_lengths]


def acceptance_metrics(hist: np.ndarray) -> dict[str, Any]:
  """τ and per-depth acceptance from `accept_hist [B, K+1]` (counts of m per verification)."""
  counts = hist.sum(axis=0).astype(np.int64)
  calls = int(counts.sum())
  emitted = int((counts * (np.arange(counts.size) + 1)).sum())
  reached = counts[::-1].cumsum()[::-1]  # reached[i]: verifications that accepted >= i drafts
  acceptance = [float(reached[i + 1] / reached[i]) if reached[i] else 0.0
                for i in range(counts.size - 1)]
  return {"tau": emitted / calls if calls else 0.0, "acceptance": acceptance,
          "accept_length_hist": counts.tolist(), "verify_calls": calls}
