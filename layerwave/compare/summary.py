"""The comparison's statistics as typed values: per layer set, mean ± 95 % CI over seeds, the paired difference
against the baseline, and the Spearman correlation between the selection objective and τ across sets.

Place in the pipeline: `layerwave.compare.stage.run` calls `summarize` on the finished cells' `result.json`
contents; `layerwave.compare.table` and `layerwave.plots` read the `Summary` it returns, and `Summary.to_json`
is what `W/results.json` holds. Pure functions of those results: no model, no files.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np
from scipy import stats as scipy_stats

__all__ = ["Budget", "Correlation", "DynamicsRow", "SetRow", "Stat", "Summary", "finalist_summary", "mean_ci",
           "paired_bootstrap", "spearman", "summarize", "temperature_key", "EXACT_SPEARMAN_MAX"]


def temperature_key(t: float) -> str:
  """The results' name of a temperature: 0 → "T0", 0.7 → "T0.7"."""
  return f"T{t:g}"


@dataclasses.dataclass(frozen=True)
class Stat:
  """A metric over seeds (or a paired difference): mean, half-width of its 95 % Student-t interval (NaN with
  one value), how many finite values, and the values."""

  mean: float
  ci95: float
  n: int = 0
  values: tuple[float, ...] = ()

  @classmethod
  def of(cls, values: Sequence[float | None]) -> Stat:
    """Of the finite values among `values` (None and NaN are left out)."""
    x = np.asarray([v for v in values if v is not None and np.isfinite(v)], np.float64)
    n = x.size
    if n == 0:
      return cls(float("nan"), float("nan"), 0, ())
    half = float(scipy_stats.t.ppf(0.975, n - 1) * x.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return cls(float(x.mean()), half, int(n), tuple(x.tolist()))

  def to_json(self) -> dict[str, Any]:
    return {"mean": self.mean, "ci95": self.ci95, "n": self.n, "values": list(self.values)}

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> Stat:
    return cls(d["mean"], d["ci95"], d.get("n", 0), tuple(d.get("values", ())))


def mean_ci(values: Sequence[float]) -> dict[str, Any]:
  """`Stat.of(values)` as JSON: {mean, ci95, n, values}."""
  return Stat.of(values).to_json()


@dataclasses.dataclass(frozen=True)
class Correlation:
  """Spearman ρ of a predictor against a τ over the distinct sets of the baseline's k, two-sided p."""

  rho: float
  p: float
  num_sets: int
  k: int

  def to_json(self) -> dict[str, Any]:
    return {"rho": self.rho, "p": self.p, "num_sets": self.num_sets, "k": self.k}


@dataclasses.dataclass(frozen=True)
class SetRow:
  """One layer set of the table.

  Attributes:
    name, ids, kind, objective, description: the `compare.LayerSet`'s.
    metrics: metric name ("T0/all", "T0/mtbench", "sim_tau", "speedup:T0/all", ...) → its `Stat` over seeds.
    vs_baseline: metric name → the `Stat` of its difference against the baseline, paired by seed.
    acceptance: per-depth acceptance at the first temperature, mean over seeds (empty without decoding).
    predictors: candidate predictor of τ → this set's value (`compare.set_predictors`).
  """

  name: str
  ids: tuple[int, ...]
  kind: str
  objective: float
  description: str = ""
  metrics: Mapping[str, Stat] = dataclasses.field(default_factory=dict)
  vs_baseline: Mapping[str, Stat] = dataclasses.field(default_factory=dict)
  acceptance: tuple[float, ...] = ()
  predictors: Mapping[str, float] = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict[str, Any]:
    return {"name": self.name, "ids": list(self.ids), "kind": self.kind, "objective": self.objective,
            "description": self.description, "metrics": {m: s.to_json() for m, s in self.metrics.items()},
            "vs_baseline": {m: s.to_json() for m, s in self.vs_baseline.items()},
            "acceptance": list(self.acceptance), "predictors": dict(self.predictors)}


@dataclasses.dataclass(frozen=True)
class DynamicsRow:
  """A dynamics set at one budget: its held-out sim τ and the difference against the baseline's, by seed."""

  name: str
  ids: tuple[int, ...]
  sim_tau: Stat
  vs_baseline: Stat

  def to_json(self) -> dict[str, Any]:
    return {"name": self.name, "ids": list(self.ids), "sim_tau": self.sim_tau.to_json(),
            "vs_baseline": self.vs_baseline.to_json()}


@dataclasses.dataclass(frozen=True)
class Budget:
  """The dynamics sets at one training budget (a multiple of the cells' `train.num_steps`)."""

  budget: float
  num_steps: int
  rows: tuple[DynamicsRow, ...]

  def to_json(self) -> dict[str, Any]:
    return {"budget": self.budget, "num_steps": self.num_steps, "rows": [r.to_json() for r in self.rows]}


@dataclasses.dataclass(frozen=True)
class Summary:
  """The comparison's table (`summarize`), and what `compare.run` adds beside it.

  Attributes:
    baseline: the baseline set's name; primary: the first temperature's pooled τ ("T0/all").
    seeds: the comparison's seeds; metrics: every metric name of the rows, in column order.
    rows: the sets, in config order.
    spearman_objective: "T0/all" and "sim_tau" → Spearman(objective, that τ).
    spearman_predictors: predictor → {"T0/all", "sim_tau"} → its Spearman correlation.
    cells_done: finished cells at budget 1×.
    sort_by: the table's row order: "" (the primary τ) or "sim_tau".
    finalists, release: `compare.run_finalists`' and `compare.release_row`'s results (their JSON form), if any.
    dynamics: budget key ("x0.25", "x1", ...) → the dynamics sets at that budget, if any.
    analysis, budget, eval_settings: where the statistics came from, the cells' training budget and the
      decoding settings (`compare.run` records them).
  """

  baseline: str
  primary: str
  seeds: tuple[int, ...]
  metrics: tuple[str, ...]
  rows: tuple[SetRow, ...]
  spearman_objective: Mapping[str, Correlation]
  spearman_predictors: Mapping[str, Mapping[str, Correlation]]
  cells_done: int
  sort_by: str = ""
  finalists: Mapping[str, Any] | None = None
  dynamics: Mapping[str, Budget] | None = None
  release: Mapping[str, Any] | None = None
  analysis: str | None = None
  budget: Mapping[str, Any] | None = None
  eval_settings: Mapping[str, Any] | None = None

  def row(self, name: str) -> SetRow:
    return next(r for r in self.rows if r.name == name)

  def to_json(self) -> dict[str, Any]:
    """What `W/results.json` holds (optional parts only when set, in the order `compare.run` adds them)."""
    out = {"baseline": self.baseline, "primary": self.primary, "seeds": list(self.seeds),
           "metrics": list(self.metrics), "rows": [r.to_json() for r in self.rows],
           "spearman_objective": {m: c.to_json() for m, c in self.spearman_objective.items()},
           "spearman_predictors": {name: {m: c.to_json() for m, c in by.items()}
                                   for name, by in self.spearman_predictors.items()},
           "cells_done": self.cells_done}
    if self.sort_by:
      out["sort_by"] = self.sort_by
    if self.finalists is not None:
      out["finalists"] = self.finalists
    if self.dynamics is not None:
      out["dynamics"] = {key: b.to_json() for key, b in self.dynamics.items()}
    if self.release is not None:
      out["release"] = self.release
    for name in ("analysis", "budget", "eval_settings"):
      if getattr(self, name) is not None:
        out[name] = getattr(self, name)
    return out


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

  Returns:
    {baseline, seeds, temperatures, datasets, rows: [{name, ids, objective, seeds, tau: {key: τ},
    vs_baseline: {key: `paired_bootstrap`}}]}, as `W/results.json` keeps it.
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


def spearman(pairs: Sequence[tuple[float, float]], k: int) -> Correlation:
  """Spearman ρ and its two-sided p-value over (x, y) pairs with finite y (exact for ≤ `EXACT_SPEARMAN_MAX`
  pairs, scipy's t approximation above); NaN with fewer than 3 or a constant side."""
  ok = [(x, y) for x, y in pairs if np.isfinite(y) and np.isfinite(x)]
  if len(ok) >= 3 and len({x for x, _ in ok}) > 1 and len({y for _, y in ok}) > 1:  # else ρ is undefined
    xs, ys = zip(*ok)
    res = scipy_stats.spearmanr(xs, ys)
    p = _exact_spearman_p(xs, ys, float(res.statistic)) if len(ok) <= EXACT_SPEARMAN_MAX else float(res.pvalue)
    return Correlation(float(res.statistic), p, len(ok), k)
  return Correlation(float("nan"), float("nan"), len(ok), k)


def summarize(sets: Sequence[Any], results: dict[tuple[str, int], dict], seeds: Sequence[int], compare: Any,
              prompts: dict[str, Any], predictors: dict[str, dict[str, float]] | None = None) -> Summary:
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
    metrics, vs_baseline = {}, {}
    for m in names:
      vals = {seed: _metric(results[(s.key, seed)], m) for seed in seeds if (s.key, seed) in results}
      metrics[m] = Stat.of(list(vals.values()))
      base = {seed: _metric(results[(baseline.key, seed)], m) for seed in seeds
              if (baseline.key, seed) in results}
      diffs = [vals[k] - base[k] for k in vals if k in base and vals[k] is not None and base[k] is not None]
      vs_baseline[m] = Stat.of(diffs)
    acc = [results[(s.key, seed)]["eval"][f"{temps[0]}/all"]["acceptance"] for seed in seeds
           if f"{temps[0]}/all" in results.get((s.key, seed), {}).get("eval", {})]
    acceptance = tuple(np.mean(np.asarray(acc, np.float64), axis=0).tolist()) if acc else ()
    rows.append(SetRow(s.name, tuple(s.ids), s.kind, s.objective, s.description, metrics, vs_baseline, acceptance,
                       dict((predictors or {}).get(s.name, {}))))
  primary = f"{temps[0]}/all"
  # Over the distinct sets of the baseline's k: Σ Ê − λ Σ C sums k terms, so objectives of other k's do not
  # compare with it.
  distinct: dict[tuple[int, ...], SetRow] = {}
  for row in rows:
    if len(row.ids) == len(baseline.ids):
      distinct.setdefault(row.ids, row)
  k = len(baseline.ids)
  ys = {m: [r.metrics[m].mean for r in distinct.values()] for m in (primary, "sim_tau")}
  correlations = {m: spearman(list(zip([r.objective for r in distinct.values()], y)), k) for m, y in ys.items()}
  by_predictor = {}
  for name in sorted({p for values in (predictors or {}).values() for p in values}):
    xs = [predictors.get(r.name, {}).get(name, float("nan")) for r in distinct.values()]
    by_predictor[name] = {m: spearman(list(zip(xs, y)), k) for m, y in ys.items()}
  return Summary(baseline=baseline.name, primary=primary, seeds=tuple(seeds), metrics=tuple(names), rows=tuple(rows),
                 spearman_objective=correlations, spearman_predictors=by_predictor, cells_done=len(results))
