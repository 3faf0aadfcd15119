"""Tests for layerwave.analysis.report: selections from statistics, stability, JSON files, summary table."""

import json
import os

import numpy as np
import pytest

from layerwave import atomic
from layerwave import layer_ids
from layerwave import selection
from layerwave.analysis import report
from layerwave.analysis import stats

from tests import configs

L, D = 12, 16


def _stats(seed=0, exact=True):
  """Synthetic statistics: entropy peaks at layer 7; CKA has blocks [1, 4), [4, 9), [9, 11)."""
  rng = np.random.default_rng(seed)
  layers = np.arange(L + 1)
  e = 3.0 - 0.02 * (layers - 7) ** 2 + 0.001 * rng.normal(size=L + 1)
  labels = np.array([0, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 4, 4])
  c = np.where(labels[:, None] == labels[None, :], 0.9, 0.3) + 0.01 * rng.random((L + 1, L + 1))
  c = 0.5 * (c + c.T)
  np.fill_diagonal(c, 1.0)
  return stats.LayerStats(prompt_entropy=e, prompt_entropy_normalized=e / np.log(D), dataset_entropy=e - 0.5,
                          dataset_entropy_normalized=(e - 0.5) / np.log(D), cka_minibatch=c,
                          cka_exact=c if exact else None, num_tokens=1000, num_prompts=10, num_sequences=10,
                          num_hsic_batches=4, num_exact_tokens=256 if exact else 0)


def test_run_selections_every_strategy_and_records_validate(tmp_path):
  options = report.SelectionOptions()
  seg = report.find_compartments(_stats().cka_minibatch, layer_ids.default_candidates(L))
  assert seg.blocks[0][0] == 1 and seg.blocks[-1][1] == L  # candidates 1..L-1
  sels = report.run_selections(_stats(), options, num_layers=L, hidden_size=D, data_hash_value="abc",
                               segmentation=seg)
  assert list(sels) == list(selection.STRATEGIES)
  assert sels["eagle3"].ids == (2, 6, 9)
  assert 7 in sels["entropy"].ids and 7 in sels["greedy"].ids
  path = tmp_path / "selection.json"
  atomic.write_json(path, report.selection_file_record(sels))
  loaded = report.load_selections(path, num_layers=L, hidden_size=D)
  assert {k: v.ids for k, v in loaded.items()} == {k: v.ids for k, v in sels.items()}
  assert all(v.data_hash == "abc" for v in loaded.values())
  with pytest.raises(ValueError, match="another model"):
    report.load_selections(path, num_layers=L + 1)
  assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []  # atomic write left nothing behind


def test_stability_of_identical_and_different_halves():
  options = report.SelectionOptions()
  full = report.run_selections(_stats(), options, num_layers=L, hidden_size=D)
  same = report.stability_report((_stats(), _stats()), full, options, num_layers=L, hidden_size=D)
  assert same["entropy_spearman"] == pytest.approx(1.0) and same["cka_max_abs_diff"] == 0.0
  assert same["all_selections_agree"]
  other = report.stability_report((_stats(0), _stats(1)), full, options, num_layers=L, hidden_size=D)
  assert 0.9 < other["entropy_spearman"] <= 1.0 and other["cka_max_abs_diff"] > 0
  json.dumps(other)
  assert not report.stability_report((_stats(), None), full, options, num_layers=L, hidden_size=D)["available"]


def test_options_errors():
  with pytest.raises(ValueError, match="unknown layer-selection strategies"):
    report.SelectionOptions(strategies=("eagle3", "best"))
  with pytest.raises(ValueError, match="granularity"):
    report.SelectionOptions(granularity="token")
  with pytest.raises(ValueError, match="exact_cka_tokens"):
    report.cka_matrix(_stats(exact=False), report.SelectionOptions(cka="exact"))
  assert report.informativeness(_stats(), report.SelectionOptions(granularity="dataset"))[0] == pytest.approx(
      _stats().dataset_entropy[0])
  assert report.data_hash({"a": 1}, [2]) == report.data_hash({"a": 1}, [2]) != report.data_hash({"a": 2}, [2])


def test_selection_options_from_the_analysis_section():
  section = configs.load("smoke").analysis
  options = report.selection_options_from_config(section)
  assert options.strategies == section.strategies and options.k == section.k and options.lam == section.lam
  section.strategies = ("eagle3,greedy",)  # what ml_collections makes of --config.analysis.strategies=eagle3,greedy
  assert report.selection_options_from_config(section).strategies == ("eagle3", "greedy")
  with pytest.raises(ValueError, match=r"analysis\.k must be an integer, got 2\.5"):
    report.selection_options_from_config({**section.to_dict(), "k": 2.5})
