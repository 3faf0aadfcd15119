"""Learned selection: a gated draft trained on every candidate depth chooses its own layers.

Place in the pipeline: beside `layerwave.selection`, which chooses layers from the analysis' statistics. Here a
draft whose fusion reads every candidate depth through a learned gate (`layerwave.models.gates`,
`draft_model.gates`) trains offline on a feature store that holds them all (`make paper-store`), with the
training loop of every other draft (`training.loop.train`: resumable orbax checkpoints); its k largest gates are
the selection, a `LayerSelection` of strategy "learned_gates" that trains like any other
(`--config.selection.path=W/selection.json --config.selection.strategy=learned_gates-k3`).

`run(config, workdir)` (experiments/learn_layers.py):

1. one gated run per seed (`learned.seeds`) into `W/seed<s>`, each with the recipe of the sweep's cells, so the
   run is also the gated draft's own cell (held-out sim τ on `train.eval_features`); its gates and top-k sets
   go to `W/seed<s>/gates.json` and `W/seed<s>/selection.json`;
2. the selection from the gates averaged over the seeds → `W/selection.json` ("learned_gates-k<k>" per k);
3. the report → `W/learned.json`, `W/learned.md`: the gates per depth and seed, their stability over seeds (the
   top-k sets, Spearman between seeds' gates), the cost in wall-minutes against the sweep's cells, and, with
   `learned.sweep` (a comparison workdir or its release), the gates as a predictor: each k = 3 set of the sweep
   scored by the sum of its gates, Spearman against its held-out sim τ, and the gated cell's sim τ paired by seed
   with the baseline's.

`python -m layerwave.training.learned manual W/selection.json` prints its sets as `compare.manual` reads them
("a,b,c;d,e,f,g,h", ascending k), to train them as a comparison's cells; `... choose PILOT_DIR` applies the pilot's
rule (`choose_kind`) to one run per gate kind and prints the kind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from scipy import stats as scipy_stats

from layerwave import atomic
from layerwave import layer_ids
from layerwave import metrics as metrics_lib
from layerwave import options as options_lib
from layerwave import sharding
from layerwave.inference import load_target
from layerwave.models.draft import Draft
from layerwave.training import features as features_lib
from layerwave.training import loop
from layerwave.training import restore
from layerwave.training.options import Recipe

__all__ = ["STRATEGY", "LearnedOptions", "candidates", "check_ks", "check_store_depths", "gate_values", "run",
           "select_top_k", "selection_file", "sweep_sets"]

STRATEGY = "learned_gates"


@dataclasses.dataclass(frozen=True)
class LearnedOptions:
  """`config.learned`: what the learned selection runs and reports.

  Attributes:
    ks: the selection sizes written (each "learned_gates-k<k>").
    seeds: gated runs, seeds 0..seeds-1 (initialisation, data order, gate noise).
    candidates: the depths the gates choose among; () = 1..L-1 (docs/METHOD.md §1).
    sweep: a comparison workdir or its release (`layerwave.compare.release`) whose 1x cells the gates are scored
      against ("" = no predictor or paired Δ in the report).
    baseline: the sweep's layer set the gated cells are paired with (ids, "" = EAGLE-3's rule).
  """

  ks: tuple[int, ...] = (3, 5)
  seeds: int = 3
  candidates: tuple[int, ...] = ()
  sweep: str = ""
  baseline: tuple[int, ...] = ()

  def __post_init__(self):
    if not self.ks or any(k < 1 for k in self.ks):
      raise ValueError(f"learned.ks must list sizes >= 1, got {self.ks}; e.g. --config.learned.ks=3,5.")
    if self.seeds < 1:
      raise ValueError(f"learned.seeds must be >= 1, got {self.seeds}.")


def candidates(num_layers: int, given: Sequence[int] = ()) -> tuple[int, ...]:
  """The depths a gated draft reads: `given`, or every candidate 1..L−1 (validated against L)."""
  ids = tuple(sorted(int(i) for i in given)) or layer_ids.default_candidates(num_layers)
  layer_ids.LayerSelection(ids=ids, num_layers=num_layers)  # range and duplicates
  return ids


def check_ks(ks: Sequence[int], depths: Sequence[int]) -> None:
  """Refuses a selection size larger than the candidates (or below 1)."""
  bad = [k for k in ks if not 1 <= k <= len(depths)]
  if bad:
    raise ValueError(f"learned.ks holds {bad}, but the gates choose among {len(depths)} candidate depths "
                     f"({min(depths)}..{max(depths)}): every k must be in [1, {len(depths)}].")


def check_store_depths(path: str, depths: Sequence[int], field: str = "train.features") -> None:
  """Refuses a feature store that lacks some of `depths`, naming them and how to extract a store that has them.

  Raises:
    features.StoreError: the missing depths and the fix.
  """
  store = features_lib.open_store(path)
  missing = sorted(set(depths) - set(store.depths))
  if missing:
    raise features_lib.StoreError(
        f"{field}={path} stores depths {sorted(store.depths)}, but a gated draft reads every candidate depth and "
        f"it lacks {missing}. Extract a store of every depth (experiments/extract_features.py "
        "--config.features.depths=all, as `make paper-store` does), or narrow --config.learned.candidates to the "
        "stored depths.")


def gate_values(draft: Draft) -> dict[int, float]:
  """{layer id: gate value} of a gated draft (`layerwave.models.gates`: the quantity whose ranking selects)."""
  if draft.gates is None:
    raise ValueError("This draft has no gates (draft_model.gates=''): train one with --config.draft_model.gates="
                     "softmax (or hard_concrete, group_lasso) to read a learned selection off it.")
  values = np.asarray(jax.device_get(draft.gate_values()), np.float64)
  return {int(i): float(v) for i, v in zip(draft.config.layer_ids, values)}


def select_top_k(gates: Mapping[int, float], k: int, num_layers: int, hidden_size: int | None = None,
                 config: Mapping[str, Any] | None = None) -> layer_ids.LayerSelection:
  """The `k` layers of largest gate (ties to the shallower) as a `LayerSelection` of strategy "learned_gates".

  Raises:
    ValueError: k larger than the gated layers, or below 1.
  """
  check_ks([k], list(gates))
  ranked = sorted(gates, key=lambda i: (-gates[i], i))
  ids = tuple(sorted(ranked[:k]))
  return layer_ids.LayerSelection(ids=ids, num_layers=num_layers, hidden_size=hidden_size, strategy=STRATEGY,
                                  scores={"gates": {str(i): gates[i] for i in sorted(gates)},
                                          "selected_gates": [gates[i] for i in ids]},
                                  config=dict(config or {}))


def selection_file(gates: Mapping[int, float], ks: Sequence[int], num_layers: int, hidden_size: int | None,
                   config: Mapping[str, Any] | None = None) -> dict[str, dict]:
  """A selection file's content ({"learned_gates-k<k>": record}), as `analysis.report.load_selections` reads."""
  return {f"{STRATEGY}-k{k}": select_top_k(gates, k, num_layers, hidden_size, config).to_dict() for k in ks}


