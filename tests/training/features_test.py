"""layerwave.training.features: extraction, the store's format and checks, offline batches, the offline step.

On the tiny chat target (tests/conftest.py): the offline step equals the online one on identical data (loss,
gradients, acc_j); a killed extraction resumes to identical content; bfloat16 round-trips within its precision;
every refusal; a store written by two processes reads as one; 8 devices equal one; offline training through
`loop.run` resumes exactly and equals online training.
"""

import dataclasses
import errno
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import layerwave
from layerwave import checkpoint as ckpt_lib
from layerwave import data as data_lib
from layerwave import inference
from layerwave import options as options_lib
from layerwave import sharding
from layerwave.data.options import DataOptions
from layerwave.models.draft import Draft, DraftConfig
from layerwave.training import features
from layerwave.training import losses
from layerwave.training import loop
from layerwave.training import sources
from layerwave.training import step as step_lib
from layerwave.training.features import extraction
from layerwave.training.features import store as store_lib
from tests import configs
from tests.multidevice import run_on_eight_devices

LAYERS = (1, 2, 3)
DATA = DataOptions(source="sharegpt", max_length=64, max_records=60, heldout_fraction=0.2)


def tiny_config(target_dir, **train):
  """The training config of tests/training/conftest.py, with its `features` section filled in."""
  c = configs.load("smoke")
  c.model = target_dir
  c.layers = LAYERS
  for key, value in dataclasses.asdict(DATA).items():
    c.data[key] = value
  c.draft_model.vocab_size = 256
  c.train.update(dict(batch_size=2, num_steps=4, warmup_steps=1, ttt_steps=2, log_every=2, eval_every=2,
                      eval_batches=1, checkpoint_every=2, lr=1e-2))
  c.train.update(train)
  c.features.update(dict(dtype="float32", batch_size=4, shard_sequences=8))
  return c


@pytest.fixture(scope="module")
def target(tiny_chat_target_dir):
  return layerwave.load_target(tiny_chat_target_dir)


@pytest.fixture(scope="module")
def dataset(target):
  return DATA.build(target.tokenizer)


def _extract(target, dataset, out, dtype="float32", **kw):
  kw = {"depths": LAYERS, "batch_size": 4, "shard_sequences": 8, "data": DATA.record(), **kw}
  return features.extract(target, dataset, str(out), dtype=dtype, **kw)


@pytest.fixture(scope="module")
def store32(target, dataset, tmp_path_factory):
  out = tmp_path_factory.mktemp("store") / "f32"
  _extract(target, dataset, out)
  return str(out)


def _contents(path):
  """Every shard array of a store, by relative path."""
  out = {}
  for root, _, files in os.walk(path):
    for f in files:
      if f.endswith(".npy"):
        out[os.path.relpath(os.path.join(root, f), path)] = np.load(os.path.join(root, f))
  return out


def _online_batch(dataset, split, t, b=4):
  it = data_lib.BatchIterator(dataset.source(split), batch_size=b, seq_len=t, pad_id=2, shuffle=False)
  return next(it)


def _offline_batch(store, split, t, layers=LAYERS, b=4):
  s = features.open_store(store)
  it = features.FeatureBatchIterator(s.split(split, t), s.layer_slots(layers), batch_size=b, seq_len=t,
                                     pad_id=2, shuffle=False)
  return next(it)


# -- the store ---------------------------------------------------------------------------------------


def test_store_holds_every_real_token_and_reads_back_in_dataset_order(store32, dataset, target):
  s = features.open_store(store32)
  assert s.depths == (1, 2, 3, 8) and s.stored_depths == LAYERS and s.seq_len == 64
  source = dataset.source("train")
  split = s.split("train")
  assert len(split) == len(source) == dataset.num_examples["train"] and s.counts("heldout")[0] == len(
      dataset.source("heldout"))
  assert s.counts("train")[1] == sum(len(source[i]["input_ids"]) for i in range(len(source)))
  manifest = json.load(open(os.path.join(store32, "manifest.json")))
  assert manifest["complete"] and manifest["splits"]["train"]["tokens"] == s.counts("train")[1]
  assert manifest["target_fingerprint"] == layerwave.inference.target_fingerprint(target)
  assert manifest["tokenizer_fingerprint"] == data_lib.tokenizer_fingerprint(target.tokenizer)
  for i in (0, len(split) - 1):
    np.testing.assert_array_equal(split[i]["input_ids"], source[i]["input_ids"])
    np.testing.assert_array_equal(split[i]["assistant_mask"], source[i]["assistant_mask"])
  # The stored hidden states and argmax are the target's on that sequence alone (no padding).
  ids = np.asarray(source[3]["input_ids"])[None]
  out = target.forward(ids, return_hidden_states=True)
  np.testing.assert_allclose(split[3]["hidden"], np.asarray(out.hidden_states)[list(LAYERS), 0], atol=2e-5)
  np.testing.assert_allclose(split[3]["final"], np.asarray(out.hidden_states)[8, 0], atol=2e-5)
  np.testing.assert_array_equal(split[3]["argmax"], np.argmax(np.asarray(out.logits)[0], -1))


