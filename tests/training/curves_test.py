"""layerwave.training.curves: learning curves read back from a run's metric log; cell overrides; the table."""

import dataclasses
import os

import pytest

from layerwave import metrics as metrics_lib
from layerwave import plots
from layerwave.training import curves
from tests import configs


def _log_run(workdir, evals, tokens_per_step=100.0, seconds_per_step=2.0):
  """Writes what training.loop.run logs: train rows with cumulative tokens / seconds, eval rows."""
  writer = metrics_lib.MetricWriter(workdir)
  for step, (tau, acc) in evals.items():
    writer.write_scalars(step, {"train/loss": 1.0, "train/tokens": step * tokens_per_step,
                                "train/seconds": step * seconds_per_step})
    writer.write_scalars(step, {"eval/loss": 2.0, "eval/sim_tau": tau,
                                **metrics_lib.flatten("eval/draft", {"acc_j": acc})})
  writer.close()


def test_read_curve_pairs_each_evaluation_with_tokens_and_seconds(tmp_path):
  w = str(tmp_path / "run")
  _log_run(w, {10: (1.2, [0.15, 0.05]), 20: (1.4, [0.3, 0.1])})
  _log_run(w, {20: (1.5, [0.35, 0.15])})  # a resumed run re-evaluates step 20: the last row wins
  points = curves.read_curve(w)
  assert [p.step for p in points] == [10, 20]
  assert points[0] == curves.Point(step=10, tokens=1000.0, seconds=20.0, sim_tau=1.2, acc=(0.15, 0.05), loss=2.0)
  assert points[1].sim_tau == 1.5 and points[1].acc == (0.35, 0.15)
  assert curves.read_curve(str(tmp_path / "missing")) == []


def test_apply_overrides_copies_and_refuses_unknown_keys():
  base = configs.load("smoke")
  cell = curves.apply_overrides(base, {"train.lr": 0.5, "draft_model.vocab_size": 64})
  assert cell.train.lr == 0.5 and cell.draft_model.vocab_size == 64 and base.train.lr != 0.5
  with pytest.raises(KeyError, match="no field 'lrr'"):
    curves.apply_overrides(base, {"train.lrr": 1})
  with pytest.raises(KeyError, match="no section 'trian'"):
    curves.apply_overrides(base, {"trian.lr": 1})


def test_sweep_trains_unfinished_cells_only_and_reports(tmp_path):
  base = configs.load("smoke")
  w = str(tmp_path)
  trained = []

  def train(config, workdir):  # stands in for loop.run: logs one evaluation at num_steps
    trained.append(os.path.basename(workdir))
    _log_run(workdir, {int(config.train.num_steps): (1.0 + config.train.lr, [config.train.lr])})

  cells = {"a": {"train.lr": 0.25}, "b": {"train.lr": 0.5}}
  _log_run(os.path.join(w, "a"), {int(base.train.num_steps): (1.25, [0.25])})  # "a" finished earlier
  result = curves.sweep(base, cells, w, train)
  assert trained == ["b"] and result["b"][-1].sim_tau == 1.5
  text = curves.table(result, cells)
  assert "| a | train.lr=0.25 | 1.250@" in text and "| b | train.lr=0.5 | 1.500@" in text
  png = plots.plot_learning_curves(str(tmp_path / "c.png"),
                                   {k: [dataclasses.asdict(p) for p in v] for k, v in result.items()})
  assert os.path.getsize(png) > 1000