def mean_ci(values: Sequence[float]) -> dict[str, Any]:
  """Mean and half-width of the 95 % Student-t interval (NaN with one value), as the sweep's tables give them."""
  x = np.asarray([v for v in values if v is not None and np.isfinite(v)], np.float64)
  if x.size == 0:
    return {"mean": float("nan"), "ci95": float("nan"), "n": 0, "values": []}
  half = float(scipy_stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size)) if x.size > 1 else float("nan")
  return {"mean": float(x.mean()), "ci95": half, "n": int(x.size), "values": x.tolist()}


# -- the sweep the gates are scored against ----------------------------------------------------------------


def sweep_sets(path: str) -> dict[tuple[int, ...], dict[str, Any]]:
  """The 1x cells of a comparison (a workdir with `cells/`, or its release's `results.json`): {ids: {"sim_tau":
  {seed: τ}, "train_seconds": [...]}}."""
  results: dict[str, dict] = {}
  packed = os.path.join(path, "results.json")
  cells = os.path.join(path, "cells")
  if os.path.isdir(cells):
    for root, _, files in os.walk(cells):
      if "result.json" in files:
        with open(os.path.join(root, "result.json"), encoding="utf-8") as f:
          results[os.path.relpath(os.path.join(root, "result.json"), path)] = json.load(f)
  elif os.path.isfile(packed):
    with open(packed, encoding="utf-8") as f:
      results = json.load(f)
  else:
    raise FileNotFoundError(f"learned.sweep={path} is neither a comparison workdir (cells/) nor its release "
                            "(results.json).")
  out: dict[tuple[int, ...], dict[str, Any]] = {}
  for rel, r in results.items():
    if not rel.startswith("cells/") or float(r.get("budget", 1.0)) != 1.0:
      continue
    row = out.setdefault(tuple(int(i) for i in r["ids"]), {"sim_tau": {}, "train_seconds": [], "positions": set()})
    row["sim_tau"][int(r["seed"])] = float(r["train"]["heldout_sim_tau"])
    row["train_seconds"].append(float(r.get("train_seconds", 0.0)))
    row["positions"].add(int(r["train"].get("heldout_positions", 0)))
  return out