def test_extraction_top1_in_blocks_of_positions_is_the_full_logits_argmax(target, dataset):
  """The forward's argmax, any block size (one that leaves a remainder of B * T = 256, exact ones, the
  default), is bit-identical to the argmax of the full [B, T, V] logits; the compiled forward holds one
  block's logits, never [B, T, V]."""
  batch = _online_batch(dataset, "train", 64)
  tokens, mask = jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask)
  logits = np.asarray(inference.forward_fn(target.graphdef, target.params, tokens, mask).logits)
  expected = np.argmax(logits, -1)
  np.testing.assert_array_equal(losses.argmax(jnp.asarray(logits)), expected)
  for chunk in (7, 64, inference.LOGITS_CHUNK):
    fn = extraction.forward_step(target.mesh, target.graphdef, LAYERS, jnp.float32, chunk)
    _, final, top1 = fn(target.params, tokens, mask)
    assert top1.dtype == jnp.int32 and top1.shape == tokens.shape
    np.testing.assert_array_equal(top1, expected)
  v = target.config.vocab_size
  text = extraction.forward_step(target.mesh, target.graphdef, LAYERS, jnp.float32, 32).lower(
      target.params, tokens, mask).as_text()
  assert f"32x{v}x" in text and f"4x64x{v}x" not in text and f"256x{v}x" not in text


def test_offline_batches_carry_the_online_fields_plus_features(store32, dataset):
  online, offline = _online_batch(dataset, "train", 48), _offline_batch(store32, "train", 48, layers=(2, 8))
  for key in ("input_ids", "attention_mask", "assistant_mask", "example_mask"):
    np.testing.assert_array_equal(getattr(offline, key), getattr(online, key))
  assert offline.features.shape == (2, 4, 48, 32) and offline.final.shape == (4, 48, 32)
  np.testing.assert_array_equal(offline.features[1], offline.final)  # layer L is h_L
  pad = offline.attention_mask == 0
  assert not np.any(offline.features[:, pad]) and not np.any(offline.argmax[pad])


def test_bfloat16_store_round_trips_within_bfloat16_precision(store32, target, dataset, tmp_path):
  _extract(target, dataset, tmp_path / "bf16", dtype="bfloat16")
  assert os.path.getsize(tmp_path / "bf16" / "train-p00000-00000" / "hidden.npy") < 0.6 * os.path.getsize(
      os.path.join(store32, "train-p00000-00000", "hidden.npy"))
  a, b = features.open_store(store32).split("train"), features.open_store(str(tmp_path / "bf16")).split("train")
  assert b[0]["hidden"].dtype == jnp.bfloat16
  for i in range(len(a)):
    for key in ("hidden", "final"):
      x, y = np.asarray(a[i][key]), np.asarray(b[i][key], np.float32)
      np.testing.assert_allclose(y, x, rtol=2.0**-8, atol=1e-30)  # round to nearest: half an ulp of 8 bits
      assert not np.array_equal(x, y)  # really rounded
    for key in ("argmax", "input_ids", "assistant_mask"):
      np.testing.assert_array_equal(a[i][key], b[i][key])


