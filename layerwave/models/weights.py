"""Checkpoint → Flax parameters: Hugging Face safetensors directories and llama / gemma3 GGUF files.

One loader serves both formats: a GGUF file is converted once into an HF-layout directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with the chat template) in a cache outside the
repository, and from then on it is an ordinary HF checkpoint. No pickle is ever read. `load_target` reads
safetensors slice by slice onto the mesh (`safetensors_loading`), with the name and shape checks defined here.

Naming: the Flax target mirrors HF's attribute names, so `model.layers.3.self_attn.q_proj.weight` is the
parameter at path `('layers', 3, 'self_attn', 'q_proj', 'kernel')`, transposed (HF stores `[out, in]`).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from layerwave import atomic
from layerwave.models.config import ModelConfig
from layerwave.models.target import Transformer

# Tensors that HF checkpoints may carry but that are derived, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
CONVERTER_VERSION = 1


def hf_name(path: tuple) -> tuple[str, bool]:
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
  """Reads `model.safetensors` or a sharded `model.safetensors.index.json` into numpy float arrays.

  The whole checkpoint in float32 host memory: for tests and small models. `load_target` reads large ones
  slice by slice onto the mesh instead (`safetensors_loading.load_params`).
  """
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


def abstract_model(config: ModelConfig, dtype=jnp.float32) -> tuple[nnx.GraphDef, list[tuple[tuple, Any]]]:
  """The model's graph and its parameters as `(path, abstract variable)` pairs (shapes only, no memory)."""
  abstract = nnx.eval_shape(lambda: Transformer(config, dtype=dtype, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  return graphdef, list(nnx.to_flat_state(state))


def check_checkpoint(config: ModelConfig, flat, shapes: Mapping[str, Sequence[int]]) -> None:
  """Checks a checkpoint's tensor names and shapes against the model's parameters.

  Args:
    config: the model's config.
    flat: `abstract_model`'s `(path, variable)` pairs.
    shapes: HF tensor name → its shape as stored (`[out, in]` for projections).

  Raises:
    ValueError: naming every missing, unexpected or wrongly shaped tensor. `rotary_emb.inv_freq` is ignored,
      and a tied model tolerates a stored `lm_head.weight`.
  """
  expected = {}
  for path, var in flat:
    name, transposed = hf_name(path)
    expected[name] = (transposed, tuple(var.shape))
  present = {k for k in shapes if not k.endswith(_IGNORED_SUFFIXES)}
  if config.tie_word_embeddings:
    present.discard("lm_head.weight")  # some tied checkpoints still store the shared matrix
  missing = sorted(set(expected) - present)
  extra = sorted(present - set(expected))
  problems = []
  if missing:
    problems.append(f"missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
  if extra:
    problems.append(f"unexpected tensors: {extra[:8]}{' ...' if len(extra) > 8 else ''}")
  for name, (transposed, shape) in expected.items():
    if name in shapes:
      stored = tuple(shapes[name])
      if (stored[::-1] if transposed else stored) != shape:
        problems.append(f"{name} has shape {stored}, expected {shape[::-1] if transposed else shape}")
  if problems:
    raise ValueError("Checkpoint does not match its config.json (" + config.model_type + "): "
                     + "; ".join(problems))


def merge_model(graphdef: nnx.GraphDef, flat, value_fn: Callable[[tuple, Any], Any]) -> Transformer:
  """The model whose parameter at each path of `flat` is `value_fn(path, abstract variable)`."""
  state = nnx.from_flat_state([(path, var.replace(value_fn(path, var))) for path, var in flat])
  return nnx.merge(graphdef, state)


def params_from_hf(config: ModelConfig, tensors: Mapping[str, np.ndarray], dtype=jnp.float32,
                   sharding_fn=None) -> Transformer:
  """Builds a `Transformer` from HF-named tensors in memory, checking names and shapes.

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
  graphdef, flat = abstract_model(config, dtype)
  check_checkpoint(config, flat, {k: v.shape for k, v in tensors.items()})

  def value(path, var):
    del var
    name, transposed = hf_name(path)
    arr = np.asarray(tensors[name], np.float32)
    arr = arr.T if transposed else arr
    return jnp.asarray(arr, dtype) if sharding_fn is None else sharding_fn(path, arr.astype(dtype))

  return merge_model(graphdef, flat, value)


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


_GEMMA3_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# What llama.cpp fixes in code for gemma3 rather than storing in the file (llama-model.cpp): every 6th block
# is global, the sliding blocks' RoPE base is 10,000, and scores are scaled by 1/sqrt(key_length).
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0


def convert_gguf(gguf_path: str, out_dir: str) -> str:
  """Dequantizes a llama- or gemma3-architecture GGUF into an HF-layout directory, atomically.

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
  if arch not in ("llama", "gemma3"):
    raise ValueError(f"GGUF file {gguf_path} has architecture {arch!r}; layerwave converts only "
                     "'llama' and 'gemma3' GGUF files (use an HF safetensors directory for other families).")
  gemma = arch == "gemma3"
  n_head = int(_field(reader, f"{arch}.attention.head_count"))
  n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
  hidden = int(_field(reader, f"{arch}.embedding_length"))
  names = _GEMMA3_GGUF_NAMES if gemma else _GGUF_NAMES
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
      elif parts[0] == "blk" and parts[2] in names:
        name = f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[-1]}"
        if not gemma and parts[2] == "attn_q":  # gemma3's rope is NeoX-style: stored unpermuted
          w = _unpermute(w, n_head)
        elif not gemma and parts[2] == "attn_k":
          w = _unpermute(w, n_kv)
      else:
        continue  # e.g. rope_freqs: recomputed from the config
      if gemma and name.endswith("norm.weight"):
        w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norm scales with the 1 added
      tensors[name] = np.ascontiguousarray(w)
  except (ValueError, IndexError, TypeError) as e:
    raise ValueError(f"GGUF file {gguf_path} is truncated or corrupt: {e!r}") from e
  vocab = int(_field(reader, f"{arch}.vocab_size", 0) or len(reader.fields["tokenizer.ggml.tokens"].data))
  head_dim = int(_field(reader, f"{arch}.attention.key_length", 0)
                 or _field(reader, f"{arch}.rope.dimension_count", hidden // n_head))
  bos = _field(reader, "tokenizer.ggml.bos_token_id")
  eos = _field(reader, "tokenizer.ggml.eos_token_id")
  num_layers = int(_field(reader, f"{arch}.block_count"))
  config = {
      "architectures": ["Gemma3ForCausalLM" if gemma else "LlamaForCausalLM"],
      "model_type": "gemma3_text" if gemma else "llama",
      "vocab_size": vocab, "hidden_size": hidden,
      "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
      "num_hidden_layers": num_layers,
      "num_attention_heads": n_head, "num_key_value_heads": n_kv, "head_dim": head_dim,
      "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
      "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
      "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
      "tie_word_embeddings": "lm_head.weight" not in tensors,
      "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
      "bos_token_id": None if bos is None else int(bos),
      "eos_token_id": None if eos is None else int(eos),
      "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
      "torch_dtype": "float32",
      "layerwave_source": {"gguf": os.path.basename(gguf_path), "converter": CONVERTER_VERSION},
  }
  if gemma:
    del config["hidden_act"], config["mlp_bias"]
    config.update(
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=head_dim,
        sliding_window=int(_field(reader, "gemma3.attention.sliding_window")),
        layer_types=["sliding_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN else "full_attention"
                     for i in range(num_layers)],
        rope_local_base_freq=GEMMA3_LOCAL_ROPE_BASE, final_logit_softcapping=None,
        attn_logit_softcapping=None)
  with atomic.atomic_directory(out_dir, prefix=".tmp-convert-") as tmp:
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    _write_gguf_tokenizer(reader, tmp, config)
  return out_dir


def _write_gguf_tokenizer(reader, out_dir: str, config: dict) -> None:
  """Writes tokenizer.json + tokenizer_config.json from a GGUF's vocabulary: byte-level BPE (`gpt2`), or
  Gemma's SentencePiece BPE (`llama` model in a gemma3 file)."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers  # pylint: disable=g-import-not-at-top
  model = _field(reader, "tokenizer.ggml.model")
  tokens = list(_field(reader, "tokenizer.ggml.tokens"))
  if model == "llama" and config["model_type"] == "gemma3_text":
    tok = gemma_sentencepiece_tokenizer(tokens, list(_field(reader, "tokenizer.ggml.token_type")),
                                        bool(_field(reader, "tokenizer.ggml.add_bos_token", True)),
                                        config["bos_token_id"],
                                        _field(reader, "tokenizer.ggml.unknown_token_id"))
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    _write_tokenizer_config(reader, out_dir, config, tokens)
    return
  if model != "gpt2":
    raise ValueError(f"GGUF tokenizer model {model!r} is not supported (byte-level BPE 'gpt2', or "
                     "SentencePiece 'llama' in a gemma3 file).")
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
  _write_tokenizer_config(reader, out_dir, config, tokens)


def _write_tokenizer_config(reader, out_dir: str, config: dict, tokens: list[str]) -> None:
  """tokenizer_config.json: the special tokens by name, BOS handling and the chat template (if any)."""

  def name(i):
    return None if i is None else tokens[int(i)]

  tok_config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "model_max_length": config["max_position_embeddings"],
      "bos_token": name(config["bos_token_id"]),
      "eos_token": name(config["eos_token_id"]),
      "pad_token": name(config["pad_token_id"]),
      "unk_token": name(_field(reader, "tokenizer.ggml.unknown_token_id")),
      "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token",
                                   config["model_type"] == "gemma3_text")),
      "clean_up_tokenization_spaces": False,
      "chat_template": _field(reader, "tokenizer.chat_template"),
  }
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(tok_config, f, indent=2)


def gemma_sentencepiece_tokenizer(tokens: list[str], types: list[int], add_bos: bool, bos_id: int | None,
                                  unk_id: int | None = None):
  """Gemma's SentencePiece BPE as a `tokenizers.Tokenizer`, from a GGUF's token list and token types.

  SentencePiece BPE merges the adjacent pair whose result ranks best; a GGUF keeps no merge list, and
  Gemma's pieces are stored best-first (the scores of normal pieces are minus their rank), so the merges
  are every split of a normal or user-defined piece into two pieces of the vocabulary, ranked by the
  merged piece's id (for one piece, the longer left part first). Text is not pre-split: spaces become
  '▁' and there is no prefix space. Unknown bytes fall back to the `<0xNN>` pieces. Control tokens
  (type 3) are special tokens and user-defined ones (type 4: newlines, tabs, HTML tags) are matched whole;
  the whitespace-run pieces are stored with real spaces, and are spelt with '▁' here like every other.

  Args:
    tokens: the GGUF's `tokenizer.ggml.tokens`, id order.
    types: its `tokenizer.ggml.token_type` (1 normal, 3 control, 4 user-defined, 6 byte).
    add_bos: prepend the BOS token to every encoded sequence.
    bos_id: the BOS token's id.
    unk_id: the unknown token's id (what an unknown piece becomes when no byte piece covers it).

  Returns:
    The tokenizer.
  """
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, normalizers, processors  # pylint: disable=g-import-not-at-top
  pieces = [t.replace(" ", "\u2581") if t and not t.strip(" ") else t for t in tokens]
  vocab = {}
  for i, piece in enumerate(pieces):
    vocab.setdefault(piece, i)
  merges = []
  for i, piece in enumerate(pieces):
    if types[i] not in (1, 4) or len(piece) < 2 or vocab[piece] != i:
      continue
    for cut in range(len(piece) - 1, 0, -1):  # the longer left part first
      left, right = piece[:cut], piece[cut:]
      if left in vocab and right in vocab:
        merges.append((left, right))
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                                        unk_token=None if unk_id is None else tokens[int(unk_id)]))
  tok.normalizer = normalizers.Replace(" ", "\u2581")
  tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                          for t, ty in zip(tokens, types) if ty == 3])
  tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                  for t, p, ty in zip(tokens, pieces, types) if ty == 4 and t == p])
  if add_bos and bos_id is not None:
    bos = tokens[bos_id]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
  return tok
