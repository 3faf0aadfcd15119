"""Draft training end to end on the real data pipeline: resume exactness, refusals, load_draft."""

import dataclasses
import json
import os
from unittest import mock

import jax
import numpy as np
import pytest
from flax import nnx

import layerwave
from layerwave import checkpoint as ckpt_lib
from layerwave import layer_ids
from layerwave.analysis import report
from layerwave.training import curves
from layerwave.training import loop
from layerwave.training.options import Recipe


def _params(workdir, target):
  draft = layerwave.load_draft(workdir, target)
  return jax.tree.leaves(nnx.state(draft, nnx.Param))


def test_killed_and_resumed_run_equals_uninterrupted(tiny_config, tmp_path):
  full = loop.run(tiny_config, str(tmp_path / "full"))
  assert full["step"] == 4 and len(full["heldout_acc"]) == 2
  interrupted = tiny_config.copy_and_resolve_references()
  interrupted.train.stop_after = 3  # dies after step 3 (checkpoint at 2 and 3)
  assert loop.run(interrupted, str(tmp_path / "resumed"))["step"] == 3
  interrupted.train.stop_after = 0
  assert loop.run(interrupted, str(tmp_path / "resumed"))["step"] == 4
  target = layerwave.load_target(tiny_config.model)
  for a, b in zip(_params(str(tmp_path / "full"), target), _params(str(tmp_path / "resumed"),
                                                                     target)):
    np.testing.assert_array_equal(a, b)
  lines = [json.loads(l) for l in open(tmp_path / "full" / "metrics.jsonl")]
  assert any("eval/sim_tau" in l for l in lines) and any("train/loss" in l for l in lines)
  assert all(l["train/grad_norm"] > 0 for l in lines if "train/grad_norm" in l)  # the steps change the draft
  # The curves' axes: cumulative real tokens and training seconds, carried across the resumption.
  full_curve = curves.read_curve(str(tmp_path / "full"))
  resumed_curve = curves.read_curve(str(tmp_path / "resumed"))
  assert [p.step for p in full_curve] == [2, 4] == [p.step for p in resumed_curve]
  assert [p.tokens for p in full_curve] == [p.tokens for p in resumed_curve]
  assert 0 < full_curve[0].tokens < full_curve[1].tokens <= 4 * 2 * 64
  assert 0 < resumed_curve[0].seconds < resumed_curve[1].seconds


def test_eval_depth_is_set_apart_from_the_training_depth(tiny_config, tmp_path):
  tiny_config.train.eval_ttt_steps = 4  # trained K = 2, evaluated 4 deep
  result = loop.run(tiny_config, str(tmp_path))
  assert len(result["heldout_acc"]) == 4
  tiny_config.train.num_steps = 6  # eval_ttt_steps is an evaluation setting: the run resumes with another
  tiny_config.train.schedule_steps = 4  # (and trains on past its 4-step schedule's end)
  tiny_config.train.eval_ttt_steps = 0
  assert len(loop.run(tiny_config, str(tmp_path))["heldout_acc"]) == 2


def test_resuming_with_another_schedule_length_is_refused(tiny_config, tmp_path):
  tiny_config.train.num_steps = 2
  loop.run(tiny_config, str(tmp_path))
  tiny_config.train.num_steps = 4  # a longer cosine schedule would change the learning rate mid-run
  with pytest.raises(ValueError, match=r"started with a 2-step learning-rate schedule.*schedule_steps=2"):
    loop.run(tiny_config, str(tmp_path))
  tiny_config.train.schedule_steps = 3  # any other length too
  with pytest.raises(ValueError, match="2-step learning-rate schedule; this run's is 3 steps"):
    loop.run(tiny_config, str(tmp_path))
  tiny_config.train.schedule_steps = 2  # kept: steps 3 and 4 run at the schedule's end value
  assert loop.run(tiny_config, str(tmp_path))["step"] == 4


def test_resume_into_a_different_config_is_refused(tiny_config, tmp_path):
  tiny_config.train.num_steps = 2
  loop.run(tiny_config, str(tmp_path))
  tiny_config.train.lr = 5e-3
  with pytest.raises(ValueError, match=r"different config.*differing fields: train\.lr\)"):
    loop.run(tiny_config, str(tmp_path))