def test_bfloat16_computed_store_serves_the_float32_target_and_says_so(store32, target, dataset, tmp_path,
                                                                        tiny_chat_target_dir):
  bf16 = layerwave.load_target(tiny_chat_target_dir, dtype="bfloat16")
  out = tmp_path / "computed16"
  _extract(target, dataset, out, compute_target=bf16)
  a, b = features.open_store(store32), features.open_store(str(out))
  # The draft it trains serves the float32 target: same fingerprint and dtype, the forward's dtype recorded.
  assert b.header["target_fingerprint"] == a.header["target_fingerprint"]
  assert b.header["target"]["dtype"] == "float32" and b.header["compute_dtype"] == "bfloat16"
  assert "compute_dtype" not in a.header and b.fingerprint != a.fingerprint
  # A store written before the field existed keeps its fingerprint (the campaign's store resumes).
  legacy = {k: a.header.get(k) for k in store_lib.CONTRACT if k != "compute_dtype"}
  assert a.fingerprint == options_lib.fingerprint(
      {"header": legacy, "splits": {s: [dataclasses.astuple(x) for x in v] for s, v in sorted(a.splits.items())}})
  x, y = a.split("train"), b.split("train")
  err = max(float(np.abs(np.asarray(y[i]["hidden"]) - np.asarray(x[i]["hidden"])).max()
                  / np.abs(np.asarray(x[i]["hidden"])).max()) for i in range(len(x)))
  assert 0 < err < 0.1  # computed in bf16: close to float32, not equal
  # ... and exactly what the bfloat16 target computes on its own (activations in bf16, not only its weights).
  _extract(bf16, dataset, tmp_path / "own16")
  z = features.open_store(str(tmp_path / "own16")).split("train")
  for i in range(len(x)):
    np.testing.assert_array_equal(x[i]["input_ids"], y[i]["input_ids"])
    for key in ("hidden", "final", "argmax"):
      np.testing.assert_array_equal(np.asarray(y[i][key]), np.asarray(z[i][key]))
  # The held-out split stands for inference: computed by the float32 target itself, bit for bit.
  h32, h16 = a.split("heldout"), b.split("heldout")
  assert len(h16) == len(h32) > 0
  for i in range(len(h32)):
    for key in ("hidden", "final", "argmax", "input_ids"):
      np.testing.assert_array_equal(np.asarray(h16[i][key]), np.asarray(h32[i][key]))
  # A held-out-only store runs no bf16 forward, so it is the float32 target's own (same contract).
  _extract(target, dataset, tmp_path / "heldout-only", splits=("heldout",), compute_target=bf16)
  assert "compute_dtype" not in features.open_store(str(tmp_path / "heldout-only")).header
  # Resuming it with a float32 forward is another store; another checkpoint as compute_target is refused.
  with pytest.raises(store_lib.StoreError, match=r"other settings \(differing: compute_dtype\)"):
    _extract(target, dataset, out)
  other = dataclasses.replace(bf16, config=dataclasses.replace(bf16.config, num_layers=bf16.config.num_layers - 1))
  with pytest.raises(ValueError, match="compute_target must be the target's own checkpoint"):
    _extract(target, dataset, tmp_path / "other", compute_target=other)
  # A float32 run trains on it (one step): the store stands in for its target.
  c = tiny_config(tiny_chat_target_dir, features=str(out), num_steps=1, eval_every=1, checkpoint_every=1)
  result = loop.run(c, str(tmp_path / "run"))
  assert result["step"] == 1 and np.isfinite(result["heldout_sim_tau"])


def test_features_options_refuse_an_unknown_compute_dtype():
  with pytest.raises(ValueError, match=r"features\.compute_dtype must be '' \(the target's config\.dtype\)"):
    extraction.FeatureOptions(dir="x", compute_dtype="int8")


def test_extraction_resumes_after_a_kill_with_identical_content(store32, target, dataset, tmp_path,
                                                                 monkeypatch):
  out = tmp_path / "killed"
  write = store_lib.write_shard
  calls = []

  def dies_on_the_third_shard(*args, **kw):
    calls.append(args[1])
    if len(calls) == 3:
      raise KeyboardInterrupt  # the process is killed mid-extraction
    return write(*args, **kw)

  monkeypatch.setattr(store_lib, "write_shard", dies_on_the_third_shard)
  with pytest.raises(KeyboardInterrupt):
    _extract(target, dataset, out)
  monkeypatch.setattr(store_lib, "write_shard", write)
  assert sorted(n for n in os.listdir(out) if not n.startswith("manifest")) == calls[:2]
  os.makedirs(out / (store_lib.tmp_prefix(0) + "leftover"))  # what a SIGKILL mid-write leaves
  with pytest.raises(store_lib.StoreError, match="process 0 of 1 has not finished"):
    features.open_store(str(out))
  resumed = _extract(target, dataset, out)
  assert not any(n.startswith(".tmp") for n in os.listdir(out))
  assert 0 < resumed["tokens_computed"] < features.open_store(store32).counts("train")[1]  # skipped 2 shards
  a, b = _contents(store32), _contents(str(out))
  assert sorted(a) == sorted(b)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)
  assert features.open_store(str(out)).fingerprint == features.open_store(store32).fingerprint


def test_two_processes_write_one_store(store32, target, dataset, tmp_path):
  out = tmp_path / "two"
  _extract(target, dataset, out, process_index=1, process_count=2)
  with pytest.raises(store_lib.StoreError, match="process 0 of 2 has not finished"):
    features.open_store(str(out))
  _extract(target, dataset, out, process_index=0, process_count=2)
  assert any(n.startswith("train-p00001-") for n in os.listdir(out))
  one, two = features.open_store(store32), features.open_store(str(out))
  assert one.counts("train") == two.counts("train") and json.load(open(out / "manifest.json"))["complete"]
  a, b = one.split("train"), two.split("train")
  np.testing.assert_array_equal(a.dataset_index, b.dataset_index)
  for i in range(len(a)):
    for key in ("hidden", "final", "argmax", "input_ids"):
      np.testing.assert_allclose(np.asarray(a[i][key]), np.asarray(b[i][key]), atol=1e-5)


# -- refusals ----------------------------------------------------------------------------------------


