"""layerwave.analysis.select_layers and experiments/select_layers.py: where a selection is read from, the
target's L, k, the bad inputs, and the launcher's default run offline on the embedded SmolLM2-135M."""

import dataclasses
import json
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from layerwave import atomic
from layerwave import layer_ids
from layerwave import selection as selection_lib
from layerwave.analysis import report
from layerwave.analysis import select_layers
from layerwave.analysis import stats

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
L, D = 12, 16


def _config(**fields):
  c = ml_collections.ConfigDict({"model": "smollm2-135m-instruct", "layers": (),
                                 "selection": {"path": "", "strategy": ""}})
  c.update(fields)
  return c


def _analysis_workdir(path) -> dict:
  """An analysis workdir (layer_stats.json + selection.json) from synthetic statistics of a 12-layer target."""
  rng = np.random.default_rng(0)
  depth = np.arange(L + 1)
  e = 3.0 - 0.02 * (depth - 7) ** 2 + 0.001 * rng.normal(size=L + 1)
  labels = np.array([0, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 4, 4])
  c = np.where(labels[:, None] == labels[None, :], 0.9, 0.3) + 0.01 * rng.random((L + 1, L + 1))
  c = 0.5 * (c + c.T)
  np.fill_diagonal(c, 1.0)
  s = stats.LayerStats(prompt_entropy=e, prompt_entropy_normalized=e / np.log(D), dataset_entropy=e,
                       dataset_entropy_normalized=e / np.log(D), cka_minibatch=c, cka_exact=None, num_tokens=1000,
                       num_prompts=10, num_sequences=10, num_hsic_batches=4, num_exact_tokens=0)
  options = report.SelectionOptions()
  seg = report.find_compartments(c, layer_ids.default_candidates(L))
  sels = report.run_selections(s, options, num_layers=L, hidden_size=D, segmentation=seg)
  os.makedirs(path, exist_ok=True)
  atomic.write_json(os.path.join(path, "selection.json"), report.selection_file_record(sels))
  atomic.write_json(os.path.join(path, "layer_stats.json"), {
      "model": {"num_layers": L, "hidden_size": D}, "settings": {"selection": dataclasses.asdict(options)},
      "filtered": s.as_dict(), "unfiltered": None, "compartments": {"blocks": [list(b) for b in seg.blocks]}})
  return sels


def _model_dir(path, num_layers):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({"model_type": "llama", "num_hidden_layers": num_layers}, f)
  return str(path)


def test_records_from_an_analysis_workdir_by_strategy(tmp_path):
  sels = _analysis_workdir(tmp_path / "a")
  got = select_layers.resolve_selection(_config(), selection=str(tmp_path / "a"), strategy="greedy")
  assert got.ids == sels["greedy"].ids and got.num_layers == L
  with pytest.raises(ValueError, match=r"holds 6 selections \(eagle3, .*--strategy=NAME"):
    select_layers.resolve_selection(_config(), selection=str(tmp_path / "a"))
  with pytest.raises(ValueError, match="has no strategy 'learned'; it has "):
    select_layers.resolve_selection(_config(), selection=str(tmp_path / "a"), strategy="learned")
  # The config's selection.path / strategy, as the training stage reads them.
  cfg = _config(selection={"path": str(tmp_path / "a" / "selection.json"), "strategy": "exhaustive"})
  assert select_layers.resolve_selection(cfg).ids == sels["exhaustive"].ids
  # A model named explicitly is checked against the record.
  with pytest.raises(ValueError, match="another model"):
    select_layers.resolve_selection(_config(), selection=str(tmp_path / "a"), strategy="greedy",
                                    model=_model_dir(tmp_path / "m30", 30))


def test_k_selects_again_from_layer_stats_and_refuses_more_than_the_candidates(tmp_path):
  _analysis_workdir(tmp_path / "a")
  got = select_layers.resolve_selection(_config(), selection=str(tmp_path / "a"), strategy="exhaustive", k=4)
  record = report.read_layer_stats(tmp_path / "a")
  e, c = record.arrays()
  want = selection_lib.select_layers("exhaustive", e, c, k=4, num_layers=L, hidden_size=D)
  assert got.k == 4 and got.ids == want.ids
  with pytest.raises(ValueError, match=r"k=20 is larger than the 11 candidate layers 1..11 .*choose k <= 11"):
    select_layers.resolve_selection(_config(), selection=str(tmp_path / "a"), strategy="greedy", k=20)
  one = tmp_path / "one.json"
  layer_ids.LayerSelection(ids=(2, 5, 9), num_layers=L, strategy="learned").save(one)
  with pytest.raises(ValueError, match=r"--k=4 differs from the record's k=3 .*Leave --k out"):
    select_layers.resolve_selection(_config(), selection=str(one), k=4)


