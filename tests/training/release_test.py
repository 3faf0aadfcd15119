"""Draft releases (`layerwave.training.release`): written atomically, loaded by short name after their
checksums and target are verified, decoding greedily exactly as plain decoding; bad releases refused."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

import layerwave
from layerwave.models import hub
from layerwave.speculative import evaluate
from layerwave.training import release

L = 8  # the tiny chat target (tests/conftest.py)


@pytest.fixture(scope="module")
def target(tiny_chat_target_dir):
  return layerwave.load_target(tiny_chat_target_dir)


@pytest.fixture
def root(tmp_path, monkeypatch):
  monkeypatch.setenv("LAYERWAVE_RELEASES", str(tmp_path / "releases"))
  return tmp_path / "releases"


def _release(target, root, name="tiny-eagle3", dtype="bfloat16"):
  draft = evaluate.load_draft("random", target, draft_vocab_size=512, seed=3)
  manifest = release.write(draft, target, str(root / name), model="tiny", dtype=dtype,
                           commands=["python experiments/train_draft.py ..."], metrics={"heldout_sim_tau": 1.0})
  return draft, manifest


def _params(draft):
  return [np.asarray(x, np.float32) for x in jax.tree.leaves(nnx.state(draft, nnx.Param))]


def test_a_release_loads_by_short_name_and_decodes_as_plain_greedy(target, root):
  draft, manifest = _release(target, root)
  assert release.available() == ["tiny-eagle3"] and manifest["layer_ids"] == [2, 4, 5]
  assert sorted(os.listdir(root / "tiny-eagle3")) == ["config.json", "manifest.json", "model.safetensors"]
  assert not [n for n in os.listdir(root) if n.startswith(".tmp")]
  loaded = layerwave.load_draft("tiny-eagle3", target)
  assert loaded.config.layer_ids == (2, 4, 5)
  for a, b in zip(_params(draft), _params(loaded)):  # bf16 on disk
    np.testing.assert_allclose(b, a, rtol=1e-2, atol=1e-2)
  prompts = [target.tokenizer("The capital of France is")["input_ids"], [5, 17, 99, 3, 250, 41, 8]]
  plain = layerwave.generate(target, prompts, 12, ignore_eos=True)
  spec, stats = layerwave.speculative.generate(target, loaded, prompts, 12, ignore_eos=True, num_draft_tokens=3)
  assert [list(map(int, r)) for r in spec] == [list(map(int, r)) for r in plain] and stats["tau"] >= 1


def test_an_unknown_short_name_lists_the_releases(target, root):
  _release(target, root)
  with pytest.raises(release.ReleaseError, match=r"No draft release named 'nope'.*tiny-eagle3"):
    layerwave.load_draft("nope", target)


@pytest.mark.parametrize("damage", ["alter", "remove", "add"])
def test_a_damaged_release_is_refused_naming_the_file(target, root, damage):
  _release(target, root)
  directory = root / "tiny-eagle3"
  weights = directory / "model.safetensors"
  if damage == "alter":
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    match = "model.safetensors does not match its SHA-256"
  elif damage == "remove":
    weights.unlink()
    match = "model.safetensors is missing"
  else:
    (directory / "notes.txt").write_text("x")
    match = "notes.txt is not listed"
  with pytest.raises(release.ReleaseError, match=match):
    layerwave.load_draft("tiny-eagle3", target)


def test_a_release_for_another_target_is_refused(target, root, tmp_path):
  _release(target, root)
  hf_reference = pytest.importorskip("tests.models.hf_reference")
  other = str(tmp_path / "other")
  hf_reference.save_hf_model_with(other, seed=1, vocab_size=49152, num_hidden_layers=L, eos_token_id=2,
                                  bos_token_id=1, pad_token_id=2)
  smol = hub.resolve("smollm2-135m-instruct")
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(smol, name), os.path.join(other, name))
  with pytest.raises(release.ReleaseError, match="is a draft for tiny"):
    layerwave.load_draft("tiny-eagle3", layerwave.load_target(other))


def test_releases_are_replaced_only_when_asked(target, root):
  _release(target, root)
  with pytest.raises(FileExistsError, match="replaced only by a better draft"):
    _release(target, root)
  with pytest.raises(ValueError, match="Release name"):
    _release(target, root, name="Bad Name")
  draft = evaluate.load_draft("random", target, draft_vocab_size=512, seed=4)
  release.write(draft, target, str(root / "tiny-eagle3"), model="tiny", overwrite=True)
  with open(root / "tiny-eagle3" / "manifest.json") as f:
    assert json.load(f)["format"] == release.FORMAT
  layerwave.load_draft("tiny-eagle3", target)


def test_release_draft_launcher_keeps_the_run_and_replaces_only_with_a_better_draft(tiny_config, tmp_path, root):
  """experiments/release_draft.py on a half-trained workdir: the manifest keeps the run (`training`, what
  `train.init_from` continues) and says it is interim; `--overwrite` with a draft worse than the release's
  held-out sim τ is refused, and the release is left as it was."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from layerwave.training import loop  # pylint: disable=g-import-not-at-top
  tiny_config.layers = (2, 3, 4)
  tiny_config.train.stop_after = 2  # of 4 steps: an unfinished run
  loop.run(tiny_config, str(tmp_path / "w"))
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  cmd = [sys.executable, os.path.join(repo, "experiments", "release_draft.py"), f"--draft={tmp_path / 'w'}",
         "--name=tiny-run", "--commands=make campaign-train"]
  env = {**os.environ, "LAYERWAVE_RELEASES": str(root)}
  subprocess.run(cmd, check=True, cwd=repo, env=env, timeout=600, capture_output=True)
  with open(root / "tiny-run" / "manifest.json") as f:
    manifest = json.load(f)
  assert manifest["training"]["step"] == 2 and manifest["training"]["num_steps"] == 4
  assert manifest["metrics"]["interim"] is True and manifest["metrics"]["step"] == 2
  assert manifest["training"]["settings"]["layers"] == [2, 3, 4]
  tau = manifest["metrics"]["heldout_sim_tau"]
  assert tau >= 1.0
  manifest["metrics"]["heldout_sim_tau"] = tau + 1.0  # as if the release held a better draft
  with open(root / "tiny-run" / "manifest.json", "w") as f:
    json.dump(manifest, f)
  before = open(root / "tiny-run" / "model.safetensors", "rb").read()
  refused = subprocess.run(cmd + ["--overwrite"], cwd=repo, env=env, timeout=600, capture_output=True, text=True)
  assert refused.returncode != 0 and "replaced only with a better draft" in refused.stderr
  assert open(root / "tiny-run" / "model.safetensors", "rb").read() == before
