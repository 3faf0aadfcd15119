"""Speculation settings chosen by measurement (`method="auto"`): the chain length or tree that decodes fastest.

On an accelerator a verification of n tokens costs about one decoding step for n up to tens of tokens; on a CPU
it grows with n almost at once (a large tree at batch 8 runs several times slower than plain decoding:
BENCHMARKS.md, "Speculative decoding"). So the
best setting depends on the machine, the batch size and the draft, and is measured, not assumed.

Every candidate (a few chains and small trees) decodes the calibration prompts end to end, each batch paired
with plain decoding of the same batch in ABBA order (`timing.paired_speedup`, the benchmark's own
measurement): the candidate's speedup is the median of its pairs' ratios of tokens per second, and the
candidate with the highest one wins (the first listed on a tie). When none beats plain decoding the tuning
says so (`Tuning.beats_plain`), and `method="auto"` then decodes plainly (`evaluate.DecodeSettings.plain`).
Nothing is predicted from separately timed parts: such predictions were off by enough to reverse the ranking
(BENCHMARKS.md, "`method=auto` now times every candidate end to end").

`tune` returns the choice with every candidate's timing, so a launcher can print the table next to what the
chosen and the fixed settings then measure (benchmarks/bench_speculative.py).

Legend (`layerwave.axes`): B batch, K draft depth (the verification reads K + 1 tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import numpy as np

from layerwave.generate import generate as plain_generate
from layerwave.inference import Target
from layerwave.speculative import decode
from layerwave.speculative import timing
from layerwave.speculative import tree as tree_lib

__all__ = ["AUTO", "AUTO_TREES", "CALIBRATION_PROMPTS", "MIN_PAIRS", "Candidate", "Tuning", "choose", "tune"]

AUTO = "auto"  # `speculate.method` value that asks for `tune`
# The trees `method="auto"` tries besides chains: small ones, since a CPU pays for every verified node.
AUTO_TREES = (tree_lib.TreeBudget(depth=3, top_k=4, tokens=8), tree_lib.TreeBudget(depth=4, top_k=4, tokens=16))
CALIBRATION_PROMPTS = 8  # prompts every candidate decodes
MIN_PAIRS = 3  # timed pairs per candidate when `tune` chooses the repeats


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One setting and its end-to-end timing against plain decoding.

  Attributes:
    spec: the drafting setting.
    measured: its paired timing on the calibration prompts (`timing.PairedTiming`).
  """

  spec: decode.SpecOptions
  measured: timing.PairedTiming

  @property
  def speedup(self) -> float:
    """The measured speedup: the median pair ratio of speculative ÷ plain tokens per second."""
    return self.measured.speedup

  @property
  def tau(self) -> float:
    """Measured new tokens per verification (bonus included) over the calibration prompts."""
    return float(decode.acceptance_metrics(np.asarray(self.measured.accept_length_hist)[None])["tau"])

  @property
  def name(self) -> str:
    s = self.spec
    return (f"chain K={s.num_draft_tokens}" if s.method == "chain" else
            f"tree d={s.tree_depth} k={s.tree_top_k} n={s.tree_tokens}")


@dataclasses.dataclass(frozen=True)
class Tuning:
  """What `tune` measured and chose.

  Attributes:
    choice: the candidate with the highest measured speedup (`choose`).
    candidates: every candidate, in the order they were timed (chains by K, then the trees as given).
    batch_size: B the candidates were timed at.
    prompts: calibration prompts decoded per candidate (the last batch padded to B).
    repeats: timed pairs per calibration batch.
    seconds: the tuner's own wall time (compilation included).
  """

  choice: Candidate
  candidates: tuple[Candidate, ...]
  batch_size: int
  prompts: int
  repeats: int
  seconds: float

  @property
  def beats_plain(self) -> bool:
    return self.choice.speedup > 1.0

  def table(self) -> str:
    """A markdown table of every candidate's measurement, the choice marked."""
    pairs = self.choice.measured.num_pairs
    lines = [f"auto (B={self.batch_size}, {self.prompts} calibration prompts, {pairs} ABBA pairs with plain "
             f"decoding per setting; tuned in {self.seconds:.0f} s):",
             "| setting | τ | spec tok/s | plain tok/s | speedup (paired) [p25, p75] |",
             "|---|---|---|---|---|"]
    for c in self.candidates:
      # When nothing beats plain decoding `auto` decodes plainly: the best candidate is then not what runs.
      mark = (" (chosen)" if self.beats_plain else " (best; plain decoding chosen)") if c is self.choice else ""
      m = c.measured.summary()
      lines.append(f"| {c.name}{mark} | {c.tau:.2f} | {m['tokens_per_s']:.1f} | {m['ar_tokens_per_s']:.1f} | "
                   f"{c.speedup:.2f}x [{m['speedup_p25']:.2f}, {m['speedup_p75']:.2f}] |")
    if not self.beats_plain:
      lines.append("No setting beats plain decoding on this machine at this batch size: `auto` decodes plainly.")
    return "\n".join(lines)

  def to_dict(self) -> dict[str, Any]:
    return {"choice": self.choice.name, "choice_spec": dataclasses.asdict(self.choice.spec),
            "beats_plain": self.beats_plain, "batch_size": self.batch_size, "prompts": self.prompts,
            "repeats": self.repeats, "seconds": self.seconds,
            "candidates": [{"name": c.name, "spec": dataclasses.asdict(c.spec), "tau": c.tau,
                            "measured": c.measured.summary()} for c in self.candidates]}