def test_a_store_that_would_not_fit_is_refused_before_writing(target, dataset, tmp_path, monkeypatch):
  monkeypatch.setattr(extraction.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**9, 10**9, 1000))
  with pytest.raises(OSError, match=r"needs ~1\.0 MiB more \(2048 tokens x 521 bytes/token for depths "
                     r"\[1, 2, 3, 8\] in float32\), but only 1\.0 KiB are free .*leave train\.features unset") as e:
    _extract(target, dataset, tmp_path / "full")
  assert e.value.errno == errno.ENOSPC
  assert [n for n in os.listdir(tmp_path / "full") if n != "manifest.json"] == []


def test_a_disk_that_fills_mid_write_leaves_no_partial_shard(store32, target, dataset, tmp_path, monkeypatch):
  out = tmp_path / "fills"
  save, saved = np.save, []

  def fills(path, *args, **kw):
    saved.append(path)
    if len(saved) == 10:  # the second shard's third array
      raise OSError(errno.ENOSPC, "No space left on device")
    return save(path, *args, **kw)

  monkeypatch.setattr(np, "save", fills)
  with pytest.raises(OSError, match=r"The disk filled while writing shard train-p00000-00001 .* partial shard "
                     r"was removed; the 1 finished shards of 'train' are kept and a rerun resumes"):
    _extract(target, dataset, out)
  monkeypatch.setattr(np, "save", save)
  assert sorted(n for n in os.listdir(out) if n != "manifest.json") == ["train-p00000-00000"]
  _extract(target, dataset, out)
  a, b = _contents(store32), _contents(str(out))
  assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_resuming_into_a_store_with_other_settings_is_refused(store32, target, dataset):
  with pytest.raises(store_lib.StoreError, match=r"other settings \(differing: depths, stored_depths\)"):
    _extract(target, dataset, store32, depths=(1, 2))


@pytest.mark.parametrize("edit, match", [
    (lambda c: setattr(c, "layers", (1, 2, 4)),
     r"has no layer 4: it stores depths \[1, 2, 3, 8\]\. Extract a store with these layers"),
    (lambda c: setattr(c.data, "max_length", 128), r"data\.max_length=128 exceeds the feature store's seq_len "
     r"\(64\).*--config\.data\.max_length=64"),
    (lambda c: setattr(c.data, "max_records", 70), r"other data \(data\.max_records=60\).*--config\.data\."
     r"max_records=60"),
    (lambda c: setattr(c, "dtype", "bfloat16"), r"computed in float32; this run loads it in bfloat16"),
    # A field the store's header predates counts as its default: a plain-text run is refused all the same.
    (lambda c: setattr(c.data, "chat_format", "plain"), r"other data \(data\.chat_format='template'\).*"
     r"--config\.data\.chat_format=template"),
])
def test_training_refuses_a_store_that_contradicts_the_run(store32, tiny_chat_target_dir, tmp_path, edit, match):
  c = tiny_config(tiny_chat_target_dir, features=store32)
  edit(c)
  with pytest.raises(store_lib.StoreError, match=match):
    loop.run(c, str(tmp_path))
  assert not os.path.exists(tmp_path / "checkpoints")  # refused before any training


def test_training_refuses_a_store_of_another_target_or_tokenizer(store32, tiny_chat_target_dir, tmp_path):
  other = tmp_path / "other_target"
  shutil.copytree(tiny_chat_target_dir, other)
  from tests.models import hf_reference  # pylint: disable=g-import-not-at-top  # needs torch
  hf_reference.save_hf_model_with(str(other), vocab_size=49152, num_hidden_layers=8, eos_token_id=2,
                                  bos_token_id=1, pad_token_id=2, seed=7)
  with pytest.raises(store_lib.StoreError, match=r"extracted from another target: .*fingerprint [0-9a-f]{12}; "
                     r"this run's target has \(L, D, V\) = \(8, 32, 49152\).*leave train\.features unset"):
    loop.run(tiny_config(str(other), features=store32), str(tmp_path / "a"))
  copy = tmp_path / "store"
  shutil.copytree(store32, copy)
  manifest = json.load(open(copy / "manifest.json"))
  manifest["tokenizer_fingerprint"] = "0" * 64  # what a store tokenised by another tokenizer records
  json.dump(manifest, open(copy / "manifest.json", "w"))
  with pytest.raises(store_lib.StoreError, match=r"another tokenizer \(fingerprint 000000000000"):
    loop.run(tiny_config(tiny_chat_target_dir, features=str(copy)), str(tmp_path / "b"))


