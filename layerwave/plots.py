"""Figures: the entropy wave, the CKA map with compartments, the chosen layers, comparisons and learning curves.

Place in the pipeline: `layer_stats.json` / `selection.json` contents (written by `layerwave.analysis.report`)
→ PNG files under `W/plots/`. Reads plain dicts and arrays only, so a notebook can redraw from the JSON files.
matplotlib runs headless (Agg backend); every file is written atomically (`layerwave.atomic`).

Legend (`layerwave.axes`): L target layers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from layerwave import atomic  # pylint: disable=g-import-not-at-top,wrong-import-position

__all__ = ["save_figure", "plot_entropy_wave", "plot_cka", "plot_selections", "plot_token_entropy",
           "plot_all", "plot_comparison", "plot_learning_curves", "plot_sim_tau", "plot_two_waves"]


def save_figure(fig, path: str) -> str:
  """Saves a figure atomically as PNG and closes it; returns the path."""
  try:
    with atomic.atomic_file(path, suffix=".png") as tmp:
      fig.savefig(tmp, dpi=120, bbox_inches="tight")
  finally:
    plt.close(fig)
  return path


def _shade_blocks(ax, blocks: Sequence[Sequence[int]]):
  for i, (s, e) in enumerate(blocks):
    ax.axvspan(s - 0.5, e - 0.5, color="0.85" if i % 2 else "0.93", zorder=0, lw=0)


def plot_entropy_wave(path: str, record: Mapping) -> str:
  """Entropy across depth, with and without the token filter (prompt and dataset level, normalised).

  Args:
    path: output PNG.
    record: `layer_stats.json` content (`filtered`, `unfiltered`, `compartments`, `stability` optional).

  Returns:
    path.
  """
  layers = np.asarray(record["layer_ids"])
  fig, axes = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
  for ax, level in zip(axes, ("prompt", "dataset")):
    _shade_blocks(ax, record["compartments"]["blocks"])
    key = f"{level}_entropy_normalized"
    ax.plot(layers, record["filtered"][key], "o-", color="C0", ms=3.5, label="token-entropy filter")
    if record.get("unfiltered"):
      ax.plot(layers, record["unfiltered"][key], "s--", color="C1", ms=3, label="no filter ("
              + str(record["filter"].get("unfiltered_control", "")) + ")")
    ax.set_ylabel(f"{level} entropy / log(min(n, D))")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower center", fontsize=8)
  axes[0].set_title(f"{record['model'].get('name', '')}: matrix entropy across depth "
                    f"(α={record['filtered']['alpha']}; shaded = compartments)")
  axes[-1].set_xlabel("layer id (HF hidden_states: 0 = embeddings, L = final norm)")
  axes[-1].set_xticks(layers[::max(1, len(layers) // 16)])
  return save_figure(fig, path)


def plot_cka(path: str, cka, blocks: Sequence[Sequence[int]], title: str = "linear CKA") -> str:
  """CKA heatmap [L+1, L+1] with the compartment boundaries drawn as squares on the diagonal.

  Args:
    path: output PNG.
    cka: [L+1, L+1] matrix.
    blocks: compartments ((start, end) pairs, end exclusive, layer ids).
    title: figure title.

  Returns:
    path.
  """
  c = np.asarray(cka, np.float64)
  fig, ax = plt.subplots(figsize=(6.4, 5.6))
  im = ax.imshow(c, cmap="viridis", vmin=min(0.0, float(np.nanmin(c))), vmax=1.0, origin="upper")
  for s, e in blocks:
    ax.add_patch(matplotlib.patches.Rectangle((s - 0.5, s - 0.5), e - s, e - s, fill=False, ec="red", lw=1.4))
  fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
  ax.set_title(title)
  ax.set_xlabel("layer id")
  ax.set_ylabel("layer id")
  return save_figure(fig, path)


def plot_selections(path: str, record: Mapping, selections: Mapping[str, Sequence[int]]) -> str:
  """The filtered entropy wave with each strategy's chosen layers marked (one row per strategy).

  Args:
    path: output PNG.
    record: `layer_stats.json` content.
    selections: {strategy: ids}.

  Returns:
    path.
  """
  layers = np.asarray(record["layer_ids"])
  level = record["selection_inputs"]["granularity"]
  e = np.asarray(record["filtered"][f"{level}_entropy"])
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 3 + 0.35 * len(selections)), sharex=True,
                                    gridspec_kw={"height_ratios": [2, max(1, 0.35 * len(selections))]})
  _shade_blocks(top, record["compartments"]["blocks"])
  top.plot(layers, e, "o-", color="C0", ms=3.5)
  top.set_ylabel(f"{level} entropy (nats)")
  top.grid(alpha=0.3)
  top.set_title("chosen layers per strategy (filtered statistics)")
  for row, (name, ids) in enumerate(selections.items()):
    ids = list(ids)
    bottom.scatter(ids, [row] * len(ids), marker="D", s=36, color=f"C{row % 10}", zorder=3)
    top.scatter(ids, e[ids], s=80, facecolors="none", edgecolors=f"C{row % 10}", zorder=3)
  _shade_blocks(bottom, record["compartments"]["blocks"])
  bottom.set_yticks(range(len(selections)))
  bottom.set_yticklabels(list(selections))
  bottom.set_ylim(-0.6, len(selections) - 0.4)
  bottom.invert_yaxis()
  bottom.grid(axis="x", alpha=0.3)
  bottom.set_xlabel("layer id")
  bottom.set_xticks(layers[::max(1, len(layers) // 16)])
  return save_figure(fig, path)


def plot_token_entropy(path: str, record: Mapping) -> str:
  """Histogram of token predictive entropy (eligible and kept tokens) with the filter threshold."""
  te = record["token_entropy"]
  edges = np.asarray(te["histogram_edges"])
  centers, width = 0.5 * (edges[1:] + edges[:-1]), np.diff(edges)
  fig, ax = plt.subplots(figsize=(7, 3.5))
  ax.bar(centers, te["histogram_eligible"], width=width, color="0.7", label="eligible")
  ax.bar(centers, te["histogram_kept"], width=width, color="C0", alpha=0.8, label="kept")
  ax.axvline(record["filter"]["threshold_nats"], color="red", lw=1.2, label="threshold")
  ax.set_xlabel("token predictive entropy H_t (nats)")
  ax.set_ylabel("tokens")
  ax.set_yscale("log")
  ax.legend(fontsize=8)
  return save_figure(fig, path)


def plot_all(folder: str, record: Mapping, selections: Mapping[str, Sequence[int]]) -> list[str]:
  """Every analysis figure into `folder`; returns the paths."""
  paths = [plot_entropy_wave(os.path.join(folder, "entropy_wave.png"), record),
           plot_selections(os.path.join(folder, "selections.png"), record, selections),
           plot_token_entropy(os.path.join(folder, "token_entropy.png"), record)]
  blocks = record["compartments"]["blocks"]
  cka_name = record["selection_inputs"]["cka"]
  for kind in ("filtered", "unfiltered"):
    stats = record.get(kind)
    if not stats:
      continue
    matrix = stats["cka_exact"] if cka_name == "exact" and stats.get("cka_exact") else stats["cka_minibatch"]
    paths.append(plot_cka(os.path.join(folder, f"cka_{kind}.png"), matrix, blocks,
                          f"{cka_name} linear CKA, {kind} tokens (red: compartments)"))
  return paths


def plot_comparison(path: str, summary) -> str:
  """The layer-set comparison (a `layerwave.compare.Summary`): τ per set, objective vs τ, acceptance.

  Left: primary τ (mean ± 95 % CI over seeds) per set, baseline dashed. Middle: selection objective against τ
  (one point per set, Spearman ρ in the title). Right: per-depth acceptance of every set.
  """
  primary = summary.primary
  rows = sorted(summary.rows, key=lambda r: np.nan_to_num(r.metrics[primary].mean, nan=-1e9))
  names = [r.name for r in rows]
  means = np.array([r.metrics[primary].mean for r in rows], np.float64)
  errs = np.nan_to_num(np.array([r.metrics[primary].ci95 for r in rows], np.float64))
  kinds = {"baseline": "C3", "strategy": "C0", "ablation": "C2", "random": "0.6", "manual": "C4"}
  colors = [kinds.get(r.kind, "C1") for r in rows]
  fig, (left, mid, right) = plt.subplots(1, 3, figsize=(15, max(4.0, 0.9 + 0.32 * len(rows))),
                                         gridspec_kw={"width_ratios": [1.3, 1, 1]})
  y = np.arange(len(rows))
  left.barh(y, means, xerr=errs, color=colors, capsize=3)
  left.set_yticks(y)
  left.set_yticklabels([f"{n} {list(r.ids)}" for n, r in zip(names, rows)], fontsize=8)
  base = next((r for r in rows if r.name == summary.baseline), None)
  if base is not None and np.isfinite(base.metrics[primary].mean):
    left.axvline(base.metrics[primary].mean, color="C3", ls="--", lw=1)
  finite = means[np.isfinite(means)]
  if finite.size:
    left.set_xlim(max(0.0, finite.min() - 2 * errs.max() - 0.05), finite.max() + 2 * errs.max() + 0.05)
  left.set_xlabel(f"τ ({primary}), mean ± 95% CI")
  left.grid(axis="x", alpha=0.3)
  objective = np.array([r.objective for r in rows])
  mid.errorbar(objective, means, yerr=errs, fmt="none", ecolor="0.7", zorder=1)
  mid.scatter(objective, means, c=colors, zorder=2)
  for x, m, n in zip(objective, means, names):
    mid.annotate(n, (x, m), fontsize=7, xytext=(3, 3), textcoords="offset points")
  corr = summary.spearman_objective.get(primary)
  mid.set_title(f"Spearman ρ = {corr.rho:+.2f} (p = {corr.p:.2g}) over {corr.num_sets} sets"
                if corr is not None and corr.num_sets >= 3 else "Spearman ρ: needs at least 3 distinct sets", fontsize=9)
  mid.set_xlabel("selection objective Σ Ê − λ Σ C")
  mid.set_ylabel(f"τ ({primary})")
  mid.grid(alpha=0.3)
  for r, c in zip(rows, colors):
    if r.acceptance:
      right.plot(np.arange(1, len(r.acceptance) + 1), r.acceptance, "o-", color=c, ms=3, lw=1,
                 alpha=1.0 if r.kind in ("baseline", "strategy") else 0.5)
  right.set_xlabel("draft depth")
  right.set_ylabel("acceptance rate given the path so far")
  right.set_title("per-depth acceptance", fontsize=9)
  right.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
  right.legend(handles=[matplotlib.lines.Line2D([], [], color=c, marker="o", lw=1, label=k)
                        for k, c in kinds.items() if any(r.kind == k for r in rows)], fontsize=8)
  right.grid(alpha=0.3)
  fig.tight_layout()
  return save_figure(fig, path)


def plot_sim_tau(path: str, summary) -> str:
  """The comparison at a glance: held-out sim τ (mean ± 95 % CI over seeds) per set, ordered by the selection
  objective, the baseline marked; with dynamics (`summary.dynamics`), a second panel of each dynamics set's Δ
  against the baseline (paired by seed) over the training budget, the baseline's own sim τ under each budget.

  Sets of another k than the baseline's (`compare.ks`) sit at the right, after a gap: their objective does not
  compare with the baseline's k.
  """
  base_name = summary.baseline
  rows = summary.rows
  k = len(next(r for r in rows if r.name == base_name).ids)
  seen, same_k, other_k = set(), [], []
  for r in rows:
    if tuple(r.ids) not in seen:
      seen.add(tuple(r.ids))
      (same_k if len(r.ids) == k else other_k).append(r)
  same_k.sort(key=lambda r: r.objective)
  other_k.sort(key=lambda r: (len(r.ids), r.objective))
  ordered = same_k + other_k
  dynamics = summary.dynamics or {}
  fig, axes = plt.subplots(1, 2 if dynamics else 1, figsize=(15 if dynamics else 10, 4.8),
                           gridspec_kw={"width_ratios": [1.6, 1]} if dynamics else None, squeeze=False)
  ax = axes[0, 0]
  x = np.arange(len(ordered)) + np.array([0] * len(same_k) + [1] * len(other_k))
  means = np.array([r.metrics["sim_tau"].mean for r in ordered], np.float64)
  errs = np.nan_to_num(np.array([r.metrics["sim_tau"].ci95 for r in ordered], np.float64))
  is_base = np.array([r.name == base_name for r in ordered])
  ax.errorbar(x[~is_base], means[~is_base], yerr=errs[~is_base], fmt="o", color="C0", capsize=3, ms=5)
  ax.errorbar(x[is_base], means[is_base], yerr=errs[is_base], fmt="*", color="C3", capsize=3, ms=12,
              label=f"{base_name} (baseline)")
  if is_base.any() and np.isfinite(means[is_base][0]):
    ax.axhline(means[is_base][0], color="C3", ls="--", lw=1)
  if other_k:
    ax.axvline(len(same_k), color="0.5", ls=":", lw=1)
    ax.annotate("other k →", (len(same_k), 1), xycoords=("data", "axes fraction"), xytext=(4, -12),
                textcoords="offset points", fontsize=8, color="0.4")
  ax.set_xticks(x)
  ax.set_xticklabels([f"{r.name}\n{','.join(map(str, r.ids))}" for r in ordered], rotation=60,
                     ha="right", fontsize=7)
  corr = summary.spearman_objective.get("sim_tau")
  title = (f"held-out sim τ by set, ordered by the selection objective (k = {k}); Spearman ρ = "
           f"{corr.rho:+.2f} (p = {corr.p:.2g})" if corr is not None and np.isfinite(corr.rho)
           else f"held-out sim τ by set, ordered by the selection objective (k = {k})")
  ax.set_title(title, fontsize=9)
  ax.set_ylabel("held-out sim τ, mean ± 95% CI over seeds")
  ax.grid(axis="y", alpha=0.3)
  ax.legend(fontsize=8, loc="lower right")
  if dynamics:
    dx = axes[0, 1]
    budgets = sorted(dynamics.values(), key=lambda b: b.budget)
    steps = np.array([b.num_steps for b in budgets], np.float64)
    names = [r.name for r in budgets[0].rows]
    palette = [f"C{j}" for j in range(10) if j != 3]  # C3 (red) is the baseline's
    dx.axhline(0.0, color="C3", lw=2, label=f"{base_name} (baseline)")
    others = [n for n in names if n != base_name]
    for i, name in enumerate(others):
      # Δ against the baseline paired by seed (the gaps are small beside the rise of τ with budget); each set a
      # little to the side, so that the CIs do not hide each other.
      d = [next(r for r in b.rows if r.name == name).vs_baseline for b in budgets]
      shift = 2.0 ** (0.06 * (i - (len(others) - 1) / 2))
      dx.errorbar(steps * shift, [v.mean for v in d], yerr=np.nan_to_num([v.ci95 for v in d]), capsize=3,
                  marker="o", ms=4, lw=1, color=palette[i % len(palette)], label=name)
    base_tau = [next((r.sim_tau.mean for r in b.rows if r.name == base_name), np.nan) for b in budgets]
    dx.set_xscale("log", base=2)
    dx.set_xticks(steps)
    dx.set_xticklabels([f"{b.budget:g}× · {b.num_steps}\n{base_name} {t:.2f}"
                        for b, t in zip(budgets, base_tau)], fontsize=8)
    dx.minorticks_off()
    dx.set_xlabel(f"training budget (× cell budget · steps; {base_name}'s sim τ)")
    dx.set_ylabel(f"Δ held-out sim τ vs {base_name}, paired by seed ± 95% CI")
    dx.set_title("dynamics: does the ranking hold as drafts improve?", fontsize=9)
    dx.grid(alpha=0.3)
    dx.legend(fontsize=7)
  fig.tight_layout()
  return save_figure(fig, path)


def plot_two_waves(path: str, result: Mapping, name_a: str = "A", name_b: str = "B") -> str:
  """Two analyses of one target on different text (`layerwave.analysis.waves.compare_records`): the filtered
  informativeness E over the candidate depths of each (left), and each strategy's selection on each (right)."""
  cands = np.asarray(result["candidates"])
  e = result["entropy"]
  fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1.5, 1]})
  left.plot(cands, e["a"], "o-", ms=3, color="C0", label=name_a)
  left.plot(cands, e["b"], "s--", ms=3, color="C1", label=name_b)
  left.set_xlabel("layer (HF hidden-state index)")
  left.set_ylabel("filtered informativeness E")
  left.set_title(f"Spearman over depths {e['spearman']:+.2f}; CKA mean |ΔC| {result['cka']['mean_abs_delta']:.3f}",
                 fontsize=9)
  left.grid(alpha=0.3)
  left.legend(fontsize=8)
  rows = result["selections"]
  for i, s in enumerate(rows):
    right.scatter(s["a"], [i - 0.12] * len(s["a"]), color="C0", marker="o", s=25)
    right.scatter(s["b"], [i + 0.12] * len(s["b"]), color="C1", marker="s", s=25)
  right.set_yticks(range(len(rows)))
  right.set_yticklabels([s["strategy"] for s in rows], fontsize=8)
  right.set_xlim(cands.min() - 1, cands.max() + 1)
  right.set_xlabel("selected layers")
  right.set_title(f"selections: {name_a} (o) vs {name_b} (s)", fontsize=9)
  right.grid(axis="x", alpha=0.3)
  fig.tight_layout()
  return save_figure(fig, path)


def plot_learning_curves(path: str, curves: Mapping[str, Sequence[Mapping]], title: str = "") -> str:
  """Simulated τ on held-out text against training tokens (left) and training minutes (right), per run.

  Args:
    path: the PNG to write.
    curves: run name → its evaluations, each a mapping with `tokens`, `seconds`, `sim_tau`
      (`dataclasses.asdict` of `layerwave.training.curves.Point`).
    title: the figure's title.
  """
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
  for i, (name, points) in enumerate(curves.items()):
    if not points:
      continue
    style = dict(marker="o", ms=3, lw=1.2, color=f"C{i % 10}", ls="-" if i < 10 else "--", label=name)
    left.plot([p["tokens"] / 1e3 for p in points], [p["sim_tau"] for p in points], **style)
    right.plot([p["seconds"] / 60 for p in points], [p["sim_tau"] for p in points], **style)
  left.set_xlabel("training tokens (thousands)")
  right.set_xlabel("training minutes (this machine)")
  left.set_ylabel("simulated τ, held-out")
  for ax in (left, right):
    ax.grid(alpha=0.3)
  right.legend(fontsize=8, loc="lower right")
  if title:
    fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  return save_figure(fig, path)