def gate_predictor(gates: Mapping[int, float], sets: Mapping[tuple[int, ...], dict], k: int = 3) -> dict[str, Any]:
  """Each k-layer set of the sweep scored by the sum of its gates, against its mean held-out sim τ: Spearman ρ
  (two-sided p; scipy's t approximation) over the distinct sets whose layers the gates cover."""
  rows = [(ids, sum(gates[i] for i in ids), float(np.mean(list(s["sim_tau"].values()))))
          for ids, s in sorted(sets.items()) if len(ids) == k and all(i in gates for i in ids)]
  if len(rows) < 3:
    return {"rho": float("nan"), "p": float("nan"), "num_sets": len(rows), "rows": []}
  res = scipy_stats.spearmanr([r[1] for r in rows], [r[2] for r in rows])
  return {"rho": float(res.statistic), "p": float(res.pvalue), "num_sets": len(rows),
          "rows": [{"ids": list(ids), "gate_score": score, "sim_tau": tau} for ids, score, tau in rows]}


# -- the run -------------------------------------------------------------------------------------------------


def _train_seed(target, recipe: Recipe, depths: tuple[int, ...], seed: int, workdir: str,
                ks: Sequence[int]) -> dict[str, Any]:
  """One gated run (resumed if interrupted, skipped if finished) → its gates, selections and held-out metrics."""
  run_dir = os.path.join(workdir, f"seed{seed}")
  path = os.path.join(run_dir, "gates.json")
  c = target.config
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  record = layer_ids.LayerSelection(ids=depths, num_layers=c.num_layers, hidden_size=c.hidden_size,
                                    strategy="all_depths")
  logging.info("Gated run seed %d (%s over %d depths, k=%d, λ=%g) into %s", seed, recipe.draft_model.gates,
               len(depths), recipe.draft_model.gate_k, recipe.draft_model.gate_strength, run_dir)
  tic = time.perf_counter()
  result = loop.train(target, record, dataclasses.replace(recipe, seed=seed), run_dir)
  seconds = time.perf_counter() - tic
  gates = gate_values(restore.load_draft(run_dir, target))
  settings = {"gates": recipe.draft_model.gates, "gate_k": recipe.draft_model.gate_k,
              "gate_strength": recipe.draft_model.gate_strength, "seed": seed, "run": run_dir}
  selections = selection_file(gates, ks, c.num_layers, c.hidden_size, settings)
  atomic.write_json(os.path.join(run_dir, "selection.json"), selections)
  out = {"seed": seed, "kind": recipe.draft_model.gates, "gates": {str(i): v for i, v in gates.items()},
         "selections": {name: s["ids"] for name, s in selections.items()}, "train": result,
         "train_seconds": seconds}
  atomic.write_json(path, out)
  loop.free_compiled()
  return out


