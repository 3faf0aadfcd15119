"""Smoke run of experiments/analyze.py on the real SmolLM2 (`:smoke` config): files written, JSON valid."""

import json
import os
import subprocess
import sys

import numpy as np

from layerwave import selection
from layerwave.analysis import report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_analyze_smoke_writes_stats_selections_and_plots(tmp_path):
  workdir = str(tmp_path / "w")
  subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "analyze.py"),
                  "--config=" + os.path.join(ROOT, "configs", "smollm2_135m.py") + ":smoke",
                  "--workdir=" + workdir, "--config.analysis.strategies=eagle3,greedy,exhaustive,compartment"],
                 check=True, cwd=ROOT, timeout=300)
  with open(os.path.join(workdir, "layer_stats.json")) as f:
    stats = json.load(f)
  assert stats["convention"] == selection.CONVENTION and stats["model"]["num_layers"] == 30
  for kind in ("filtered", "unfiltered"):
    assert len(stats[kind]["prompt_entropy"]) == 31 and len(stats[kind]["dataset_entropy_normalized"]) == 31
    assert np.asarray(stats[kind]["cka_minibatch"]).shape == (31, 31)
    assert np.all(np.isfinite(stats[kind]["prompt_entropy"]))
  assert np.asarray(stats["filtered"]["cka_exact"]).shape == (31, 31)
  counts = stats["counts"]
  assert 0 < counts["kept"] < counts["eligible"] <= counts["positions"] and counts["batches"] == 4
  assert stats["filter"]["threshold_nats"] > 0 and stats["compartments"]["blocks"][0][0] == 1
  assert stats["stability"]["available"]
  sels = report.load_selections(os.path.join(workdir, "selection.json"), num_layers=30, hidden_size=576)
  assert list(sels) == ["eagle3", "greedy", "exhaustive", "compartment"]
  assert sels["eagle3"].ids == (2, 15, 27)
  assert len({s.data_hash for s in sels.values()}) == 1 and sels["greedy"].data_hash == stats["data_hash"]
  for name in ("entropy_wave", "selections", "token_entropy", "cka_filtered", "cka_unfiltered"):
    with open(os.path.join(workdir, "plots", name + ".png"), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
