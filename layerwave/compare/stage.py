"""The paper's experiment as one stage: drafts trained on different layer sets, compared by acceptance length τ.

Place in the pipeline: after the analysis (`layer_stats.json`), it runs the last two stages many times.
`run(config, workdir)`:

1. statistics: `config.compare.analysis` (an analysis workdir), or the analysis stage run into `W/analysis`,
   read back typed (`report.read_layer_stats`);
2. layer sets (`layerwave.compare.sets`), each with the selection objective it reaches;
3. cells, one per (layer set, seed) (`layerwave.compare.cells`), then the dynamics at other budgets, the probes,
   the finalists and the released draft (`layerwave.compare.finalists`);
4. the table (`layerwave.compare.summary`, `layerwave.compare.table`): mean ± 95 % CI over seeds per set, the
   paired difference against the baseline, and the Spearman correlation between the selection objective and τ
   across sets → `W/results.json`, `W/results.md`, `W/plots/compare.png`, `W/plots/sim_tau.png`.

With `config.distributed` the sweep runs as several JAX processes: each trains and decodes over the global mesh,
and process 0 alone reads and writes the workdir, so every file is written once, atomically.
`experiments/compare_layers.py` is the launcher; the README's main job runs it with the `:demo` config.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax
import numpy as np
from absl import logging

from layerwave import atomic
from layerwave import metrics as metrics_lib
from layerwave import plots
from layerwave import sharding
from layerwave.analysis import analyze
from layerwave.analysis import report as report_lib
from layerwave.compare.cells import (Sweep, budget_key, budget_of, cell_recipe, check_store_layers, check_workdir,
                                     dynamics_cells, eval_prompts, finalist_prompts, train_cells)
from layerwave.compare.finalists import probe_scores, release_row, run_finalists
from layerwave.compare.sets import (CompareOptions, LayerSet, auto_dynamics_sets, dynamics_sets, layer_sets,
                                    set_predictors)
from layerwave.compare.summary import Budget, DynamicsRow, Summary, summarize
from layerwave.compare.table import markdown_table
from layerwave.inference import load_target
from layerwave.speculative import evaluate as evaluate_lib
from layerwave.training.options import Recipe

__all__ = ["dynamics_summary", "run"]


def _analysis_record(config, workdir: str) -> report_lib.AnalysisRecord:
  """layer_stats.json of `compare.analysis`, or of the analysis stage run (once) into W/analysis."""
  path = config.compare.analysis
  if not path:
    path = os.path.join(workdir, "analysis")
    if not sharding.on_process_0(lambda: os.path.exists(os.path.join(path, "layer_stats.json"))):
      logging.info("Stage 1/3: analysis (entropy and CKA of every layer) into %s", path)
      analyze.run(config, path)
  if jax.process_count() == 1:
    record = report_lib.read_layer_stats(path)
  else:  # process 0's file, read once: every process selects the same sets from it
    read = lambda: (lambda r: {"content": r.content, "path": r.path})(report_lib.read_layer_stats(path))  # noqa: E731
    got = sharding.on_process_0(read)
    record = report_lib.AnalysisRecord.from_content(got["content"], got["path"])
  if record.model["name"] != config.model:
    raise ValueError(f"{record.path} was computed for {record.model['name']!r}, not config.model="
                     f"{config.model!r}.")
  return record


def run(config, workdir: str) -> Summary:
  """Runs (or resumes) the comparison in `workdir`; returns the summary (also written as JSON/markdown)."""
  if not workdir:
    raise ValueError("compare needs --workdir: the folder for cells/, results.md and plots/.")
  # Multi-host when asked, as every launcher: its stages (analysis, training, evaluation) then run over the
  # global mesh; processes started with other configs would each sweep their own cells, so they are refused.
  sharding.maybe_initialize_distributed(config.distributed)
  sharding.check_processes_agree(config, "The layer-set comparison")
  cmp = CompareOptions.from_config(config.compare)
  seeds = cmp.seed_list
  sharding.on_process_0(lambda: os.makedirs(workdir, exist_ok=True))
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
  # After every input was validated: a failed start records nothing.
  sharding.on_process_0(lambda: check_workdir(workdir, config))
  sweep = Sweep(cmp=cmp, recipe=recipe, record=record, target=target, prompts=prompts, settings=settings,
                workdir=workdir)
  # Seed-major: after the first pass every set has one seed, so a partial run already compares them all.
  # Then the dynamics: the budget sets again at each of compare.budgets.
  # With compare.budget_sets=auto the dynamics sets are chosen once every 1x cell has finished.
  cells = [(s, seed, 1.0) for seed in seeds for s in unique.values()]
  cells += dynamics_cells(dynamics, cmp, seeds)
  by_budget: dict[float, dict[tuple[str, int], dict]] = {1.0: {}}
  train_cells(sweep, cells, by_budget)
  if cmp.budgets and "auto" in cmp.budget_sets:
    if len(by_budget[1.0]) == len(unique) * len(seeds):
      dynamics = auto_dynamics_sets(sets, summarize(sets, by_budget[1.0], seeds, cmp, prompts), cmp)
      logging.info("Dynamics (compare.budget_sets=auto): %s at budgets %s", ", ".join(d.name for d in dynamics),
                   ", ".join(budget_key(b) for b in cmp.budgets))
      train_cells(sweep, dynamics_cells(dynamics, cmp, seeds), by_budget, offset=len(cells))
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
  extra: dict[str, Any] = {"sort_by": "sim_tau" if cmp.sort_by == "sim_tau" else ""}
  if cmp.finalists:
    extra["finalists"] = run_finalists(target, sets, by_budget[1.0], summary, cmp, settings, finals, workdir,
                                       recipe, record)
  if dynamics:
    extra["dynamics"] = dynamics_summary(dynamics, by_budget, seeds, cmp, prompts, recipe)
  if cmp.release:
    extra["release"] = release_row(target, cmp.release, prompts, settings, cmp, workdir)
  summary = dataclasses.replace(
      summary, **extra, analysis=record.path, budget=budget_of(recipe),
      eval_settings={"datasets": list(prompts), "prompts_per_dataset": cmp.num_prompts,
                     "max_new_tokens": cmp.max_new_tokens, "temperatures": list(cmp.temperatures),
                     "method": settings.spec.method, "num_draft_tokens": settings.spec.num_draft_tokens,
                     "batch_size": settings.batch_size, "timing_repeats": settings.timing_repeats})
  sharding.on_process_0(lambda: _write_results(workdir, summary))
  return summary


def _write_results(workdir: str, summary: Summary) -> list[str]:
  """W/results.json, W/results.md and the two figures (process 0 alone); the paths written."""
  table = markdown_table(summary)
  paths = [atomic.write_json(os.path.join(workdir, "results.json"), summary.to_json()),
           atomic.write_text(os.path.join(workdir, "results.md"), table + "\n"),
           plots.plot_comparison(os.path.join(workdir, "plots", "compare.png"), summary),
           plots.plot_sim_tau(os.path.join(workdir, "plots", "sim_tau.png"), summary)]
  print(table)
  print(f"\nwrote {paths[1]}, {paths[0]}, {paths[2]}, {paths[3]}")
  return paths


def dynamics_summary(sets: Sequence[LayerSet], by_budget: dict[float, dict], seeds: Sequence[int],
                     cmp: CompareOptions, prompts, recipe: Recipe) -> dict[str, Budget]:
  """Per budget (1 and each of `compare.budgets`, ascending): every dynamics set's held-out sim τ and its Δ
  against the baseline paired by seed — does the ranking hold, grow or vanish as the drafts improve?"""
  out = {}
  for b in sorted({1.0, *cmp.budgets}):
    rows = summarize(sets, by_budget.get(b, {}), seeds, cmp, prompts).rows
    out[budget_key(b)] = Budget(b, cell_recipe(recipe, 0, b).train.num_steps,
                                tuple(DynamicsRow(r.name, r.ids, r.metrics["sim_tau"], r.vs_baseline["sim_tau"])
                                      for r in rows))
  return out