def summarize(runs: Sequence[dict], ks: Sequence[int], opts: LearnedOptions, num_layers: int) -> dict[str, Any]:
  """The report's numbers: mean gates and their selections, stability over seeds, cost, and the sweep's
  predictor and paired Δ (with `opts.sweep`)."""
  depths = sorted(int(i) for i in runs[0]["gates"])
  table = np.array([[r["gates"][str(i)] for i in depths] for r in runs])  # [seeds, n]
  mean = dict(zip(depths, table.mean(axis=0).tolist()))
  out: dict[str, Any] = {
      "kind": runs[0]["kind"], "seeds": [r["seed"] for r in runs], "depths": depths,
      "gates": {str(i): table[:, j].tolist() for j, i in enumerate(depths)},
      "mean_gates": {str(i): v for i, v in mean.items()},
      "selections": {f"k{k}": list(select_top_k(mean, k, num_layers).ids) for k in ks},
      "per_seed": {f"k{k}": [r["selections"][f"{STRATEGY}-k{k}"] for r in runs] for k in ks},
      "gated_sim_tau": mean_ci([r["train"].get("heldout_sim_tau", float("nan")) for r in runs]),
      "minutes": {"gated_runs": sum(r["train_seconds"] for r in runs) / 60.0,
                  "per_run": [r["train_seconds"] / 60.0 for r in runs]},
  }
  if len(runs) > 1:
    pairs = [(a, b) for a in range(len(runs)) for b in range(a + 1, len(runs))]
    out["seed_spearman"] = [float(scipy_stats.spearmanr(table[a], table[b]).statistic) for a, b in pairs]
    out["always_chosen"] = {f"k{k}": sorted(set.intersection(*(set(s) for s in out["per_seed"][f"k{k}"])))
                            for k in ks}
  if opts.sweep:
    sets = sweep_sets(opts.sweep)
    out["predictor"] = gate_predictor(mean, sets, 3)
    out["minutes"]["sweep_1x_cells"] = sum(sum(s["train_seconds"]) for s in sets.values()) / 60.0
    out["minutes"]["sweep_1x_num_cells"] = sum(len(s["train_seconds"]) for s in sets.values())
    out["minutes"]["sweep_1x_distinct_sets"] = len(sets)
    base = tuple(opts.baseline) or layer_ids.eagle3_layer_ids(num_layers)
    positions = {r["train"].get("heldout_positions") for r in runs}
    # Paired only when scored on the same held-out positions as the sweep's cells (a pilot's smaller store is not).
    if base in sets and positions == sets[base]["positions"]:
      deltas = [r["train"]["heldout_sim_tau"] - sets[base]["sim_tau"][r["seed"]] for r in runs
                if r["seed"] in sets[base]["sim_tau"] and "heldout_sim_tau" in r["train"]]
      out["vs_baseline"] = {"baseline": list(base), **mean_ci(deltas)}
  return out


def gate_gap(gates: Mapping[Any, float], k: int) -> float:
  """How far the k largest gates stand above the rest: (mean of the top k − mean of the rest) / mean of the top k,
  1 when the rest are closed, 0 when every gate is alike."""
  v = np.sort(np.asarray(list(gates.values()), np.float64))[::-1]
  top = v[:k].mean()
  return float((top - v[k:].mean()) / top) if top > 0 and v.size > k else 0.0