def test_train_over_typed_objects_resumes_what_run_started(tiny_config, tmp_path):
  """`loop.train(target, layers, recipe, W)` (what compare calls with the target it holds) and the launcher's
  `loop.run(config, W)` compute the same run: a run started by one resumes under the other, exactly."""
  full = loop.run(tiny_config, str(tmp_path / "full"))
  target = layerwave.load_target(tiny_config.model)
  layers = layer_ids.LayerSelection(ids=(1, 2, 3), num_layers=8, hidden_size=32, strategy="manual")
  recipe = Recipe.from_config(tiny_config)
  half = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, stop_after=2))
  assert loop.train(target, layers, half, str(tmp_path / "typed"))["step"] == 2
  assert loop.run(tiny_config, str(tmp_path / "typed")) == {**full, "tokens_per_s": mock.ANY}
  for a, b in zip(_params(str(tmp_path / "full"), target), _params(str(tmp_path / "typed"), target)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match=r"differing fields: seed\)"):
    loop.train(target, layers, dataclasses.replace(recipe, seed=1), str(tmp_path / "typed"))
  with pytest.raises(ValueError, match=r"differing fields: layers"):
    loop.train(target, dataclasses.replace(layers, ids=(1, 2, 4)), recipe, str(tmp_path / "typed"))
  with pytest.raises(ValueError, match="out of range"):
    loop.train(target, dataclasses.replace(layers, ids=(1, 2, 9)), recipe, str(tmp_path / "bad"))


