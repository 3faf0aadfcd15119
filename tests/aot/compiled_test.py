"""`experiments/aot_check.py` end to end: every stage of a small Llama-shaped target compiled for a TPU v5e-4
(libtpu, no TPU), rows that fit, rows that do not, and the bad inputs a user would give."""

import json
import os
import subprocess
import sys

import pytest

from layerwave import aot
from layerwave.aot import stages

pytest.importorskip("libtpu")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _aot_check(tmp_path, *flags):
  out = tmp_path / "rows.json"
  cmd = [sys.executable, os.path.join(REPO, "experiments", "aot_check.py"), f"--json={out}", *flags]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200, check=False)
  return proc, (json.loads(out.read_text()) if out.exists() else None)


def test_every_stage_compiles_for_a_v5e_slice_and_fits(tmp_path):
  proc, result = _aot_check(tmp_path, "--config=configs/llama3_8b.py:smoke", "--stages=all")
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = {r["stage"]: r for r in result["rows"]}
  want = {"forward", "analysis", "extract", "train_offline", "train_online", "distill_prefill", "distill_decode",
          "generate_b1", "generate_b4", "speculate_chain_b1", "speculate_chain_b4", "speculate_tree_b1",
          "speculate_tree_b4"}
  assert set(rows) == want
  assert result["compiled_not_run"] and result["mesh"] == {"data": 2, "model": 2}
  for name, row in rows.items():
    assert row["fits"], (name, row["verdict"])
    assert 0 < row["peak_bytes"] < row["hbm_bytes"], name
    assert row["flops"] > 0 and row["bytes_accessed"] > 0 and row["roofline_seconds"] > 0, name
    assert row["compile_cpu_seconds"] > 0 and row["host_peak_bytes"] > 2 ** 27 and row["load_average"] >= 0, name
  # The target's weights are split over 'model': each chip holds about half of the tiny model's 10.4 MB of bf16
  # weights (5.2M parameters) beside the batch; replicated, they would be all of it.
  assert rows["forward"]["argument_bytes"] < 7.0e6
  assert "| train_offline |" in proc.stdout


def test_a_stage_too_large_for_the_chip_is_a_row_not_a_traceback(tmp_path):
  proc, result = _aot_check(tmp_path, "--config=configs/llama3_8b.py:smoke", "--stages=train_offline",
                            "--config.train.batch_size=256", "--config.data.max_length=4096")
  assert proc.returncode == 0, proc.stderr[-3000:]
  (row,) = result["rows"]
  assert row["fits"] is False and "does not fit" in row["verdict"]
  assert "train.batch_size" in row["note"]


def test_bad_inputs_name_the_fix(tmp_path):
  proc, _ = _aot_check(tmp_path, "--config=configs/llama3_8b.py:smoke", "--topology=v9z:2x2")
  assert proc.returncode != 0 and "Unknown TPU topology" in proc.stderr
  proc, _ = _aot_check(tmp_path, "--config=configs/llama3_8b.py:smoke", "--stages=forward",
                       "--config.mesh=(('data',1),('model',4))")
  assert proc.returncode != 0 and "does not divide the model's KV heads 2" in proc.stderr
  proc, _ = _aot_check(tmp_path, "--config=configs/llama3_8b.py:smoke", "--stages=forward",
                       "--config.train.batch_size=3")
  assert proc.returncode != 0 and "train.batch_size=3 is not divisible" in proc.stderr
  proc, _ = _aot_check(tmp_path, "--config=configs/llama3_8b.py:smoke", "--stages=nonsense")
  assert proc.returncode != 0 and "Unknown stages ['nonsense']" in proc.stderr


def test_shapes_come_from_a_config_json_and_unsupported_ones_are_refused(tmp_path):
  model = aot.model_shapes(os.path.join(REPO, "configs", "shapes", "llama-3.1-8b"))
  assert (model.num_layers, model.hidden_size, model.num_kv_heads, model.vocab_size) == (32, 4096, 8, 128256)
  assert aot.model_shapes(os.path.join(REPO, "configs", "shapes", "qwen3-32b", "config.json")).qk_norm
  bad = tmp_path / "config.json"
  bad.write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 8}))
  with pytest.raises(ValueError, match="Unsupported model_type 'mixtral'"):
    aot.model_shapes(str(tmp_path))
  with pytest.raises(FileNotFoundError, match="No config.json"):
    aot.model_shapes(str(tmp_path / "nowhere"))
  assert set(stages.STAGES) >= {"analysis", "train_offline", "speculate_tree"}
