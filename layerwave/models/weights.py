"""Checkpoint → Flax parameters: Hugging Face safetensors directories and llama GGUF files.

One loader serves both formats: a GGUF file is converted once into an HF-layout directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with the chat template) in a cache outside the
repository, and from then on it is an ordinary HF checkpoint. No pickle is ever read.

Naming: the Flax target mirrors HF's attribute names, so `model.layers.3.self_attn.q_proj.weight` is the
parameter at path `('layers', 3, 'self_attn', 'q_proj', 'kernel')`, transposed (HF stores `[out, in]`).
"""

from __future__ import annotations

import json
import os
from typing import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from layerwave import atomic
from layerwave.models.config import ModelConfig
from layerwave.models.target import Transformer

# Tensors that HF checkpoints may carry but that are derived, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
CONVERTER_VERSION = 1


def _hf_name(path: tuple) -> tuple[str, bool]:
  """Flax parameter path → (HF tensor name, whether it is transposed)."""
  *prefix, leaf = [str(p) for p in path]
  base = ".".join(prefix)
  if leaf == "embedding":
    return "model.embed_tokens.weight", False
  if prefix == ["lm_head"]:
    return "lm_head.weight", True
  name = "model." + base + (".bias" if leaf == "bias" else ".weight")
  return name, leaf == "kernel"


def read_safetensors(directory: str) -> dict[str, np.ndarray]:
  """Reads `model.safetensors` or a sharded `model.safetensors.index.json` into numpy float arrays."""
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  single = os.path.join(directory, "model.safetensors")
  index = os.path.join(directory, "model.safetensors.index.json")
  if os.path.exists(single):
    files = [single]
  elif os.path.exists(index):
    with open(index) as f:
      files = sorted({os.path.join(directory, v) for v in json.load(f)["weight_map"].values()})
  else:
    raise FileNotFoundError(
        f"No weights in {directory}: expected model.safetensors or model.safetensors.index.json "
        "(pickled pytorch_model.bin checkpoints are not read; re-save with safe_serialization=True).")
  tensors = {}
  for file in files:
    with safe_open(file, framework="flax") as f:  # the flax reader understands bfloat16
      for key in f.keys():
        tensors[key] = np.asarray(f.get_tensor(key).astype(jnp.float32))
  return tensors