def test_ids_given_by_hand_and_the_default_rule_take_l_from_the_model(tmp_path):
  model = _model_dir(tmp_path / "m", 32)
  got = select_layers.resolve_selection(_config(), layers=["3", "9", "20"], model=model)
  assert got.ids == (3, 9, 20) and got.num_layers == 32 and got.strategy == "manual"
  assert select_layers.resolve_selection(_config(layers=(4, 8, 12)), model=model).ids == (4, 8, 12)
  assert select_layers.resolve_selection(_config(), model=model).ids == (2, 16, 29)  # EAGLE-3's rule, L = 32
  assert select_layers.resolve_selection(_config(), model=os.path.join(model, "config.json"), k=1).ids == (16,)
  with pytest.raises(ValueError, match=r"layer ids \[40\] out of range for L=32.*1..31.*--model"):
    select_layers.resolve_selection(_config(), layers="2,15,40", model=model)
  with pytest.raises(ValueError, match=r"k=40 is larger than the 31 candidate layers 1..31 .*choose k <= 31"):
    select_layers.resolve_selection(_config(), model=model, k=40)
  with pytest.raises(ValueError, match="Give the layers one way"):
    select_layers.resolve_selection(_config(), layers="2,15,27", selection=str(tmp_path))
  with pytest.raises(FileNotFoundError, match="holds no selection.json"):
    select_layers.resolve_selection(_config(), selection=str(tmp_path / "m"), model=model)


def test_a_training_workdir_gives_the_record_its_checkpoint_carries(tmp_path):
  from layerwave import checkpoint  # pylint: disable=g-import-not-at-top  # orbax: only this test needs it
  sel = layer_ids.LayerSelection(ids=(2, 5, 9), num_layers=L, strategy="learned_gates")
  ckpt = checkpoint.Checkpointer(str(tmp_path / "w" / "checkpoints"))
  ckpt.save(3, {"w": np.zeros(2, np.float32)}, {"d2t": np.zeros(1, np.int32)}, {"selection": sel.to_dict()})
  ckpt.close()
  assert select_layers.resolve_selection(_config(), selection=str(tmp_path / "w")) == sel


def test_an_eagle3_export_reads_its_layerwave_record_only(tmp_path):
  sel = layer_ids.LayerSelection(ids=(2, 5, 9), num_layers=L, strategy="learned")
  (tmp_path / "ours").mkdir()
  with open(tmp_path / "ours" / "config.json", "w") as f:
    json.dump({"architectures": ["LlamaForCausalLMEagle3"], "eagle_aux_hidden_state_layer_ids": [2, 5, 9],
               "layerwave": {"selection": sel.to_dict()}}, f)
  assert select_layers.resolve_selection(_config(), selection=str(tmp_path / "ours")) == sel
  (tmp_path / "theirs").mkdir()
  with open(tmp_path / "theirs" / "config.json", "w") as f:
    json.dump({"architectures": ["LlamaForCausalLMEagle3"],
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 8]}}, f)
  with pytest.raises(ValueError, match=r"layerwave did not export.*\[1, 4, 8\].*--layers="):
    select_layers.resolve_selection(_config(), selection=str(tmp_path / "theirs"))


def test_run_writes_the_report_and_refuses_what_a_named_engine_cannot_read(tmp_path):
  model = _model_dir(tmp_path / "m", 30)
  lines = []
  rep = select_layers.run(_config(), layers="3,9,20", model=model, engines=["vllm", "specforge"],
                          json_path=str(tmp_path / "out.json"), log=lines.append)
  with open(tmp_path / "out.json") as f:
    assert json.load(f) == json.loads(json.dumps(rep))
  assert rep["engines"]["specforge"]["ids"] == [2, 8, 19] and list(rep["engines"]) == ["vllm", "specforge"]
  assert "specforge — SpecForge: [2, 8, 19]" in lines[0]
  with pytest.raises(ValueError, match="tpu_inference: .*--allow_ignored_selection"):
    select_layers.run(_config(), layers="3,9,20", model=model, engines=["tpu_inference"], log=lines.append)


def test_the_launcher_prints_every_engine_for_the_embedded_default(tmp_path):
  """No flags: EAGLE-3's layers of the config's target (the embedded SmolLM2-135M, L = 30), offline."""
  env = {**os.environ, "PYTHONPATH": ROOT}
  out = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "select_layers.py"),
                        "--json=" + str(tmp_path / "ids.json")], check=True, cwd=tmp_path, capture_output=True,
                       text=True, timeout=600, env=env).stdout
  assert "hf_hidden_states ids [2, 15, 27] of a target with L = 30" in out
  assert "sglang_before_pr25454 — SGLang before PR #25454 (+1 on every explicit id): [1, 14, 26]" in out
  assert "CANNOT" not in out
  with open(tmp_path / "ids.json") as f:
    assert json.load(f)["engines"]["tensorrt_llm"]["ids"] == [1, 14, 26]
  bad = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "select_layers.py"), "--engines=trt"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
  assert bad.returncode != 0 and "unknown engine 'trt'" in bad.stderr
