"""The speculation launchers end to end on the tiny chat target: experiments/speculate.py and
benchmarks/bench_speculative.py (both thin over layerwave.speculative.evaluate)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "--config=" + os.path.join(ROOT, "configs", "smollm2_135m.py") + ":smoke"


def _run(script, *args):
  """Runs `script` (a path under the repository, e.g. experiments/speculate.py) with the `:smoke` config."""
  env = {**os.environ, "PYTHONPATH": ROOT}
  return subprocess.run([sys.executable, os.path.join(ROOT, script), CONFIG, *args],
                        check=True, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def test_speculate_and_bench_with_a_random_draft(tiny_chat_target_dir, tmp_path):
  common = ["--config.model=" + tiny_chat_target_dir, "--config.draft=random", "--config.layers=2,4,6",
            "--config.speculate.max_new_tokens=4", "--config.speculate.timing_repeats=1"]
  out = _run("experiments/speculate.py", *common, "--workdir=" + str(tmp_path / "spec"))
  with open(tmp_path / "spec" / "spec_metrics.json") as f:
    spec = json.load(f)["spec"]
  assert spec["prompts"] == 2 and spec["equal_to_ar"] == 1.0 and "| chain K=3 | 0 | 2 |" in out.stdout
  with open(tmp_path / "spec" / "spec_generations.jsonl") as f:
    assert len(f.readlines()) == 2
  out = _run("benchmarks/bench_speculative.py", *common, "--workdir=" + str(tmp_path / "bench"), "--datasets=gsm8k",
             "--num_prompts=2", "--methods=chain2,tree", "--temperatures=0")
  with open(tmp_path / "bench" / "bench_speculative.json") as f:
    results = json.load(f)["results"]
  assert [r["name"] for r in results] == ["chain2", "tree"]
  assert all(r["equal_to_ar"] == 1.0 for r in results) and "| gsm8k | 0 | tree |" in out.stdout
  for r in results:  # the speedup's two factors, and the table's last column
    assert r["speedup"] == pytest.approx(r["effective_tau"] / r["iteration_cost"], rel=1e-9)  # one pair, same tokens
    assert f"| {r['iteration_cost']:.2f} |" in out.stdout
  # Killed after its first row: the rerun keeps that row and decodes only the missing one.
  rows = tmp_path / "bench" / "rows"
  assert sorted(os.listdir(rows)) == ["gsm8k-n2-T0-chain2.json", "gsm8k-n2-T0-tree.json"]
  (rows / "gsm8k-n2-T0-tree.json").unlink()
  kept = (rows / "gsm8k-n2-T0-chain2.json").stat().st_mtime
  out = _run("benchmarks/bench_speculative.py", *common, "--workdir=" + str(tmp_path / "bench"), "--datasets=gsm8k",
             "--num_prompts=2", "--methods=chain2,tree", "--temperatures=0")
  assert "gsm8k T=0 chain2: kept from" in out.stdout and "gsm8k T=0 tree: tau=" in out.stdout
  assert (rows / "gsm8k-n2-T0-chain2.json").stat().st_mtime == kept
  with open(tmp_path / "bench" / "bench_speculative.json") as f:
    assert [r["name"] for r in json.load(f)["results"]] == ["chain2", "tree"]
  # Training fields added later count only when set: rows recorded before one existed resume; set, it makes
  # another config, refused with the field named.
  with open(tmp_path / "bench" / "bench_settings.json") as f:
    record = json.load(f)
  del record["settings"]["config"]["train"]["target_dtype"]
  record["fingerprint"] = "recorded-before-target_dtype"
  with open(tmp_path / "bench" / "bench_settings.json", "w") as f:
    json.dump(record, f)
  out = _run("benchmarks/bench_speculative.py", *common, "--workdir=" + str(tmp_path / "bench"), "--datasets=gsm8k",
             "--num_prompts=2", "--methods=chain2", "--temperatures=0")
  assert "gsm8k T=0 chain2: kept from" in out.stdout
  with pytest.raises(subprocess.CalledProcessError) as refused:
    _run("benchmarks/bench_speculative.py", *common, "--workdir=" + str(tmp_path / "bench"), "--datasets=gsm8k",
         "--num_prompts=2", "--methods=chain2,tree", "--temperatures=0", "--config.train.target_dtype=bfloat16")
  assert "differing fields: config.train.target_dtype" in refused.value.stderr
  # --nopaired: τ and acceptance only, no plain decoding and no speedup columns.
  out = _run("benchmarks/bench_speculative.py", *common, "--workdir=" + str(tmp_path / "tau"), "--datasets=gsm8k",
             "--num_prompts=2", "--methods=chain2", "--temperatures=0", "--nopaired")
  with open(tmp_path / "tau" / "bench_speculative.json") as f:
    (row,) = json.load(f)["results"]
  assert row["tau"] >= 1.0 and "speedup" not in row and "equal_to_ar" not in row
  assert "| gsm8k | 0 | chain2 |" in out.stdout and "| – | – | – | – |" in out.stdout
  assert "iteration_cost" not in row


def test_speculate_honours_plain_chat_format_on_a_gemma_base_model(tmp_path):
  """Gemma-3-270M's real tokenizer has no chat template: prompts are rendered as plain text, as its drafts
  are trained (`data.chat_format=plain`); the template format is refused with the fix named."""
  import pytest  # pylint: disable=g-import-not-at-top
  hf_reference = pytest.importorskip("tests.models.hf_reference")
  import transformers  # pylint: disable=g-import-not-at-top
  from layerwave.speculative import evaluate  # pylint: disable=g-import-not-at-top
  gemma = hf_reference.save_tiny_gemma_with_real_tokenizer(str(tmp_path / "gemma"))
  tokenizer = transformers.AutoTokenizer.from_pretrained(gemma)
  (rid, ids), = evaluate.chat_prompts(tokenizer, "mtbench", 1, chat_format="plain")
  assert tokenizer.decode(ids).startswith("<bos>User: ") and tokenizer.decode(ids).endswith("\n\nAssistant:")
  with pytest.raises(ValueError, match="no chat template.*chat_format=plain"):
    evaluate.chat_prompts(tokenizer, "mtbench", 1)
  common = ["--config.model=" + gemma, "--config.draft=random", "--config.layers=1,2,3",
            "--config.data.chat_format=plain", "--config.speculate.max_new_tokens=8",
            "--config.speculate.timing_repeats=1"]
  _run("experiments/speculate.py", *common, "--workdir=" + str(tmp_path / "spec"))
  with open(tmp_path / "spec" / "spec_metrics.json") as f:
    spec = json.load(f)["spec"]
  assert spec["prompts"] == 2 and spec["equal_to_ar"] == 1.0 and spec["tau"] >= 1.0
  failed = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "speculate.py"), CONFIG,
                           *common[:3], "--workdir=" + str(tmp_path / "refused")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
  assert failed.returncode != 0 and "chat_format=plain" in failed.stderr