@pytest.mark.parametrize("array, bad, match", [
    ("final", lambda x: x.astype(np.float64), r"final\.npy holds float64 \(\d+, 32\), but the manifest says "
     r"float32"),
    ("hidden", lambda x: x[:2], r"hidden\.npy holds float32 \(2, \d+, 32\), but the manifest says float32 "
     r"\(3, \d+, 32\)"),
    ("argmax", lambda x: x[:-1], r"argmax\.npy holds int32 \(\d+,\), but the manifest says int32"),
])
def test_a_store_whose_arrays_disagree_with_its_manifest_is_refused(store32, tmp_path, array, bad, match):
  copy = tmp_path / "store"
  shutil.copytree(store32, copy)
  path = copy / "train-p00000-00001" / f"{array}.npy"
  np.save(path, bad(np.load(path)))
  with pytest.raises(store_lib.StoreError, match=match):
    features.open_store(str(copy))
  manifest = json.load(open(copy / "manifest.json"))
  json.dump({**manifest, "dtype": "int8"}, open(copy / "manifest.json", "w"))
  with pytest.raises(store_lib.StoreError, match=r"manifest names dtype 'int8'"):
    features.open_store(str(copy))
  with pytest.raises(store_lib.StoreError, match=r"No feature store at .*extract_features\.py"):
    features.open_store(str(tmp_path / "nothing"))


# -- the offline step --------------------------------------------------------------------------------


def _draft_and_state(target, argmax, seed=0):
  """A draft whose vocabulary holds every other target argmax seen (so both kinds of position occur)."""
  seen = np.unique(argmax)
  ids = np.sort(np.concatenate([seen[::2], np.setdiff1d(np.arange(300), seen)[:300 - len(seen[::2])]]))
  cfg = DraftConfig.from_target(target.config, LAYERS, draft_vocab_size=len(ids))
  draft = Draft(cfg, embedding=target.params["embed_tokens"]["embedding"][...], rngs=nnx.Rngs(seed))
  draft.d2t[...] = jnp.asarray(ids - np.arange(len(ids)), jnp.int32)
  draft.t2d[...] = jnp.zeros(target.config.vocab_size, bool).at[ids].set(True)
  graphdef, params, vocab, embed = step_lib.split_draft(draft)
  head = sources.target_head(target)[:, ids]
  return graphdef, params, vocab, embed, head


def test_offline_step_equals_online_step_on_identical_data(store32, target, dataset):
  online, offline = _online_batch(dataset, "train", 64), _offline_batch(store32, "train", 64)
  np.testing.assert_array_equal(online.input_ids, offline.input_ids)
  graphdef, params, vocab, embed, head = _draft_and_state(target, offline.argmax[offline.attention_mask > 0])
  on_arrays = {k: v for k, v in online.arrays().items() if k != "example_mask"}
  program = step_lib.StepProgram(graphdef, step_lib.LossSettings(steps=3, decay=0.8, assistant_only=False),
                                 target_graphdef=target.graphdef)
  online_fn = step_lib._loss_fn  # pylint: disable=protected-access
  offline_fn = step_lib._offline_loss_fn  # pylint: disable=protected-access
  (on_loss, on_aux), on_grads = jax.value_and_grad(online_fn, has_aux=True)(
      params, vocab, embed, target.params, on_arrays, program)
  (off_loss, off_aux), off_grads = jax.value_and_grad(offline_fn, has_aux=True)(
      params, vocab, embed, head, offline.arrays(), program)
  assert float(on_loss) > 1.0 and 0 < float(on_aux["in_vocab_j"][0]) < float(on_aux["tokens_j"][0])
  np.testing.assert_allclose(float(off_loss), float(on_loss), rtol=1e-5)
  for key in ("hits_j", "tokens_j", "in_vocab_j", "acc_j", "acc_in_vocab_j"):
    np.testing.assert_array_equal(np.asarray(off_aux[key]), np.asarray(on_aux[key]), err_msg=key)
  np.testing.assert_allclose(np.asarray(off_aux["loss_j"]), np.asarray(on_aux["loss_j"]), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(off_grads), jax.tree.leaves(on_grads)):
    scale = float(np.abs(np.asarray(b)).max())
    assert scale > 0
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * scale, rtol=1e-4)
  # The jitted steps agree too (what the loops call).
  optimizer = step_lib.OptimizerSettings(1e-3, 1, 10)
  fresh = lambda: step_lib.init_state(jax.tree.map(jnp.copy, params), optimizer)  # noqa: E731  # donated
  trains = dataclasses.replace(program, optimizer=optimizer)
  _, m_on = step_lib.train_step(fresh(), vocab, embed, target.params, on_arrays, program=trains)
  state = fresh()
  _, m_off = step_lib.train_step_offline(state, vocab, embed, head, offline.arrays(), program=trains)
  np.testing.assert_allclose(float(m_off["grad_norm"]), float(m_on["grad_norm"]), rtol=1e-5)
  e_on = step_lib.eval_step(params, vocab, embed, target.params, on_arrays, program=program)
  e_off = step_lib.eval_step_offline(params, vocab, embed, head, offline.arrays(), program=program)
  np.testing.assert_array_equal(np.asarray(e_off["acc_j"]), np.asarray(e_on["acc_j"]))


def test_store_lengths_are_the_sequences_lengths(store32):
  s = features.open_store(store32)
  for t in (None, 40):
    split = s.split("train", t)
    np.testing.assert_array_equal(split.lengths(), [len(split[i]["input_ids"]) for i in range(len(split))])
  assert split.lengths().max() == 40  # cut to max_length as the items are


