"""The comparison's extra rows: the finalists decoded on larger prompt sets, the released draft beside the cells,
and the linear probes of the next token as a predictor of τ.

Place in the pipeline: after the cells (`layerwave.compare.cells`), before the table. Each keeps its evaluation in
the workdir under a key of what it depends on (`W/finalists/...`, `W/release/<name>.json`, `W/probe.json`), so a
rerun decodes or fits only what is new. Under several JAX processes all decode, and process 0 alone reads and
writes those files.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from typing import Any, Sequence

import numpy as np
from absl import logging

from layerwave import atomic
from layerwave import layer_ids
from layerwave import options as options_lib
from layerwave import sharding
from layerwave.analysis import report as report_lib
from layerwave.compare.cells import cell_dir, cell_recipe, evaluate_draft, read_json
from layerwave.compare.sets import CompareOptions, LayerSet
from layerwave.compare.summary import Summary, finalist_summary, temperature_key
from layerwave.speculative import evaluate as evaluate_lib
from layerwave.training import features as features_lib
from layerwave.training import loop
from layerwave.training import probe as probe_lib
from layerwave.training import release as release_lib
from layerwave.training import restore
from layerwave.training.options import Recipe

__all__ = ["choose_finalists", "probe_scores", "release_row", "run_finalists"]


def _write(path: str, content: dict) -> None:
  """`content` written to `path` by process 0 (every process calls it, and waits for it)."""
  sharding.on_process_0(functools.partial(atomic.write_json, path, content))


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
  cached = read_json(path)
  if cached is not None and cached.get("key") == key:
    return cached
  if cmp.report_only:
    logging.info("Linear probes of the next token: not computed yet (compare.report_only trains nothing).")
    return None
  logging.info("Linear probes of the next token: %d sets, %d tokens of %s", len(ids), options.tokens,
               recipe.train.features)
  out = {"key": key, **probe_lib.probe_sets(recipe.train.features, ids, options)}
  _write(path, out)
  return out


def choose_finalists(sets: Sequence[LayerSet], summary: Summary, cmp: CompareOptions) -> list[LayerSet]:
  """The `compare.finalists` distinct sets of highest mean held-out sim τ (the baseline's layers excluded), then
  the baseline: what the speculative Δτ is paired against."""
  means = {r.name: r.metrics["sim_tau"].mean for r in summary.rows}
  baseline = next(s for s in sets if s.name == cmp.baseline)
  ranked = sorted((s for s in sets if np.isfinite(means.get(s.name, np.nan))), key=lambda s: -means[s.name])
  chosen: dict[str, LayerSet] = {}
  for s in ranked:
    if len(chosen) < cmp.finalists and s.key != baseline.key:
      chosen.setdefault(s.key, s)
  return [*chosen.values(), baseline]


def run_finalists(target, sets: Sequence[LayerSet], results: dict[tuple[str, int], dict], summary: Summary,
                  cmp: CompareOptions, settings: evaluate_lib.DecodeSettings, prompts: dict[str, list[list[int]]],
                  workdir: str, recipe: Recipe | None = None,
                  record: report_lib.AnalysisRecord | None = None) -> dict[str, Any]:
  """Speculative τ of the finalists (`choose_finalists`) on `prompts` (`finalist_prompts`) at every temperature,
  each draft decoding the same prompts, with Δτ against the baseline from a paired bootstrap over prompts
  (`compare.summary.finalist_summary`).

  Runs once every cell at budget 1× has finished (the ranking needs them all); before that the summary says how
  many cells remain. Each (set, seed) evaluation is kept in `W/finalists/<set key>/seed<s>.json`, so a rerun
  decodes only what is new; `report_only` decodes nothing. A finalist whose cell has a result but no checkpoint
  (restored from a released sweep, `layerwave.compare.release`) is trained again with its cell's recipe
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
      kept = read_json(path)
      if kept is not None and kept.get("prompts_key") == prompts_key:
        todo = [t for t in temperatures if f"{temperature_key(t)}/all" not in kept["eval"]]
      else:
        kept, todo = None, list(temperatures)
      if not todo or cmp.report_only:
        if kept is not None:
          evals[(s.key, seed)] = kept
        continue
      directory = cell_dir(workdir, s, seed)
      retrained = None
      if not sharding.on_process_0(functools.partial(os.path.isdir, os.path.join(directory, "checkpoints"))):
        if recipe is None or record is None:
          raise FileNotFoundError(
              f"Finalist {s.name} {list(s.ids)} seed {seed} has no checkpoint in {directory}: retrain that cell "
              "(delete its result.json) or set compare.finalists=0.")
        recorded = results[(s.key, seed)]["train"].get("heldout_sim_tau", math.nan)
        logging.info("Finalist %s %s seed %d: no checkpoint in %s (a released cell): training it again with its "
                     "recipe", s.name, list(s.ids), seed, directory)
        layers = layer_ids.LayerSelection(ids=s.ids, num_layers=record.num_layers, hidden_size=record.hidden_size,
                                          strategy=s.name)
        again = loop.train(target, layers, cell_recipe(recipe, seed), directory)
        retrained = {"recorded_sim_tau": recorded, "sim_tau": again.get("heldout_sim_tau", math.nan)}
        logging.info("Finalist %s seed %d retrained: held-out sim τ %.4f (its cell recorded %.4f)", s.name, seed,
                     retrained["sim_tau"], recorded)
      logging.info("Finalist %s %s seed %d: speculative decoding of %d prompts at T = %s", s.name, list(s.ids),
                   seed, sum(len(p) for p in prompts.values()), ", ".join(f"{t:g}" for t in todo))
      tic = time.perf_counter()
      draft = restore.load_draft(directory, target)
      new = evaluate_draft(target, draft, prompts, at, todo, seed, speedup=False)
      row = {"ids": list(s.ids), "seed": seed, "prompts_key": prompts_key,
             "eval": {**(kept or {}).get("eval", {}), **new},
             "eval_seconds": (kept or {}).get("eval_seconds", 0.0) + time.perf_counter() - tic}
      if retrained is not None:
        row["retrained"] = retrained
      row = atomic.jsonable(row)
      _write(path, row)
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
  cached = read_json(path)
  if cached is not None and cached.get("key") == key:
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
  row = atomic.jsonable(row)
  _write(path, row)
  return row
