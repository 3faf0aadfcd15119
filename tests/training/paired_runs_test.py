"""experiments/paired_runs.py: one cell trained two ways, paired by seed (make dtype-check's verdict)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats as scipy_stats

from layerwave.training import loop

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _summarize(root, *args):
  cmd = [sys.executable, os.path.join(REPO, "experiments", "paired_runs.py"), f"--root={root}", "--a=float32",
         "--b=bfloat16", "--seeds=0,1", *args]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_paired_runs_reports_each_seeds_delta_and_refuses_pairs_that_are_not_one_cell(tiny_config, tmp_path):
  root = tmp_path / "dtype"
  results = {}
  for seed in (0, 1):
    for dtype in ("float32", "bfloat16"):
      c = tiny_config.copy_and_resolve_references()
      c.seed = seed
      c.train.compute_dtype = dtype
      results[dtype, seed] = loop.run(c, str(root / f"{dtype}-seed{seed}"))
  done = _summarize(root)
  assert done.returncode == 0, done.stderr[-2000:]
  with open(root / "summary" / "paired.json") as f:
    summary = json.load(f)
  delta = [results["bfloat16", s]["heldout_sim_tau"] - results["float32", s]["heldout_sim_tau"] for s in (0, 1)]
  np.testing.assert_allclose(summary["delta_sim_tau"]["values"], delta, rtol=1e-5, atol=1e-7)
  half = scipy_stats.t.ppf(0.975, 1) * np.std(delta, ddof=1) / np.sqrt(2)
  assert summary["delta_sim_tau"]["ci95"] == pytest.approx(half, rel=1e-5, abs=1e-9)
  assert summary["step"] == 4 and len(summary["runs"]["float32"]) == 2
  assert all(r["tokens_per_s"] > 0 for r in summary["runs"]["bfloat16"])
  assert done.stdout.strip().splitlines()[-1].startswith("held-out sim tau: float32 ")

  # A "pair" that also differs in the learning rate is not one cell trained two ways.
  other = tiny_config.copy_and_resolve_references()
  other.seed, other.train.compute_dtype, other.train.lr = 1, "bfloat16", 5e-3
  loop.run(other, str(tmp_path / "lr" / "bfloat16-seed1"))
  for seed in (0, 1):
    os.symlink(root / f"float32-seed{seed}", tmp_path / "lr" / f"float32-seed{seed}")
  os.symlink(root / "bfloat16-seed0", tmp_path / "lr" / "bfloat16-seed0")
  refused = _summarize(tmp_path / "lr")
  assert refused.returncode != 0 and "train.lr" in refused.stderr and "not only in train.compute_dtype" in (
      refused.stderr)
  # A missing run is named with the command that makes it.
  missing = _summarize(root, "--seeds=0,1,2")
  assert missing.returncode != 0 and "float32-seed2" in missing.stderr and "no training run" in missing.stderr
