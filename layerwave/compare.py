"""The paper's experiment: drafts trained on different layer sets, compared by acceptance length τ.

Place in the pipeline: after the analysis (`layer_stats.json`), it runs the last two stages many times.
`run(config, workdir)`:

1. statistics: `config.compare.analysis` (an analysis workdir), or the analysis stage run into `W/analysis`,
   read back typed (`report.read_layer_stats`);
2. layer sets (`layer_sets`): the `eagle3` baseline, selection strategies, ablations (`nofilter`: the
   ablation strategy on the statistics without the token filter; `entropy_only`: λ = 0; `cka_only`: the k
   least similar layers, entropy ignored; a λ sweep), N random sets and manual sets, each with the selection
   objective Σ Ê − λ Σ C it reaches on the filtered statistics. Sets with the same ids share their cells;
3. cells, one per (layer set, seed): a draft trained (`training.loop.train`, on the target loaded once) with
   the same recipe (`config.train`, `config.draft_model`, `config.data`) and seed, then speculative decoding on held-out MT-bench, HumanEval
   and GSM8K prompts at each temperature (τ per dataset, per-depth acceptance; with `compare.speedup`, the
   speedup against `layerwave.generate`, both timed in alternation on the same batches inside the cell:
   `timing.paired_speedup`). Each cell writes `W/cells/<ids>/seed<s>/result.json` when done; a rerun
   skips finished cells and resumes an interrupted training from its checkpoint. A workdir written under a
   different config is refused;
4. the table (`layerwave.compare_table.summarize`): mean ± 95 % CI over seeds per set, the paired difference
   against the baseline, and the Spearman correlation between the selection objective and τ across sets →
   `W/results.json`, `W/results.md`, `W/plots/compare.png`.

`experiments/compare_layers.py` is the launcher; the README's main job runs it with the `:demo` config.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from typing import Any, Sequence

import numpy as np
from absl import logging

from layerwave import atomic
from layerwave import layer_ids
from layerwave import metrics as metrics_lib
from layerwave import options as options_lib
from layerwave import plots
from layerwave import selection as selection_lib
from layerwave import sharding
from layerwave.analysis import analyze
from layerwave.analysis import collect as collect_lib
from layerwave.analysis import compartments as compartments_lib
from layerwave.analysis import report as report_lib
from layerwave.compare_table import finalist_summary, markdown_table, mean_ci, summarize, temperature_key
from layerwave.data.options import DataOptions
from layerwave.inference import load_target
from layerwave.speculative import evaluate as evaluate_lib
from layerwave.training import features as features_lib
from layerwave.training import loop
from layerwave.training import probe as probe_lib
from layerwave.training import release as release_lib
from layerwave.training import restore
from layerwave.training.options import DraftModelOptions, Recipe, TrainOptions, expand_home, home_as_tilde

# summarize, markdown_table and mean_ci are layerwave.compare_table's, reachable here too.
__all__ = ["CompareOptions", "LayerSet", "layer_sets", "run", "summarize", "markdown_table", "mean_ci",
           "SET_ITEMS", "auto_dynamics_sets", "choose_finalists", "finalist_prompts", "probe_scores", "run_finalists",
           "set_predictors"]

# Items of `compare.sets` besides the selection strategies (selection_lib.STRATEGIES).
SET_ITEMS = ("nofilter", "entropy_only", "cka_only")
# Fields of `compare` that may change between a run and its resumption: they add cells, not change them.
_GROWABLE = ("sets", "lams", "num_random", "manual", "ks", "budgets", "budget_sets", "seeds", "baseline",
             "keep_checkpoints", "report_only", "release", "release_batch_size", "finalists", "finalist_prompts",
             "finalist_seeds", "finalist_temperatures", "finalist_max_prompt_tokens", "probe_tokens", "probe_vocab",
             "sort_by")
_RUN_LENGTH = ("stop_after", "log_every", "eval_every", "checkpoint_every")


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


# -- config, fingerprint and resumption --------------------------------------------------------------


def fingerprint_settings(config) -> dict[str, Any]:
  """Every setting that fixes what a cell computes, from the stages' typed options (`dataclasses.asdict`).

  The target (`model`, `dtype`); `compare` less the fields that only add cells (`_GROWABLE`); `data`,
  `draft_model` and `train` less its logging and checkpointing (`_RUN_LENGTH`; `train.features`, the store
  offline cells read, stays in); the decoding (`speculate` as
  `DecodeSettings`, less the temperature, which `compare.temperatures` sets, and the timing repeats unless
  `compare.speedup`); and the analysis only when it runs here (`compare.analysis` empty). Not the mesh, nor
  the top-level `seed`, `layers`, `selection` and `draft`, which the cells set themselves.
  """
  cmp = CompareOptions.from_config(config.compare)
  out = {"model": config.model, "dtype": config.dtype}
  out["compare"] = {k: v for k, v in dataclasses.asdict(cmp).items() if k not in _GROWABLE}
  train = dataclasses.asdict(options_lib.from_section(TrainOptions, config.train, "train"))
  out["train"] = {k: v for k, v in TrainOptions.drop_unset_later(train).items() if k not in _RUN_LENGTH}
  out["draft_model"] = options_lib.from_section(DraftModelOptions, config.draft_model, "draft_model").record()
  out["data"] = options_lib.from_section(DataOptions, config.data, "data").record()
  decoding = dataclasses.asdict(evaluate_lib.DecodeSettings.from_config(config.speculate,
                                                                        max_new_tokens=cmp.max_new_tokens))
  # `plain` is what `auto`'s tuning decides, never a config field.
  for key in ("temperature", "prompt_width", "plain") + (() if cmp.speedup else ("timing_repeats",)):
    decoding.pop(key)
  out["speculate"] = {**decoding.pop("spec"), **decoding}  # flat, as the section names its fields
  if not cmp.analysis:
    a = config.analysis
    collect_options = dataclasses.asdict(collect_lib.options_from_config(a))
    collect_options.pop("log_every")
    collect_options.pop("ladder_ratio")  # how the entropy's eigendecompositions are padded: the same values
    out["analysis"] = {**collect_options, **dataclasses.asdict(report_lib.selection_options_from_config(a)),
                       "split": options_lib.convert(a.split, str, "analysis.split"),
                       "batch_size": options_lib.convert(a.batch_size, int, "analysis.batch_size")}
    widths = options_lib.convert(a.get("bucket_widths", ()), tuple[int, ...], "analysis.bucket_widths")
    if widths:  # how sequences are grouped moves the HSIC minibatches (absent when off: older workdirs match)
      out["analysis"]["bucket_widths"] = widths
  return out


def fingerprint(config) -> tuple[str, dict]:
  """The hash of `fingerprint_settings` and the settings, home paths as "~/..." (what `W/compare.json` records)."""
  d = home_as_tilde(fingerprint_settings(config))
  return options_lib.fingerprint(d), d


def check_workdir(workdir: str, config) -> None:
  """Records the config in `W/compare.json`, or refuses a workdir written under a different one (naming the
  fields that differ). Paths under the home directory are recorded as "~/..." and compared expanded, so that
  a sweep released from one machine (`layerwave.compare_release`) resumes on another whose home differs."""
  _, d = fingerprint(config)
  path = os.path.join(workdir, "compare.json")
  cells = os.path.join(workdir, "cells")
  if not os.path.exists(path) and os.path.isdir(cells) and any(
      "result.json" in files for _, _, files in os.walk(cells)):
    raise ValueError(f"{workdir} holds finished cells but no compare.json: a comparison of an older layerwave "
                     "(e.g. the 61k-token sweep), whose budget and settings cannot be checked against this "
                     "config. Use a new --workdir.")
  options_lib.record_settings(path, d, "comparison results", normalize=expand_home)


def recipe_key(recipe: Recipe, *, legacy: bool = False) -> str:
  """What a cell's result.json records of the recipe it trained with (`Recipe.fingerprint_settings`, paths
  under the home directory as "~/...", so that released cells match on any machine; `legacy`: as absolute
  paths, which cells written before that recorded)."""
  settings = recipe.fingerprint_settings()
  return options_lib.fingerprint(settings if legacy else home_as_tilde(settings))


def cell_recipe(recipe: Recipe, seed: int, budget: float = 1.0) -> Recipe:
  """One cell's training recipe: the shared budget with this seed, run to its end (no `stop_after`).

  `budget` ≠ 1 (the dynamics, `compare.budgets`) scales the steps, and with them the warm-up and an explicit
  schedule length, so the learning-rate schedule keeps its shape; batch, data and order stay.
  """
  t = recipe.train
  if budget != 1.0:
    scale = lambda n: max(1, int(round(n * budget))) if n else 0  # noqa: E731
    t = dataclasses.replace(t, num_steps=scale(t.num_steps), schedule_steps=scale(t.schedule_steps),
                            warmup_steps=int(round(t.warmup_steps * budget)))
  return dataclasses.replace(recipe, seed=int(seed), train=dataclasses.replace(t, stop_after=0))


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


def budget_key(budget: float) -> str:
  return f"x{budget:g}"


# -- evaluation --------------------------------------------------------------------------------------


def eval_prompts(compare: CompareOptions, tokenizer, chat_format: str = "template",
                 fields: tuple[str, str] = ("max_prompt_tokens", "num_prompts")) -> dict[str, list[list[int]]]:
  """Held-out prompts per dataset, in `data.chat_format`: the first `num_prompts` first turns of ≤
  max_prompt_tokens (none with `num_prompts` 0: the cells are scored by held-out sim τ alone)."""
  if not compare.num_prompts:
    return {}
  return {name: [ids for _, ids in evaluate_lib.chat_prompts(tokenizer, name, compare.num_prompts,
                                                              compare.max_prompt_tokens, section="compare",
                                                              chat_format=chat_format, fields=fields)]
          for name in compare.datasets}


def finalist_prompts(compare: CompareOptions, tokenizer, chat_format: str = "template") -> dict[str, list[list[int]]]:
  """The finalists' prompts: the first `finalist_prompts` of each dataset of ≤ `finalist_max_prompt_tokens`
  (0: `max_prompt_tokens`) tokens. `run` builds them before any cell trains, so a dataset with too few prompts
  that short is refused then, not after hours of cells."""
  return eval_prompts(dataclasses.replace(compare, num_prompts=compare.finalist_prompts,
                                          max_prompt_tokens=compare.finalist_max_prompt_tokens
                                          or compare.max_prompt_tokens),
                      tokenizer, chat_format, fields=("finalist_max_prompt_tokens", "finalist_prompts"))


def evaluate_draft(target, draft, prompts, settings: evaluate_lib.DecodeSettings, temperatures: Sequence[float],
                   seed: int, speedup: bool = False) -> dict[str, Any]:
  """τ (and per-depth acceptance) per temperature and dataset, pooled over datasets as `all`.

  With `speedup`, plain decoding (`layerwave.generate`) and speculation decode each batch in alternation
  (`timing.paired_speedup`, `speculate.timing_repeats` pairs per batch): the speedup is the median of the
  per-pair tokens/s ratios, with its quartiles, and at T = 0 the outputs are compared token for token.
  """
  result = {}
  for t in temperatures if prompts else ():
    at_t = dataclasses.replace(settings, temperature=t)
    # Compilation stays outside the clock only when timed (paired_speedup warms each shape up first).
    runs = {name: evaluate_lib.evaluate(target, draft, ps, at_t, seed, paired=speedup, warmup=speedup)
            for name, ps in prompts.items()}
    runs["all"] = evaluate_lib.pooled(list(runs.values()))
    for name, ev in runs.items():
      result[f"{temperature_key(t)}/{name}"] = evaluate_lib.acceptance_row(ev, greedy=t == 0)
  return result


# -- the run -------------------------------------------------------------------------------------------


def _analysis_record(config, workdir: str) -> report_lib.AnalysisRecord:
  """layer_stats.json of `compare.analysis`, or of the analysis stage run (once) into W/analysis."""
  path = config.compare.analysis
  if not path:
    path = os.path.join(workdir, "analysis")
    if not os.path.exists(os.path.join(path, "layer_stats.json")):
      logging.info("Stage 1/3: analysis (entropy and CKA of every layer) into %s", path)
      analyze.run(config, path)
  record = report_lib.read_layer_stats(path)
  if record.model["name"] != config.model:
    raise ValueError(f"{record.path} was computed for {record.model['name']!r}, not config.model="
                     f"{config.model!r}.")
  return record


def check_store_layers(recipe: Recipe, sets: Sequence[LayerSet]) -> None:
  """Refuses, before any cell trains, feature stores (`train.features`, `train.eval_features`) that lack a
  layer some set reads, naming the sets and the missing layers."""
  for field in ("features", "eval_features"):
    path = getattr(recipe.train, field)
    if not path:
      continue
    store = features_lib.open_store(path)
    have = set(store.depths)
    missing = {s.name: sorted(set(s.ids) - have) for s in sets if not set(s.ids) <= have}
    if missing:
      union = sorted(set().union(*(s.ids for s in sets)))
      raise features_lib.StoreError(
          f"train.{field}={path} stores layers {sorted(have)}, but these sets read others: "
          + "; ".join(f"{name} lacks {ids}" for name, ids in missing.items())
          + f". Extract a store of the union of every set's layers ({','.join(map(str, union))}) with "
          "experiments/extract_features.py --config.features.depths=..., or drop those sets.")


def _cell_dir(workdir: str, layer_set: LayerSet, seed: int, budget: float = 1.0) -> str:
  if budget == 1.0:
    return os.path.join(workdir, "cells", layer_set.key, f"seed{seed}")
  return os.path.join(workdir, "cells", layer_set.key, budget_key(budget), f"seed{seed}")


def _dynamics_cells(dynamics: Sequence[LayerSet], cmp: CompareOptions, seeds: Sequence[int]) -> list[tuple]:
  unique = {s.key: s for s in dynamics}
  return [(s, seed, b) for b in cmp.budgets if b != 1.0 for seed in seeds for s in unique.values()]


def auto_dynamics_sets(sets: Sequence[LayerSet], summary: dict[str, Any], cmp: CompareOptions) -> list[LayerSet]:
  """`compare.budget_sets=auto`: the baseline, the three distinct sets of highest and the two of lowest mean
  held-out sim τ at budget 1x (the issue's dynamics), in that order; then the sets `budget_sets` names beside
  "auto" (e.g. `auto,exhaustive`: the paper's own choice, wherever it ranks), less those already chosen."""
  means = {r["name"]: r["metrics"]["sim_tau"]["mean"] for r in summary["rows"]}
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


def _train_cells(cells, by_budget, started, offset, cmp, recipe, record, target, prompts, settings, workdir) -> None:
  """Trains and evaluates each (set, seed, budget) cell not yet finished into `by_budget`; reads back the
  finished ones (refusing a cell of another recipe)."""
  done_here = 0
  for i, (s, seed, budget) in enumerate(cells):
    results = by_budget.setdefault(budget, {})
    cell_dir = _cell_dir(workdir, s, seed, budget)
    path = os.path.join(cell_dir, "result.json")
    if os.path.exists(path):
      with open(path) as f:
        result = json.load(f)
      want = recipe_key(cell_recipe(recipe, seed, budget))
      if result.get("recipe") not in (want, recipe_key(cell_recipe(recipe, seed, budget), legacy=True)):
        raise ValueError(f"Cell {cell_dir} was trained with another recipe (key {result.get('recipe')}, this "
                         f"sweep's is {want}): every cell must share the sweep's budget, data and order. Delete "
                         "that cell's folder to retrain it, or use a new --workdir.")
      results[(s.key, seed)] = result
      continue
    if cmp.report_only:
      continue
    remaining = len(cells) - i
    eta = ((time.perf_counter() - started) / done_here * remaining) if done_here else float("nan")
    logging.info("Cell %d/%d: %s %s seed %d budget %s — training (ETA of these cells %.0f min)",
                 offset + i + 1, offset + len(cells), s.name, list(s.ids), seed, budget_key(budget), eta / 60)
    tic = time.perf_counter()
    layers = layer_ids.LayerSelection(ids=s.ids, num_layers=record.num_layers,
                                      hidden_size=record.hidden_size, strategy=s.name)
    train = loop.train(target, layers, cell_recipe(recipe, seed, budget), cell_dir)
    train_seconds = time.perf_counter() - tic
    evaluation = {}
    if prompts:
      logging.info("Cell %d/%d: %s seed %d — speculative decoding on %s", offset + i + 1, offset + len(cells),
                   s.name, seed, ", ".join(prompts))
      draft = restore.load_draft(cell_dir, target)
      evaluation = evaluate_draft(target, draft, prompts, settings, cmp.temperatures, seed, cmp.speedup)
    result = {"ids": list(s.ids), "seed": seed, "budget": budget,
              "recipe": recipe_key(cell_recipe(recipe, seed, budget)), "train": train,
              "train_seconds": train_seconds, "eval": evaluation,
              "eval_seconds": time.perf_counter() - tic - train_seconds}
    atomic.write_json(path, result)
    if not cmp.keep_checkpoints:
      shutil.rmtree(os.path.join(cell_dir, "checkpoints"), ignore_errors=True)
    loop.free_compiled()
    results[(s.key, seed)] = result
    done_here += 1
    t0 = temperature_key(cmp.temperatures[0])
    tau = f"τ({t0}) {evaluation[f'{t0}/all']['tau']:.3f}, " if evaluation else ""
    logging.info("Cell %d/%d: %s seed %d — %sheld-out sim τ %.3f, %.0f s", offset + i + 1, offset + len(cells),
                 s.name, seed, tau, train.get("heldout_sim_tau", float("nan")), time.perf_counter() - tic)


def run(config, workdir: str) -> dict[str, Any]:
  """Runs (or resumes) the comparison in `workdir`; returns the summary (also written as JSON/markdown)."""
  if not workdir:
    raise ValueError("compare needs --workdir: the folder for cells/, results.md and plots/.")
  # Multi-host when asked, as every launcher: its stages (analysis, training, evaluation) then run over the
  # global mesh; processes started with other configs would each sweep their own cells, so they are refused.
  sharding.maybe_initialize_distributed(config.distributed)
  sharding.check_processes_agree(config, "The layer-set comparison")
  cmp = CompareOptions.from_config(config.compare)
  seeds = cmp.seed_list
  os.makedirs(workdir, exist_ok=True)
  metrics_lib.quiet_library_logs()
  record = _analysis_record(config, workdir)
  recipe = Recipe.from_config(config)
  sets = layer_sets(record, cmp)
  unique = {}
  for s in sets:
    unique.setdefault(s.key, s)
  logging.info("Layer sets (%d, %d distinct):\n%s", len(sets), len(unique),
               "\n".join(f"  {s.name:14s} {list(s.ids)}  objective {s.objective:+.3f}  ({s.description})"
                         for s in sets))
  dynamics = dynamics_sets(sets, cmp)
  check_store_layers(recipe, unique.values())
  target = load_target(config.model, dtype=config.dtype, mesh_spec=config.mesh)
  prompts = eval_prompts(cmp, target.tokenizer, str(config.data.chat_format))
  finals = finalist_prompts(cmp, target.tokenizer, str(config.data.chat_format)) if cmp.finalists else {}
  settings = evaluate_lib.DecodeSettings.from_config(
      config.speculate, max_new_tokens=cmp.max_new_tokens,
      prompt_width=max((len(p) for ps in prompts.values() for p in ps), default=cmp.max_prompt_tokens))
  check_workdir(workdir, config)  # after every input was validated: a failed start records nothing
  # Seed-major: after the first pass every set has one seed, so a partial run already compares them all.
  # Then the dynamics: the budget sets again at each of compare.budgets.
  # With compare.budget_sets=auto the dynamics sets are chosen once every 1x cell has finished.
  cells = [(s, seed, 1.0) for seed in seeds for s in unique.values()]
  cells += _dynamics_cells(dynamics, cmp, seeds)
  by_budget: dict[float, dict[tuple[str, int], dict]] = {1.0: {}}
  started, done_here = time.perf_counter(), 0
  _train_cells(cells, by_budget, started, 0, cmp, recipe, record, target, prompts, settings, workdir)
  if cmp.budgets and "auto" in cmp.budget_sets:
    if len(by_budget[1.0]) == len(unique) * len(seeds):
      dynamics = auto_dynamics_sets(sets, summarize(sets, by_budget[1.0], seeds, cmp, prompts), cmp)
      logging.info("Dynamics (compare.budget_sets=auto): %s at budgets %s", ", ".join(d.name for d in dynamics),
                   ", ".join(budget_key(b) for b in cmp.budgets))
      _train_cells(_dynamics_cells(dynamics, cmp, seeds), by_budget, time.perf_counter(), len(cells), cmp, recipe,
                   record, target, prompts, settings, workdir)
    else:
      logging.info("Dynamics (compare.budget_sets=auto): chosen once every 1x cell has finished (%d of %d).",
                   len(by_budget[1.0]), len(unique) * len(seeds))
  predictors = {s.name: set_predictors(record, s.ids) for s in sets}
  if cmp.probe_tokens:
    probes = probe_scores(recipe, sets, cmp, workdir)
    for s in sets if probes else ():
      predictors[s.name]["linear probe of the next token (its layers concatenated)"] = probes["sets"][s.key[1:]]
      predictors[s.name]["linear probe of the next token (mean over its layers)"] = float(
          np.mean([probes["layers"][str(i)] for i in s.ids]))
  summary = summarize(sets, by_budget[1.0], seeds, cmp, prompts, predictors=predictors)
  if cmp.sort_by == "sim_tau":
    summary["sort_by"] = "sim_tau"
  if cmp.finalists:
    summary["finalists"] = run_finalists(target, sets, by_budget[1.0], summary, cmp, settings, finals, workdir,
                                         recipe, record)
  if dynamics:
    summary["dynamics"] = dynamics_summary(dynamics, by_budget, seeds, cmp, prompts, recipe)
  if cmp.release:
    summary["release"] = release_row(target, cmp.release, prompts, settings, cmp, workdir)
  summary["analysis"] = record.path
  summary["budget"] = budget_of(recipe)
  summary["eval_settings"] = {"datasets": list(prompts), "prompts_per_dataset": cmp.num_prompts,
                              "max_new_tokens": cmp.max_new_tokens, "temperatures": list(cmp.temperatures),
                              "method": settings.spec.method, "num_draft_tokens": settings.spec.num_draft_tokens,
                              "batch_size": settings.batch_size, "timing_repeats": settings.timing_repeats}
  table = markdown_table(summary)
  atomic.write_json(os.path.join(workdir, "results.json"), summary)
  atomic.write_text(os.path.join(workdir, "results.md"), table + "\n")
  plot_path = plots.plot_comparison(os.path.join(workdir, "plots", "compare.png"), summary)
  sim_path = plots.plot_sim_tau(os.path.join(workdir, "plots", "sim_tau.png"), summary)
  print(table)
  print(f"\nwrote {os.path.join(workdir, 'results.md')}, {os.path.join(workdir, 'results.json')}, {plot_path}, "
        f"{sim_path}")
  return summary


def dynamics_summary(sets: Sequence[LayerSet], by_budget: dict[float, dict], seeds: Sequence[int],
                     cmp: CompareOptions, prompts, recipe: Recipe) -> dict[str, Any]:
  """Per budget (1 and each of `compare.budgets`, ascending): every dynamics set's held-out sim τ and its Δ
  against the baseline paired by seed — does the ranking hold, grow or vanish as the drafts improve?"""
  out = {}
  for b in sorted({1.0, *cmp.budgets}):
    rows = summarize(sets, by_budget.get(b, {}), seeds, cmp, prompts)["rows"]
    out[budget_key(b)] = {"budget": b, "num_steps": cell_recipe(recipe, 0, b).train.num_steps,
                          "rows": [{"name": r["name"], "ids": r["ids"], "sim_tau": r["metrics"]["sim_tau"],
                                    "vs_baseline": r["vs_baseline"]["sim_tau"]} for r in rows]}
  return out


def probe_scores(recipe: Recipe, sets: Sequence[LayerSet], cmp: CompareOptions,
                 workdir: str) -> dict[str, Any] | None:
  """Held-out next-token accuracy of a linear probe per set and per layer (`layerwave.training.probe`), on the
  cells' own training store (`train.features`: its train split fits, its heldout split scores); kept in
  `W/probe.json` under the store's fingerprint, the probe settings and the sets (None with `report_only` and no
  kept probes)."""
  if not recipe.train.features:
    raise ValueError("compare.probe_tokens reads the cells' feature store: set train.features (an offline "
                     "comparison), or compare.probe_tokens=0.")
  options = probe_lib.ProbeOptions(tokens=cmp.probe_tokens, heldout_tokens=max(1, cmp.probe_tokens // 4),
                                   vocab=cmp.probe_vocab)
  ids = sorted({s.ids for s in sets})
  store = features_lib.open_store(recipe.train.features)
  key = options_lib.fingerprint({"store": store.fingerprint, "options": dataclasses.asdict(options),
                                 "sets": [list(i) for i in ids]})
  path = os.path.join(workdir, "probe.json")
  if os.path.exists(path):
    with open(path) as f:
      cached = json.load(f)
    if cached.get("key") == key:
      return cached
  if cmp.report_only:
    logging.info("Linear probes of the next token: not computed yet (compare.report_only trains nothing).")
    return None
  logging.info("Linear probes of the next token: %d sets, %d tokens of %s", len(ids), options.tokens,
               recipe.train.features)
  out = {"key": key, **probe_lib.probe_sets(recipe.train.features, ids, options)}
  atomic.write_json(path, out)
  return out


def choose_finalists(sets: Sequence[LayerSet], summary: dict[str, Any], cmp: CompareOptions) -> list[LayerSet]:
  """The `compare.finalists` distinct sets of highest mean held-out sim τ (the baseline's layers excluded), then
  the baseline: what the speculative Δτ is paired against."""
  means = {r["name"]: r["metrics"]["sim_tau"]["mean"] for r in summary["rows"]}
  baseline = next(s for s in sets if s.name == cmp.baseline)
  ranked = sorted((s for s in sets if np.isfinite(means.get(s.name, np.nan))), key=lambda s: -means[s.name])
  chosen: dict[str, LayerSet] = {}
  for s in ranked:
    if len(chosen) < cmp.finalists and s.key != baseline.key:
      chosen.setdefault(s.key, s)
  return [*chosen.values(), baseline]


def run_finalists(target, sets: Sequence[LayerSet], results: dict[tuple[str, int], dict], summary: dict[str, Any],
                  cmp: CompareOptions, settings: evaluate_lib.DecodeSettings, prompts: dict[str, list[list[int]]],
                  workdir: str, recipe: Recipe | None = None,
                  record: report_lib.AnalysisRecord | None = None) -> dict[str, Any]:
  """Speculative τ of the finalists (`choose_finalists`) on `prompts` (`finalist_prompts`) at every temperature,
  each draft decoding the same prompts, with Δτ against the baseline from a paired bootstrap over prompts
  (`compare_table.finalist_summary`).

  Runs once every cell at budget 1× has finished (the ranking needs them all); before that the summary says how
  many cells remain. Each (set, seed) evaluation is kept in `W/finalists/<set key>/seed<s>.json`, so a rerun
  decodes only what is new; `report_only` decodes nothing. A finalist whose cell has a result but no checkpoint
  (restored from a released sweep, `layerwave.compare_release`) is trained again with its cell's recipe
  (`recipe`, `record`), and both held-out sim τ are logged and kept.
  """
  need = len({s.key for s in sets}) * cmp.seeds
  if len(results) < need:
    return {"pending": need - len(results)}
  chosen = choose_finalists(sets, summary, cmp)
  seeds = list(range(cmp.finalist_seeds))
  temperatures = cmp.finalist_temperatures or cmp.temperatures
  cmp = dataclasses.replace(cmp, temperatures=temperatures)  # what finalist_summary tabulates
  at = dataclasses.replace(settings, prompt_width=max(len(p) for ps in prompts.values() for p in ps))
  # What a kept evaluation must hold to be reused: these prompts (their hash) at these temperatures.
  prompts_key = options_lib.fingerprint({"prompts": prompts, "settings": dataclasses.asdict(at)})
  evals: dict[tuple[str, int], dict] = {}
  for s in chosen:
    for seed in seeds:
      path = os.path.join(workdir, "finalists", s.key, f"seed{seed}.json")
      kept = None
      if os.path.exists(path):
        with open(path) as f:
          kept = json.load(f)
      if kept is not None and kept.get("prompts_key") == prompts_key:
        todo = [t for t in temperatures if f"{temperature_key(t)}/all" not in kept["eval"]]
      else:
        kept, todo = None, list(temperatures)
      if not todo or cmp.report_only:
        if kept is not None:
          evals[(s.key, seed)] = kept
        continue
      cell_dir = _cell_dir(workdir, s, seed)
      retrained = None
      if not os.path.isdir(os.path.join(cell_dir, "checkpoints")):
        if recipe is None or record is None:
          raise FileNotFoundError(
              f"Finalist {s.name} {list(s.ids)} seed {seed} has no checkpoint in {cell_dir}: retrain that cell "
              "(delete its result.json) or set compare.finalists=0.")
        recorded = results[(s.key, seed)]["train"].get("heldout_sim_tau", math.nan)
        logging.info("Finalist %s %s seed %d: no checkpoint in %s (a released cell): training it again with its "
                     "recipe", s.name, list(s.ids), seed, cell_dir)
        layers = layer_ids.LayerSelection(ids=s.ids, num_layers=record.num_layers, hidden_size=record.hidden_size,
                                          strategy=s.name)
        again = loop.train(target, layers, cell_recipe(recipe, seed), cell_dir)
        retrained = {"recorded_sim_tau": recorded, "sim_tau": again.get("heldout_sim_tau", math.nan)}
        logging.info("Finalist %s seed %d retrained: held-out sim τ %.4f (its cell recorded %.4f)", s.name, seed,
                     retrained["sim_tau"], recorded)
      logging.info("Finalist %s %s seed %d: speculative decoding of %d prompts at T = %s", s.name, list(s.ids),
                   seed, sum(len(p) for p in prompts.values()), ", ".join(f"{t:g}" for t in todo))
      tic = time.perf_counter()
      draft = restore.load_draft(cell_dir, target)
      new = evaluate_draft(target, draft, prompts, at, todo, seed, speedup=False)
      row = {"ids": list(s.ids), "seed": seed, "prompts_key": prompts_key,
             "eval": {**(kept or {}).get("eval", {}), **new},
             "eval_seconds": (kept or {}).get("eval_seconds", 0.0) + time.perf_counter() - tic}
      if retrained is not None:
        row["retrained"] = retrained
      atomic.write_json(path, row)
      evals[(s.key, seed)] = row
      loop.free_compiled()
  out = finalist_summary(chosen, evals, seeds, cmp, list(prompts))
  out["prompts_per_dataset"] = {name: len(ps) for name, ps in prompts.items()}
  return out


def release_row(target, name: str, prompts, settings: evaluate_lib.DecodeSettings, cmp: CompareOptions,
                workdir: str) -> dict[str, Any]:
  """The released draft `name` (`releases/<name>`, checksums and target verified) decoded on the comparison's
  prompts exactly as the cells are (same settings, temperatures and paired timing): what a user gets today,
  beside what the layer sets reach at the cells' budget.

  `name`: a release's short name (`releases/<name>`, or under `$LAYERWAVE_RELEASES`) or its directory. The
  evaluation is kept in `W/release/<name>.json` under the release's checksums, so a rerun reuses it and a
  replaced release is evaluated anew. A name with no release yet gives a row saying so (with the releases
  there are), not an error: the main job runs before the first draft is released.
  """
  if release_lib.is_release_dir(name):
    directory = name
  else:
    directory = release_lib.resolve(name) if name in release_lib.available() else None
  if directory is None:
    logging.warning("compare.release=%s: no such release under %s (releases: %s); the table says so.", name,
                    release_lib.releases_root(), ", ".join(release_lib.available()) or "none")
    return {"name": name, "missing": True, "available": release_lib.available()}
  manifest = release_lib.verify_for(directory, target)
  # Decoded as a user runs it: `compare.release_batch_size` prompts per call (1: where speculation pays).
  settings = dataclasses.replace(settings, batch_size=cmp.release_batch_size)
  key = options_lib.fingerprint({"sha256": manifest["sha256"], "decoding": dataclasses.asdict(settings),
                                 "temperatures": list(cmp.temperatures), "speedup": cmp.speedup})
  name = os.path.basename(os.path.normpath(directory))
  path = os.path.join(workdir, "release", f"{name}.json")
  if os.path.exists(path):
    with open(path) as f:
      cached = json.load(f)
    if cached.get("key") == key:
      return cached
  logging.info("The released draft %s %s: speculative decoding on %s", name, manifest["layer_ids"],
               ", ".join(prompts))
  draft = restore.load_draft(directory, target)
  tic = time.perf_counter()
  evaluation = evaluate_draft(target, draft, prompts, settings, cmp.temperatures, 0, cmp.speedup)
  row = {"name": name, "key": key, "layer_ids": manifest["layer_ids"], "dtype": manifest.get("dtype"),
         "batch_size": settings.batch_size, "num_draft_tokens": settings.spec.num_draft_tokens,
         "manifest_metrics": manifest.get("metrics", {}), "eval": evaluation,
         "eval_seconds": time.perf_counter() - tic}
  atomic.write_json(path, row)
  return row


def budget_of(recipe: Recipe) -> dict[str, Any]:
  """The training budget every cell shares."""
  t, d = recipe.train, recipe.draft_model
  length = recipe.data.max_length
  return {"num_steps": t.num_steps, "batch_size": t.batch_size, "max_length": length, "lr": t.lr,
          "ttt_steps": t.ttt_steps, "draft_vocab_size": d.vocab_size, "draft_layers": d.num_layers,
          "tokens_per_cell": t.num_steps * t.batch_size * length}
