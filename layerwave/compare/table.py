"""The comparison as markdown: one row per layer set (mean ± 95 % CI over seeds, Δ against the baseline), the
Spearman correlations, the predictors of τ, the finalists, the dynamics and the released draft.

Place in the pipeline: `layerwave.compare.stage.run` writes `markdown_table(summary)` to `W/results.md`, from the
typed `layerwave.compare.summary.Summary`. Pure functions: no model, no files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from layerwave.compare.summary import Budget, Stat, Summary

__all__ = ["markdown_table"]


def _fmt(m: Stat | None, signed: bool = False) -> str:
  if m is None or m.n == 0 or not np.isfinite(m.mean):
    return "–"
  mean = f"{m.mean:+.3f}" if signed else f"{m.mean:.3f}"
  return mean + (f" ± {m.ci95:.3f}" if np.isfinite(m.ci95) else "")


def _fmt_speedup(metrics: dict[str, Stat], name: str) -> str:
  """A speedup cell: with one seed, the cell's median and the [p25, p75] of its timed pairs."""
  m = metrics[name]
  p25, p75 = (metrics.get(name.replace("speedup:", f"speedup_{q}:")) for q in ("p25", "p75"))
  if m.n == 1 and p25 is not None and p25.n == 1 and p75 is not None and p75.n == 1:
    return f"{m.mean:.2f} [{p25.mean:.2f}, {p75.mean:.2f}]"
  return _fmt(m)


def markdown_table(summary: Summary) -> str:
  """The comparison as markdown: one row per set, sorted by the primary τ (or by `summary.sort_by`)."""
  primary = summary.primary
  temps = sorted({m.split("/")[0] for m in summary.metrics if "/" in m and ":" not in m})
  datasets = [m.split("/")[1] for m in summary.metrics
              if m.startswith(primary.split("/")[0] + "/") and not m.endswith("/all")]
  others = [f"{t}/all" for t in temps if f"{t}/all" != primary]
  speed = [m for m in summary.metrics if m.startswith("speedup:")]
  equal = [m for m in summary.metrics if m.startswith("equal_to_ar:")]
  # With no decoding in the cells (`compare.num_prompts=0`: held-out sim τ alone) the τ columns are left out.
  decoded = any(r.metrics[primary].n for r in summary.rows)
  tau_head = ([f"τ {primary}", f"Δτ vs {summary.baseline}"] + [f"τ {primary.split('/')[0]}/{d}" for d in datasets]
              + [f"τ {m}" for m in others]) if decoded else []
  head = (["set", "layers", "k", "seeds", "objective"] + tau_head
          + ["held-out sim τ", f"Δ sim τ vs {summary.baseline}"] + [m.replace("speedup:", "speedup ") for m in speed]
          + ["greedy = plain decoding" for _ in equal])
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  first_with_ids = {}
  for r in summary.rows:  # in config order: later sets with the same ids share the first one's cells
    first_with_ids.setdefault(r.ids, r.name)
  order = summary.sort_by or primary  # `compare.sort_by`: the primary τ, or sim_tau
  rows = sorted(summary.rows, key=lambda r: -np.nan_to_num(r.metrics[order].mean, nan=-1e9))
  for r in rows:
    is_base = r.name == summary.baseline
    name = f"**{r.name}**" if is_base else r.name
    if first_with_ids[r.ids] != r.name:
      name += f" (= {first_with_ids[r.ids]})"
    seeds = max(r.metrics[primary].n, r.metrics["sim_tau"].n)
    cells = [name, ",".join(map(str, r.ids)), str(len(r.ids)), str(seeds), f"{r.objective:+.3f}"]
    if decoded:
      cells += [_fmt(r.metrics[primary]), "(baseline)" if is_base else _fmt(r.vs_baseline[primary], True)]
      cells += [_fmt(r.metrics[f"{primary.split('/')[0]}/{d}"]) for d in datasets]
      cells += [_fmt(r.metrics[m]) for m in others]
    cells += [_fmt(r.metrics["sim_tau"]), "(baseline)" if is_base else _fmt(r.vs_baseline["sim_tau"], True)]
    cells += [_fmt_speedup(r.metrics, m) for m in speed]
    cells += [f"{r.metrics[m].mean:.0%}" if r.metrics[m].n else "–" for m in equal]
    lines.append("| " + " | ".join(cells) + " |")
  corr = summary.spearman_objective
  release = _release_lines(summary.release, primary, bool(speed))
  notes = [f"\nMean ± 95 % CI (Student t) over seeds {list(summary.seeds)}; Δτ is the paired difference against "
           f"`{summary.baseline}` (same seed). τ = new tokens per target verification (bonus token "
           "included)."]
  if speed:
    pairs = sorted({int(v) for r in summary.rows for m in speed
                    for v in getattr(r.metrics.get(m.replace("speedup:", "timing_pairs:")), "values", ())})
    notes.append(f"Speedup = speculative ÷ plain decoding tokens/s, timed in alternation on the same batches "
                 f"inside each cell (ABBA order, compilation excluded): per cell the median of "
                 f"{'/'.join(map(str, pairs)) or '–'} pair ratios, [p25, p75] of the pairs with one seed, "
                 "mean ± 95 % CI of the cells' medians with more.")
  for m, c in corr.items():
    if m == primary and not decoded:
      continue
    if c.num_sets < 3:
      notes.append(f"Spearman(selection objective, {m}): needs at least 3 distinct sets ({c.num_sets} here).")
    else:
      notes.append(f"Spearman(selection objective, {m}) over {c.num_sets} distinct sets: "
                   f"ρ = {c.rho:+.2f} (p = {c.p:.2g}).")
  return "\n".join(release + lines + notes + _predictor_lines(summary)
                   + _finalist_lines(summary.finalists)
                   + _dynamics_lines(summary.dynamics, summary.baseline))


