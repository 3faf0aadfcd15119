"""Small random Hugging Face PyTorch models, saved to disk, as the independent reference for parity tests."""

from __future__ import annotations

import os
import shutil

import pytest

from layerwave.models import hub

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (model_type, extra config). Covers every family, tied/untied, GQA/MHA, explicit head_dim,
# q/k/v bias, q/k norm, and both rope scalings.
FAMILIES = {
    "llama": ("llama", dict(tie_word_embeddings=False)),
    "llama_tied_mha": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "llama3_rope": ("llama", dict(tie_word_embeddings=False, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=16))),
    "llama_linear_rope": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                                            factor=2.0))),
    "mistral": ("mistral", dict(sliding_window=None, tie_word_embeddings=False)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3": ("qwen3", dict(tie_word_embeddings=False, head_dim=16, use_sliding_window=False)),
    # Gemma 3: a window of 4 (shorter than the test sequences), local and global blocks with different
    # RoPE bases, query_pre_attn_scalar != head_dim, final logits soft-capped (tied embeddings).
    "gemma3": ("gemma3_text", dict(
        num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=12, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        final_logit_softcapping=3.0, tie_word_embeddings=True)),
    # The older layout (sliding_window_pattern, rope_local_base_freq), untied, attention soft-capping and
    # a linearly scaled global RoPE (as Gemma 3 4B and up).
    "gemma3_pattern": ("gemma3_text", dict(
        num_hidden_layers=3, head_dim=8, query_pre_attn_scalar=8, sliding_window=3,
        sliding_window_pattern=2, rope_theta=10000.0, rope_local_base_freq=50.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        tie_word_embeddings=False)),
}


def make_hf_model(name: str, seed: int = 0):
  model_type, extra = FAMILIES[name]
  config = transformers.AutoConfig.for_model(model_type, **{**BASE, **extra})
  torch.manual_seed(seed)
  # Eager attention: the one HF path that applies Gemma's attention soft-capping.
  kw = {"attn_implementation": "eager"} if model_type == "gemma3_text" else {}
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kw)
  with torch.no_grad():  # HF initialises norms to 1; randomise them so the scales are tested too
    for n, p in model.named_parameters():
      if n.endswith("norm.weight") or n.endswith(".bias"):
        p.add_(0.1 * torch.randn_like(p))
  return model.eval()


def save_hf_model(name: str, directory: str, seed: int = 0):
  model = make_hf_model(name, seed)
  os.makedirs(directory, exist_ok=True)
  model.save_pretrained(directory, safe_serialization=True)
  return model


def save_hf_model_with(directory: str, model_type: str = "llama", seed: int = 0, **overrides):
  """Saves a random model of `model_type` with BASE settings overridden (e.g. a real vocab size)."""
  config = transformers.AutoConfig.for_model(model_type, **{**BASE, **overrides})
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  os.makedirs(directory, exist_ok=True)
  model.save_pretrained(directory, safe_serialization=True)
  return model


def save_tiny_gemma_with_real_tokenizer(directory: str) -> str:
  """A tiny random Gemma 3 (FAMILIES["gemma3"]) with Gemma-3-270M's real tokenizer: a base model (BOS, no chat
  template, V = 262,144). Returns `directory`."""
  real = hub.resolve("gemma3-270m")
  model_type, extra = FAMILIES["gemma3"]
  save_hf_model_with(directory, model_type=model_type,
                     **{**extra, "vocab_size": 262144, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0})
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(real, name), os.path.join(directory, name))
  return directory
