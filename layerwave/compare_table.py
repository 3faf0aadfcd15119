"""The comparison's table: per layer set, mean ± 95 % CI over seeds, the paired difference against the baseline,
and the Spearman correlation between the selection objective and τ across sets; as a summary dict and markdown.

Place in the pipeline: `layerwave.compare.run` calls `summarize` on the finished cells' `result.json` contents
and writes `markdown_table(summary)` to `W/results.md`. Pure functions of those results: no model, no files.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

import numpy as np
from scipy import stats as scipy_stats

__all__ = ["finalist_summary", "markdown_table", "mean_ci", "paired_bootstrap", "summarize", "temperature_key"]


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


def paired_bootstrap(stats: Sequence[Sequence[int]], base: Sequence[Sequence[int]], num: int = 4000,
                     seed: int = 0) -> dict[str, Any]:
  """Δτ = τ(stats) − τ(base) over the same prompts, with its 95 % percentile interval from resampling prompts.

  Args:
    stats, base: per prompt [emitted tokens, verifications] (`decode.prompt_stats`), prompt i of each the same
      prompt; τ of a set of prompts is Σ emitted / Σ verifications, as the pooled τ.
    num: bootstrap resamples; seed: their PRNG seed (fixed, so a table is reproducible).

  Returns:
    {delta, lo, hi, p_le_0 (share of resamples with Δτ ≤ 0: a one-sided bootstrap p-value), prompts}.
  """
  a, b = np.asarray(stats, np.float64), np.asarray(base, np.float64)
  if a.shape != b.shape or a.ndim != 2 or a.shape[1] != 2 or not len(a):
    raise ValueError(f"paired_bootstrap needs the same prompts for both: [P, 2] arrays, got {a.shape} and "
                     f"{b.shape}.")
  idx = np.random.default_rng(seed).integers(0, len(a), (int(num), len(a)))
  tau = lambda x, i: x[i, 0].sum(-1) / np.maximum(x[i, 1].sum(-1), 1)  # noqa: E731
  boot = tau(a, idx) - tau(b, idx)
  delta = a[:, 0].sum() / a[:, 1].sum() - b[:, 0].sum() / b[:, 1].sum()
  lo, hi = np.percentile(boot, [2.5, 97.5])
  return {"delta": float(delta), "lo": float(lo), "hi": float(hi), "p_le_0": float((boot <= 0).mean()),
          "prompts": int(len(a))}


def finalist_summary(sets: Sequence[Any], evals: dict[tuple[str, int], dict], seeds: Sequence[int], compare: Any,
                     datasets: Sequence[str]) -> dict[str, Any]:
  """The finalists' speculative τ per temperature (pooled over datasets, and per dataset) and Δτ against the
  baseline (the last of `sets`) by a paired bootstrap over prompts; with several seeds each prompt's counts are
  summed over the seeds first, so a resample draws prompts, not runs.

  Args:
    sets: the finalists, the baseline last (`compare.choose_finalists`).
    evals: (set key, seed) → {"eval": `compare.evaluate_draft`'s rows}, for the evaluations done.
    seeds, compare: the finalists' seeds; the `compare.CompareOptions` (temperatures).
    datasets: the prompt sets, in column order.
  """
  baseline = sets[-1]
  temps = [temperature_key(t) for t in compare.temperatures]

  def counts(s, key):
    per_seed = [evals[(s.key, seed)]["eval"].get(key, {}).get("prompt_stats") for seed in seeds
                if (s.key, seed) in evals]
    if not per_seed or any(p is None for p in per_seed):
      return None
    return np.sum(np.asarray(per_seed, np.int64), axis=0)

  rows = []
  for s in sets:
    row = {"name": s.name, "ids": list(s.ids), "objective": s.objective,
           "seeds": sum((s.key, seed) in evals for seed in seeds), "tau": {}, "vs_baseline": {}}
    for t in temps:
      for d in [*datasets, "all"]:
        key = f"{t}/{d}"
        mine, base = counts(s, key), counts(baseline, key)
        if mine is None:
          continue
        row["tau"][key] = float(mine[:, 0].sum() / mine[:, 1].sum())
        if base is not None and s is not baseline:
          row["vs_baseline"][key] = paired_bootstrap(mine, base)
    rows.append(row)
  return {"baseline": baseline.name, "seeds": list(seeds), "temperatures": temps, "datasets": list(datasets),
          "rows": rows}


def _metric(result: dict, name: str) -> float | None:
  if name == "sim_tau":
    return result["train"].get("heldout_sim_tau")
  if ":" in name:  # "speedup:T0/all", "equal_to_ar:T0/all"
    field, key = name.split(":", 1)
    return result["eval"].get(key, {}).get(field)
  return result["eval"].get(name, {}).get("tau")


EXACT_SPEARMAN_MAX = 9  # up to this many sets the p-value is exact (9! = 362,880 orderings)


def _exact_spearman_p(x: Sequence[float], y: Sequence[float], rho: float) -> float:
  """Two-sided p of Spearman's ρ by enumerating every pairing of x's ranks with y's: the share of the n!
  orderings whose |ρ| is at least the observed one. The t approximation (scipy's) is far off for few sets: for
  n = 3 it reports p = 0 for ρ = ±1, whose exact p is 2/6."""
  rx = scipy_stats.rankdata(x) - (len(x) + 1) / 2
  ry = scipy_stats.rankdata(y) - (len(y) + 1) / 2
  perms = np.array(list(itertools.permutations(range(len(y)))), np.int32)
  r = (ry[perms] @ rx) / np.sqrt((rx @ rx) * (ry @ ry))
  return float(np.mean(np.abs(r) >= abs(rho) - 1e-12))


def _spearman(pairs: Sequence[tuple[float, float]], k: int) -> dict[str, Any]:
  """Spearman ρ and its two-sided p-value over (x, y) pairs with finite y (exact for ≤ `EXACT_SPEARMAN_MAX`
  pairs, scipy's t approximation above); NaN with fewer than 3 or a constant side."""
  ok = [(x, y) for x, y in pairs if np.isfinite(y) and np.isfinite(x)]
  if len(ok) >= 3 and len({x for x, _ in ok}) > 1 and len({y for _, y in ok}) > 1:  # else ρ is undefined
    xs, ys = zip(*ok)
    res = scipy_stats.spearmanr(xs, ys)
    p = _exact_spearman_p(xs, ys, float(res.statistic)) if len(ok) <= EXACT_SPEARMAN_MAX else float(res.pvalue)
    return {"rho": float(res.statistic), "p": p, "num_sets": len(ok), "k": k}
  return {"rho": float("nan"), "p": float("nan"), "num_sets": len(ok), "k": k}


def summarize(sets: Sequence[Any], results: dict[tuple[str, int], dict], seeds: Sequence[int], compare: Any,
              prompts: dict[str, Any], predictors: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
  """Mean ± 95 % CI per set, paired differences against the baseline, Spearman(objective, τ) over sets.

  Args:
    sets: the `compare.LayerSet`s, in config order.
    results: (set key, seed) → the cell's result.json content, for the finished cells.
    seeds: the seeds of the comparison.
    compare: its `compare.CompareOptions` (temperatures, speedup, baseline).
    prompts: dataset name → prompts (the names order the columns).
    predictors: set name → {candidate predictor → value} (`compare.set_predictors`): each gets the objective's
      Spearman statistics against τ, in `spearman_predictors`.
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
           if f"{temps[0]}/all" in results.get((s.key, seed), {}).get("eval", {})]
    row["acceptance"] = np.mean(np.asarray(acc, np.float64), axis=0).tolist() if acc else []
    rows.append(row)
  primary = f"{temps[0]}/all"
  # Over the distinct sets of the baseline's k: Σ Ê − λ Σ C sums k terms, so objectives of other k's do not
  # compare with it.
  distinct = {}
  for row in rows:
    if len(row["ids"]) == len(baseline.ids):
      distinct.setdefault(tuple(row["ids"]), row)
  k = len(baseline.ids)
  ys = {m: [r["metrics"][m]["mean"] for r in distinct.values()] for m in (primary, "sim_tau")}
  correlations = {m: _spearman(list(zip([r["objective"] for r in distinct.values()], y)), k)
                  for m, y in ys.items()}
  by_predictor = {}
  for name in sorted({p for values in (predictors or {}).values() for p in values}):
    xs = [predictors.get(r["name"], {}).get(name, float("nan")) for r in distinct.values()]
    by_predictor[name] = {m: _spearman(list(zip(xs, y)), k) for m, y in ys.items()}
  for row in rows:
    row["predictors"] = dict((predictors or {}).get(row["name"], {}))
  return {"baseline": baseline.name, "primary": primary, "seeds": list(seeds), "metrics": names,
          "rows": rows, "spearman_objective": correlations, "spearman_predictors": by_predictor,
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
  """The comparison as markdown: one row per set, sorted by the primary τ (or by `summary["sort_by"]`)."""
  primary = summary["primary"]
  temps = sorted({m.split("/")[0] for m in summary["metrics"] if "/" in m and ":" not in m})
  datasets = [m.split("/")[1] for m in summary["metrics"]
              if m.startswith(primary.split("/")[0] + "/") and not m.endswith("/all")]
  others = [f"{t}/all" for t in temps if f"{t}/all" != primary]
  speed = [m for m in summary["metrics"] if m.startswith("speedup:")]
  equal = [m for m in summary["metrics"] if m.startswith("equal_to_ar:")]
  # With no decoding in the cells (`compare.num_prompts=0`: held-out sim τ alone) the τ columns are left out.
  decoded = any(r["metrics"][primary]["n"] for r in summary["rows"])
  tau_head = ([f"τ {primary}", f"Δτ vs {summary['baseline']}"] + [f"τ {primary.split('/')[0]}/{d}" for d in datasets]
              + [f"τ {m}" for m in others]) if decoded else []
  head = (["set", "layers", "k", "seeds", "objective"] + tau_head
          + ["held-out sim τ", f"Δ sim τ vs {summary['baseline']}"] + [m.replace("speedup:", "speedup ") for m in speed]
          + ["greedy = plain decoding" for _ in equal])
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  first_with_ids = {}
  for r in summary["rows"]:  # in config order: later sets with the same ids share the first one's cells
    first_with_ids.setdefault(tuple(r["ids"]), r["name"])
  order = summary.get("sort_by", primary)  # `compare.sort_by`: the primary τ, or sim_tau
  rows = sorted(summary["rows"], key=lambda r: -np.nan_to_num(r["metrics"][order]["mean"], nan=-1e9))
  for r in rows:
    is_base = r["name"] == summary["baseline"]
    name = f"**{r['name']}**" if is_base else r["name"]
    if first_with_ids[tuple(r["ids"])] != r["name"]:
      name += f" (= {first_with_ids[tuple(r['ids'])]})"
    seeds = max(r["metrics"][primary]["n"], r["metrics"]["sim_tau"]["n"])
    cells = [name, ",".join(map(str, r["ids"])), str(len(r["ids"])), str(seeds), f"{r['objective']:+.3f}"]
    if decoded:
      cells += [_fmt(r["metrics"][primary]), "(baseline)" if is_base else _fmt(r["vs_baseline"][primary], True)]
      cells += [_fmt(r["metrics"][f"{primary.split('/')[0]}/{d}"]) for d in datasets]
      cells += [_fmt(r["metrics"][m]) for m in others]
    cells += [_fmt(r["metrics"]["sim_tau"]),
              "(baseline)" if is_base else _fmt(r["vs_baseline"]["sim_tau"], True)]
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
    if m == primary and not decoded:
      continue
    if c["num_sets"] < 3:
      notes.append(f"Spearman(selection objective, {m}): needs at least 3 distinct sets ({c['num_sets']} here).")
    else:
      notes.append(f"Spearman(selection objective, {m}) over {c['num_sets']} distinct sets: "
                   f"ρ = {c['rho']:+.2f} (p = {c['p']:.2g}).")
  return "\n".join(release + lines + notes + _predictor_lines(summary)
                   + _finalist_lines(summary.get("finalists"))
                   + _dynamics_lines(summary.get("dynamics"), summary["baseline"]))


def _predictor_lines(summary: dict[str, Any]) -> list[str]:
  """What predicts τ: Spearman ρ (p) of the objective and of each candidate predictor against held-out sim τ and
  the primary τ, over the distinct sets of the baseline's k; the strongest candidate against sim τ named."""
  preds = summary.get("spearman_predictors") or {}
  if not preds:
    return []
  primary = summary["primary"]
  fmt = lambda c: "–" if not np.isfinite(c["rho"]) else f"{c['rho']:+.2f} (p = {c['p']:.2g})"  # noqa: E731
  rows = [("selection objective Σ Ê − λ Σ C", summary["spearman_objective"])] + list(preds.items())
  n = summary["spearman_objective"]["sim_tau"]["num_sets"]
  decoded = any(r["metrics"][primary]["n"] for r in summary["rows"])  # else no τ column (sim τ alone)
  lines = ["", f"What predicts τ: Spearman ρ over the {n} distinct sets of k = "
           f"{summary['spearman_objective']['sim_tau']['k']} (p: two-sided, no correction for the "
           f"{len(rows)} predictors tried).", "",
           "| predictor | ρ vs held-out sim τ |" + (f" ρ vs τ {primary} |" if decoded else ""),
           "|---|---|" + ("---|" if decoded else "")]
  lines += [f"| {name} | {fmt(c['sim_tau'])} |" + (f" {fmt(c[primary])} |" if decoded else "") for name, c in rows]
  finite = [(abs(c["sim_tau"]["rho"]), name) for name, c in preds.items() if np.isfinite(c["sim_tau"]["rho"])]
  if finite:
    best = max(finite)[1]
    lines.append(f"\nStrongest candidate against sim τ: {best}, ρ = {preds[best]['sim_tau']['rho']:+.2f} "
                 f"(p = {preds[best]['sim_tau']['p']:.2g}).")
  return lines


def _finalist_lines(finalists: dict | None) -> list[str]:
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
  how = ""
  if "batch_size" in row:
    how = f", chain of {row['num_draft_tokens']} at batch {row['batch_size']}"
  layers = ",".join(map(str, row["layer_ids"]))
  return [f"Released draft `{row['name']}` (layers {layers}, {row.get('dtype')}{how}): "
          + "; ".join(parts) + ".\n"]
