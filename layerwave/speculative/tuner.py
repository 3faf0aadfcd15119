"""Speculation settings chosen by cost (`method="auto"`): the chain length or tree budget that maximises tokens/s.

On an accelerator a verification of n tokens costs about one decoding step for n up to tens of tokens; on a CPU
it grows with n almost at once (a tree of 48 nodes at batch 8 runs 0.11-0.18x plain decoding here). So the
best setting depends on the machine, the batch size and the draft, and is measured, not assumed:

1. costs, measured once per (target, draft, batch size, context): the target's verification of n tokens
   against a filled cache for a few n (with the selected layers' hidden states, as the loop runs it); one
   chain step of the draft (one token against its cache); the draft's commit of n tokens; and plain decoding's
   prefill and time per token (`layerwave.generate`).
2. acceptance, measured once: one speculative run at the longest candidate chain on calibration prompts
   gives the per-depth acceptance a_1..a_K (the rate at which depth i is accepted given depths < i were);
   a chain of length K then accepts on average τ(K) = 1 + Σ_{j≤K} Π_{i≤j} a_i tokens per verification, for
   every K up to the probe's (a shorter chain drafts the same first tokens). A tree's τ is measured by one
   run per candidate budget (it does not follow from the chain's), which also times its iteration as it runs
   (drafting, gather and reranking included).
3. the model: one iteration of chain K costs verify(K + 1) + (K - 1) draft steps + commit(K + 1) + the loop's
   own overhead (the probe run's measured time per iteration minus its predicted components); predicted
   speedup = τ / (iteration seconds / plain seconds per token). The candidates are ranked by it.
4. confirmation: the model's parts are timed minutes apart on a machine whose speed drifts, and on a CPU its
   predictions were 10-25 % off (trees optimistic; chains pessimistic, as separately timed calls pay a dispatch
   the fused loop does not; BENCHMARKS.md). So the `confirm` best-predicted candidates are then
   decoded end to end on the calibration prompts, each batch paired with plain decoding in ABBA order
   (`timing.paired_speedup`, the benchmark's own measurement), and the one with the highest measured speedup
   wins; when none beats plain decoding the report says so (`Tuning.beats_plain`).

`tune` returns the choice with the whole table, so a launcher can print the prediction next to what the
chosen and the fixed settings then measure (experiments/bench_speculative.py).

Legend (`layerwave.axes`): B batch, K draft depth (the verification reads K + 1 tokens).
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

from layerwave.generate import generate as plain_generate
from layerwave.inference import Target, cached_forward, new_cache
from layerwave.models.kv_cache import causal_mask
from layerwave.speculative import decode
from layerwave.speculative import timing
from layerwave.speculative import tree as tree_lib

__all__ = ["AUTO", "AUTO_TREES", "CALIBRATION_PROMPTS", "Candidate", "Costs", "Tuning", "chain_tau",
           "measure_costs", "tune"]

AUTO = "auto"  # `speculate.method` value that asks for `tune`
# The trees `method="auto"` tries besides chains: small ones, since a CPU pays for every verified node.
AUTO_TREES = (tree_lib.TreeBudget(depth=3, top_k=4, tokens=8), tree_lib.TreeBudget(depth=4, top_k=4, tokens=16))
CALIBRATION_PROMPTS = 8  # prompts the acceptance probes decode


def chain_tau(acceptance: Sequence[float], k: int) -> float:
  """Expected tokens per verification of a chain of `k` drafts: 1 + Σ_{j≤k} Π_{i≤j} a_i."""
  a = np.asarray(list(acceptance)[:k], np.float64)
  return float(1.0 + np.cumprod(a).sum())


def _median_seconds(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # compile and warm up outside the clock
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


@dataclasses.dataclass(frozen=True)
class Costs:
  """Measured seconds of the loop's parts at one batch size and context length.

  Attributes:
    batch_size: B.
    context: committed tokens in the caches while timing.
    plain_token_s: plain decoding (`layerwave.generate`), seconds per new token of one row (a decode step).
    prefill_s: plain decoding's prefill of the calibration batch (subtracted from the probe runs' time).
    verify_s: `(n, seconds)` of one target verification of n new tokens (hidden states included).
    draft_step_s: one chain step of the draft (one token against its cache).
    draft_logits_s: the draft's first proposal (LM head on the committed feature).
    commit_s: `(n, seconds)` of the draft reading n accepted tokens with their target features.
  """

  batch_size: int
  context: int
  plain_token_s: float
  prefill_s: float
  verify_s: tuple[tuple[int, float], ...]
  draft_step_s: float
  draft_logits_s: float
  commit_s: tuple[tuple[int, float], ...]

  @staticmethod
  def _interp(table, n: int) -> float:
    ns, secs = zip(*table)
    return float(np.interp(n, ns, secs))  # linear between measured n (flat beyond the last)

  def verify(self, n: int) -> float:
    return self._interp(self.verify_s, n)

  def commit(self, n: int) -> float:
    return self._interp(self.commit_s, n)

  def chain_iteration(self, k: int) -> float:
    """Predicted seconds of one chain-K iteration, the loop's overhead excluded."""
    return self.verify(k + 1) + self.draft_logits_s + (k - 1) * self.draft_step_s + self.commit(k + 1)



