"""The comparison's cells: one draft trained and decoded per (layer set, seed, budget), resumable.

Place in the pipeline: the sweep's middle (`layerwave.compare.run`). Each cell trains a draft
(`training.loop.train`, on the target loaded once) with the sweep's recipe (`config.train`, `config.draft_model`,
`config.data`) and its seed, then decodes held-out MT-bench, HumanEval and GSM8K prompts at each temperature (τ per
dataset, per-depth acceptance; with `compare.speedup`, the speedup against plain decoding, timed in alternation on
the same batches: `timing.paired_speedup`). A finished cell writes `W/cells/<ids>/seed<s>/result.json`; a rerun
skips it and resumes an interrupted training from its checkpoint. `W/compare.json` records the config
(`fingerprint`), so a workdir written under another one is refused.

Under several JAX processes every process trains and decodes (the programs span the global mesh) and process 0
alone reads and writes the workdir (`sharding.on_process_0`): all take their decisions from what it read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import time
from collections.abc import Mapping
from typing import Any, Sequence

from absl import logging

from layerwave import atomic
from layerwave import layer_ids
from layerwave import options as options_lib
from layerwave import sharding
from layerwave.analysis import collect as collect_lib
from layerwave.analysis import report as report_lib
from layerwave.compare.sets import CompareOptions, LayerSet
from layerwave.compare.summary import temperature_key
from layerwave.data.options import DataOptions
from layerwave.speculative import evaluate as evaluate_lib
from layerwave.training import features as features_lib
from layerwave.training import loop
from layerwave.training import restore
from layerwave.training.options import DraftModelOptions, Recipe, TrainOptions, expand_home, home_as_tilde

__all__ = ["Sweep", "budget_key", "budget_of", "cell_dir", "cell_recipe", "check_store_layers", "check_workdir",
           "dynamics_cells", "eval_prompts", "evaluate_draft", "finalist_prompts", "fingerprint",
           "fingerprint_settings", "read_json", "recipe_key", "train_cells"]

# Fields of `compare` that may change between a run and its resumption: they add cells, not change them.
_GROWABLE = ("sets", "lams", "num_random", "manual", "ks", "budgets", "budget_sets", "seeds", "baseline",
             "keep_checkpoints", "report_only", "release", "release_batch_size", "finalists", "finalist_prompts",
             "finalist_seeds", "finalist_temperatures", "finalist_max_prompt_tokens", "probe_tokens", "probe_vocab",
             "sort_by")
_RUN_LENGTH = ("stop_after", "log_every", "eval_every", "checkpoint_every")


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
  a sweep released from one machine (`layerwave.compare.release`) resumes on another whose home differs."""
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


def cell_dir(workdir: str, layer_set: LayerSet, seed: int, budget: float = 1.0) -> str:
  """W/cells/<set key>/seed<s> at budget 1×, W/cells/<set key>/x<budget>/seed<s> at another."""
  if budget == 1.0:
    return os.path.join(workdir, "cells", layer_set.key, f"seed{seed}")
  return os.path.join(workdir, "cells", layer_set.key, budget_key(budget), f"seed{seed}")


def dynamics_cells(dynamics: Sequence[LayerSet], cmp: CompareOptions,
                   seeds: Sequence[int]) -> list[tuple[LayerSet, int, float]]:
  """The (set, seed, budget) cells of the dynamics: each set at each of `compare.budgets` other than 1×."""
  unique = {s.key: s for s in dynamics}
  return [(s, seed, b) for b in cmp.budgets if b != 1.0 for seed in seeds for s in unique.values()]


def read_json(path: str) -> Any:
  """The JSON content of `path` as process 0 reads it (None where it does not exist), on every process."""
  def read():
    if not os.path.exists(path):
      return None
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  return sharding.on_process_0(read)


@dataclasses.dataclass(frozen=True)
class Sweep:
  """What every cell of one comparison shares.

  Attributes:
    cmp: the comparison's options.
    recipe: the training recipe every cell starts from (`cell_recipe` gives it its seed and budget).
    record: the analysis record the layer sets come from (the target's L and D).
    target: the target, loaded once.
    prompts: held-out prompts per dataset (`eval_prompts`; empty: held-out sim τ alone).
    settings: the decoding settings of the cells' evaluation.
    workdir: the comparison's workdir (W/cells/... below it).
  """

  cmp: CompareOptions
  recipe: Recipe
  record: report_lib.AnalysisRecord
  target: Any
  prompts: Mapping[str, list[list[int]]]
  settings: evaluate_lib.DecodeSettings
  workdir: str