def test_interrupted_save_leaves_previous_checkpoint_usable(tiny_config, tmp_path):
  tiny_config.train.num_steps = 2
  loop.run(tiny_config, str(tmp_path))
  # What a save killed midway leaves: orbax's uncommitted temporary directory.
  os.makedirs(tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp-1700000000")
  assert ckpt_lib.Checkpointer(str(tmp_path / "checkpoints")).latest_step() == 2
  target = layerwave.load_target(tiny_config.model)
  assert layerwave.load_draft(str(tmp_path), target).config.layer_ids == (1, 2, 3)


def test_load_draft_refuses_another_target(tiny_config, tmp_path):
  tiny_config.train.num_steps = 1
  tiny_config.train.checkpoint_every = 1
  loop.run(tiny_config, str(tmp_path))
  other = layerwave.load_target("smollm2-135m-instruct")
  with pytest.raises(ValueError, match=r"\(L, D, V\) = \(8, 32, 49152\)"):
    layerwave.load_draft(str(tmp_path), other)
  with pytest.raises(FileNotFoundError, match="No draft"):
    layerwave.load_draft(str(tmp_path / "nothing"), other)


@pytest.mark.parametrize("edit,error,match", [
    (lambda c: setattr(c, "layers", (1, 9)), ValueError, "out of range"),
    (lambda c: setattr(c, "layers", (1, 1)), ValueError, "duplicate"),
    (lambda c: setattr(c, "layers", ("a,b",)), ValueError, r"--config\.layers must be comma-separated integers"),
    (lambda c: setattr(c.data, "max_length", 100000), ValueError, "max_position_embeddings"),
    (lambda c: (setattr(c, "layers", ()), setattr(c.selection, "path", "/nonexistent.json"),
                setattr(c.selection, "strategy", "greedy")), FileNotFoundError, "analyze.py"),
    (lambda c: setattr(c, "layers", ()), ValueError, "Give the draft's layers"),
])
def test_bad_training_inputs(tiny_config, tmp_path, edit, error, match):
  edit(tiny_config)
  with pytest.raises(error, match=match):
    loop.run(tiny_config, str(tmp_path))


def test_selection_file_without_the_strategy(tiny_config, tmp_path):
  path = tmp_path / "selection.json"
  record = {"ids": [1, 3], "num_layers": 8, "hidden_size": 32, "strategy": "greedy"}
  path.write_text(json.dumps({"greedy": record}))
  tiny_config.layers = ()
  tiny_config.selection.path = str(path)
  tiny_config.selection.strategy = "entropy"
  with pytest.raises(ValueError, match=r"no strategy 'entropy'; it has \['greedy'\]"):
    loop.run(tiny_config, str(tmp_path / "w"))
  tiny_config.selection.strategy = "greedy"
  tiny_config.train.num_steps = 1
  assert loop.run(tiny_config, str(tmp_path / "w"))["layers"] == [1, 3]


def test_selection_file_for_another_model(tmp_path):
  path = tmp_path / "selection.json"
  path.write_text(json.dumps({"greedy": {"ids": [2, 15, 27], "num_layers": 30,
                                         "hidden_size": 576, "strategy": "greedy"}}))
  with pytest.raises(ValueError, match="30"):
    report.read_selection(str(path), "greedy", num_layers=4, hidden_size=32)


def test_a_run_continues_from_its_interim_release_on_a_machine_without_its_workdir(tiny_config, tmp_path,
                                                                                  monkeypatch):
  """`train.init_from`: a release made from step 2 of a 4-step run continues in an empty workdir at step 2 of
  the same schedule and data stream: the same batches (tokens counted equal to the uninterrupted run's), the
  release's bfloat16 weights, and fresh AdamW moments (its first update is exactly ±lr(2) per parameter)."""
  from layerwave.training import release  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("LAYERWAVE_RELEASES", str(tmp_path / "releases"))
  tiny_config.layers = (2, 3, 4)  # an EAGLE-3 export refuses a first id of 1 (engines disagree on it)
  full = loop.run(tiny_config, str(tmp_path / "full"))
  target = layerwave.load_target(tiny_config.model)
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "full" / "checkpoints"))
  meta2, meta4 = ckpt.read_meta(2), ckpt.read_meta(4)
  ckpt.close()
  draft2 = layerwave.load_draft(str(tmp_path / "full"), target, step=2)
  record = release.training_record(meta2)
  assert record["step"] == 2 and record["num_steps"] == 4 and record["schedule_steps"] == 4
  release.write(draft2, target, str(tmp_path / "releases" / "tiny-interim"), model=tiny_config.model,
                training=record, metrics={"heldout_sim_tau": 1.0})
  released = [np.asarray(x, np.float32) for x in jax.tree.leaves(nnx.state(
      layerwave.load_draft("tiny-interim", target), nnx.Param))]

  cont = tiny_config.copy_and_resolve_references()
  cont.train.init_from = "tiny-interim"  # not fingerprinted: the settings are the run's own
  cont.train.stop_after = 1
  assert loop.run(cont, str(tmp_path / "cont"))["step"] == 3
  assert sorted(int(n) for n in os.listdir(tmp_path / "cont" / "checkpoints") if n.isdigit()) == [2, 3]
  step3 = [np.asarray(x) for x in _params(str(tmp_path / "cont"), target)]
  moved = max(float(np.abs(a - b).max()) for a, b in zip(step3, released))
  schedule = tiny_config.train.lr * 0.5 * (1 + np.cos(np.pi * (2 - 1) / (4 - 1)))  # lr(2): warm-up 1, cosine to 4
  np.testing.assert_allclose(moved, schedule, rtol=1e-4)  # a fresh Adam step is ±lr; an old one's is smaller
  cont.train.stop_after = 0
  result = loop.run(cont, str(tmp_path / "cont"))  # its own checkpoint now wins; init_from is not consulted
  assert result["step"] == 4 and np.isfinite(result["heldout_sim_tau"])
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "cont" / "checkpoints"))
  cont4 = ckpt.read_meta(4)
  ckpt.close()
  assert cont4["continued_from"] == {"release": str(tmp_path / "releases" / "tiny-interim"), "step": 2}
  assert cont4["data_position"] == meta4["data_position"]
  assert cont4["tokens_trained"] == meta4["tokens_trained"]  # the same batches as the uninterrupted run
  assert cont4["config_fingerprint"] == meta4["config_fingerprint"]
  assert full["heldout_loss"] > 0 and abs(result["heldout_loss"] - full["heldout_loss"]) < 0.1 * full["heldout_loss"]

  assert cont4["compute_dtypes"] == [[0, "float32"]]
  # The release continues in bfloat16 compute (precision, not recipe), and the history says so.
  bf16 = cont.copy_and_resolve_references()
  bf16.train.compute_dtype = "bfloat16"
  assert loop.run(bf16, str(tmp_path / "cont-bf16"))["step"] == 4
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "cont-bf16" / "checkpoints"))
  assert ckpt.read_meta(4)["compute_dtypes"] == [[0, "float32"], [2, "bfloat16"]]
  ckpt.close()

  # Bad inputs: another recipe, another schedule, no such release, a release without its run.
  other = cont.copy_and_resolve_references()
  other.train.lr = 5e-3
  with pytest.raises(ValueError, match=r"another config.*differing fields: train\.lr"):
    loop.run(other, str(tmp_path / "other"))
  other = cont.copy_and_resolve_references()
  other.train.num_steps = 6
  with pytest.raises(ValueError, match=r"ran a 4-step learning-rate schedule.*schedule_steps=4"):
    loop.run(other, str(tmp_path / "other"))
  other = cont.copy_and_resolve_references()
  other.train.init_from = "tiny-missing"
  with pytest.raises(release.ReleaseError, match="No draft release named 'tiny-missing'.*tiny-interim"):
    loop.run(other, str(tmp_path / "other"))
  release.write(draft2, target, str(tmp_path / "releases" / "tiny-bare"), model=tiny_config.model)
  other.train.init_from = "tiny-bare"
  with pytest.raises(ValueError, match="records no training run"):
    loop.run(other, str(tmp_path / "other"))
  assert not os.path.exists(tmp_path / "other" / "checkpoints") or not os.listdir(tmp_path / "other" / "checkpoints")


