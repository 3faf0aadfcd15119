"""The analysis stage, `layerwave.analysis.analyze.run`, on the tiny chat target: files written, JSON valid."""

import json
import os

import numpy as np
import pytest

from layerwave import layer_ids
from layerwave.analysis import analyze
from layerwave.analysis import report

from tests import configs

L, D = 8, 32  # the tiny chat target (tests/conftest.py)


def test_run_writes_stats_selections_and_plots(tiny_chat_target_dir, tmp_path):
  config = configs.load("smoke")
  config.model = tiny_chat_target_dir
  config.analysis.strategies = ("eagle3", "greedy", "exhaustive", "compartment")
  workdir = str(tmp_path / "w")
  out = analyze.run(config, workdir)
  with open(os.path.join(workdir, "layer_stats.json")) as f:
    stats = json.load(f)
  assert stats["convention"] == layer_ids.CONVENTION and stats["model"]["num_layers"] == L
  for kind in ("filtered", "unfiltered"):
    assert len(stats[kind]["prompt_entropy"]) == L + 1 and len(stats[kind]["dataset_entropy_normalized"]) == L + 1
    assert np.asarray(stats[kind]["cka_minibatch"]).shape == (L + 1, L + 1)
    assert np.all(np.isfinite(stats[kind]["prompt_entropy"]))
  assert np.asarray(stats["filtered"]["cka_exact"]).shape == (L + 1, L + 1)
  counts = stats["counts"]
  assert 0 < counts["kept"] < counts["eligible"] <= counts["positions"] and counts["batches"] == 4
  assert stats["filter"]["threshold_nats"] > 0 and stats["compartments"]["blocks"][0][0] == 1
  assert stats["stability"]["available"]
  sels = report.load_selections(os.path.join(workdir, "selection.json"), num_layers=L, hidden_size=D)
  assert list(sels) == ["eagle3", "greedy", "exhaustive", "compartment"]
  assert sels["eagle3"].ids == (2, 4, 5)
  assert len({s.data_hash for s in sels.values()}) == 1 and sels["greedy"].data_hash == stats["data_hash"]
  assert {k: v.ids for k, v in out["selections"].items()} == {k: v.ids for k, v in sels.items()}
  for name in ("entropy_wave", "selections", "token_entropy", "cka_filtered", "cka_unfiltered"):
    with open(os.path.join(workdir, "plots", name + ".png"), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert sorted(os.listdir(workdir)) == ["layer_stats.json", "plots", "selection.json"]


def test_run_in_length_buckets(tiny_chat_target_dir, tmp_path):
  # ShareGPT first turns at 512 tokens: a few end by 256, so `analysis.bucket_widths` reads them in [2, 256]
  # batches beside the [1, 512] ones: the whole split, two shapes, the same sequences with less padding.
  config = configs.load("smoke")
  config.model = tiny_chat_target_dir
  config.data.max_length = 512
  config.data.max_records = 30
  config.analysis.batch_size = 1
  config.analysis.num_batches = 0
  config.analysis.bucket_widths = (256, 1024)  # wider than max_length: dropped
  config.analysis.strategies = ("eagle3", "greedy")
  out = analyze.run(config, str(tmp_path / "w"))
  counts = out["layer_stats"]["counts"]
  assert [shape[:2] for shape in counts["shapes"]] == [[2, 256], [1, 512]]
  assert counts["batches"] == sum(n for _, _, n in counts["shapes"])
  assert counts["padded_positions"] == 512 * counts["batches"] > counts["positions"]
  assert "2×256 (" in out["summary"] and "of the slots real" in out["summary"]
  config.analysis.bucket_widths = (0, 256)
  with pytest.raises(ValueError, match=r"analysis.bucket_widths=\(0, 256\) must be positive"):
    analyze.run(config, str(tmp_path / "bad"))
