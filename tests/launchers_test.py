"""The speculation launchers end to end on the tiny chat target: experiments/speculate.py and
experiments/bench_speculative.py (both thin over layerwave.speculative.evaluate)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "--config=" + os.path.join(ROOT, "configs", "smollm2_135m.py") + ":smoke"


def _run(script, *args):
  env = {**os.environ, "PYTHONPATH": ROOT}
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", script), CONFIG, *args],
                        check=True, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def test_speculate_and_bench_with_a_random_draft(tiny_chat_target_dir, tmp_path):
  common = ["--config.model=" + tiny_chat_target_dir, "--config.draft=random", "--config.layers=2,4,6",
            "--config.speculate.max_new_tokens=4", "--config.speculate.timing_repeats=1"]
  out = _run("speculate.py", *common, "--workdir=" + str(tmp_path / "spec"))
  with open(tmp_path / "spec" / "spec_metrics.json") as f:
    spec = json.load(f)["spec"]
  assert spec["prompts"] == 2 and spec["equal_to_ar"] == 1.0 and "| chain K=3 | 0 | 2 |" in out.stdout
  with open(tmp_path / "spec" / "spec_generations.jsonl") as f:
    assert len(f.readlines()) == 2
  out = _run("bench_speculative.py", *common, "--workdir=" + str(tmp_path / "bench"), "--datasets=gsm8k",
             "--num_prompts=2", "--methods=chain2,tree", "--temperatures=0")
  with open(tmp_path / "bench" / "bench_speculative.json") as f:
    results = json.load(f)["results"]
  assert [r["name"] for r in results] == ["chain2", "tree"]
  assert all(r["equal_to_ar"] == 1.0 for r in results) and "| gsm8k | 0 | tree |" in out.stdout
  # --nopaired: τ and acceptance only, no plain decoding and no speedup columns.
  out = _run("bench_speculative.py", *common, "--workdir=" + str(tmp_path / "tau"), "--datasets=gsm8k",
             "--num_prompts=2", "--methods=chain2", "--temperatures=0", "--nopaired")
  with open(tmp_path / "tau" / "bench_speculative.json") as f:
    (row,) = json.load(f)["results"]
  assert row["tau"] >= 1.0 and "speedup" not in row and "equal_to_ar" not in row
  assert "| gsm8k | 0 | chain2 |" in out.stdout and "| – | – | – |" in out.stdout
