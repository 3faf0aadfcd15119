"""Speedups as paired, interleaved timings of plain and speculative decoding on the same batches.

The last measurement of the pipeline: every speedup the project reports (`experiments/speculate.py`,
`benchmarks/bench_speculative.py`, `layerwave.compare`) comes from `paired_speedup`. On a shared machine
the speed of the same code drifts several-fold as other jobs come and go (BENCHMARKS.md), so plain decoding
timed once and speculation timed minutes later gives a ratio of two different machines. Here each batch is
decoded by both, back to back, `repeats` times, in ABBA order (plain first in even pairs, speculative first in
odd ones, so a linear drift cancels), after one untimed warm-up of each (compilation outside the clock).
Each pair gives one ratio of tokens per second (speculative ÷ plain: at T > 0 the two may emit different
numbers of tokens); the speedup is the median ratio, with its quartiles and range over the pairs. Across
processes (a multi-host mesh) every call's seconds are the slowest process's (`sharding.process_max`): the
program ends when its last process does, and every process then holds the same timings and ratios.

Where a speedup comes from: when both functions report their loop's `steps` (plain decode steps; speculative
iterations, each one draft + verify), the speedup splits into two measured factors,

  speedup = effective_tau / iteration_cost,   effective_tau = plain steps / speculative iterations,
                                              iteration_cost = (s per iteration) / (s per plain step),

exactly when both emit the same tokens (greedy) and prefill is negligible. At batch 1, effective_tau is τ; so
`iteration_cost` is the break-even τ of this drafting setting on this machine, and a target speedup S needs
τ = S · iteration_cost. At batch B a step serves B rows and effective_tau is the slowest row's.

Legend (`layerwave.axes`): K draft depth.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np

from layerwave import sharding
from layerwave.speculative import decode as decode_lib

__all__ = ["PairedTiming", "combine", "paired_speedup"]

# fn(batch of prompts) -> (new-token lists, metrics): `layerwave.generate(..., return_stats=True)` or
# `layerwave.speculative.generate` bound to a target, draft and settings.
DecodeFn = Callable[[list], tuple[list, dict]]


@dataclasses.dataclass(frozen=True)
class PairedTiming:
  """The result of `paired_speedup` (or of `combine` over several of them).

  Attributes:
    ratios: per pair, speculative tokens/s ÷ plain tokens/s of the same batch and repeat.
    plain_tokens_per_s, spec_tokens_per_s: per pair, each side's tokens per second.
    repeats: timed pairs per batch.
    plain_outputs, spec_outputs: new-token lists per prompt (from each batch's first timed call).
    accept_length_hist: `[K+1]` the speculative calls' accepted-length counts summed over batches (one
      call per batch), or None when `spec_fn` reports none.
    per_batch: per batch {new_tokens, plain_new_tokens, seconds, plain_seconds (medians over its
      repeats), speedup (median of its ratios)[, tau, verify_calls, prompt_stats (`decode.prompt_stats`)]
      [, steps, plain_steps, effective_tau, iteration_cost (the module docstring)]}.
  """

  ratios: tuple[float, ...]
  plain_tokens_per_s: tuple[float, ...]
  spec_tokens_per_s: tuple[float, ...]
  repeats: int
  plain_outputs: list
  spec_outputs: list
  accept_length_hist: np.ndarray | None
  per_batch: list

  @property
  def num_pairs(self) -> int:
    return len(self.ratios)

  @property
  def speedup(self) -> float:
    """The median of the per-pair ratios."""
    return float(np.median(self.ratios))

  def quantiles(self) -> tuple[float, float]:
    """(25th, 75th) percentiles of the per-pair ratios (linear interpolation)."""
    p25, p75 = np.percentile(self.ratios, [25, 75])
    return float(p25), float(p75)

  def describe(self) -> str:
    """How the speedup was timed, for tables: pairs, order, statistic and spread."""
    p25, p75 = self.quantiles()
    return (f"median of {self.num_pairs} interleaved (ABBA) pairs, {self.repeats} per batch "
            f"[p25 {p25:.2f}, p75 {p75:.2f}; min {min(self.ratios):.2f}, max {max(self.ratios):.2f}]")

  def decomposition(self) -> dict[str, float]:
    """{effective_tau, iteration_cost}: the speedup's two factors (module docstring), pooled over batches
    (plain steps ÷ speculative iterations, and seconds per iteration ÷ seconds per plain step, each summed
    over the batches); empty when a function did not report its steps."""
    rows = [r for r in self.per_batch if "steps" in r and "plain_steps" in r]
    if not rows or len(rows) != len(self.per_batch):
      return {}
    steps = sum(r["steps"] for r in rows)
    plain_steps = sum(r["plain_steps"] for r in rows)
    per_iteration = sum(r["seconds"] for r in rows) / steps
    per_step = sum(r["plain_seconds"] for r in rows) / plain_steps
    return {"effective_tau": plain_steps / steps, "iteration_cost": per_iteration / per_step}

  def summary(self) -> dict[str, Any]:
    """The timing as JSON-ready scalars (no outputs)."""
    p25, p75 = self.quantiles()
    return {"speedup": self.speedup, "speedup_p25": p25, "speedup_p75": p75,
            "speedup_min": float(min(self.ratios)), "speedup_max": float(max(self.ratios)),
            "timing_pairs": self.num_pairs, "timing_repeats": self.repeats,
            "tokens_per_s": float(np.median(self.spec_tokens_per_s)),
            "ar_tokens_per_s": float(np.median(self.plain_tokens_per_s)),
            "timing": "paired: " + self.describe(), **self.decomposition()}


def _check(prompts: Sequence[Sequence[int]], batch_size: int, repeats: int) -> None:
  if len(prompts) == 0:
    raise ValueError("paired_speedup needs at least one prompt.")
  for name, value in (("batch_size", batch_size), ("repeats", repeats)):
    if isinstance(value, bool) or int(value) != value or value < 1:
      raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _call(fn: DecodeFn, ids: list, which: str) -> tuple[list, dict, float]:
  """One timed call: (outputs, metrics, seconds; the slowest process's)."""
  start = time.perf_counter()
  result = fn(ids)
  seconds = sharding.process_max(time.perf_counter() - start)
  if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
    raise TypeError(f"{which} must return (new-token lists, metrics dict), like layerwave.generate with "
                    f"return_stats=True; got {type(result).__name__}.")
  if len(result[0]) != len(ids):
    raise ValueError(f"{which} returned {len(result[0])} outputs for a batch of {len(ids)} prompts.")
  return result[0], result[1], seconds


def paired_speedup(plain_fn: DecodeFn, spec_fn: DecodeFn, prompts: Sequence[Sequence[int]],
                   batch_size: int, repeats: int = 3, warmup: bool = True) -> PairedTiming:
  """Times plain and speculative decoding of the same batches in alternation; see the module docstring.

  Batch by batch: with `warmup`, one untimed call of each on the batch when its (size, longest prompt)
  has not been seen (equal keys give equal padded shapes, hence no compilation inside the clock); then
  `repeats` pairs of timed calls, plain first in even pairs and speculative first in odd ones (counted over
  all batches, so one repeat per batch still alternates).

  Args:
    plain_fn: batch -> (outputs, metrics), e.g. `layerwave.generate(..., return_stats=True)`.
    spec_fn: batch -> (outputs, metrics with `accept_length_hist`, `tau`, `verify_calls`), e.g.
      `layerwave.speculative.generate`, with the same sampling settings.
    prompts: token-id lists, decoded in batches of `batch_size` in order.
    batch_size: prompts per call.
    repeats: timed pairs per batch (≥ 1; the median needs ≥ 3 to resist one disturbed pair).
    warmup: decode each new batch shape once with both functions before timing.

  Returns:
    A `PairedTiming`: per-pair ratios (`speedup` their median, `quantiles()`), both sides' tokens/s,
    outputs of both, the summed acceptance histogram and per-batch rows.

  Raises:
    ValueError: no prompts, a batch size or repeat count that is not a positive integer, or a function
      returning a wrong number of outputs.
    TypeError: a function that does not return (outputs, metrics).
  """
  _check(prompts, batch_size, repeats)
  batches = [list(prompts[i:i + batch_size]) for i in range(0, len(prompts), batch_size)]
  warmed = set()
  ratios, plain_rates, spec_rates, per_batch = [], [], [], []
  plain_outputs, spec_outputs, hist = [], [], None
  pair = 0
  for ids in batches:
    key = (len(ids), max(len(p) for p in ids))
    if warmup and key not in warmed:
      warmed.add(key)
      _call(plain_fn, ids, "plain_fn")
      _call(spec_fn, ids, "spec_fn")
    seconds = {"plain": [], "spec": []}
    tokens = {"plain": [], "spec": []}
    first: dict[str, tuple[list, dict]] = {}
    for _ in range(int(repeats)):
      order = ("plain", "spec") if pair % 2 == 0 else ("spec", "plain")
      for which in order:
        out, metrics, dt = _call(plain_fn if which == "plain" else spec_fn, ids, f"{which}_fn")
        first.setdefault(which, (out, metrics))
        seconds[which].append(dt)
        tokens[which].append(sum(len(o) for o in out))
      plain_rates.append(tokens["plain"][-1] / seconds["plain"][-1])
      spec_rates.append(tokens["spec"][-1] / seconds["spec"][-1])
      ratios.append(spec_rates[-1] / plain_rates[-1])
      pair += 1
    plain_outputs.extend(first["plain"][0])
    out, metrics = first["spec"]
    spec_outputs.extend(out)
    row = {"new_tokens": tokens["spec"][0], "plain_new_tokens": tokens["plain"][0],
           "seconds": float(np.median(seconds["spec"])), "plain_seconds": float(np.median(seconds["plain"])),
           "speedup": float(np.median(ratios[-int(repeats):]))}
    if "accept_length_hist" in metrics:
      h = np.asarray(metrics["accept_length_hist"], np.int64)
      hist = h if hist is None else hist + h
      row.update(tau=metrics["tau"], verify_calls=metrics["verify_calls"])
    if "accept_lengths" in metrics:
      row["prompt_stats"] = decode_lib.prompt_stats(metrics["accept_lengths"])
    plain_metrics = first["plain"][1]
    if metrics.get("steps") and plain_metrics.get("steps"):
      row.update(steps=int(metrics["steps"]), plain_steps=int(plain_metrics["steps"]),
                 effective_tau=plain_metrics["steps"] / metrics["steps"],
                 iteration_cost=(row["seconds"] / metrics["steps"]) / (row["plain_seconds"] / plain_metrics["steps"]))
    per_batch.append(row)
  return PairedTiming(tuple(ratios), tuple(plain_rates), tuple(spec_rates), int(repeats), plain_outputs,
                      spec_outputs, hist, per_batch)


def combine(timings: Sequence[PairedTiming]) -> PairedTiming:
  """Pools several timings (e.g. one per dataset) into one: all their pairs, outputs and histograms."""
  if not timings:
    raise ValueError("combine needs at least one PairedTiming.")
  hists = [t.accept_length_hist for t in timings if t.accept_length_hist is not None]
  repeats = {t.repeats for t in timings}
  if len(repeats) > 1:
    raise ValueError(f"combine pools timings of one repeat count; got {sorted(repeats)}.")
  return PairedTiming(
      ratios=sum((t.ratios for t in timings), ()),
      plain_tokens_per_s=sum((t.plain_tokens_per_s for t in timings), ()),
      spec_tokens_per_s=sum((t.spec_tokens_per_s for t in timings), ()),
      repeats=repeats.pop(),
      plain_outputs=[o for t in timings for o in t.plain_outputs],
      spec_outputs=[o for t in timings for o in t.spec_outputs],
      accept_length_hist=sum(hists[1:], hists[0]) if hists else None,
      per_batch=[r for t in timings for r in t.per_batch])