@dataclasses.dataclass(frozen=True)
class Candidate:
  """One setting's prediction: τ, seconds per iteration and the speedup over plain decoding.

  `measured` is the paired speedup of the end-to-end confirmation run (`timing.PairedTiming`), None when the
  candidate was not among the confirmed ones.
  """

  spec: decode.SpecOptions
  tau: float
  iteration_s: float
  speedup: float
  measured: timing.PairedTiming | None = None

  @property
  def measured_speedup(self) -> float | None:
    return None if self.measured is None else self.measured.speedup

  @property
  def name(self) -> str:
    s = self.spec
    return (f"chain K={s.num_draft_tokens}" if s.method == "chain" else
            f"tree d={s.tree_depth} k={s.tree_top_k} n={s.tree_tokens}")


@dataclasses.dataclass(frozen=True)
class Tuning:
  """What `tune` measured and chose.

  Attributes:
    choice: the confirmed candidate with the highest measured speedup (without confirmation: the highest
      predicted one).
    candidates: every candidate: the confirmed ones by measured speedup, then the rest by prediction.
    costs: the measured costs.
    acceptance: per-depth acceptance of the probe chain.
    overhead_s: the loop's measured per-iteration overhead beyond the modelled parts.
    seconds: the tuner's own wall time (compilation included).
  """

  choice: Candidate
  candidates: tuple[Candidate, ...]
  costs: Costs
  acceptance: tuple[float, ...]
  overhead_s: float
  seconds: float

  @property
  def beats_plain(self) -> bool:
    c = self.choice
    return (c.speedup if c.measured_speedup is None else c.measured_speedup) > 1.0

  def table(self) -> str:
    """A markdown table of every candidate's prediction, the choice first."""
    lines = [f"auto (B={self.costs.batch_size}, context {self.costs.context}, plain "
             f"{1e3 * self.costs.plain_token_s:.1f} ms/token, loop overhead {1e3 * self.overhead_s:.1f} ms/iter"
             f", acceptance {' '.join(f'{a:.2f}' for a in self.acceptance)}; tuned in {self.seconds:.0f} s):",
             "| setting | predicted τ | ms / iteration | predicted speedup | measured speedup (paired) [p25, p75] |",
             "|---|---|---|---|---|"]
    for c in self.candidates:
      mark = " (chosen)" if c is self.choice else ""
      measured = "not confirmed"
      if c.measured is not None:
        p25, p75 = c.measured.quantiles()
        measured = f"{c.measured.speedup:.2f}x [{p25:.2f}, {p75:.2f}]"
      lines.append(f"| {c.name}{mark} | {c.tau:.2f} | {1e3 * c.iteration_s:.1f} | {c.speedup:.2f}x | {measured} |")
    if not self.beats_plain:
      lines.append("No setting beats plain decoding on this machine at this batch size (measured where "
                   "confirmed, else predicted).")
    return "\n".join(lines)

  def to_dict(self) -> dict[str, Any]:
    return {"choice": self.choice.name, "choice_spec": dataclasses.asdict(self.choice.spec),
            "beats_plain": self.beats_plain, "acceptance": list(self.acceptance),
            "overhead_s": self.overhead_s, "seconds": self.seconds, "costs": dataclasses.asdict(self.costs),
            "candidates": [{"name": c.name, "tau": c.tau, "iteration_s": c.iteration_s, "speedup": c.speedup,
                            "measured": None if c.measured is None else c.measured.summary()}
                           for c in self.candidates]}


@functools.partial(jax.jit, static_argnames=("graphdef", "layer_ids"), donate_argnames=("cache",))
def _verify(graphdef, params, tokens, cache, lengths, *, layer_ids):
  b, n = tokens.shape
  positions = lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None]
  out = cached_forward(graphdef, params, tokens, positions, causal_mask(jnp.ones((b, n), jnp.int32)), cache,
                       lengths, return_hidden_states=True, hidden_layers=layer_ids)
  return out.logits, out.hidden_states, out.cache


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _draft_call(graphdef, params, g, tokens, cache, lengths):
  draft = nnx.merge(graphdef, params)
  b, n = tokens.shape
  positions = lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None]
  h, logits, cache = draft(g, tokens, positions, causal_mask(jnp.ones((b, n), jnp.int32)), cache, lengths)
  return h, logits, cache


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _draft_commit(graphdef, params, features, tokens, cache, lengths):
  draft = nnx.merge(graphdef, params)
  b, n = tokens.shape
  positions = lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None]
  h, _, cache = draft(draft.fuse(features), tokens, positions, causal_mask(jnp.ones((b, n), jnp.int32)), cache,
                      lengths)
  return h, cache


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _draft_logits(graphdef, params, h):
  return nnx.merge(graphdef, params).logits(h)


