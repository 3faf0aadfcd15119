"""The embedded SmolLM2 GGUF: conversion, parity with transformers' PyTorch model, a real answer."""

import os
import shutil

import numpy as np
import pytest

import layerwave
from layerwave.models import hub, weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def target():
  return layerwave.load_target(NAME)


def test_converted_directory_is_hf_layout(target):
  files = set(os.listdir(target.path))
  assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
  c = target.config
  assert (c.num_layers, c.hidden_size, c.vocab_size) == (30, 576, 49152)
  assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rope_theta) == (9, 3, 64, 100000.0)
  assert c.tie_word_embeddings
  tok = target.tokenizer
  assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"
  assert tok.decode(tok.encode("Hello world 2024!")) == "Hello world 2024!"


def test_logits_match_pytorch_on_converted_weights(target):
  tok = target.tokenizer
  ids = tok.apply_chat_template([{"role": "user", "content": "Name three primary colours."}],
                                add_generation_prompt=True, tokenize=True, return_dict=False)
  ids = np.asarray([ids])
  hf = transformers.AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32)
  with torch.no_grad():
    ref = hf(torch.tensor(ids), output_hidden_states=True)
  out = target.forward(ids, return_hidden_states=True)
  np.testing.assert_allclose(out.logits, ref.logits.numpy(), atol=2e-4, rtol=1e-4)
  np.testing.assert_array_equal(np.argmax(out.logits, -1), ref.logits.numpy().argmax(-1))
  np.testing.assert_allclose(out.hidden_states[15], ref.hidden_states[15].numpy(), atol=2e-4,
                             rtol=1e-4)


def test_greedy_chat_answer_mentions_paris(target):
  tok = target.tokenizer
  ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                add_generation_prompt=True, tokenize=True, return_dict=False)
  answer = tok.decode(layerwave.generate(target, [ids], max_new_tokens=24)[0])
  assert "Paris" in answer


def test_truncated_gguf_is_a_clear_error(tmp_path):
  src = hub.embedded_gguf(NAME)
  bad = tmp_path / "truncated.gguf"
  with open(src, "rb") as f:
    bad.write_bytes(f.read(3 << 20))
  with pytest.raises(ValueError, match="truncated or corrupt"):
    weights.convert_gguf(str(bad), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()  # nothing half-written
  assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp")] == []


def test_gguf_of_another_architecture_is_refused(tmp_path):
  gguf = pytest.importorskip("gguf")
  path = str(tmp_path / "other.gguf")
  writer = gguf.GGUFWriter(path, "gpt2")
  writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(ValueError, match="architecture 'gpt2'"):
    layerwave.load_target(path)


def test_gguf_cache_is_reused_and_rebuilt_if_removed(tmp_path, monkeypatch):
  monkeypatch.setenv("LAYERWAVE_CACHE", str(tmp_path))
  first = hub.resolve(NAME)
  assert first.startswith(str(tmp_path))
  mtime = os.path.getmtime(os.path.join(first, "model.safetensors"))
  assert hub.resolve(NAME) == first
  assert os.path.getmtime(os.path.join(first, "model.safetensors")) == mtime
  shutil.rmtree(first)
  assert os.path.exists(os.path.join(hub.resolve(NAME), "config.json"))