def _predictor_lines(summary: Summary) -> list[str]:
  """What predicts τ: Spearman ρ (p) of the objective and of each candidate predictor against held-out sim τ and
  the primary τ, over the distinct sets of the baseline's k; the strongest candidate against sim τ named."""
  preds = summary.spearman_predictors
  if not preds:
    return []
  primary = summary.primary
  fmt = lambda c: "–" if not np.isfinite(c.rho) else f"{c.rho:+.2f} (p = {c.p:.2g})"  # noqa: E731
  rows = [("selection objective Σ Ê − λ Σ C", summary.spearman_objective)] + list(preds.items())
  n = summary.spearman_objective["sim_tau"].num_sets
  decoded = any(r.metrics[primary].n for r in summary.rows)  # else no τ column (sim τ alone)
  lines = ["", f"What predicts τ: Spearman ρ over the {n} distinct sets of k = "
           f"{summary.spearman_objective['sim_tau'].k} (p: two-sided, no correction for the "
           f"{len(rows)} predictors tried).", "",
           "| predictor | ρ vs held-out sim τ |" + (f" ρ vs τ {primary} |" if decoded else ""),
           "|---|---|" + ("---|" if decoded else "")]
  lines += [f"| {name} | {fmt(c['sim_tau'])} |" + (f" {fmt(c[primary])} |" if decoded else "") for name, c in rows]
  finite = [(abs(c["sim_tau"].rho), name) for name, c in preds.items() if np.isfinite(c["sim_tau"].rho)]
  if finite:
    best = max(finite)[1]
    lines.append(f"\nStrongest candidate against sim τ: {best}, ρ = {preds[best]['sim_tau'].rho:+.2f} "
                 f"(p = {preds[best]['sim_tau'].p:.2g}).")
  return lines


def _finalist_lines(finalists: Mapping[str, Any] | None) -> list[str]:
  """The finalists' table: speculative τ on the larger prompt sets, Δτ with its paired-bootstrap 95 % interval."""
  if not finalists:
    return []
  if "pending" in finalists:
    return ["", f"Finalists: decoded once every cell has finished ({finalists['pending']} cells to go)."]
  keys = [f"{t}/all" for t in finalists["temperatures"]]
  head = ["finalist", "layers", "seeds"] + [h for k in keys for h in (f"τ {k}", "Δτ [95 % bootstrap]", "p(Δ≤0)")]
  per = finalists.get("prompts_per_dataset", {})
  lines = ["", f"Finalists: speculative τ on {', '.join(f'{n} {d}' for d, n in per.items())} prompts; Δτ against "
           f"`{finalists['baseline']}` on the same prompts, 95 % percentile interval of a paired bootstrap over "
           "prompts (4,000 resamples).", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in finalists["rows"]:
    base = r["name"] == finalists["baseline"]
    cells = [f"**{r['name']}**" if base else r["name"], ",".join(map(str, r["ids"])), str(r["seeds"])]
    for k in keys:
      tau, d = r["tau"].get(k), r["vs_baseline"].get(k)
      cells.append("–" if tau is None else f"{tau:.3f}")
      if base:
        cells += ["(baseline)", ""]
      elif d is None:
        cells += ["–", "–"]
      else:
        cells += [f"{d['delta']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]", f"{d['p_le_0']:.3f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def _dynamics_lines(dynamics: Mapping[str, Budget] | None, baseline: str) -> list[str]:
  """The dynamics table: held-out sim τ and its paired Δ against the baseline per set, one column pair per
  budget."""
  if not dynamics:
    return []
  budgets = list(dynamics.values())
  head = ["set", "layers"] + [f"{h} ×{b.budget:g} ({b.num_steps} steps)" for b in budgets
                              for h in ("sim τ", "Δ")]
  lines = ["", "Dynamics: held-out sim τ as the budget grows (Δ paired by seed against "
           f"`{baseline}`).", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for i, row in enumerate(budgets[0].rows):
    cells = [row.name, ",".join(map(str, row.ids))]
    for b in budgets:
      r = b.rows[i]
      cells += [_fmt(r.sim_tau), "(baseline)" if r.name == baseline else _fmt(r.vs_baseline, True)]
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def _release_lines(row: Mapping[str, Any] | None, primary: str, timed: bool) -> list[str]:
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
  how = ""
  if "batch_size" in row:
    how = f", chain of {row['num_draft_tokens']} at batch {row['batch_size']}"
  layers = ",".join(map(str, row["layer_ids"]))
  return [f"Released draft `{row['name']}` (layers {layers}, {row.get('dtype')}{how}): "
          + "; ".join(parts) + ".\n"]