def params_from_hf(config: ModelConfig, tensors: Mapping[str, np.ndarray], dtype=jnp.float32,
                   sharding_fn=None) -> Transformer:
  """Builds a `Transformer` from HF-named tensors, checking names and shapes.

  Args:
    config: the model's config.
    tensors: HF tensor name → array (`[out, in]` for projections).
    dtype: parameter dtype.
    sharding_fn: optional `(path, array) -> jax.Array` placing each parameter (e.g. on a mesh).

  Returns:
    The model with the checkpoint's weights.

  Raises:
    ValueError: naming every missing, unexpected or wrongly shaped tensor.
  """
  abstract = nnx.eval_shape(lambda: Transformer(config, dtype=dtype, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  flat = nnx.to_flat_state(state)
  expected = {}
  for path, var in flat:
    name, transposed = _hf_name(path)
    expected[name] = (path, transposed, var.shape)
  present = {k for k in tensors if not k.endswith(_IGNORED_SUFFIXES)}
  if config.tie_word_embeddings:
    present.discard("lm_head.weight")  # some tied checkpoints still store the shared matrix
  missing = sorted(set(expected) - present)
  extra = sorted(present - set(expected))
  problems = []
  if missing:
    problems.append(f"missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
  if extra:
    problems.append(f"unexpected tensors: {extra[:8]}{' ...' if len(extra) > 8 else ''}")
  for name, (path, transposed, shape) in expected.items():
    if name in tensors:
      got = tuple(tensors[name].shape[::-1] if transposed else tensors[name].shape)
      if got != tuple(shape):
        problems.append(f"{name} has shape {tuple(tensors[name].shape)}, expected "
                        f"{tuple(shape[::-1]) if transposed else tuple(shape)}")
  if problems:
    raise ValueError("Checkpoint does not match its config.json (" + config.model_type + "): "
                     + "; ".join(problems))
  values = []
  for path, var in flat:
    name, transposed = _hf_name(path)
    arr = np.asarray(tensors[name], np.float32)
    arr = arr.T if transposed else arr
    value = jnp.asarray(arr, dtype) if sharding_fn is None else sharding_fn(path, arr.astype(dtype))
    values.append((path, var.replace(value)))
  state = nnx.from_flat_state(values)
  return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------------------------------
# GGUF (llama architecture) → HF-layout directory.

_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's rope row permutation of a Q or K projection `[n*d, in]`."""
  rows = w.shape[0]
  return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def _field(reader, key, default=None):
  f = reader.fields.get(key)
  if f is None:
    return default
  return f.contents()


def convert_gguf(gguf_path: str, out_dir: str) -> str:
  """Dequantizes a llama-architecture GGUF into an HF-layout directory, atomically.

  The directory is written under a temporary name next to `out_dir` and renamed into place, so an
  interrupted conversion never leaves a half-written checkpoint.

  Returns:
    `out_dir`.

  Raises:
    ValueError: for another architecture or a truncated/corrupt file.
  """
  import gguf  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  try:
    reader = gguf.GGUFReader(gguf_path)
  except Exception as e:  # gguf raises assorted errors (ValueError, struct.error, ...) on bad files
    raise ValueError(f"Cannot read GGUF file {gguf_path}: it is truncated or corrupt ({e!r}).") from e
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise ValueError(f"GGUF file {gguf_path} has architecture {arch!r}; layerwave converts only "
                     "'llama' GGUF files (use an HF safetensors directory for other families).")
  n_head = int(_field(reader, "llama.attention.head_count"))
  n_kv = int(_field(reader, "llama.attention.head_count_kv", n_head))
  hidden = int(_field(reader, "llama.embedding_length"))
  tensors = {}
  try:
    for t in reader.tensors:
      w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
      w = w.reshape([int(s) for s in reversed(t.shape)])
      parts = t.name.split(".")
      if t.name == "token_embd.weight":
        name = "model.embed_tokens.weight"
      elif t.name == "output_norm.weight":
        name = "model.norm.weight"
      elif t.name == "output.weight":
        name = "lm_head.weight"
      elif parts[0] == "blk" and parts[2] in _GGUF_NAMES:
        name = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[-1]}"
        if parts[2] == "attn_q":
          w = _unpermute(w, n_head)
        elif parts[2] == "attn_k":
          w = _unpermute(w, n_kv)
      else:
        continue  # e.g. rope_freqs: recomputed from the config
      tensors[name] = np.ascontiguousarray(w)
  except (ValueError, IndexError, TypeError) as e:
    raise ValueError(f"GGUF file {gguf_path} is truncated or corrupt: {e!r}") from e
  vocab = int(_field(reader, "llama.vocab_size", 0) or len(reader.fields["tokenizer.ggml.tokens"].data))
  head_dim = int(_field(reader, "llama.rope.dimension_count", hidden // n_head))
  bos = _field(reader, "tokenizer.ggml.bos_token_id")
  eos = _field(reader, "tokenizer.ggml.eos_token_id")
  config = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": vocab, "hidden_size": hidden,
      "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
      "num_hidden_layers": int(_field(reader, "llama.block_count")),
      "num_attention_heads": n_head, "num_key_value_heads": n_kv, "head_dim": head_dim,
      "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
      "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
      "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
      "tie_word_embeddings": "lm_head.weight" not in tensors,
      "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
      "bos_token_id": None if bos is None else int(bos),
      "eos_token_id": None if eos is None else int(eos),
      "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
      "torch_dtype": "float32",
      "layerwave_source": {"gguf": os.path.basename(gguf_path), "converter": CONVERTER_VERSION},
  }
  with atomic.atomic_directory(out_dir, prefix=".tmp-convert-") as tmp:
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    _write_gguf_tokenizer(reader, tmp, config)
  return out_dir


def _write_gguf_tokenizer(reader, out_dir: str, config: dict) -> None:
  """Writes tokenizer.json + tokenizer_config.json from a GGUF's byte-level BPE (`gpt2`) vocabulary."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers  # pylint: disable=g-import-not-at-top
  model = _field(reader, "tokenizer.ggml.model")
  if model != "gpt2":
    raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2').")
  tokens = list(_field(reader, "tokenizer.ggml.tokens"))
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
  types = list(_field(reader, "tokenizer.ggml.token_type"))
  pre = _field(reader, "tokenizer.ggml.pre", "default")
  tok = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                        fuse_unk=False, byte_fallback=False))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in ("smollm", "starcoder", "refact", "command-r", "codeshell"):
    # llama.cpp splits every digit on its own before the GPT-2 regex for these vocabularies.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
  elif pre in ("default", "gpt2", None):
    tok.pre_tokenizer = byte_level
  else:
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported by layerwave's converter.")
  tok.decoder = decoders.ByteLevel()
  special = [tokenizers.AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, types) if ty == 3]  # 3 = control token
  tok.add_special_tokens(special)
  tok.save(os.path.join(out_dir, "tokenizer.json"))

  def name(i):
    return None if i is None else tokens[int(i)]

  tok_config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "model_max_length": config["max_position_embeddings"],
      "bos_token": name(config["bos_token_id"]),
      "eos_token": name(config["eos_token_id"]),
      "pad_token": name(config["pad_token_id"]),
      "unk_token": name(_field(reader, "tokenizer.ggml.unknown_token_id")),
      "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
      "clean_up_tokenization_spaces": False,
      "chat_template": _field(reader, "tokenizer.chat_template"),
  }
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(tok_config, f, indent=2)