def choose(candidates: Sequence[Candidate]) -> Candidate:
  """The candidate with the highest measured speedup; on a tie, the first of them in `candidates`.

  Args:
    candidates: timed candidates.

  Returns:
    One of `candidates`.

  Raises:
    ValueError: no candidates.
  """
  if not candidates:
    raise ValueError("choose needs at least one timed candidate.")
  best = candidates[0]
  for c in candidates[1:]:
    if c.speedup > best.speedup:
      best = c
  return best


def _positive_int(name: str, value: Any, hint: str) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be a positive integer ({hint}), got {value!r}.")


def _specs(chain_lengths: Sequence[int], tree_budgets: Sequence[tree_lib.TreeBudget]) -> list[decode.SpecOptions]:
  """The candidate settings, checked: chains by K (duplicates dropped), then the trees as given."""
  chain_lengths, tree_budgets = tuple(chain_lengths), tuple(tree_budgets)
  if not chain_lengths and not tree_budgets:
    raise ValueError("tune needs at least one candidate: give chain_lengths or tree_budgets.")
  for k in chain_lengths:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
      raise ValueError(f"chain lengths must be >= 1 (integers K of drafted tokens), got {chain_lengths}.")
  for b in tree_budgets:
    if not isinstance(b, tree_lib.TreeBudget):
      raise ValueError(f"tree_budgets must be tree.TreeBudget(depth, top_k, tokens) values, got {b!r}.")
  specs = [decode.SpecOptions(method="chain", num_draft_tokens=int(k)) for k in sorted(set(chain_lengths))]
  specs += [decode.SpecOptions(method="tree", tree_depth=b.depth, tree_top_k=b.top_k, tree_tokens=b.tokens)
            for b in dict.fromkeys(tree_budgets)]
  return specs


def tune(target: Target, draft: Any, prompts: Sequence[Sequence[int]], *, batch_size: int,
         max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
         chain_lengths: Sequence[int] = (1, 2, 3), tree_budgets: Sequence[tree_lib.TreeBudget] = (),
         repeats: int | None = None) -> Tuning:
  """Decodes the calibration prompts with every candidate, paired with plain decoding, and picks the fastest.

  The prompts are cut into batches of `batch_size` (the last one padded by repeating its prompts) and padded
  to one width, so each side compiles once, outside the clock. Each candidate is then timed by
  `timing.paired_speedup` on every batch, `repeats` pairs per batch, and `choose` picks among them.

  Args:
    target: the loaded target.
    draft: its draft (a `Draft` or `LoadedDraft`).
    prompts: calibration prompts (token ids).
    batch_size: B, as the setting will be used.
    max_new_tokens: tokens per prompt in the timed runs.
    temperature, top_k, top_p, seed: the sampling the setting will be used with (both sides use it).
    chain_lengths: candidate chain lengths K.
    tree_budgets: candidate EAGLE-2 trees.
    repeats: timed pairs per calibration batch; None takes the fewest giving `MIN_PAIRS` pairs per candidate.

  Returns:
    A `Tuning`: the choice and every candidate's `timing.PairedTiming`.

  Raises:
    ValueError: no prompts, no candidates, a chain length, batch size, token count or repeat count that is not
      a positive integer, or a tree budget that is not a `tree.TreeBudget`; all before anything is decoded.
  """
  if not prompts:
    raise ValueError("tune needs at least one calibration prompt.")
  _positive_int("batch_size", batch_size, "prompts per decoding call")
  _positive_int("max_new_tokens", max_new_tokens, "tokens per calibration prompt")
  if repeats is not None:
    _positive_int("repeats", repeats, "timed pairs per calibration batch, or None to choose")
  specs = _specs(chain_lengths, tree_budgets)
  start = time.perf_counter()
  rows = [list(p) for p in prompts]
  batches = [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
  batches[-1] += [batches[-1][i % len(batches[-1])] for i in range(batch_size - len(batches[-1]))]
  padded = [p for batch in batches for p in batch]  # whole batches: one compiled shape per side
  if repeats is None:
    repeats = -(-MIN_PAIRS // len(batches))
  sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                  prompt_width=max(len(p) for p in rows))
  plain_fn = functools.partial(plain_generate, target, max_new_tokens=max_new_tokens, **sampling,
                               return_stats=True)
  plain_fn(batches[0])  # compile outside the clock
  candidates = []
  for spec in specs:
    spec_fn = functools.partial(decode.generate, target, draft, max_new_tokens=max_new_tokens, **sampling,
                                **dataclasses.asdict(spec))
    spec_fn(batches[0])  # compile outside the clock (every batch shares the padded shape)
    measured = timing.paired_speedup(plain_fn, spec_fn, padded, batch_size, repeats=repeats, warmup=False)
    candidates.append(Candidate(spec, measured))
  return Tuning(choice=choose(candidates), candidates=tuple(candidates), batch_size=int(batch_size),
                prompts=len(padded), repeats=int(repeats), seconds=time.perf_counter() - start)