def test_a_length_bucketed_batch_trains_as_its_rows_padded_to_full_width(store32, target):
  """Bucketing only drops padding: the loss, the metrics and the gradients of a [rows, w] batch equal those of
  the same rows padded to [rows, max_length]."""
  s = features.open_store(store32)
  split = s.split("train", 24)  # sequences cut to 24 tokens: all in the width-32 bucket of [4, 32] batches
  it = features.FeatureBatchIterator(split, s.layer_slots(LAYERS), batch_size=2, seq_len=64, pad_id=2, seed=1,
                                     widths=(16, 32))
  assert it.widths == (32,)
  batch = next(it)
  assert batch.input_ids.shape == (4, 32) and batch.attention_mask.sum() > 4 * 16
  wide = it.collate([split[i] for i in batch.indices], batch.indices, batch.position, (4, 64))
  graphdef, params, vocab, embed, head = _draft_and_state(target, batch.argmax[batch.attention_mask > 0])
  fn = jax.value_and_grad(step_lib._offline_loss_fn, has_aux=True)  # pylint: disable=protected-access
  program = step_lib.StepProgram(graphdef, step_lib.LossSettings(steps=3, decay=0.8, assistant_only=False))
  (short_loss, short_aux), short_grads = fn(params, vocab, embed, head, batch.arrays(), program)
  (wide_loss, wide_aux), wide_grads = fn(params, vocab, embed, head, wide.arrays(), program)
  assert float(short_loss) > 1.0
  np.testing.assert_allclose(float(short_loss), float(wide_loss), rtol=1e-5)
  for key in ("hits_j", "tokens_j", "in_vocab_j"):
    np.testing.assert_array_equal(np.asarray(short_aux[key]), np.asarray(wide_aux[key]), err_msg=key)
  for a, b in zip(jax.tree.leaves(short_grads), jax.tree.leaves(wide_grads)):
    scale = float(np.abs(np.asarray(b)).max())
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * scale, rtol=1e-4)


SCRIPT = """
    import numpy as np
    from layerwave import sharding
    from layerwave.training import features, step as step_lib
    from tests.training import features_test as ft
    target = layerwave.load_target(ARGS[0], mesh=sharding.make_mesh())
    assert target.mesh.shape["data"] == 8
    ft._extract(target, ft.DATA.build(target.tokenizer), ARGS[1], batch_size=8)
    write_result(ft.offline_steps(target, ARGS[1]))
"""


def offline_steps(target, store, steps=3):
  """Three offline train steps on a batch of 8 from `store`, the batch sharded over the target's mesh."""
  batch = _offline_batch(store, "train", 64, b=8)
  graphdef, params, vocab, embed, head = _draft_and_state(target, batch.argmax[batch.attention_mask > 0])
  optimizer = step_lib.OptimizerSettings(3e-3, 1, 10)
  rep = sharding.replicated(target.mesh)
  state = jax.device_put(step_lib.init_state(params, optimizer), rep)
  vocab, embed, head = jax.device_put((vocab, embed, head), rep)
  arrays = features.device_arrays(batch, target.mesh)
  assert arrays["features"].sharding.spec == jax.sharding.PartitionSpec(None, "data")
  for _ in range(steps):
    state, m = step_lib.train_step_offline(state, vocab, embed, head, arrays, program=step_lib.StepProgram(
        graphdef, step_lib.LossSettings(steps=2, decay=0.8, assistant_only=True), optimizer=optimizer))
  return {"loss": float(m["loss"]), "params": [np.asarray(x).tolist() for x in jax.tree.leaves(state.params)]}


def test_eight_devices_extract_and_train_like_one(store32, target, tiny_chat_target_dir, tmp_path):
  got = run_on_eight_devices(SCRIPT, tmp_path, tiny_chat_target_dir, tmp_path / "store8")
  a, b = _contents(store32), _contents(str(tmp_path / "store8"))
  assert sorted(a) == sorted(b)
  for key in a:
    np.testing.assert_allclose(a[key], b[key], atol=2e-5, err_msg=key)
  want = offline_steps(target, store32)
  assert abs(got["loss"] - want["loss"]) < 1e-5 and want["loss"] > 0
  for x, y in zip(got["params"], want["params"]):
    np.testing.assert_allclose(x, y, atol=2e-5)


# -- the loop ----------------------------------------------------------------------------------------


def _params(workdir, target):
  return jax.tree.leaves(nnx.state(layerwave.load_draft(workdir, target), nnx.Param))