def _timed_loop(fn, state, repeats: int) -> float:
  """Median seconds of `state = fn(state)` (a call that donates and returns its cache)."""
  state = jax.block_until_ready(fn(state))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    state = jax.block_until_ready(fn(state))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def measure_costs(target: Target, draft: Any, prompts: Sequence[Sequence[int]], context: int, *,
                  max_n: int = 8, plain_tokens: int = 32, repeats: int = 5, prompt_width: int = 0) -> Costs:
  """Times the loop's parts on a batch of `prompts` (B = their number), `context` tokens in both caches.

  The caches hold zeros (a call's cost does not depend on what its cache holds). Verification and the draft's
  commit are timed at n = 1, 2, 3, ..., `max_n`. Plain
  decoding is timed on `prompts` themselves: its prefill (one new token) and its seconds per decode step (from
  1 and 1 + `plain_tokens` new tokens, so the prefill cancels), padded to `prompt_width` as the probes are.
  """
  loaded = decode.as_loaded_draft(draft, target.mesh)
  dcfg = loaded.config
  b, ids = len(prompts), tuple(dcfg.layer_ids)
  ns = list(range(1, max_n + 1))
  slots = context + max(ns) + 1
  lengths = jnp.full((b,), context, jnp.int32)
  dtype = nnx.merge(target.graphdef, target.params).compute_dtype
  draft_model = nnx.merge(loaded.graphdef, loaded.params)
  verify_s, commit_s = [], []
  for n in ns:
    tokens = jnp.ones((b, n), jnp.int32)
    verify_s.append((n, _timed_loop(
        lambda c: _verify(target.graphdef, target.params, tokens, c, lengths, layer_ids=ids)[2],
        new_cache(target.config, b, slots, dtype, target.mesh), repeats)))
    features = jnp.ones((len(ids), b, n, dcfg.target_hidden_size), draft_model.compute_dtype)
    commit_s.append((n, _timed_loop(
        lambda c: _draft_commit(loaded.graphdef, loaded.params, features, tokens, c, lengths)[1],
        new_cache(dcfg.model, b, slots, draft_model.compute_dtype, target.mesh), repeats)))
  h = jnp.ones((b, 1, dcfg.model.hidden_size), draft_model.compute_dtype)
  one = jnp.ones((b, 1), jnp.int32)
  draft_step_s = _timed_loop(lambda c: _draft_call(loaded.graphdef, loaded.params, h, one, c, lengths)[2],
                             new_cache(dcfg.model, b, slots, draft_model.compute_dtype, target.mesh), repeats)
  draft_logits_s = _median_seconds(lambda: _draft_logits(loaded.graphdef, loaded.params, h[:, 0]), repeats)

  def plain(n):
    return _median_seconds(lambda: plain_generate(target, prompts, n, ignore_eos=True,
                                                         prompt_width=prompt_width), max(repeats // 2, 1))

  prefill_s = plain(1)
  plain_token_s = max((plain(plain_tokens + 1) - prefill_s) / plain_tokens, 1e-9)
  return Costs(batch_size=b, context=context, plain_token_s=plain_token_s, prefill_s=prefill_s,
               verify_s=tuple(verify_s), draft_step_s=draft_step_s, draft_logits_s=draft_logits_s,
               commit_s=tuple(commit_s))


def tune(target: Target, draft: Any, prompts: Sequence[Sequence[int]], *, batch_size: int,
         max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
         chain_lengths: Sequence[int] = (1, 2, 3, 4, 5, 6, 7),
         tree_budgets: Sequence[tree_lib.TreeBudget] = (), repeats: int = 5, confirm: int = 2) -> Tuning:
  """Measures costs and acceptance once, ranks the settings by predicted tokens/s and confirms the best.

  Args:
    target, draft: the loaded target and draft.
    prompts: calibration prompts (token ids). The acceptance probes decode all of them, in batches of
      `batch_size`; the costs are timed on the first batch.
    batch_size: B, as the setting will be used.
    max_new_tokens: tokens per prompt in the probes.
    temperature, top_k, top_p, seed: the sampling the setting will be used with (acceptance depends on it).
    chain_lengths: candidate chain lengths K.
    tree_budgets: candidate EAGLE-2 trees (each costs one probe over the calibration prompts).
    repeats: timed calls per measured part (the median is used).
    confirm: how many of the best-predicted candidates to decode end to end, paired with plain decoding on
      the calibration prompts (one ABBA pair per batch), choosing by the measured speedup; 0 chooses by
      prediction alone.
  """
  if not prompts:
    raise ValueError("tune needs at least one calibration prompt.")
  if not chain_lengths and not tree_budgets:
    raise ValueError("tune needs at least one candidate: give chain_lengths or tree_budgets.")
  if any(int(k) < 1 for k in chain_lengths):
    raise ValueError(f"chain lengths must be >= 1, got {tuple(chain_lengths)}.")
  if isinstance(confirm, bool) or int(confirm) != confirm or confirm < 0:
    raise ValueError(f"confirm must be an integer >= 0 (candidates to confirm end to end), got {confirm!r}.")
  start = time.perf_counter()
  rows = [list(p) for p in prompts]
  width = max(len(p) for p in rows)  # one compilation for every calibration batch
  batches = [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
  batches[-1] += [batches[-1][i % len(batches[-1])] for i in range(batch_size - len(batches[-1]))]
  context = int(np.mean([len(p) for p in batches[0]])) + max_new_tokens // 2  # the average cache length
  k_max = max(chain_lengths) if chain_lengths else 1
  sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, prompt_width=width)
  costs = measure_costs(target, draft, batches[0], context, max_n=k_max + 1, repeats=repeats,
                        prompt_width=width)

  def probe(spec: decode.SpecOptions) -> tuple[dict, float]:
    """Acceptance over every calibration batch; seconds per iteration on the first (after a warm-up)."""
    kwargs = dict(method=spec.method, num_draft_tokens=spec.num_draft_tokens, tree_depth=spec.tree_depth,
                  tree_top_k=spec.tree_top_k, tree_tokens=spec.tree_tokens)
    decode.generate(target, draft, batches[0], max_new_tokens, **sampling, **kwargs)  # compile
    hist, per_iter = None, 0.0
    for i, batch in enumerate(batches):
      _, m = decode.generate(target, draft, batch, max_new_tokens, **sampling, **kwargs)
      h = np.asarray(m["accept_length_hist"], np.int64)
      hist = h if hist is None else hist + h
      if i == 0:
        per_iter = max(m["seconds"] - costs.prefill_s, 1e-9) / max(m["steps"], 1)
    return decode.acceptance_metrics(hist[None]), per_iter

  candidates, overhead, acceptance = [], 0.0, ()
  if chain_lengths:
    m, per_iter = probe(decode.SpecOptions(method="chain", num_draft_tokens=k_max))
    acceptance = tuple(float(a) for a in m["acceptance"])
    overhead = max(per_iter - costs.chain_iteration(k_max), 0.0)
    for k in sorted(set(int(k) for k in chain_lengths)):
      it = costs.chain_iteration(k) + overhead
      tau = chain_tau(acceptance, k)
      candidates.append(Candidate(decode.SpecOptions(method="chain", num_draft_tokens=k), tau, it,
                                  tau * costs.plain_token_s / it))
  for bud in tree_budgets:
    spec = decode.SpecOptions(method="tree", tree_depth=bud.depth, tree_top_k=bud.top_k, tree_tokens=bud.tokens)
    m, it = probe(spec)  # a tree's iteration is timed as it runs (its gather and reranking included)
    candidates.append(Candidate(spec, float(m["tau"]), it, float(m["tau"]) * costs.plain_token_s / it))
  candidates.sort(key=lambda c: -c.speedup)
  if confirm:
    plain_fn = lambda ids: plain_generate(  # noqa: E731
        target, ids, max_new_tokens, **sampling, return_stats=True)
    padded = [p for batch in batches for p in batch]  # whole batches: one compiled shape per side
    plain_fn(batches[0])  # compile outside the clock
    confirmed = []
    for c in candidates[:int(confirm)]:
      spec_fn = functools.partial(decode.generate, target, draft, max_new_tokens=max_new_tokens, **sampling,
                                  **dataclasses.asdict(c.spec))
      spec_fn(batches[0])  # compile outside the clock (every batch shares the padded shape)
      measured = timing.paired_speedup(plain_fn, spec_fn, padded, batch_size, repeats=1, warmup=False)
      confirmed.append(dataclasses.replace(c, measured=measured))
    confirmed.sort(key=lambda c: -c.measured.speedup)
    candidates = confirmed + candidates[int(confirm):]
  return Tuning(choice=candidates[0], candidates=tuple(candidates), costs=costs, acceptance=acceptance,
                overhead_s=overhead, seconds=time.perf_counter() - start)
