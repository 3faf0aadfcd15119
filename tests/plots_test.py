"""layerwave.plots: every figure from plain dicts (as read back from the JSON files), the comparison's from its
typed `compare.Summary`, written atomically."""

import dataclasses
import os

import matplotlib.axes
import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pytest

from layerwave import compare
from layerwave import plots

L = 6


def _record():
  rng = np.random.default_rng(0)
  wave = lambda: (1 + 0.1 * rng.random(L + 1)).tolist()  # noqa: E731
  stats = {"prompt_entropy": wave(), "prompt_entropy_normalized": wave(), "dataset_entropy": wave(),
           "dataset_entropy_normalized": wave(), "alpha": 1.0, "cka_exact": None,
           "cka_minibatch": np.clip(np.eye(L + 1) + 0.3, 0, 1).tolist()}
  edges = np.linspace(0, 10, 11)
  return {"layer_ids": list(range(L + 1)), "model": {"name": "tiny"}, "filtered": stats, "unfiltered": dict(stats),
          "compartments": {"blocks": [[1, 3], [3, 6]]}, "filter": {"threshold_nats": 4.0,
                                                                   "unfiltered_control": "matched"},
          "selection_inputs": {"granularity": "prompt", "cka": "minibatch"},
          "token_entropy": {"histogram_edges": edges.tolist(), "histogram_eligible": [10] * 10,
                            "histogram_kept": [0] * 4 + [10] * 6}}


def _is_png(path):
  image = matplotlib.image.imread(path)
  return image.ndim == 3 and min(image.shape[:2]) > 100


def test_plot_all_writes_every_figure_and_closes_it(tmp_path):
  open_before = plt.get_fignums()
  paths = plots.plot_all(str(tmp_path / "plots"), _record(), {"eagle3": (2, 3, 4), "greedy": [1, 5]})
  names = sorted(os.path.basename(p) for p in paths)
  assert names == ["cka_filtered.png", "cka_unfiltered.png", "entropy_wave.png", "selections.png",
                   "token_entropy.png"]
  assert sorted(os.listdir(tmp_path / "plots")) == names  # no temporary file left
  assert all(_is_png(p) for p in paths) and plt.get_fignums() == open_before


def test_cka_figure_marks_the_compartments_in_red(tmp_path):
  matrix = np.full((L + 1, L + 1), 0.2)
  plain = matplotlib.image.imread(plots.plot_cka(str(tmp_path / "plain.png"), matrix, []))
  boxed = matplotlib.image.imread(plots.plot_cka(str(tmp_path / "boxed.png"), matrix, [[1, 4]]))
  red = lambda im: np.sum((im[..., 0] > 0.8) & (im[..., 1] < 0.3) & (im[..., 2] < 0.3))  # noqa: E731
  assert red(plain) == 0 and red(boxed) > 50


def _summary(rows, metric, correlation):
  """A `compare.Summary` of `rows` whose only metric is `metric` (the comparison's figures read nothing else)."""
  return compare.Summary(baseline="eagle3", primary="T0/all", seeds=(0,), metrics=(metric,), rows=tuple(rows),
                         spearman_objective={metric: correlation}, spearman_predictors={}, cells_done=len(rows))


def test_comparison_figure(tmp_path):
  def row(name, kind, tau, objective):
    return compare.SetRow(name, (1, 2, 3), kind, objective, metrics={"T0/all": compare.Stat(tau, 0.05)},
                          acceptance=(0.5, 0.2))
  rows = [row("eagle3", "baseline", 1.3, 0.5), row("exhaustive", "strategy", 1.4, 0.9),
          row("random-0", "random", float("nan"), 0.1)]
  summary = _summary(rows, "T0/all", compare.Correlation(float("nan"), float("nan"), 2, 3))
  assert _is_png(plots.plot_comparison(str(tmp_path / "compare.png"), summary))


def test_sim_tau_figure_marks_the_baseline_and_draws_the_dynamics(tmp_path, monkeypatch):
  def row(name, ids, sim, objective):
    return compare.SetRow(name, ids, "strategy", objective, metrics={"sim_tau": compare.Stat(sim, 0.02)})
  rows = [row("eagle3", (2, 15, 27), 1.60, 0.5), row("exhaustive", (3, 12, 20), 1.65, 0.9),
          row("cka_only", (1, 2, 3), 1.55, 0.1), row("last", (30,), 1.40, 1.0), row("nan", (4, 5, 6), float("nan"), 0)]
  summary = _summary(rows, "sim_tau", compare.Correlation(1.0, 0.0, 3, 3))
  open_before = plt.get_fignums()
  alone = matplotlib.image.imread(plots.plot_sim_tau(str(tmp_path / "alone.png"), summary))
  def dyn_rows(d):  # the dynamics panel draws each set's Δ against the baseline, paired by seed
    nan = float("nan")
    return (compare.DynamicsRow("eagle3", (2, 15, 27), compare.Stat(1.5 + d, 0.01), compare.Stat(0.0, 0.0)),
            compare.DynamicsRow("exhaustive", (3, 12, 20), compare.Stat(1.52 + d, nan),
                                compare.Stat(0.02 + d / 10, nan)))
  summary = dataclasses.replace(summary, dynamics={"x0.25": compare.Budget(0.25, 100, dyn_rows(-0.2)),
                                                   "x1": compare.Budget(1.0, 400, dyn_rows(0.0)),
                                                   "x4": compare.Budget(4.0, 1600, dyn_rows(0.3))})
  drawn, errorbar = [], matplotlib.axes.Axes.errorbar

  def spy(ax, x, y, *args, **kwargs):
    drawn.append((kwargs.get("label"), np.asarray(x, np.float64), np.asarray(y, np.float64)))
    return errorbar(ax, x, y, *args, **kwargs)

  monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", spy)
  both = matplotlib.image.imread(plots.plot_sim_tau(str(tmp_path / "both.png"), summary))
  # The dynamics panel: the non-baseline set's paired Δ in budget order (not its absolute τ), one point a budget.
  (_, x, y), = [d for d in drawn if d[0] == "exhaustive"]
  np.testing.assert_allclose(y, [0.0, 0.02, 0.05])
  np.testing.assert_allclose(x / [100, 400, 1600], x[0] / 100)  # at the budgets' steps (shifted alike)
  red = lambda im: np.sum((im[..., 0] > 0.75) & (im[..., 1] < 0.3) & (im[..., 2] < 0.3))  # noqa: E731
  assert red(alone) > 30 and both.shape[1] > alone.shape[1] and red(both) > red(alone)
  assert plt.get_fignums() == open_before


def test_a_failed_save_leaves_nothing_and_closes_the_figure(tmp_path, monkeypatch):
  fig, ax = plt.subplots()
  ax.plot([0, 1])

  def broken(path, **kw):
    with open(path, "wb") as f:
      f.write(b"half")
    raise OSError("disk full")

  monkeypatch.setattr(fig, "savefig", broken)
  with pytest.raises(OSError, match="disk full"):
    plots.save_figure(fig, str(tmp_path / "x.png"))
  assert os.listdir(tmp_path) == [] and fig.number not in plt.get_fignums()