def choose_kind(summaries: Mapping[str, dict], k: int = 3, min_gap: float = 0.5) -> tuple[str, list[dict]]:
  """The pilot's rule: among the gate kinds whose k largest gates stand apart (`gate_gap` ≥ `min_gap`: a
  selection, not every depth left open), the one whose gated draft reaches the highest held-out sim τ; if none
  stands apart, the largest gap. The sweep's τ of the sets (what the gates are then tested against) plays no
  part. Returns (kind, one row per kind)."""
  rows = [{"kind": kind, "gap": gate_gap(s["mean_gates"], k), "sim_tau": s["gated_sim_tau"]["mean"],
           "minutes": s["minutes"]["gated_runs"], "selection": s["selections"].get(f"k{k}"),
           "predictor_rho": (s.get("predictor") or {}).get("rho")} for kind, s in sorted(summaries.items())]
  apart = [r for r in rows if r["gap"] >= min_gap]
  best = max(apart, key=lambda r: r["sim_tau"]) if apart else max(rows, key=lambda r: r["gap"])
  return best["kind"], rows


def markdown(summary: dict[str, Any]) -> str:
  """The report as markdown: gates per depth, selections, stability, predictor, cost."""
  lines = [f"# Learned selection ({summary['kind']} gates, seeds {summary['seeds']})", "",
           "| depth | gate (mean over seeds) | per seed |", "|---|---|---|"]
  for i in summary["depths"]:
    per = ", ".join(f"{v:.3f}" for v in summary["gates"][str(i)])
    lines.append(f"| {i} | {summary['mean_gates'][str(i)]:.3f} | {per} |")
  lines.append("")
  for k, ids in summary["selections"].items():
    lines.append(f"- **{k}**: {ids} (per seed: {summary['per_seed'][k]}; in every seed: "
                 f"{summary.get('always_chosen', {}).get(k, '-')})")
  if "seed_spearman" in summary:
    lines.append(f"- Spearman of the gates between seeds: {', '.join(f'{r:+.2f}' for r in summary['seed_spearman'])}")
  g = summary["gated_sim_tau"]
  lines.append(f"- The gated all-depth draft's held-out sim τ: {g['mean']:.3f} ± {g['ci95']:.3f}")
  if "vs_baseline" in summary:
    d = summary["vs_baseline"]
    lines.append(f"- Δ against {d['baseline']} paired by seed: {d['mean']:+.3f} ± {d['ci95']:.3f}")
  if "predictor" in summary:
    p = summary["predictor"]
    lines.append(f"- Gates as a predictor (sum over a set's layers) of the sweep's k = 3 sets' held-out sim τ: "
                 f"Spearman ρ = {p['rho']:+.2f} (p = {p['p']:.3f}, {p['num_sets']} sets)")
  m = summary["minutes"]
  cost = f"- Cost: {m['gated_runs']:.1f} wall-minutes for the gated runs"
  if "sweep_1x_cells" in m:
    cost += (f", against {m['sweep_1x_cells']:.1f} for the sweep's {m['sweep_1x_num_cells']} 1x cells "
             f"({m['sweep_1x_distinct_sets']} sets)")
  lines.append(cost + " (the same 2-core machine's wall clock).")
  return "\n".join(lines)


