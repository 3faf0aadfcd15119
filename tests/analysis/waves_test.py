"""The wave on two texts: differences against numpy by hand, and the launcher on real record files."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats as scipy_stats

from layerwave import selection as selection_lib
from layerwave.analysis import report
from layerwave.analysis import waves
from tests.compare_test import _record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _selections(record):
  e, c = record.arrays("filtered")
  return {s: selection_lib.select_layers(s, e, c, k=3, lam=record.selection.lam, candidates=record.candidates,
                                         num_layers=record.num_layers, hidden_size=record.hidden_size)
          for s in ("eagle3", "exhaustive", "entropy")}


def test_one_text_against_itself_moves_nothing():
  a = _record(0)
  out = waves.compare_records(a, a, _selections(a), _selections(a))
  assert out["entropy"]["spearman"] == pytest.approx(1.0) and out["entropy"]["max_abs_delta_e_hat"] == 0.0
  assert out["cka"]["max_abs_delta"] == 0.0 and out["compartments"]["same"]
  assert all(s["same"] and s["a_under_b"] == s["b_under_b"] for s in out["selections"])


def test_two_texts_by_hand():
  a, b = _record(0), _record(1)
  sa, sb = _selections(a), _selections(b)
  out = waves.compare_records(a, b, sa, sb)
  cands = list(a.candidates)
  ea, ca = a.arrays("filtered")
  eb, cb = b.arrays("filtered")
  assert out["entropy"]["spearman"] == pytest.approx(scipy_stats.spearmanr(ea[cands], eb[cands]).statistic)
  ha = (ea[cands] - ea[cands].min()) / np.ptp(ea[cands])
  hb = (eb[cands] - eb[cands].min()) / np.ptp(eb[cands])
  assert out["entropy"]["max_abs_delta_e_hat"] == pytest.approx(np.abs(ha - hb).max())
  pairs = [(i, j) for i in cands for j in cands if i != j]
  assert out["cka"]["mean_abs_delta"] == pytest.approx(np.mean([abs(ca[i, j] - cb[i, j]) for i, j in pairs]))
  ex = next(s for s in out["selections"] if s["strategy"] == "exhaustive")
  assert ex["a"] == list(sa["exhaustive"].ids) and ex["b"] == list(sb["exhaustive"].ids)
  assert ex["a_under_b"] <= ex["b_under_b"] + 1e-12  # b's exhaustive choice is optimal on b's statistics
  eagle = next(s for s in out["selections"] if s["strategy"] == "eagle3")
  assert eagle["same"] and eagle["shared"] == eagle["a"]  # the fixed rule does not read the text
  text = waves.markdown(out, "distilled", "sharegpt")
  assert "| exhaustive |" in text and "Spearman" in text


def test_analyses_of_different_targets_are_refused():
  a = _record(0)
  other = report.AnalysisRecord.from_content({**a.content, "model": {**a.content["model"], "hidden_size": 32}})
  with pytest.raises(ValueError, match="different targets"):
    waves.compare_records(a, other, {}, {})


def test_launcher_writes_the_report_and_plot(tmp_path):
  dirs = []
  for seed in (0, 1):
    record = _record(seed)
    d = tmp_path / f"analysis{seed}"
    d.mkdir()
    (d / "layer_stats.json").write_text(json.dumps(record.content))
    (d / "selection.json").write_text(json.dumps(report.selection_file_record(_selections(record))))
    dirs.append(str(d))
  out = tmp_path / "waves"
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "compare_waves.py"), "--a=" + dirs[0], "--b=" + dirs[1],
         "--names=distilled,sharegpt", "--out=" + str(out)]
  run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  assert "The wave on two texts: distilled" in run.stdout
  assert sorted(os.listdir(out)) == ["waves.json", "waves.md", "waves.png"]
  assert json.loads((out / "waves.json").read_text())["candidates"] == list(_record(0).candidates)
  missing = subprocess.run(cmd[:2] + ["--a=" + str(tmp_path), "--b=" + dirs[1], "--out=" + str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
  assert missing.returncode != 0 and "has no layer_stats.json: run experiments/analyze.py" in missing.stderr
