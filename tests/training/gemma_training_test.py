"""Draft training over a Gemma 3 target through the pipeline's own stages.

A tiny random Gemma 3 (4 blocks, window 4, one global block) with the real Gemma-3-270M tokenizer (V = 262,144,
no chat template): ShareGPT conversations as plain text (`data.chat_format=plain`), a feature store whose top-1
comes from logits taken 128 positions at a time, offline training that equals online training on the same
batches, and the trained draft lossless in the speculative loop.
"""

import os

import jax
import numpy as np
import pytest
from flax import nnx

import layerwave
from layerwave import options
from layerwave.data.options import DataOptions
from layerwave.training import features
from layerwave.training import loop
from tests.training.features_test import tiny_config


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
  hf_reference = pytest.importorskip("tests.models.hf_reference")  # needs torch
  directory = hf_reference.save_tiny_gemma_with_real_tokenizer(str(tmp_path_factory.mktemp("tiny_gemma_chat")))
  return directory


def _config(gemma_dir, **train):
  c = tiny_config(gemma_dir, **train)
  c.layers = (1, 2, 3)
  c.data.chat_format = "plain"
  c.draft_model.vocab_size = 512
  return c


def _params(workdir, target):
  return jax.tree.leaves(nnx.state(layerwave.load_draft(workdir, target), nnx.Param))


def test_gemma_store_offline_training_equals_online_and_the_draft_is_lossless(gemma_dir, tmp_path):
  target = layerwave.load_target(gemma_dir)
  assert target.config.gemma and target.tokenizer is not None
  data = options.from_section(DataOptions, _config(gemma_dir).data, "data")  # the runs' own data settings
  built = data.build(target.tokenizer)
  example = built.source("train")[0]
  ids, mask = np.asarray(example["input_ids"]), np.asarray(example["assistant_mask"])
  text = target.tokenizer.decode(ids[ids != 0].tolist())
  assert text.startswith("<bos>User: ") and "\n\nAssistant: " in text  # a base model's plain-text turns
  assert 0 < mask.sum() < (ids != 0).sum()  # only the replies are trained on

  store = str(tmp_path / "store")
  features.extract(target, built, store, dtype="float32", depths=(1, 2, 3), batch_size=4, shard_sequences=8,
                   data=data.record())
  offline = loop.run(_config(gemma_dir, features=store), str(tmp_path / "offline"))
  online = loop.run(_config(gemma_dir), str(tmp_path / "online"))
  assert offline["step"] == online["step"] == 4
  for a, b in zip(_params(str(tmp_path / "offline"), target), _params(str(tmp_path / "online"), target)):
    np.testing.assert_allclose(a, b, atol=1e-4)

  draft = layerwave.load_draft(str(tmp_path / "offline"), target)
  assert draft.config.model.model_type == "llama"  # the draft block is Llama-style over a Gemma target
  prompts = [ids[:12].tolist(), ids[3:9].tolist()]
  ref = layerwave.generate(target, prompts, 12, ignore_eos=True)
  for method in ("chain", "tree"):
    out, _ = layerwave.speculative.generate(target, draft, prompts, 12, method=method, ignore_eos=True)
    assert out == ref, method