def test_a_resumed_run_may_switch_its_compute_dtype_and_records_the_history(tiny_config, tmp_path):
  """train.compute_dtype is precision, not recipe: a run resumes in the other dtype (its checkpoints keep
  [first step, dtype] segments), while any recipe change still refuses the resume."""
  c = tiny_config.copy_and_resolve_references()
  c.train.stop_after = 2
  assert loop.run(c, str(tmp_path))["step"] == 2
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"))
  meta2 = ckpt.read_meta(2)
  ckpt.close()
  c.train.compute_dtype, c.train.stop_after = "bfloat16", 1
  assert loop.run(c, str(tmp_path))["step"] == 3
  c.train.compute_dtype, c.train.stop_after = "float32", 0
  result = loop.run(c, str(tmp_path))
  assert result["step"] == 4 and np.isfinite(result["heldout_sim_tau"])
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"))
  meta3, meta4 = ckpt.read_meta(3), ckpt.read_meta(4)
  ckpt.close()
  assert meta2["compute_dtypes"] == [[0, "float32"]]
  assert meta3["compute_dtypes"] == [[0, "float32"], [2, "bfloat16"]]
  assert meta3["settings"]["train"]["compute_dtype"] == "bfloat16"
  assert meta4["compute_dtypes"] == [[0, "float32"], [2, "bfloat16"], [3, "float32"]]
  assert meta4["config_fingerprint"] == meta2["config_fingerprint"]
  other = c.copy_and_resolve_references()
  other.train.compute_dtype, other.train.lr, other.train.num_steps = "bfloat16", 5e-3, 4
  with pytest.raises(ValueError, match=r"different config.*differing fields: train\.compute_dtype, train\.lr"):
    loop.run(other, str(tmp_path))


def test_online_training_forward_in_bfloat16_evaluates_in_float32(tiny_config, tmp_path):
  """train.target_dtype=bfloat16: every training step's target forward runs on the cast target, every held-out
  evaluation on the float32 target itself; the setting is part of the recipe (recorded only when set)."""
  from layerwave.training import step as step_lib  # pylint: disable=g-import-not-at-top
  seen = {"train": set(), "eval": set()}

  def spy(kind, fn):
    def wrapped(*args, **kwargs):
      seen[kind].update(str(x.dtype) for x in jax.tree.leaves(args[3]))  # the target's parameters
      return fn(*args, **kwargs)
    return wrapped

  c = tiny_config.copy_and_resolve_references()
  c.train.target_dtype = "bfloat16"
  with mock.patch.object(step_lib, "train_step", spy("train", step_lib.train_step)), \
       mock.patch.object(step_lib, "eval_step", spy("eval", step_lib.eval_step)):
    result = loop.run(c, str(tmp_path / "bf16"))
  assert seen == {"train": {"bfloat16"}, "eval": {"float32"}}
  assert result["step"] == 4 and np.isfinite(result["heldout_sim_tau"])
  plain = loop.run(tiny_config, str(tmp_path / "f32"))
  assert any(not np.array_equal(a, b) for a, b in zip(_params(str(tmp_path / "bf16"), _target(c)),
                                                       _params(str(tmp_path / "f32"), _target(c))))
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "bf16" / "checkpoints"))
  meta = ckpt.read_meta(4)
  ckpt.close()
  assert meta["settings"]["train"]["target_dtype"] == "bfloat16"
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "f32" / "checkpoints"))
  assert "target_dtype" not in ckpt.read_meta(4)["settings"]["train"]  # unset: runs recorded before it resume
  ckpt.close()
  assert plain["step"] == 4
  c.train.num_steps, c.train.target_dtype = 6, ""
  with pytest.raises(ValueError, match=r"different config.*differing fields: train\.target_dtype"):
    loop.run(c, str(tmp_path / "bf16"))


def _target(config):
  return layerwave.load_target(config.model)