def run(config, workdir: str) -> dict[str, Any]:
  """Gated runs per seed, their selections and the report, in `workdir` (resumable); returns the summary."""
  if not workdir:
    raise ValueError("learned selection needs --workdir: the folder for the gated runs and selection.json.")
  opts = options_lib.from_section(LearnedOptions, config.learned, "learned")
  recipe = Recipe.from_config(config)
  if not recipe.draft_model.gates:
    raise ValueError("A learned selection trains a gated draft: set --config.draft_model.gates=softmax (or "
                     "hard_concrete, group_lasso) and --config.draft_model.fc_norm=True.")
  if not recipe.train.features:
    raise ValueError("A learned selection trains offline from a store of every depth: set "
                     "--config.train.features=DIR (`make paper-store` writes one).")
  metrics_lib.quiet_library_logs()
  sharding.use_compilation_cache(config.get("compilation_cache", ""))
  mesh = sharding.make_mesh(config.mesh)
  target = load_target(config.model, dtype=config.dtype, mesh=mesh)
  depths = candidates(target.config.num_layers, opts.candidates)
  check_ks(tuple(opts.ks) + (recipe.draft_model.gate_k,), depths)
  check_store_depths(recipe.train.features, depths)
  if recipe.train.eval_features:
    check_store_depths(recipe.train.eval_features, depths, "train.eval_features")
  os.makedirs(workdir, exist_ok=True)
  runs = [_train_seed(target, recipe, depths, seed, workdir, opts.ks) for seed in range(opts.seeds)]
  summary = summarize(runs, opts.ks, opts, target.config.num_layers)
  c = target.config
  settings = {"gates": recipe.draft_model.gates, "seeds": summary["seeds"], "from": "mean gates over seeds"}
  atomic.write_json(os.path.join(workdir, "selection.json"),
                    selection_file({int(i): v for i, v in summary["mean_gates"].items()}, opts.ks, c.num_layers,
                                   c.hidden_size, settings))
  atomic.write_json(os.path.join(workdir, "learned.json"), summary)
  table = markdown(summary)
  atomic.write_text(os.path.join(workdir, "learned.md"), table + "\n")
  print(table)
  return summary


def manual_sets(path: str) -> str:
  """A learned selection file's sets in ascending k, as `compare.manual` reads them ("2,8,14;2,8,14,21,27")."""
  selections = [layer_ids.LayerSelection.from_dict(d) for d in _read_json(path).values()]
  return ";".join(",".join(map(str, s.ids)) for s in sorted(selections, key=lambda s: s.k))


def _read_json(path: str) -> dict:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def choose(pilot_dir: str) -> str:
  """Applies `choose_kind` to the pilot's runs (`pilot_dir/<kind>/learned.json`), writes `pilot_dir/choice.json`
  and returns the kind."""
  summaries = {}
  for kind in sorted(os.listdir(pilot_dir)):
    path = os.path.join(pilot_dir, kind, "learned.json")
    if os.path.isfile(path):
      summaries[kind] = _read_json(path)
  if not summaries:
    raise FileNotFoundError(f"{pilot_dir} holds no finished pilot run (<kind>/learned.json): run make learned-pilot.")
  kind, rows = choose_kind(summaries)
  atomic.write_json(os.path.join(pilot_dir, "choice.json"), {"kind": kind, "rows": rows})
  table = ["| gates | top-3 gap | gated held-out sim τ | k = 3 | k = 5 | ρ vs the sweep's k = 3 sets | wall-minutes |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    s = summaries[r["kind"]]
    table.append(f"| {'**' + r['kind'] + '**' if r['kind'] == kind else r['kind']} | {r['gap']:.2f} | "
                 f"{r['sim_tau']:.3f} | {s['selections'].get('k3')} | {s['selections'].get('k5')} | "
                 f"{r['predictor_rho'] if r['predictor_rho'] is None else format(r['predictor_rho'], '+.2f')} | "
                 f"{r['minutes']:.1f} |")
  atomic.write_text(os.path.join(pilot_dir, "choice.md"), "\n".join(table) + f"\n\nChosen: {kind}.\n")
  return kind


USAGE = ("usage: python -m layerwave.training.learned manual W/selection.json   # its sets as compare.manual\n"
         "       python -m layerwave.training.learned choose PILOT_DIR          # the pilot's gate kind")

if __name__ == "__main__":
  if len(sys.argv) != 3 or sys.argv[1] not in ("manual", "choose"):
    sys.exit(USAGE)
  print(manual_sets(sys.argv[2]) if sys.argv[1] == "manual" else choose(sys.argv[2]))