def train_cells(sweep: Sweep, cells: Sequence[tuple[LayerSet, int, float]], by_budget: dict[float, dict],
                offset: int = 0) -> None:
  """Trains and evaluates each (set, seed, budget) cell not yet finished into `by_budget`; reads back the
  finished ones (refusing a cell of another recipe).

  Args:
    sweep: what the cells share.
    cells: the cells, in training order.
    by_budget: budget → {(set key, seed): result.json content}, filled in place.
    offset: cells counted before these, for the log's "Cell i/n".
  """
  cmp, recipe, target, prompts = sweep.cmp, sweep.recipe, sweep.target, sweep.prompts
  started, done_here = time.perf_counter(), 0
  for i, (s, seed, budget) in enumerate(cells):
    results = by_budget.setdefault(budget, {})
    directory = cell_dir(sweep.workdir, s, seed, budget)
    path = os.path.join(directory, "result.json")
    result = read_json(path)
    if result is not None:
      want = recipe_key(cell_recipe(recipe, seed, budget))
      if result.get("recipe") not in (want, recipe_key(cell_recipe(recipe, seed, budget), legacy=True)):
        raise ValueError(f"Cell {directory} was trained with another recipe (key {result.get('recipe')}, this "
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
    layers = layer_ids.LayerSelection(ids=s.ids, num_layers=sweep.record.num_layers,
                                      hidden_size=sweep.record.hidden_size, strategy=s.name)
    train = loop.train(target, layers, cell_recipe(recipe, seed, budget), directory)
    train_seconds = time.perf_counter() - tic
    evaluation = {}
    if prompts:
      logging.info("Cell %d/%d: %s seed %d — speculative decoding on %s", offset + i + 1, offset + len(cells),
                   s.name, seed, ", ".join(prompts))
      draft = restore.load_draft(directory, target)
      evaluation = evaluate_draft(target, draft, prompts, sweep.settings, cmp.temperatures, seed, cmp.speedup)
    result = {"ids": list(s.ids), "seed": seed, "budget": budget,
              "recipe": recipe_key(cell_recipe(recipe, seed, budget)), "train": train,
              "train_seconds": train_seconds, "eval": evaluation,
              "eval_seconds": time.perf_counter() - tic - train_seconds}
    # Process 0 writes; every process goes on with what it wrote.
    result = sharding.on_process_0(functools.partial(_write_cell, path, atomic.jsonable(result), cmp.keep_checkpoints))
    loop.free_compiled()
    results[(s.key, seed)] = result
    done_here += 1
    t0 = temperature_key(cmp.temperatures[0])
    tau = f"τ({t0}) {evaluation[f'{t0}/all']['tau']:.3f}, " if evaluation else ""
    logging.info("Cell %d/%d: %s seed %d — %sheld-out sim τ %.3f, %.0f s", offset + i + 1, offset + len(cells),
                 s.name, seed, tau, train.get("heldout_sim_tau", float("nan")), time.perf_counter() - tic)


def _write_cell(path: str, result: dict, keep_checkpoints: bool) -> dict:
  """Writes a finished cell's result.json (and drops its checkpoints unless kept); returns the result."""
  atomic.write_json(path, result)
  if not keep_checkpoints:
    shutil.rmtree(os.path.join(os.path.dirname(path), "checkpoints"), ignore_errors=True)
  return result


def budget_of(recipe: Recipe) -> dict[str, Any]:
  """The training budget every cell shares."""
  t, d = recipe.train, recipe.draft_model
  length = recipe.data.max_length
  return {"num_steps": t.num_steps, "batch_size": t.batch_size, "max_length": length, "lr": t.lr,
          "ttt_steps": t.ttt_steps, "draft_vocab_size": d.vocab_size, "draft_layers": d.num_layers,
          "tokens_per_cell": t.num_steps * t.batch_size * length}
