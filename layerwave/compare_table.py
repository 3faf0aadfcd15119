"""The comparison's table: per layer set, mean ± 95 % CI over seeds, the paired difference against the baseline,
and the Spearman correlation between the selection objective and τ across sets; as a summary dict and markdown.

Place in the pipeline: `layerwave.compare.run` calls `summarize` on the finished cells' `result.json` contents
and writes `markdown_table(summary)` to `W/results.md`. Pure functions of those results: no model, no files.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from scipy import stats as scipy_stats

__all__ = ["markdown_table", "mean_ci", "summarize", "temperature_key"]


def temperature_key(t: float) -> str:
  """The results' name of a temperature: 0 → "T0", 0.7 → "T0.7"."""
  return f"T{t:g}"


def mean_ci(values: Sequence[float]) -> dict[str, Any]:
  """Mean and half-width of the 95 % Student-t interval (NaN with one value)."""
  x = np.asarray([v for v in values if v is not None and np.isfinite(v)], np.float64)
  n = x.size
  if n == 0:
    return {"mean": float("nan"), "ci95": float("nan"), "n": 0, "values": []}
  half = (float(scipy_stats.t.ppf(0.975, n - 1) * x.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan"))
  return {"mean": float(x.mean()), "ci95": half, "n": int(n), "values": x.tolist()}


def _metric(result: dict, name: str) -> float | None:
  if name == "sim_tau":
    return result["train"].get("heldout_sim_tau")
  if ":" in name:  # "speedup:T0/all", "equal_to_ar:T0/all"
    field, key = name.split(":", 1)
    return result["eval"].get(key, {}).get(field)
  return result["eval"].get(name, {}).get("tau")


def summarize(sets: Sequence[Any], results: dict[tuple[str, int], dict], seeds: Sequence[int], compare: Any,
              prompts: dict[str, Any]) -> dict[str, Any]:
  """Mean ± 95 % CI per set, paired differences against the baseline, Spearman(objective, τ) over sets.

  Args:
    sets: the `compare.LayerSet`s, in config order.
    results: (set key, seed) → the cell's result.json content, for the finished cells.
    seeds: the seeds of the comparison.
    compare: its `compare.CompareOptions` (temperatures, speedup, baseline).
    prompts: dataset name → prompts (the names order the columns).
  """
  temps = [temperature_key(t) for t in compare.temperatures]
  names = [f"{t}/{d}" for t in temps for d in [*prompts, "all"]] + ["sim_tau"]
  if compare.speedup:
    names += [f"{f}:{t}/all" for t in temps for f in ("speedup", "speedup_p25", "speedup_p75",
                                                       "timing_pairs")]
    names += [f"equal_to_ar:{t}/all" for t in temps if t == "T0"]
  baseline = next(s for s in sets if s.name == compare.baseline)
  rows = []
  for s in sets:
    row = {"name": s.name, "ids": list(s.ids), "kind": s.kind, "objective": s.objective,
           "description": s.description, "metrics": {}, "vs_baseline": {}}
    for m in names:
      vals = {seed: _metric(results[(s.key, seed)], m) for seed in seeds if (s.key, seed) in results}
      row["metrics"][m] = mean_ci(list(vals.values()))
      base = {seed: _metric(results[(baseline.key, seed)], m) for seed in seeds
              if (baseline.key, seed) in results}
      diffs = [vals[k] - base[k] for k in vals if k in base and vals[k] is not None and base[k] is not None]
      row["vs_baseline"][m] = mean_ci(diffs)
    acc = [results[(s.key, seed)]["eval"][f"{temps[0]}/all"]["acceptance"] for seed in seeds
           if (s.key, seed) in results]
    row["acceptance"] = np.mean(np.asarray(acc, np.float64), axis=0).tolist() if acc else []
    rows.append(row)
  primary = f"{temps[0]}/all"
  # Over the distinct sets of the baseline's k: Σ Ê − λ Σ C sums k terms, so objectives of other k's do not
  # compare with it.
  distinct = {}
  for row in rows:
    if len(row["ids"]) == len(baseline.ids):
      distinct.setdefault(tuple(row["ids"]), row)
  xs = [r["objective"] for r in distinct.values()]
  correlations = {}
  for m in (primary, "sim_tau"):
    ys = [r["metrics"][m]["mean"] for r in distinct.values()]
    ok = [(x, y) for x, y in zip(xs, ys) if np.isfinite(y)]
    if len(ok) >= 3:
      res = scipy_stats.spearmanr(*zip(*ok))
      correlations[m] = {"rho": float(res.statistic), "p": float(res.pvalue), "num_sets": len(ok),
                         "k": len(baseline.ids)}
    else:
      correlations[m] = {"rho": float("nan"), "p": float("nan"), "num_sets": len(ok), "k": len(baseline.ids)}
  return {"baseline": baseline.name, "primary": primary, "seeds": list(seeds), "metrics": names,
          "rows": rows, "spearman_objective": correlations,
          "cells_done": len(results)}


def _fmt(m: dict, signed: bool = False) -> str:
  if not m or m.get("n", 0) == 0 or not np.isfinite(m["mean"]):
    return "–"
  mean = f"{m['mean']:+.3f}" if signed else f"{m['mean']:.3f}"
  return mean + (f" ± {m['ci95']:.3f}" if np.isfinite(m["ci95"]) else "")


def _fmt_speedup(metrics: dict, name: str) -> str:
  """A speedup cell: with one seed, the cell's median and the [p25, p75] of its timed pairs."""
  m = metrics[name]
  p25, p75 = (metrics.get(name.replace("speedup:", f"speedup_{q}:"), {}) for q in ("p25", "p75"))
  if m.get("n") == 1 and p25.get("n") == 1 and p75.get("n") == 1:
    return f"{m['mean']:.2f} [{p25['mean']:.2f}, {p75['mean']:.2f}]"
  return _fmt(m)


def markdown_table(summary: dict[str, Any]) -> str:
  """The comparison as markdown: one row per set, sorted by the primary τ."""
  primary = summary["primary"]
  temps = sorted({m.split("/")[0] for m in summary["metrics"] if "/" in m and ":" not in m})
  datasets = [m.split("/")[1] for m in summary["metrics"]
              if m.startswith(primary.split("/")[0] + "/") and not m.endswith("/all")]
  others = [f"{t}/all" for t in temps if f"{t}/all" != primary]
  speed = [m for m in summary["metrics"] if m.startswith("speedup:")]
  equal = [m for m in summary["metrics"] if m.startswith("equal_to_ar:")]
  head = (["set", "layers", "seeds", "objective", f"τ {primary}", f"Δτ vs {summary['baseline']}"]
          + [f"τ {primary.split('/')[0]}/{d}" for d in datasets] + [f"τ {m}" for m in others]
          + ["held-out sim τ"] + [m.replace("speedup:", "speedup ") for m in speed]
          + ["greedy = plain decoding" for _ in equal])
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  first_with_ids = {}
  for r in summary["rows"]:  # in config order: later sets with the same ids share the first one's cells
    first_with_ids.setdefault(tuple(r["ids"]), r["name"])
  rows = sorted(summary["rows"], key=lambda r: -np.nan_to_num(r["metrics"][primary]["mean"], nan=-1e9))
  for r in rows:
    is_base = r["name"] == summary["baseline"]
    name = f"**{r['name']}**" if is_base else r["name"]
    if first_with_ids[tuple(r["ids"])] != r["name"]:
      name += f" (= {first_with_ids[tuple(r['ids'])]})"
    cells = [name, ",".join(map(str, r["ids"])), str(r["metrics"][primary]["n"]), f"{r['objective']:+.3f}",
             _fmt(r["metrics"][primary]), "(baseline)" if is_base else _fmt(r["vs_baseline"][primary], True)]
    cells += [_fmt(r["metrics"][f"{primary.split('/')[0]}/{d}"]) for d in datasets]
    cells += [_fmt(r["metrics"][m]) for m in others]
    cells += [_fmt(r["metrics"]["sim_tau"])]
    cells += [_fmt_speedup(r["metrics"], m) for m in speed]
    cells += [f"{r['metrics'][m]['mean']:.0%}" if r["metrics"][m]["n"] else "–" for m in equal]
    lines.append("| " + " | ".join(cells) + " |")
  corr = summary["spearman_objective"]
  release = _release_lines(summary.get("release"), primary, bool(speed))
  notes = [f"\nMean ± 95 % CI (Student t) over seeds {summary['seeds']}; Δτ is the paired difference against "
           f"`{summary['baseline']}` (same seed). τ = new tokens per target verification (bonus token "
           "included)."]
  if speed:
    pairs = sorted({int(v) for r in summary["rows"] for m in speed
                    for v in r["metrics"].get(m.replace("speedup:", "timing_pairs:"), {}).get("values", [])})
    notes.append(f"Speedup = speculative ÷ plain decoding tokens/s, timed in alternation on the same batches "
                 f"inside each cell (ABBA order, compilation excluded): per cell the median of "
                 f"{'/'.join(map(str, pairs)) or '–'} pair ratios, [p25, p75] of the pairs with one seed, "
                 "mean ± 95 % CI of the cells' medians with more.")
  for m, c in corr.items():
    if c["num_sets"] < 3:
      notes.append(f"Spearman(selection objective, {m}): needs at least 3 distinct sets ({c['num_sets']} here).")
    else:
      notes.append(f"Spearman(selection objective, {m}) over {c['num_sets']} distinct sets: "
                   f"ρ = {c['rho']:+.2f} (p = {c['p']:.2g}).")
  return "\n".join(release + lines + notes + _dynamics_lines(summary.get("dynamics"), summary["baseline"]))


def _dynamics_lines(dynamics: dict | None, baseline: str) -> list[str]:
  """The dynamics table: held-out sim τ and its paired Δ against the baseline per set, one column pair per
  budget."""
  if not dynamics:
    return []
  budgets = list(dynamics.values())
  head = ["set", "layers"] + [f"{h} ×{b['budget']:g} ({b['num_steps']} steps)" for b in budgets
                              for h in ("sim τ", "Δ")]
  lines = ["", "Dynamics: held-out sim τ as the budget grows (Δ paired by seed against "
           f"`{baseline}`).", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for i, row in enumerate(budgets[0]["rows"]):
    cells = [row["name"], ",".join(map(str, row["ids"]))]
    for b in budgets:
      r = b["rows"][i]
      cells += [_fmt(r["sim_tau"]), "(baseline)" if r["name"] == baseline else _fmt(r["vs_baseline"], True)]
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def _release_lines(row: dict | None, primary: str, timed: bool) -> list[str]:
  """The released draft's line above the table (`compare.release_row`), or nothing without one."""
  if not row:
    return []
  if row.get("missing"):
    return [f"Released draft `{row['name']}`: not under releases/ yet (there: {', '.join(row['available']) or 'none'};"
            " `make release-draft` writes it).\n"]
  ev = row["eval"].get(primary, {})
  parts = [f"τ {primary} {ev.get('tau', float('nan')):.3f}"]
  if timed and "speedup" in ev:
    parts.append(f"speedup {ev['speedup']:.2f} [{ev['speedup_p25']:.2f}, {ev['speedup_p75']:.2f}] over plain "
                 f"decoding (median of {ev.get('timing_pairs', 0)} paired runs)")
  if "equal_to_ar" in ev:
    parts.append(f"greedy = plain decoding {ev['equal_to_ar']:.0%}")
  held = row.get("manifest_metrics", {}).get("heldout_sim_tau")
  if held is not None:
    parts.append(f"held-out sim τ {held:.3f} (its manifest)")
  return [f"Released draft `{row['name']}` (layers {','.join(map(str, row['layer_ids']))}, {row.get('dtype')}): "
          + "; ".join(parts) + ".\n"]