def test_offline_training_resumes_exactly_and_equals_online_training(store32, tiny_chat_target_dir, target,
                                                                     tmp_path):
  # The whole target vocabulary as V_d: every position counts, so the loss is far from zero.
  full = tiny_config(tiny_chat_target_dir, features=store32)
  full.draft_model.vocab_size = target.config.vocab_size
  result = loop.run(full, str(tmp_path / "full"))
  assert result["step"] == 4 and result["heldout_loss"] > 1.0
  killed = full.copy_and_resolve_references()
  killed.train.stop_after = 3
  assert loop.run(killed, str(tmp_path / "resumed"))["step"] == 3
  killed.train.stop_after = 0
  assert loop.run(killed, str(tmp_path / "resumed"))["step"] == 4
  for a, b in zip(_params(str(tmp_path / "full"), target), _params(str(tmp_path / "resumed"), target)):
    np.testing.assert_array_equal(a, b)
  online = full.copy_and_resolve_references()
  online.train.features = ""
  with pytest.raises(ValueError, match=r"trained from the feature store [0-9a-f]+, but this run reads online"):
    loop.run(online, str(tmp_path / "full"))
  assert loop.run(online, str(tmp_path / "online"))["step"] == 4  # same seed: the same batches, online
  for a, b in zip(_params(str(tmp_path / "full"), target), _params(str(tmp_path / "online"), target)):
    np.testing.assert_allclose(a, b, atol=1e-4)
  meta = ckpt_lib.Checkpointer(str(tmp_path / "full" / "checkpoints")).read_meta()
  assert meta["feature_store"] == features.open_store(store32).fingerprint


def test_offline_training_with_length_buckets_resumes_exactly(store32, tiny_chat_target_dir, target, tmp_path):
  bucketed = tiny_config(tiny_chat_target_dir, features=store32, bucket_widths=(16, 32))
  result = loop.run(bucketed, str(tmp_path / "full"))
  assert result["step"] == 4 and result["heldout_positions"] > 0
  killed = bucketed.copy_and_resolve_references()
  killed.train.stop_after = 3
  assert loop.run(killed, str(tmp_path / "resumed"))["step"] == 3
  killed.train.stop_after = 0
  assert loop.run(killed, str(tmp_path / "resumed"))["step"] == 4
  for a, b in zip(_params(str(tmp_path / "full"), target), _params(str(tmp_path / "resumed"), target)):
    np.testing.assert_array_equal(a, b)
  other = bucketed.copy_and_resolve_references()
  other.train.bucket_widths = ()
  with pytest.raises(ValueError, match="holds a run with a different config"):
    loop.run(other, str(tmp_path / "full"))
  # A width that does not divide the 128 slots (48: 2 rows of 48, 96 slots) trains on the rows that fit.
  odd = tiny_config(tiny_chat_target_dir, features=store32, bucket_widths=(48,))
  assert loop.run(odd, str(tmp_path / "odd"))["step"] == 4


