"""Compartments: contiguous blocks of depth with high mutual CKA (docs/METHOD.md §6).

Place in the pipeline: the [L+1, L+1] CKA matrix from `layerwave.analysis.stats` (usually restricted to the
candidate layers) → an optimal contiguous segmentation → the `compartment` selection strategy and the plots
of "the wave" (entropy profile across depth, with compartment boundaries).

Objective (precise). For a contiguous block b = [s, e) let P(b) = {(ℓ, m) ∈ b², ℓ ≠ m} be its ordered pairs
of distinct layers. A segmentation into blocks scores

    Q = Σ_b Σ_{(ℓ, m) ∈ P(b)} (C_ℓm − β)  =  Σ_b |b|(|b| − 1) · (mean off-diagonal CKA over b − β)

("pairs" weighting, the default): the total within-block mean CKA, in excess of a baseline β, weighted by the
number of pairs it averages. Singletons score 0. β is what a pair must beat to be worth grouping; by default
the mean off-diagonal CKA of the whole matrix, so two layers share a compartment when they are more similar
than depth at large. This rules out both trivial answers: one block of everything scores exactly 0, all
singletons score 0, and merging two homogeneous blocks helps iff their cross-similarity exceeds β. Because a
large homogeneous block scores more than its pieces, g can be chosen by maximising Q*(g) (minus an optional
penalty · g); no tuned penalty is needed for clean block structure.
The alternative "layers" weighting, Σ_b |b| · (mean off-diagonal over b − β), counts every layer once with its
mean CKA to its block-mates; it is indifferent to splitting a homogeneous block, so it suits a fixed g.
For a fixed number of blocks g the optimum is exact by dynamic programming in O(g·n²), with O(1) block scores
from 2-D prefix sums. Automatic g: argmax_g Q*(g) − penalty · g, ties → fewest blocks.

Legend (`layerwave.axes`): L target layers.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

__all__ = ["Segmentation", "default_baseline", "block_scores", "segment", "segment_fixed", "labels_from_blocks",
           "selection_blocks"]


@dataclasses.dataclass(frozen=True)
class Segmentation:
  """A contiguous segmentation of depth.

  Attributes:
    blocks: tuple of (start, end) pairs, end exclusive, in the caller's index space (`offset` added).
    score: objective Q of this segmentation.
    baseline: β used.
    scores_by_g: optimal Q*(g) for every g tried (index g-1), for plots / diagnostics.
  """

  blocks: tuple[tuple[int, int], ...]
  score: float
  baseline: float
  scores_by_g: tuple[float, ...] = ()

  @property
  def num_blocks(self) -> int:
    return len(self.blocks)

  @property
  def boundaries(self) -> tuple[int, ...]:
    """Start index of every block after the first."""
    return tuple(s for s, _ in self.blocks[1:])


def _check_matrix(sim) -> np.ndarray:
  c = np.asarray(sim, dtype=np.float64)
  if c.ndim != 2 or c.shape[0] != c.shape[1] or c.shape[0] == 0:
    raise ValueError(f"similarity matrix must be square [n, n], got shape {c.shape}")
  if not np.all(np.isfinite(c)):
    raise ValueError("similarity matrix holds NaN/inf")
  return 0.5 * (c + c.T)


def default_baseline(sim) -> float:
  """Mean off-diagonal entry of the similarity matrix (0 for a 1×1 matrix)."""
  c = _check_matrix(sim)
  n = c.shape[0]
  if n < 2:
    return 0.0
  return float((c.sum() - np.trace(c)) / (n * (n - 1)))


_WEIGHTINGS = ("pairs", "layers")


def block_scores(sim, baseline: float = 0.0, weighting: str = "pairs") -> np.ndarray:
  """Score of every contiguous block.

  Args:
    sim: [n, n] similarity matrix.
    baseline: β.
    weighting: "pairs" (Σ over ordered pairs of C − β) or "layers" (|b| · (mean off-diagonal − β)).

  Returns:
    [n, n+1] array S with S[s, e] the score of b = [s, e) for e − s ≥ 2, 0 for singletons and -inf for
    empty / reversed blocks.
  """
  if weighting not in _WEIGHTINGS:
    raise ValueError(f"unknown weighting {weighting!r}; known: {_WEIGHTINGS}")
  c = _check_matrix(sim)
  n = c.shape[0]
  c = c - np.diag(np.diag(c))
  prefix = np.zeros((n + 1, n + 1))
  prefix[1:, 1:] = c.cumsum(0).cumsum(1)
  s = np.arange(n)[:, None]
  e = np.arange(n + 1)[None, :]
  size = e - s
  sum_in = prefix[e, e] - prefix[s, e] - prefix[e, s] + prefix[s, s]
  excess = sum_in - size * (size - 1) * baseline
  with np.errstate(divide="ignore", invalid="ignore"):
    score = excess if weighting == "pairs" else excess / (size - 1)
  score = np.where(size >= 2, score, np.where(size == 1, 0.0, -np.inf))
  return score


def _dp(scores: np.ndarray, max_blocks: int) -> tuple[np.ndarray, np.ndarray]:
  """best[g, e] = max score of [0, e) in g blocks; arg[g, e] = start of the last block."""
  n = scores.shape[0]
  best = np.full((max_blocks + 1, n + 1), -np.inf)
  arg = np.zeros((max_blocks + 1, n + 1), dtype=np.int64)
  best[0, 0] = 0.0
  for g in range(1, max_blocks + 1):
    for e in range(g, n + 1):
      starts = np.arange(g - 1, e)
      cand = best[g - 1, starts] + scores[starts, e]
      j = int(np.argmax(cand))
      best[g, e] = cand[j]
      arg[g, e] = starts[j]
  return best, arg


def _backtrack(arg: np.ndarray, g: int, n: int, offset: int) -> tuple[tuple[int, int], ...]:
  blocks = []
  e = n
  for gg in range(g, 0, -1):
    s = int(arg[gg, e])
    blocks.append((s + offset, e + offset))
    e = s
  return tuple(reversed(blocks))


def segment_fixed(sim, num_blocks: int, baseline: float | None = None, offset: int = 0,
                  weighting: str = "pairs") -> Segmentation:
  """Optimal segmentation into exactly `num_blocks` contiguous blocks.

  Args:
    sim: [n, n] similarity (CKA) matrix.
    num_blocks: g, 1 ≤ g ≤ n.
    baseline: β; None → mean off-diagonal similarity (0 gives the plain size-weighted within-block mean).
    offset: added to the returned indices (e.g. 1 when sim covers layers 1..L-1).
    weighting: "pairs" or "layers" (module docstring).

  Returns:
    Segmentation.
  """
  c = _check_matrix(sim)
  n = c.shape[0]
  if not 1 <= num_blocks <= n:
    raise ValueError(f"num_blocks must be in [1, {n}], got {num_blocks}")
  beta = default_baseline(c) if baseline is None else float(baseline)
  best, arg = _dp(block_scores(c, beta, weighting), num_blocks)
  return Segmentation(_backtrack(arg, num_blocks, n, offset), float(best[num_blocks, n]), beta,
                      tuple(float(v) for v in best[1:, n]))


def segment(
    sim,
    num_blocks: int | None = None,
    *,
    baseline: float | None = None,
    penalty: float = 0.0,
    max_blocks: int | None = None,
    min_blocks: int = 1,
    offset: int = 0,
    weighting: str = "pairs",
) -> Segmentation:
  """Optimal contiguous segmentation; g fixed, or chosen by argmax_g Q*(g) − penalty · g.

  Args:
    sim: [n, n] similarity (CKA) matrix.
    num_blocks: g, or None to choose it.
    baseline: β; None → mean off-diagonal similarity.
    penalty: cost per block when choosing g (≥ 0).
    max_blocks: largest g tried (default n).
    min_blocks: smallest g tried when choosing g.
    offset: added to the returned indices.
    weighting: "pairs" or "layers" (module docstring).

  Returns:
    Segmentation.
  """
  c = _check_matrix(sim)
  n = c.shape[0]
  if num_blocks is not None:
    return segment_fixed(c, num_blocks, baseline=baseline, offset=offset, weighting=weighting)
  if penalty < 0:
    raise ValueError(f"penalty must be >= 0, got {penalty}")
  hi = n if max_blocks is None else min(int(max_blocks), n)
  if not 1 <= min_blocks <= hi:
    raise ValueError(f"need 1 <= min_blocks <= max_blocks <= n = {n}; got {min_blocks}, {max_blocks}")
  beta = default_baseline(c) if baseline is None else float(baseline)
  best, arg = _dp(block_scores(c, beta, weighting), hi)
  totals = best[1:, n]
  gs = np.arange(1, hi + 1)
  objective = np.where(gs >= min_blocks, totals - penalty * gs, -np.inf)
  # Round before argmax so float noise cannot break a genuine tie towards more blocks.
  g = int(gs[np.argmax(np.round(objective, 10))])
  return Segmentation(_backtrack(arg, g, n, offset), float(totals[g - 1]), beta,
                      tuple(float(v) for v in totals))


def selection_blocks(cka, candidates: Sequence[int], k: int, segmentation: Segmentation | None = None
                     ) -> tuple[tuple[int, int], ...]:
  """The compartments the `compartment` selection strategy picks one layer from (at least k of them).

  Args:
    cka: [L+1, L+1] pairwise CKA.
    candidates: the candidate layer ids (contiguous when segmenting here).
    k: layers to select.
    segmentation: a segmentation already made (the analysis' report); used when it has at least k blocks.

  Returns:
    (start, end) pairs, end exclusive, hf ids: `segmentation`'s blocks, or the automatic segmentation of the
    candidates' CKA with at least k blocks.
  """
  if segmentation is not None and segmentation.num_blocks >= k:
    return tuple(tuple(b) for b in segmentation.blocks)
  cands = np.array(sorted({int(i) for i in candidates}), dtype=np.int64)
  if not np.array_equal(cands, np.arange(cands[0], cands[-1] + 1)):
    raise ValueError(f"automatic compartments need contiguous candidates, got {cands.tolist()}; pass the "
                     "blocks (compartments=) to the compartment strategy.")
  sub = np.asarray(cka, np.float64)[np.ix_(cands, cands)]
  return segment(sub, min_blocks=min(int(k), cands.size), offset=int(cands[0])).blocks


def labels_from_blocks(blocks, n: int | None = None, offset: int = 0) -> np.ndarray:
  """Block label of every index covered by `blocks` ((start, end) pairs, end exclusive).

  Args:
    blocks: contiguous (start, end) pairs.
    n: length of the label vector (default: the last end − offset).
    offset: index of label position 0.

  Returns:
    [n] int array, -1 for indices not in any block.
  """
  blocks = [(int(s), int(e)) for s, e in blocks]
  n = (max(e for _, e in blocks) - offset) if n is None else n
  labels = np.full((n,), -1, dtype=np.int64)
  for i, (s, e) in enumerate(blocks):
    labels[max(s - offset, 0):max(e - offset, 0)] = i
  return labels
