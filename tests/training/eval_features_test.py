"""train.eval_features: drafts trained on one store, evaluated on another store's held-out split."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import layerwave
from layerwave import sharding
from layerwave.data.options import DataOptions
from layerwave.training import features
from layerwave.training import loop
from layerwave.training import sources
from layerwave.training import losses
from layerwave.training import step as step_lib
from tests.training.features_test import LAYERS, tiny_config

OTHER = DataOptions(source="sharegpt", max_length=64, max_records=40, heldout_fraction=0.5, split_seed=7)


@pytest.fixture(scope="module")
def stores(tiny_chat_target_dir, tmp_path_factory):
  target = layerwave.load_target(tiny_chat_target_dir)
  base = tiny_config(tiny_chat_target_dir)
  own = DataOptions(**{k: base.data[k] for k in ("source", "max_length", "max_records", "heldout_fraction",
                                                 "split_seed")})
  out = []
  for name, data in (("train", own), ("other", OTHER)):
    path = str(tmp_path_factory.mktemp("stores") / name)
    features.extract(target, data.build(target.tokenizer), path, depths=LAYERS, dtype="float32", batch_size=4,
                     shard_sequences=8, data=dataclasses.asdict(data))
    out.append(path)
  return target, out[0], out[1]


def test_evaluation_reads_the_other_store_and_training_is_unchanged(stores, tiny_chat_target_dir, tmp_path):
  target, train_store, other = stores
  def config(**train):
    c = tiny_config(tiny_chat_target_dir, features=train_store, **train)
    c.draft_model.vocab_size = target.config.vocab_size  # every position counts: the loss is far from zero
    return c

  own = loop.run(config(), str(tmp_path / "own"))
  cross = loop.run(config(eval_features=other, eval_batches=50), str(tmp_path / "cross"))
  a = jax.tree.leaves(nnx.state(layerwave.load_draft(str(tmp_path / "own"), target), nnx.Param))
  b = jax.tree.leaves(nnx.state(layerwave.load_draft(str(tmp_path / "cross"), target), nnx.Param))
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)  # where it is evaluated does not change what is trained
  assert own["step"] == cross["step"] == 4
  # Recount the cross evaluation by hand: every held-out sequence of the other store, pooled.
  draft = layerwave.load_draft(str(tmp_path / "cross"), target)
  graphdef, params, vocab, embed = step_lib.split_draft(draft)
  store = features.open_store(other)
  heldout = store.split("heldout", 64)
  assert len(heldout) != len(features.open_store(train_store).split("heldout", 64))
  it = features.FeatureBatchIterator(heldout, store.layer_slots(LAYERS), batch_size=2, seq_len=64,
                                     pad_id=int(target.tokenizer.pad_token_id or 0), shuffle=False,
                                     drop_remainder=False, num_epochs=1)
  ids = np.arange(draft.config.draft_vocab_size) + np.asarray(draft.d2t[...])
  head_rows = np.take(np.asarray(sources.target_head(target)), ids, axis=1)
  hits = tokens = 0.0
  batch_losses = []
  for batch in it:
    m = step_lib.eval_step_offline(params, vocab, embed, head_rows, features.device_arrays(batch, target.mesh),
                                   program=step_lib.StepProgram(graphdef, step_lib.LossSettings(
                                       steps=2, decay=0.8, assistant_only=True)))
    hits, tokens = hits + np.asarray(m["hits_j"]), tokens + np.asarray(m["tokens_j"])
    batch_losses.append(float(m["loss"]))
  assert len(batch_losses) == -(-len(heldout) // 2) and np.sum(tokens) > 0
  assert cross["heldout_positions"] == int(tokens[0]) != own["heldout_positions"]
  assert cross["heldout_loss"] == pytest.approx(np.mean(batch_losses), rel=1e-5)
  np.testing.assert_allclose(cross["heldout_acc"], hits / np.maximum(tokens, 1), rtol=1e-6)
  assert cross["heldout_sim_tau"] == pytest.approx(float(losses.simulated_tau(hits / np.maximum(tokens, 1))))


def test_a_heldout_only_float32_store_evaluates_and_cannot_train(stores, tiny_chat_target_dir, tmp_path):
  """make paper-store's second store: the run's own held-out split in float32 (as at inference), no train split."""
  target, train_store, _ = stores
  base = tiny_config(tiny_chat_target_dir)
  own = DataOptions(**{k: base.data[k] for k in ("source", "max_length", "max_records", "heldout_fraction",
                                                 "split_seed")})
  heldout32 = str(tmp_path / "heldout32")
  features.extract(target, own.build(target.tokenizer), heldout32, depths=LAYERS, dtype="float32", batch_size=4,
                   shard_sequences=8, data=dataclasses.asdict(own), splits=("heldout",))
  assert features.open_store(heldout32).counts("train") == (0, 0)
  result = loop.run(tiny_config(tiny_chat_target_dir, features=train_store, eval_features=heldout32),
                    str(tmp_path / "run"))
  assert result["step"] == 4 and result["heldout_positions"] > 0
  with pytest.raises(features.StoreError, match=r"has no 'train' sequences .* a held-out-only store serves "
                                                r"train\.eval_features"):
    loop.run(tiny_config(tiny_chat_target_dir, features=heldout32), str(tmp_path / "bad"))


def test_eval_features_needs_a_training_store(tiny_chat_target_dir, tmp_path, stores):
  _, _, other = stores
  with pytest.raises(ValueError, match="train.eval_features evaluates offline; it needs train.features"):
    loop.run(tiny_config(tiny_chat_target_dir, eval_features=other), str(tmp_path))


def test_evaluate_on_store_equals_the_training_runs_evaluation(stores, tiny_chat_target_dir, tmp_path):
  target, train_store, other = stores
  c = tiny_config(tiny_chat_target_dir, features=train_store, eval_features=other, eval_batches=50)
  result = loop.run(c, str(tmp_path))
  m = loop.evaluate_on_store(layerwave.load_draft(str(tmp_path), target), target, other, steps=2, batch_size=2,
                             seq_len=64)
  np.testing.assert_allclose(m["acc_j"], result["heldout_acc"], rtol=1e-6)
  assert m["loss"] == pytest.approx(result["heldout_loss"], rel=1e-6)
  assert int(m["predicted_positions"]) == result["heldout_positions"]
  with pytest.raises(features.StoreError, match="lacks|missing|not among|depths"):
    draft = layerwave.load_draft(str(tmp_path), target)
    bad = dataclasses.replace(draft.config, layer_ids=(0, 1, 2))
    draft.config = bad
    loop.evaluate_on_store(draft, target, other, steps=2)


def test_a_whole_split_evaluation_reads_the_runs_length_buckets(stores, tiny_chat_target_dir, tmp_path,
                                                                monkeypatch):
  """With train.bucket_widths and train.eval_batches covering the held-out split, the periodic evaluation reads
  it in those buckets (narrower batches, fewer padded positions) with the pooled accuracies of a padded pass."""
  target = stores[0]
  data = DataOptions(source="sharegpt", max_length=256, max_records=40, heldout_fraction=0.5, split_seed=3)
  store = str(tmp_path / "store")
  features.extract(target, data.build(target.tokenizer), store, depths=LAYERS, dtype="float32", batch_size=4,
                   shard_sequences=8, data=dataclasses.asdict(data))
  heldout = features.open_store(store).split("heldout", max_length=256)
  assert np.asarray(heldout.lengths()).min() <= 128  # some sequences fit a narrower bucket
  shapes = []
  real_eval = step_lib.eval_step_offline
  def spy(*args, **kwargs):
    shapes.append(args[4]["input_ids"].shape)
    return real_eval(*args, **kwargs)
  monkeypatch.setattr(step_lib, "eval_step_offline", spy)
  c = tiny_config(tiny_chat_target_dir, features=store, eval_batches=50, bucket_widths=(64, 128))
  for key, value in dataclasses.asdict(data).items():
    c.data[key] = value
  result = loop.run(c, str(tmp_path / "w"))
  monkeypatch.setattr(step_lib, "eval_step_offline", real_eval)
  assert shapes and min(s[1] for s in shapes) < 256 and max(s[0] for s in shapes) > 2
  m = loop.evaluate_on_store(layerwave.load_draft(str(tmp_path / "w"), target), target, store, steps=2,
                             batch_size=2)  # padded to 256, one pass
  np.testing.assert_allclose(m["acc_j"], result["heldout_acc"], rtol=1e-6)
  assert int(m["predicted_positions"]) == result["heldout_positions"]
  # A partial pass (fewer batches than the split holds) keeps the padded batches.
  shapes.clear()
  monkeypatch.setattr(step_lib, "eval_step_offline", spy)
  c.train.eval_batches = 1
  loop.run(c, str(tmp_path / "partial"))
  assert shapes and all(s == (2, 256) for s in shapes)


def test_sweep_launcher_trains_cells_and_the_sharegpt_cell_from_another_store(stores, tiny_chat_target_dir,
                                                                             tmp_path):
  _, train_store, other = stores
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  c = tiny_config(tiny_chat_target_dir)
  args = ["--config=" + os.path.join(root, "configs", "smollm2_135m.py") + ":smoke",
          "--config.model=" + tiny_chat_target_dir, "--config.layers=1,2,3", "--config.train.features=" + train_store,
          "--workdir=" + str(tmp_path), "--cells=k3,sharegpt", "--sharegpt_features=" + other,
          "--sharegpt_like=k3", "--config.train.num_steps=2", "--config.train.eval_every=2",
          "--config.train.checkpoint_every=2", "--config.draft_model.vocab_size=256"]
  args += [f"--config.data.{k}={c.data[k]}" for k in ("source", "max_length", "max_records", "heldout_fraction")]
  out = subprocess.run([sys.executable, os.path.join(root, "experiments", "sweep_recipe.py"), *args], check=True,
                       cwd=root, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": root})
  assert "| k3 | train.ttt_steps=3 |" in out.stdout and "| sharegpt |" in out.stdout
  result = json.load(open(tmp_path / "curves.json"))
  assert [p["step"] for p in result["curves"]["k3"]] == [2] == [p["step"] for p in result["curves"]["sharegpt"]]
  assert result["cells"]["sharegpt"]["train.eval_features"] == train_store  # judged on the base store's text
  assert result["cells"]["sharegpt"]["data.max_records"] == OTHER.max_records
  assert os.path.getsize(tmp_path / "curves.png") > 1000


def test_compare_refuses_a_store_that_lacks_a_sets_layer_before_training(stores, tiny_chat_target_dir):
  from layerwave import compare
  from layerwave.training.options import Recipe
  _, path, other = stores
  recipe = Recipe.from_config(tiny_config(tiny_chat_target_dir))
  recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, features=path, eval_features=other))
  covered = compare.LayerSet("eagle3", tuple(LAYERS), "baseline", 0.0, "")
  compare.check_store_layers(recipe, [covered])  # every layer stored: no error
  outside = sorted(set(range(1, 8)) - set(LAYERS))[:2]
  lacking = compare.LayerSet("even-k4", tuple(sorted({*LAYERS[:2], *outside})), "k", 0.0, "")
  with pytest.raises(features.StoreError, match=rf"train\.features=.*even-k4 lacks \[{outside[0]}, {outside[1]}\]"):
    compare.check_store_layers(recipe, [covered, lacking])


def test_compare_probes_its_sets_on_the_training_store_and_keeps_the_result(stores, tiny_chat_target_dir,
                                                                            tmp_path):
  from layerwave import compare
  from layerwave.training import probe
  from layerwave.training.options import Recipe
  _, path, _ = stores
  recipe = Recipe.from_config(tiny_config(tiny_chat_target_dir))
  cmp = compare.CompareOptions(probe_tokens=200, probe_vocab=8, seeds=1)
  sets = [compare.LayerSet("eagle3", tuple(LAYERS), "baseline", 0.0, ""),
          compare.LayerSet("last-two", tuple(LAYERS[1:]), "manual", 0.0, "")]
  with pytest.raises(ValueError, match="compare.probe_tokens reads the cells' feature store: set train.features"):
    compare.probe_scores(recipe, sets, cmp, str(tmp_path))
  recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, features=path))
  got = compare.probe_scores(recipe, sets, cmp, str(tmp_path))
  want = probe.probe_sets(path, [s.ids for s in sets], probe.ProbeOptions(tokens=200, heldout_tokens=50, vocab=8))
  assert got["sets"] == want["sets"] and got["layers"] == want["layers"]
  assert set(got["sets"]) == {"-".join(map(str, LAYERS)), "-".join(map(str, LAYERS[1:]))}
  stamp = os.path.getmtime(tmp_path / "probe.json")
  assert compare.probe_scores(recipe, sets, cmp, str(tmp_path)) == got  # read back, not refitted
  assert os.path.getmtime(tmp_path / "probe.json") == stamp
  more = compare.probe_scores(recipe, sets, dataclasses.replace(cmp, probe_tokens=100), str(tmp_path))
  assert more["tokens"] == 100 and os.path.getmtime(tmp_path / "probe.json") > stamp  # other settings: refitted


def test_release_draft_measures_the_released_weights_on_the_whole_heldout_split(stores, tiny_chat_target_dir,
                                                                                 tmp_path):
  """experiments/release_draft.py --heldout=STORE: the manifest's held-out sim τ is the bf16 release's own on
  every held-out sequence (what `evaluate_on_store` gives the loaded release), and a later --overwrite is
  judged on that measurement, not on the run's few-batch periodic evaluation."""
  target = stores[0]
  own = tiny_config(tiny_chat_target_dir)
  data = DataOptions(**{k: own.data[k] for k in ("source", "max_length", "max_records", "heldout_fraction",
                                                 "split_seed")})
  train_store = str(tmp_path / "store")  # ids from 2 (release.write refuses a first id of 1)
  features.extract(target, data.build(target.tokenizer), train_store, depths=(2, 3, 4), dtype="float32",
                   batch_size=4, shard_sequences=8, data=dataclasses.asdict(data))
  c = tiny_config(tiny_chat_target_dir, features=train_store, bucket_widths=(16, 32))  # the release reuses them
  c.layers = (2, 3, 4)
  c.draft_model.vocab_size = target.config.vocab_size
  loop.run(c, str(tmp_path / "w"))
  releases = tmp_path / "releases"
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  cmd = [sys.executable, os.path.join(repo, "experiments", "release_draft.py"), f"--draft={tmp_path / 'w'}",
         "--name=tiny-heldout", f"--heldout={train_store}", "--heldout_steps=3"]
  env = {**os.environ, "LAYERWAVE_RELEASES": str(releases)}
  subprocess.run(cmd, check=True, cwd=repo, env=env, timeout=600, capture_output=True)
  with open(releases / "tiny-heldout" / "manifest.json") as f:
    manifest = json.load(f)
  heldout = manifest["metrics"]["heldout"]
  store = features.open_store(train_store)
  assert heldout["store"] == store.fingerprint and heldout["steps"] == 3 and heldout["dtype"] == "bfloat16"
  assert manifest["metrics"]["heldout_sim_tau"] == heldout["sim_tau"]
  released = layerwave.load_draft(str(releases / "tiny-heldout"), target)
  m = loop.evaluate_on_store(released, target, train_store, steps=3, batch_size=2)
  assert heldout["sim_tau"] == pytest.approx(float(m["sim_tau"]), rel=1e-6)
  np.testing.assert_allclose(heldout["acc_j"], m["acc_j"], rtol=1e-6)
  # Length buckets change no pooled metric of a whole-split pass; they refuse a partial one.
  c_widths = loop.evaluate_on_store(released, target, train_store, steps=3, batch_size=2, widths=(16, 32))
  np.testing.assert_allclose(c_widths["acc_j"], m["acc_j"], rtol=1e-6)
  assert int(c_widths["predicted_positions"]) == heldout["positions"]
  with pytest.raises(ValueError, match="whole split"):
    loop.evaluate_on_store(released, target, train_store, steps=3, batch_size=2, widths=(16,), max_batches=1)
  # ... over more than the one batch the run's periodic evaluation read (train.eval_batches=1).
  first = loop.evaluate_on_store(released, target, train_store, steps=3, batch_size=2, max_batches=1)
  assert heldout["positions"] > int(first["predicted_positions"])
  assert heldout["positions"] == int(m["predicted_positions"]) > 0
  # Every held-out sequence counted: as many positions as a pass with one batch per sequence finds.
  whole = loop.evaluate_on_store(released, target, train_store, steps=3, batch_size=1)
  assert heldout["positions"] == int(whole["predicted_positions"])
  # A release whose whole-split τ is higher is kept, even when its periodic τ is lower than this draft's.
  manifest["metrics"]["heldout"]["sim_tau"] += 1.0
  manifest["metrics"]["heldout_sim_tau"] = 0.0
  with open(releases / "tiny-heldout" / "manifest.json", "w") as f:
    json.dump(manifest, f)
  refused = subprocess.run(cmd + ["--overwrite"], cwd=repo, env=env, timeout=600, capture_output=True, text=True)
  assert refused.returncode != 0 and "replaced only with a better draft" in refused.stderr