def test_launchers_extract_then_train_offline(tiny_chat_target_dir, tmp_path):
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  common = ["--config=" + os.path.join(root, "configs", "smollm2_135m.py") + ":smoke",
            "--config.model=" + tiny_chat_target_dir, "--config.layers=2,4,6"]

  def launch(script, *args):
    return subprocess.run([sys.executable, os.path.join(root, "experiments", script), *common, *args], check=True,
                          cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": root})

  out = launch("extract_features.py", "--config.features.dir=" + str(tmp_path / "store"))
  assert json.loads(out.stdout)["tokens_computed"] > 0
  store = features.open_store(str(tmp_path / "store"))
  assert store.depths == (2, 4, 6, 8) and store.dtype == "bfloat16" and store.seq_len == 128
  assert "Feature store" in out.stderr and "bytes/token" in out.stderr  # the size, printed up front
  again = launch("extract_features.py", "--config.features.dir=" + str(tmp_path / "store"))
  assert json.loads(again.stdout)["tokens_computed"] == 0  # finished shards are skipped
  launch("train_draft.py", "--workdir=" + str(tmp_path / "w"), "--config.train.features=" + str(tmp_path / "store"))
  lines = [json.loads(l) for l in open(tmp_path / "w" / "metrics.jsonl")]
  assert any("eval/sim_tau" in l for l in lines) and max(l.get("step", 0) for l in lines) == 6


# -- more text beside the store: train.extra_features, train.max_sequences -------------------------------

OTHER = DataOptions(source="sharegpt", max_length=64, max_records=90, heldout_fraction=0.2)


@pytest.fixture(scope="module")
def extra32(target, tmp_path_factory):
  """A second store: other conversations (90 records, a superset of store32's), its train split only."""
  out = tmp_path_factory.mktemp("store") / "extra"
  features.extract(target, OTHER.build(target.tokenizer), str(out), dtype="float32", depths=LAYERS, batch_size=4,
                   shard_sequences=8, data=OTHER.record(), splits=("train",))
  return str(out)


def test_joined_splits_read_each_part_in_order_and_a_head_is_a_prefix(store32, extra32):
  a = features.open_store(store32).split("train", 64)
  b = features.open_store(extra32).split("train", 64)
  joined = features.JoinedSplit([a, b])
  assert len(joined) == len(a) + len(b) and joined.sizes == [len(a), len(b)]
  np.testing.assert_array_equal(joined.lengths(), np.concatenate([a.lengths(), b.lengths()]))
  ends = {0: (a, 0), len(a) - 1: (a, len(a) - 1), len(a): (b, 0), len(joined) - 1: (b, len(b) - 1)}
  for i, (part, j) in ends.items():
    for key, value in part[j].items():
      np.testing.assert_array_equal(joined[i][key], value)
  with pytest.raises(IndexError):
    joined[len(joined)]  # pylint: disable=pointless-statement
  head = a.head(5)
  assert len(head) == 5 and list(head.dataset_index) == list(a.dataset_index[:5])
  np.testing.assert_array_equal(head.lengths(), a.lengths()[:5])
  np.testing.assert_array_equal(head[4]["final"], a[4]["final"])
  assert len(a.head(10_000)) == len(a)


def test_training_reads_the_extra_stores_train_split_beside_its_own(store32, extra32, tiny_chat_target_dir, target,
                                                                     tmp_path, caplog):
  caplog.set_level("INFO")
  n_a = len(features.open_store(store32).split("train", 64))
  n_b = len(features.open_store(extra32).split("train", 64))
  both = tiny_config(tiny_chat_target_dir, features=store32, extra_features=extra32)
  assert loop.run(both, str(tmp_path / "both"))["step"] == 4
  assert f"Training split: {n_a} sequences of {store32} and {n_b} of {extra32}." in caplog.text
  meta = ckpt_lib.Checkpointer(str(tmp_path / "both" / "checkpoints")).read_meta()
  assert meta["feature_store"] == "+".join(features.open_store(p).fingerprint for p in (store32, extra32))
  alone = tiny_config(tiny_chat_target_dir, features=store32)
  assert loop.run(alone, str(tmp_path / "alone"))["step"] == 4
  # Same seed, other batches: the extra sequences are trained on.
  assert any(not np.array_equal(x, y) for x, y in zip(_params(str(tmp_path / "both"), target),
                                                       _params(str(tmp_path / "alone"), target)))
  # A run resumes only with the same stores.
  with pytest.raises(ValueError, match=r"trained from the feature store [0-9a-f]+\+[0-9a-f]+, but this run reads "
                                       r"from the feature store [0-9a-f]+;"):
    loop.run(alone, str(tmp_path / "both"))
  # A prefix of the store's train split: the same run on its first 7 sequences.
  caplog.clear()
  few = tiny_config(tiny_chat_target_dir, features=store32, max_sequences=7)
  assert loop.run(few, str(tmp_path / "few"))["step"] == 4
  assert "train split (7 sequences" in caplog.text
  with pytest.raises(ValueError, match="holds a run with a different config.*max_sequences"):
    loop.run(few, str(tmp_path / "alone"))


def test_an_extra_store_that_does_not_fit_the_run_is_refused(store32, extra32, target, tiny_chat_target_dir,
                                                              tmp_path):
  def refused(match, **train):
    with pytest.raises(ValueError, match=match):
      loop.run(tiny_config(tiny_chat_target_dir, features=store32, **train), str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run" / "checkpoints")

  refused(r"names a store twice \(or train\.features' own", extra_features=store32)
  refused(r"names a store twice", extra_features=f"{extra32},{extra32}")
  refused(r"train\.max_sequences=1000 but .* holds \d+ train sequences", max_sequences=1000)
  refused(r"has an empty entry", extra_features=f"{extra32},")
  other_split = dataclasses.replace(OTHER, split_seed=1)
  out = tmp_path / "split1"
  features.extract(target, other_split.build(target.tokenizer), str(out), dtype="float32", depths=LAYERS,
                   batch_size=4, shard_sequences=8, data=other_split.record(), splits=("train",))
  refused(r"split its conversations with data\.split_seed=1, this run with 0.*--config\.data\.split_seed=0",
          extra_features=str(out))
  out = tmp_path / "depths"
  features.extract(target, OTHER.build(target.tokenizer), str(out), dtype="float32", depths=(0,) + LAYERS,
                   batch_size=4, shard_sequences=8, data=OTHER.record(), splits=("train",))
  refused(r"stores the depths \[0, 1, 2, 3\], .* \[1, 2, 3\]: stores trained from together must lay out the "
          r"layers \[1, 2, 3\] alike", extra_features=str(out))
  out = tmp_path / "bf16"
  features.extract(target, OTHER.build(target.tokenizer), str(out), dtype="bfloat16", depths=LAYERS,
                   batch_size=4, shard_sequences=8, data=OTHER.record(), splits=("train",))
  refused(r"stores bfloat16 features of width \d+, .* float32 of width \d+.*--config\.features\.dtype=float32",
          extra_features=str(out))
  with pytest.raises(ValueError, match="need train.features"):
    loop.run(tiny_config(tiny_chat_target_dir, extra_features=extra32), str(tmp_path / "online"))
