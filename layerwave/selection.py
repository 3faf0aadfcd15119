"""Layer selection: statistics → the target layers an EAGLE-3 draft reads (docs/METHOD.md §5).

Place in the pipeline: `LayerStats` (per-layer informativeness E [L+1], pairwise CKA C [L+1, L+1]) →
`select_layers` → a `layerwave.layer_ids.LayerSelection` record (ids in the hf_hidden_states convention of
`layerwave.layer_ids`), one per strategy, which the analysis stage writes as `selection.json` for training.

Objective for a set S (exhaustive / compartment): Σ_{ℓ∈S} Ê_ℓ − λ Σ_{ℓ<m ∈ S} C_ℓm, with Ê the min-max
normalisation of E over the candidates.

Legend (`layerwave.axes`): L target layers, k selected layers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from layerwave import atomic
from layerwave import layer_ids

__all__ = [
    "STRATEGIES",
    "exhaustive_search",
    "normalize_informativeness",
    "select_layers",
    "subset_objective",
]

STRATEGIES = ("eagle3", "entropy", "greedy", "exhaustive", "compartment", "random")
MAX_SUBSETS = 5_000_000  # exhaustive enumeration limit (C(29, 3) = 3,654 for SmolLM2-135M)


def normalize_informativeness(entropy, candidates: Sequence[int]) -> np.ndarray:
  """Ê: E min-max normalised over the candidates (candidates map to [0, 1]; constant E → 0).

  Args:
    entropy: [L+1] per-layer informativeness.
    candidates: candidate ids.

  Returns:
    [L+1] float64 (non-candidates are normalised with the same affine map).
  """
  e = np.asarray(entropy, np.float64)
  c = e[list(candidates)]
  lo, hi = c.min(), c.max()
  return (e - lo) / (hi - lo) if hi > lo else np.zeros_like(e)


def subset_objective(subsets: np.ndarray, e_hat: np.ndarray, cka: np.ndarray, lam: float) -> np.ndarray:
  """Σ_{ℓ∈S} Ê_ℓ − λ Σ_{ℓ<m ∈ S} C_ℓm for each row of `subsets` [num_subsets, k] → [num_subsets]."""
  subsets = np.asarray(subsets)
  value = e_hat[subsets].sum(axis=1)
  k = subsets.shape[1]
  for a, b in itertools.combinations(range(k), 2):
    value = value - lam * cka[subsets[:, a], subsets[:, b]]
  return value


def _gap_ok(subsets: np.ndarray, min_gap: int) -> np.ndarray:
  if min_gap <= 1 or subsets.shape[1] < 2:
    return np.ones(subsets.shape[0], bool)
  return np.all(np.diff(np.sort(subsets, axis=1), axis=1) >= min_gap, axis=1)


def _max_feasible(candidates: Sequence[int], min_gap: int) -> int:
  """Largest subset of candidates with pairwise distance ≥ min_gap (greedy from the smallest is optimal)."""
  count, last = 0, None
  for c in sorted(candidates):
    if last is None or c - last >= max(min_gap, 1):
      count, last = count + 1, c
  return count


def exhaustive_search(cands: np.ndarray, k: int, e_hat, cka, lam, min_gap) -> tuple[int, ...]:
  """The k-subset of `cands` with the largest `subset_objective` among those `min_gap` apart (all of them)."""
  total = math.comb(len(cands), k)
  if total > MAX_SUBSETS:
    raise ValueError(f"exhaustive search over C({len(cands)}, {k}) = {total} subsets exceeds {MAX_SUBSETS}; "
                     "use greedy or fewer candidates")
  subsets = cands[np.array(list(itertools.combinations(range(len(cands)), k)), dtype=np.int64).reshape(-1, k)]
  value = np.where(_gap_ok(subsets, min_gap), subset_objective(subsets, e_hat, cka, lam), -np.inf)
  return tuple(int(i) for i in subsets[int(np.argmax(value))])


def _greedy(cands: np.ndarray, k: int, e_hat, cka, lam, min_gap) -> tuple[int, ...]:
  chosen = [int(cands[np.argmax(e_hat[cands])])]
  while len(chosen) < k:
    rest = np.array([c for c in cands if c not in chosen
                     and all(abs(c - s) >= max(min_gap, 1) for s in chosen)], dtype=np.int64)
    if rest.size == 0:
      raise ValueError(f"greedy selection found no candidate at distance >= min_gap={min_gap} from {chosen}; "
                       "use strategy 'exhaustive' or a smaller min_gap")
    gain = e_hat[rest] - lam * cka[np.ix_(rest, chosen)].max(axis=1)
    chosen.append(int(rest[np.argmax(gain)]))
  return tuple(chosen)


def select_layers(
    strategy: str,
    entropy=None,
    cka=None,
    k: int = 3,
    lam: float = 1.0,
    min_gap: int = 0,
    candidates: Sequence[int] | None = None,
    seed: int = 0,
    compartments: Sequence[tuple[int, int]] | None = None,
    *,
    num_layers: int | None = None,
    hidden_size: int | None = None,
    include_embeddings: bool = False,
    include_final: bool = False,
    data_hash: str | None = None,
    config: dict | None = None,
) -> layer_ids.LayerSelection:
  """Chooses k target layers.

  Args:
    strategy: one of STRATEGIES:
      eagle3 — (2, L//2, L−3) (k ≠ 3: evenly spaced 2..L−3); ignores the statistics.
      entropy — the k largest Ê (exact under min_gap).
      greedy — argmax Ê, then repeatedly argmax_ℓ Ê_ℓ − λ max_{m∈S} C_ℓm.
      exhaustive — argmax over all k-subsets of the objective.
      compartment — the best-Ê layer of each compartment, then the best k of those by the objective; at most
        one per compartment. `compartments`: (start, end) pairs, end exclusive, hf ids (the caller segments:
        `layerwave.analysis.compartments.selection_blocks`, so selection does not import the analysis).
      random — k distinct candidates drawn with `seed`.
    entropy: [L+1] per-layer informativeness E (e.g. LayerStats.prompt_entropy). Not needed for eagle3/random.
    cka: [L+1, L+1] pairwise CKA. Needed for greedy / exhaustive / compartment (λ > 0).
    k: number of layers (≥ 1).
    lam: λ.
    min_gap: minimum |ℓ − m| between chosen ids (0 or 1 = no constraint).
    candidates: allowed ids (default 1..L−1, see include_*).
    seed: random seed (random strategy), recorded in every case.
    compartments: the compartments of the compartment strategy (required for it).
    num_layers: L; inferred from len(entropy) − 1 when omitted.
    hidden_size: D of the target, stored for load-time validation.
    include_embeddings: add id 0 to the default candidates.
    include_final: add id L to the default candidates.
    data_hash: hash of the statistics' data, stored.
    config: extra settings to store.

  Returns:
    A `layerwave.layer_ids.LayerSelection`.

  Raises:
    ValueError: unknown strategy, k infeasible for the candidates / min_gap, missing or mis-shaped inputs.
  """
  if strategy not in STRATEGIES:
    raise ValueError(f"unknown layer-selection strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
  k, min_gap = int(k), int(min_gap)
  if k < 1:
    raise ValueError(f"k must be >= 1, got {k}")
  if min_gap < 0:
    raise ValueError(f"min_gap must be >= 0, got {min_gap}")

  e = None if entropy is None else np.asarray(entropy, np.float64)
  c = None if cka is None else np.asarray(cka, np.float64)
  if num_layers is None:
    if e is None and c is None:
      raise ValueError("give num_layers, or entropy [L+1] / cka [L+1, L+1] to infer it")
    num_layers = (e.shape[0] if e is not None else c.shape[0]) - 1
  num_layers = int(num_layers)
  if e is not None and e.shape != (num_layers + 1,):
    raise ValueError(f"entropy must have shape [L+1] = ({num_layers + 1},), got {e.shape}")
  if c is not None and c.shape != (num_layers + 1, num_layers + 1):
    raise ValueError(f"cka must have shape [L+1, L+1] = ({num_layers + 1}, {num_layers + 1}), got {c.shape}")
  for name, arr in (("entropy", e), ("cka", c)):
    if arr is not None and not np.all(np.isfinite(arr)):
      raise ValueError(f"{name} holds NaN/inf")

  if candidates is None:
    candidates = layer_ids.default_candidates(num_layers, include_embeddings, include_final)
  cands = np.array(sorted({layer_ids.as_layer_id(i) for i in candidates}), dtype=np.int64)
  if cands.size == 0 or cands.min() < 0 or cands.max() > num_layers:
    raise ValueError(f"candidates must be non-empty ids in [0, {num_layers}], got {list(candidates)}")
  if k > cands.size:
    raise ValueError(f"k={k} exceeds the {cands.size} candidates {cands.tolist()}")
  feasible = _max_feasible(cands.tolist(), min_gap)
  if k > feasible:
    raise ValueError(f"k={k} is infeasible under min_gap={min_gap}: at most {feasible} of the candidates "
                     f"{cands.tolist()} are that far apart")

  needs_e = strategy in ("entropy", "greedy", "exhaustive", "compartment")
  needs_c = strategy in ("greedy", "exhaustive", "compartment") and (lam != 0 or strategy == "compartment")
  if needs_e and e is None:
    raise ValueError(f"strategy {strategy!r} needs the per-layer entropy [L+1]")
  if needs_c and c is None:
    raise ValueError(f"strategy {strategy!r} needs the CKA matrix [L+1, L+1]")
  e_hat = normalize_informativeness(e, cands) if e is not None else np.zeros(num_layers + 1)
  c_use = c if c is not None else np.zeros((num_layers + 1, num_layers + 1))
  extra: dict[str, Any] = {}

  if strategy == "eagle3":
    ids = layer_ids.eagle3_layer_ids(num_layers, k)
    missing = [i for i in ids if i not in set(cands.tolist())]
    if missing:
      raise ValueError(f"eagle3 ids {list(ids)} include non-candidates {missing}")
  elif strategy == "entropy":
    order = cands[np.argsort(-e_hat[cands], kind="stable")]
    ids = tuple(int(i) for i in order[:k])
    if not _gap_ok(np.array([ids]), min_gap)[0]:
      ids = exhaustive_search(cands, k, e_hat, c_use, 0.0, min_gap)
  elif strategy == "greedy":
    ids = _greedy(cands, k, e_hat, c_use, lam, min_gap)
  elif strategy == "exhaustive":
    ids = exhaustive_search(cands, k, e_hat, c_use, lam, min_gap)
  elif strategy == "compartment":
    if compartments is None:
      raise ValueError("strategy 'compartment' needs its blocks: compartments=[(start, end), ...] "
                       "(layerwave.analysis.compartments.selection_blocks segments the CKA)")
    blocks = [(int(s), int(t)) for s, t in compartments]
    reps = []
    for s, t in blocks:
      inside = cands[(cands >= s) & (cands < t)]
      if inside.size:
        reps.append(int(inside[np.argmax(e_hat[inside])]))
    if len(reps) < k:
      raise ValueError(f"only {len(reps)} compartments hold candidates ({blocks}); k={k} needs at least k")
    reps_arr = np.array(reps, dtype=np.int64)
    if _max_feasible(reps, min_gap) < k and min_gap > 1:
      raise ValueError(f"no {k} compartment representatives {reps} are min_gap={min_gap} apart")
    ids = exhaustive_search(reps_arr, k, e_hat, c_use, lam, min_gap)
    extra["compartments"] = [list(b) for b in blocks]
    extra["representatives"] = reps
  else:  # random
    rng = np.random.default_rng(seed)
    for _ in range(10_000):
      draw = np.sort(rng.choice(cands, size=k, replace=False))
      if _gap_ok(draw[None], min_gap)[0]:
        break
    else:
      raise ValueError(f"random selection found no {k} candidates min_gap={min_gap} apart in 10000 draws")
    ids = tuple(int(i) for i in draw)

  ids = tuple(sorted(int(i) for i in ids))
  arr = np.array([ids])
  scores = {
      "objective": float(subset_objective(arr, e_hat, c_use, lam)[0]),
      "entropy_normalized": {str(i): float(e_hat[i]) for i in ids},
      "cka_pairs": {f"{a},{b}": float(c_use[a, b]) for a, b in itertools.combinations(ids, 2)},
  }
  if e is not None:
    scores["entropy"] = {str(i): float(e[i]) for i in ids}
  scores.update(extra)
  cfg = {"k": k, "candidates": cands.tolist(), "include_embeddings": include_embeddings,
         "include_final": include_final}
  cfg.update(config or {})
  return layer_ids.LayerSelection(ids=ids, num_layers=num_layers, hidden_size=hidden_size, strategy=strategy,
                        lam=float(lam), min_gap=min_gap, scores=atomic.jsonable(scores), data_hash=data_hash,
                        config=atomic.jsonable(cfg), seed=int(seed))
