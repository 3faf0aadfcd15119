"""The comparison's settings and its layer sets: which drafts the sweep trains.

Place in the pipeline: first step of `layerwave.compare.run`, after the analysis. `CompareOptions` is the parsed
`config.compare`; `layer_sets` turns an analysis record (`report.read_layer_stats`) into the `LayerSet`s: the
`eagle3` baseline, selection strategies, ablations (`nofilter`: the ablation strategy on the statistics without the
token filter; `entropy_only`: λ = 0; `cka_only`: the k least similar layers, entropy ignored; a λ sweep), N random
sets, manual sets and other k's, each with the selection objective Σ Ê − λ Σ C it reaches on the filtered
statistics. Sets with the same ids share their cells. `dynamics_sets` / `auto_dynamics_sets` name the sets trained
again at other budgets.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from layerwave import layer_ids
from layerwave import options as options_lib
from layerwave import selection as selection_lib
from layerwave.analysis import compartments as compartments_lib
from layerwave.analysis import report as report_lib
from layerwave.compare.summary import Summary
from layerwave.speculative import evaluate as evaluate_lib

__all__ = ["CompareOptions", "LayerSet", "SET_ITEMS", "auto_dynamics_sets", "dynamics_sets", "layer_sets",
           "set_predictors"]

# Items of `compare.sets` besides the selection strategies (selection_lib.STRATEGIES).
SET_ITEMS = ("nofilter", "entropy_only", "cka_only")


@dataclasses.dataclass(frozen=True)
class LayerSet:
  """One entry of the comparison.

  Attributes:
    name: its label ("eagle3", "exhaustive", "nofilter", "lam=0.25", "random-1", "manual-0", ...).
    ids: target layer ids, HF hidden-state convention (sorted).
    kind: "baseline", "strategy", "ablation", "random" or "manual".
    objective: Σ Ê − λ Σ C of `ids` on the filtered statistics (the analysis' λ and candidates).
    description: how the set was chosen.
  """

  name: str
  ids: tuple[int, ...]
  kind: str
  objective: float
  description: str

  @property
  def key(self) -> str:
    """Directory name of the set's cells: layer sets with equal ids share them."""
    return "L" + "-".join(str(i) for i in self.ids)


@dataclasses.dataclass(frozen=True)
class CompareOptions:
  """`config.compare`, parsed and validated once (configs/smollm2_135m.py describes every field).

  The list fields (`sets`, `lams`, `datasets`, `temperatures`) are tuples in the config; the command line
  gives them as `--config.compare.sets=eagle3,greedy`, and old comma strings are still read
  (`layerwave.options`). `manual` stays a ';'-separated string in the config ("1,2,3;27,28,29"): ml_collections'
  tuple parser refuses ';', and a tuple of tuples would need quoted parentheses on the command line; a tuple
  of tuples is read too.
  """

  sets: tuple[str, ...] = ()
  baseline: str = "eagle3"
  ablation_strategy: str = "exhaustive"
  lams: tuple[float, ...] = ()
  num_random: int = 0
  random_seed: int = 1
  manual: tuple[tuple[int, ...], ...] = ()
  ks: tuple[int, ...] = ()
  budgets: tuple[float, ...] = ()
  budget_sets: tuple[str, ...] = ()
  seeds: int = 1
  analysis: str = ""
  datasets: tuple[str, ...] = evaluate_lib.DATASETS
  num_prompts: int = 8
  max_prompt_tokens: int = 256
  temperatures: tuple[float, ...] = (0.0,)
  max_new_tokens: int = 64
  speedup: bool = False
  keep_checkpoints: bool = True
  report_only: bool = False
  release: str = ""
  release_batch_size: int = 1
  finalists: int = 0
  finalist_prompts: int = 80
  finalist_seeds: int = 1
  finalist_temperatures: tuple[float, ...] = ()
  finalist_max_prompt_tokens: int = 0
  probe_tokens: int = 0
  probe_vocab: int = 1024
  sort_by: str = "tau"

  def __post_init__(self):
    if self.ablation_strategy not in ("greedy", "exhaustive"):
      raise ValueError(f"compare.ablation_strategy must be 'greedy' or 'exhaustive', got "
                       f"{self.ablation_strategy!r}.")
    if any(v < 0 for v in self.lams):
      raise ValueError(f"compare.lams holds {min(self.lams)}; λ must be >= 0.")
    if self.num_random < 0:
      raise ValueError(f"compare.num_random must be >= 0, got {self.num_random}.")
    if any(k < 1 for k in self.ks):
      raise ValueError(f"compare.ks holds {min(self.ks)}; every k (number of layers a draft reads) must be >= 1.")
    if any(not b > 0 for b in self.budgets):
      raise ValueError(f"compare.budgets holds {min(self.budgets)}; budgets are multiples (> 0) of train.num_steps.")
    if self.seeds < 1:
      raise ValueError(f"compare.seeds must be >= 1 (number of seeds, 0..n-1), got {self.seeds}.")
    if self.release_batch_size < 1:
      raise ValueError(f"compare.release_batch_size must be >= 1 (prompts per call for the released draft), got "
                       f"{self.release_batch_size}; set --config.compare.release_batch_size=1.")
    if not self.datasets:
      raise ValueError(f"compare.datasets is empty; name at least one of {', '.join(evaluate_lib.DATASETS)}.")
    for name in self.datasets:
      if name not in evaluate_lib.DATASETS:
        raise ValueError(f"compare.datasets names {name!r}; held-out prompt sets are "
                         f"{', '.join(evaluate_lib.DATASETS)}.")
    if not self.temperatures or any(t < 0 for t in self.temperatures):
      raise ValueError(f"compare.temperatures must list temperatures >= 0, got {self.temperatures!r}.")
    if self.finalists < 0 or self.finalist_prompts < 1 or not 1 <= self.finalist_seeds <= self.seeds:
      raise ValueError(f"compare.finalists must be >= 0, compare.finalist_prompts >= 1 and "
                       f"compare.finalist_seeds in [1, compare.seeds={self.seeds}]; got {self.finalists}, "
                       f"{self.finalist_prompts} and {self.finalist_seeds}.")
    if self.finalist_max_prompt_tokens < 0:
      raise ValueError(f"compare.finalist_max_prompt_tokens must be >= 0 (0: compare.max_prompt_tokens), got "
                       f"{self.finalist_max_prompt_tokens}.")
    if any(t < 0 for t in self.finalist_temperatures):
      raise ValueError(f"compare.finalist_temperatures must be >= 0 (empty: compare.temperatures), got "
                       f"{self.finalist_temperatures!r}.")
    if self.sort_by not in ("tau", "sim_tau"):
      raise ValueError(f"compare.sort_by must be 'tau' (the first temperature's speculative τ) or 'sim_tau' "
                       f"(held-out simulated τ), got {self.sort_by!r}.")
    if self.probe_tokens < 0 or self.probe_vocab < 2:
      raise ValueError(f"compare.probe_tokens must be >= 0 (0: no probe) and compare.probe_vocab >= 2; got "
                       f"{self.probe_tokens} and {self.probe_vocab}.")
    if self.finalists and not self.keep_checkpoints:
      raise ValueError("compare.finalists decodes the finalists' drafts after every cell has finished, so it "
                       "needs their checkpoints: set compare.keep_checkpoints=True (or compare.finalists=0).")
    if self.max_new_tokens < 1 or self.num_prompts < 0:
      raise ValueError(f"compare.max_new_tokens must be >= 1 and compare.num_prompts >= 0, got "
                       f"{self.max_new_tokens} and {self.num_prompts}.")
    if self.num_prompts == 0 and (self.speedup or self.release or self.sort_by == "tau"):
      raise ValueError("compare.num_prompts=0 decodes no prompt in the cells (held-out sim τ only), so there is "
                       "no speculative τ to sort by nor speedup to time: set compare.sort_by=sim_tau, "
                       "compare.speedup=False and compare.release='', or compare.num_prompts >= 1.")

  @classmethod
  def from_config(cls, compare) -> CompareOptions:
    """From the `compare` section (tuples, or comma strings, for the list fields)."""
    return options_lib.from_section(cls, compare, "compare")

  @property
  def seed_list(self) -> list[int]:
    return list(range(self.seeds))


def layer_sets(record: report_lib.AnalysisRecord, compare: CompareOptions) -> list[LayerSet]:
  """The layer sets `compare` names, selected from an analysis record (`report.read_layer_stats`).

  Selections use the analysis' own settings (k, λ, min_gap, candidates, compartments, seed), so the
  strategies here are those of the analysis' `selection.json`.

  Raises:
    ValueError: an unknown item, an invalid manual set, no baseline among the sets, bad numbers.
  """
  opts = record.selection
  num_layers, hidden = record.num_layers, record.hidden_size
  k, lam, min_gap, seed = opts.k, opts.lam, opts.min_gap, opts.seed
  candidates = record.candidates
  blocks = list(record.blocks) if len(record.blocks) >= k else None
  e, c = record.arrays("filtered")
  e_hat = selection_lib.normalize_informativeness(e, candidates)
  ablation = compare.ablation_strategy

  def select(strategy, entropy=e, cka=c, lam_=lam, seed_=seed, k_=k):
    compartments = None
    if strategy == "compartment":
      compartments = blocks or compartments_lib.selection_blocks(cka, candidates, k)
    return selection_lib.select_layers(
        strategy, entropy, cka, k=k_, lam=lam_, min_gap=min_gap, candidates=candidates, seed=seed_,
        compartments=compartments, num_layers=num_layers, hidden_size=hidden).ids

  out: list[LayerSet] = []

  def add(name, ids, kind, description):
    ids = tuple(sorted(int(i) for i in ids))
    objective = float(selection_lib.subset_objective(np.array([ids]), e_hat, c, lam)[0])
    out.append(LayerSet(name, ids, kind, objective, description))

  baseline = compare.baseline
  for item in compare.sets:
    if item in selection_lib.STRATEGIES:
      kind = "baseline" if item == baseline else ("random" if item == "random" else "strategy")
      add(item, select(item), kind, f"{item} strategy on the filtered statistics (λ={lam:g})")
    elif item == "nofilter":
      e_u, c_u = record.arrays("unfiltered")
      add(item, select(ablation, e_u, c_u), "ablation",
          f"{ablation} on the statistics without the token filter")
    elif item == "entropy_only":
      add(item, select(ablation, lam_=0.0), "ablation", f"{ablation} with λ = 0 (entropy only)")
    elif item == "cka_only":
      zeros = np.zeros_like(e)
      ids = selection_lib.exhaustive_search(np.asarray(candidates), k, zeros, c, 1.0, min_gap)
      add(item, ids, "ablation", "the k least similar layers (Σ C minimal), entropy ignored")
    else:
      raise ValueError(f"compare.sets names {item!r}, which is neither a strategy "
                       f"({', '.join(selection_lib.STRATEGIES)}) nor an ablation ({', '.join(SET_ITEMS)}); "
                       "use compare.lams for a λ sweep, compare.num_random for random sets and "
                       "compare.manual for explicit ids.")
  for value in compare.lams:
    add(f"lam={value:g}", select(ablation, lam_=value), "ablation", f"{ablation} with λ = {value:g}")
  for i in range(compare.num_random):
    s = compare.random_seed + i
    add(f"random-{i}", select("random", seed_=s), "random", f"k random candidates (seed {s})")
  for i, ids in enumerate(compare.manual):
    try:
      layer_ids.LayerSelection(ids=ids, num_layers=num_layers, hidden_size=hidden,
                               strategy="manual").validate_for(num_layers, hidden)
    except ValueError as err:
      raise ValueError(f"compare.manual set {','.join(map(str, ids))!r} is not a valid layer set for this target "
                       f"(L={num_layers}, ids 0..{num_layers}, distinct): {err}") from err
    add(f"manual-{i}", ids, "manual", "given ids")
  for k_other in compare.ks:
    if k_other == 1:
      add("last", (num_layers,), "k", "k = 1: h_L, the final-norm hidden state (the one layer EAGLE-1/2 read)")
      continue
    strategy = ablation
    if strategy == "exhaustive" and math.comb(len(candidates), k_other) > selection_lib.MAX_SUBSETS:
      strategy = "greedy"  # C(29, 9) = 10 M subsets: past the enumeration limit
    add(f"{strategy}-k{k_other}", select(strategy, k_=k_other), "k",
        f"{strategy} at k = {k_other} (λ={lam:g})")
    add(f"even-k{k_other}", select("eagle3", k_=k_other), "k",
        f"k = {k_other} spread evenly over 2..L−3 (the eagle3 rule at k = {k_other})")
  if not out:
    raise ValueError("compare.sets, lams, num_random and manual name no layer set.")
  names = [s.name for s in out]
  duplicates = sorted({n for n in names if names.count(n) > 1})
  if duplicates:
    raise ValueError(f"compare names {duplicates} more than once.")
  if baseline not in names:
    raise ValueError(f"compare.baseline={baseline!r} is not among the sets {names}; add it to compare.sets.")
  return out


def set_predictors(record: report_lib.AnalysisRecord, ids: Sequence[int]) -> dict[str, float]:
  """What a reader might try instead of the objective to predict a set's τ, from the analysis and the ids alone:
  the objective's two terms, depth, distance to the last layer, the deepest layer's filtered entropy, spread."""
  e, c = record.arrays("filtered")
  e_hat = selection_lib.normalize_informativeness(e, record.candidates)
  ids = [int(i) for i in ids]
  deepest = max(ids)
  return {"informativeness Σ Ê": float(e_hat[ids].sum()),
          "redundancy Σ C": float(sum(c[a, b] for i, a in enumerate(ids) for b in ids[i + 1:])),
          "deepest layer": float(deepest),
          "mean depth": float(np.mean(ids)),
          "distance to the last layer": float(record.num_layers - deepest),
          "filtered entropy of the deepest layer": float(e[deepest]),
          "spread (deepest − shallowest)": float(deepest - min(ids))}


def dynamics_sets(sets: Sequence[LayerSet], cmp: CompareOptions) -> list[LayerSet]:
  """The sets trained again at `compare.budgets` (`compare.budget_sets`, default every set); the baseline must
  be among them, since their Δ is paired against it at each budget."""
  if not cmp.budgets:
    return []
  by_name = {s.name: s for s in sets}
  names = cmp.budget_sets or tuple(by_name)
  unknown = [n for n in names if n not in by_name and n != "auto"]
  if unknown:
    raise ValueError(f"compare.budget_sets names {unknown}, which are not among the sets {list(by_name)} "
                     "(or 'auto').")
  if "auto" in names:  # chosen once the 1x cells have finished (`auto_dynamics_sets`, in run)
    return []
  if cmp.baseline not in names:
    raise ValueError(f"compare.budget_sets must include the baseline {cmp.baseline!r}: each budget's Δ is paired "
                     "against it.")
  return [by_name[n] for n in names]


def auto_dynamics_sets(sets: Sequence[LayerSet], summary: Summary, cmp: CompareOptions) -> list[LayerSet]:
  """`compare.budget_sets=auto`: the baseline, the three distinct sets of highest and the two of lowest mean
  held-out sim τ at budget 1x, in that order; then the sets `budget_sets` names beside
  "auto" (e.g. `auto,exhaustive`: the paper's own choice, wherever it ranks), less those already chosen."""
  means = {r.name: r.metrics["sim_tau"].mean for r in summary.rows}
  baseline = next(s for s in sets if s.name == cmp.baseline)
  distinct: dict[str, LayerSet] = {}
  for s in sorted((s for s in sets if np.isfinite(means.get(s.name, np.nan))), key=lambda s: -means[s.name]):
    if s.key != baseline.key:
      distinct.setdefault(s.key, s)
  ranked = list(distinct.values())
  chosen = [baseline, *ranked[:3], *ranked[3:][-2:]]
  by_name = {s.name: s for s in sets}
  for name in cmp.budget_sets:
    if name != "auto" and by_name[name].key not in {s.key for s in chosen}:
      chosen.append(by_name[name])
  return chosen
