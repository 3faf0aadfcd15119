"""Loading the target, `load_target(spec)` → `Target`, and the calls the analysis and decoding make on it.

`Target` bundles the NNX model split into `(graphdef, params)` (plain pytrees for jit, orbax and shardings),
its `ModelConfig`, tokenizer and mesh. The functions beside it:

* `forward_fn`: the jitted, cache-free forward over `[B, T]` tokens (`Target.forward`, the analysis);
* `cached_forward`: new tokens against a `KVCache` under any mask among them, un-jitted because it runs
  inside the jitted decoding loops (prefill, decoding, and the speculative loop's verification of a chain or
  a tree);
* `new_cache` and `pad_prompts`: the decoding loops' cache (batch over `'data'`) and right-padded prompts;
* `over_positions`: a per-position function of the final states (the LM head and what is reduced from its
  logits: token entropy, top-1) a block of positions at a time, so that [B, T, V] logits never exist at once
  (1 MiB per token in float32 for Gemma 3's V = 262,144). The analysis and the feature extraction use it.

The draft-training step merges the target inside its own jitted step instead (`layerwave.training.step`).

Legend (`layerwave.axes`): B batch, T tokens, P prompt width, S cache slots, G key/value heads, Dh head width,
L target layers, D target width, V target vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from layerwave import sharding
from layerwave.models import attention
from layerwave.models import hub
from layerwave.models import safetensors_loading
from layerwave.models.config import ModelConfig
from layerwave.models.kv_cache import KVCache, causal_mask
from layerwave.models.target import TargetOutput, Transformer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def parse_dtype(dtype: Any):
  """'float32' / 'bfloat16' / 'float16' (or the jnp dtype itself) → jnp dtype."""
  if isinstance(dtype, str):
    if dtype not in DTYPES:
      raise ValueError(f"Unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}.")
    return DTYPES[dtype]
  for value in DTYPES.values():
    if jnp.dtype(dtype) == jnp.dtype(value):
      return value
  raise ValueError(f"Unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}.")


@dataclasses.dataclass
class Target:
  """A loaded target LLM.

  Attributes:
    config: the model's `ModelConfig` (`num_layers` L, `hidden_size` D, `vocab_size` V, ...).
    graphdef: the NNX graph definition (static).
    params: the NNX parameter state (a pytree of arrays placed on `mesh`).
    tokenizer: a transformers tokenizer with the chat template, or None if the checkpoint has none.
    mesh: the device mesh the parameters live on.
    path: the local checkpoint directory.
    spec: what `load_target` was given (a short name, a directory, a `.gguf` file): what records of a run
      name the target by, so that `load_target(spec)` loads it again.
  """

  config: ModelConfig
  graphdef: Any
  params: Any
  tokenizer: Any
  mesh: Mesh
  path: str | None = None
  spec: str | None = None

  @property
  def model(self) -> Transformer:
    return nnx.merge(self.graphdef, self.params)

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    ids = set(self.config.eos_token_ids)
    if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
      ids.add(int(self.tokenizer.eos_token_id))
    return tuple(sorted(ids))

  def forward(self, input_ids, attention_mask=None, return_hidden_states: bool = False
              ) -> TargetOutput:
    """Full forward over a batch.

    Args:
      input_ids: `[B, T]` token ids (array or nested lists of equal length).
      attention_mask: optional `[B, T]`, 1 for real tokens, 0 for padding (left or right).
      return_hidden_states: also return `[L+1, B, T, D]` hidden states (HF convention).

    Returns:
      `TargetOutput` with `logits [B, T, V]` and `hidden_states` (or None).
    """
    tokens = np.asarray(input_ids)
    if tokens.ndim != 2 or tokens.size == 0:
      raise ValueError(f"input_ids must be a non-empty [B, T] array, got shape {tokens.shape}.")
    mask = np.ones_like(tokens) if attention_mask is None else np.asarray(attention_mask)
    if mask.shape != tokens.shape:
      raise ValueError(f"attention_mask shape {mask.shape} differs from input_ids {tokens.shape}.")
    check_token_ids(tokens, self.config.vocab_size)
    sharding.check_batch(self.mesh, tokens.shape[0])
    batch = sharding.batch_sharding(self.mesh)
    tokens = jax.device_put(tokens.astype(np.int32), batch)
    mask = jax.device_put(mask.astype(np.int32), batch)
    return forward_fn(self.graphdef, self.params, tokens, mask,
                      return_hidden_states=return_hidden_states)


def target_fingerprint(target: Target) -> str:
  """A hex sha256 of what fixes the target's outputs: its `ModelConfig` and every parameter's name, dtype,
  shape and bytes.

  Stages that store what the target computed (the feature store, regenerated answers) record it, and refuse
  to mix their output with another target's. The parameters are hashed as loaded, so the same checkpoint
  loaded in another dtype is another target. It hashes every parameter's bytes: one pass over the whole model.
  """
  digest = hashlib.sha256()
  digest.update(json.dumps(target.config.identity(), sort_keys=True, default=str).encode())
  for path, leaf in jax.tree_util.tree_leaves_with_path(target.params):
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      leaf = multihost_utils.process_allgather(leaf, tiled=True)
    value = np.ascontiguousarray(np.asarray(leaf))
    digest.update(f"{jax.tree_util.keystr(path)}|{value.dtype}|{value.shape}".encode())
    digest.update(value.reshape(-1).view(np.uint8))
  return digest.hexdigest()


def check_token_ids(tokens: np.ndarray, vocab_size: int) -> None:
  if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
    raise ValueError(f"Token ids must lie in [0, {vocab_size}); got range "
                     f"[{tokens.min()}, {tokens.max()}].")


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
  """RoPE positions `[B, T]`: the index among real tokens (correct for left and right padding)."""
  return jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0).astype(jnp.int32)


LOGITS_CHUNK = 128  # positions whose [LOGITS_CHUNK, V] logits exist at once (128 MiB float32 for V = 262,144)


def over_positions(h: jax.Array, fn, chunk: int = LOGITS_CHUNK):
  """`fn` applied to the positions of `h` a block of `chunk` positions at a time (`jax.lax.map`).

  Equal to `fn(h.reshape(-1, D))` reshaped back to [B, T, ...] when `fn` treats positions independently (the
  LM head and any reduction over V), but only one block's intermediates ([chunk, V] logits) exist at once.

  Args:
    h: [B, T, D] states (`TargetOutput.last_hidden`).
    fn: [n, D] → a pytree of [n, ...] arrays, position by position.
    chunk: positions per block (B * T need not be a multiple: the last block is padded and cut).

  Returns:
    `fn`'s pytree with each leaf [B, T, ...].
  """
  b, t, d = h.shape
  n = b * t
  chunk = max(1, min(int(chunk), n))
  flat = jnp.pad(h.reshape(n, d), ((0, -n % chunk), (0, 0)))
  out = jax.lax.map(fn, flat.reshape(-1, chunk, d))
  return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:])[:n].reshape(b, t, *a.shape[2:]), out)


@functools.partial(jax.jit, static_argnames=("graphdef", "return_hidden_states", "hidden_layers",
                                             "compute_logits"))
def forward_fn(graphdef, params, tokens, attention_mask, *, return_hidden_states=False,
               hidden_layers=None, compute_logits=True) -> TargetOutput:
  """Cache-free forward. `tokens`, `attention_mask`: `[B, T]`."""
  model = nnx.merge(graphdef, params)
  return model(tokens, positions_from_mask(attention_mask), causal_mask(attention_mask),
               return_hidden_states=return_hidden_states, hidden_layers=hidden_layers,
               compute_logits=compute_logits, valid=attention_mask)


def compute_dtype(graphdef, params):
  """The compute dtype a model was built with (`Transformer` / `Draft`): the dtype of its KV cache."""
  return nnx.merge(graphdef, params).compute_dtype


def logits_fn(graphdef, params):
  return nnx.merge(graphdef, params).logits


def cached_forward(graphdef, params, tokens, positions, mask, cache, lengths, *,
                   return_hidden_states=False, hidden_layers=None, compute_logits=True,
                   read_slots=None, valid=None) -> TargetOutput:
  """New tokens `[B, T]` against `cache` (un-jitted: called inside larger jitted loops).

  Args:
    graphdef, params: the target.
    tokens: `[B, T]` new tokens.
    positions: `[B, T]` their RoPE positions.
    mask: `[B, T, T]` which new tokens each new token may read (causal for a chain, ancestors for a tree).
    cache: a `KVCache`; the new entries are written at slots `lengths[b] + i`.
    lengths: `[B]` committed prefix length per row.
    return_hidden_states, hidden_layers, compute_logits, read_slots: as `Transformer.__call__`.
    valid: `[B, T]` real tokens of a prefill into an empty cache (`lengths` zero, `mask` `causal_mask(valid)`):
      its attention then runs through the target's kernel (`Transformer.__call__`).

  Returns:
    `TargetOutput` with the updated cache (the caller commits by advancing `lengths`).
  """
  model = nnx.merge(graphdef, params)
  return model(tokens, positions, mask, cache, lengths, return_hidden_states=return_hidden_states,
               hidden_layers=hidden_layers, compute_logits=compute_logits, read_slots=read_slots,
               valid=valid)


def load_target(spec: str, dtype: Any = "float32", mesh: Mesh | None = None,
                mesh_spec: sharding.MeshSpec = sharding.DEFAULT_MESH, attention_impl: str = "auto") -> Target:
  """Loads a Llama-family target LLM.

  Args:
    spec: a short name (`smollm2-135m-instruct`), an HF checkpoint directory, a `.gguf` file (converted
      once into `$LAYERWAVE_CACHE`), or a hub id where a network exists.
    dtype: parameter/compute dtype: 'float32' (default), 'bfloat16' or 'float16'.
    mesh: the device mesh; built from `mesh_spec` when None.
    mesh_spec: axes for a new mesh, e.g. `(('data', -1),)` or `(('data', -1), ('model', 2))`.
    attention_impl: the kernel of cache-free causal forwards (`with_attention`); "auto" by the mesh's platform.

  Returns:
    A `Target`.
  """
  dtype = parse_dtype(dtype)
  path = hub.resolve(spec)
  config = ModelConfig.from_pretrained(path)
  mesh = sharding.make_mesh(mesh_spec) if mesh is None else mesh
  model = safetensors_loading.load_params(config, path, mesh, dtype)  # slice by slice, onto the mesh
  graphdef, params = nnx.split(model)
  target = Target(config=config, graphdef=graphdef, params=params, tokenizer=_load_tokenizer(path),
                  mesh=mesh, path=path, spec=str(spec))
  return with_attention(target, attention_impl)


def with_dtype(target: Target, dtype: Any) -> Target:
  """The same target computing in `dtype`: its parameters cast once (no reload), its modules built for it.

  What `load_target(spec, dtype)` loads (a float32 checkpoint rounded to bfloat16 either way), without reading
  the checkpoint again: the training forwards that may run in bfloat16 (`features.compute_dtype`,
  `train.target_dtype`) take it beside the float32 target that evaluates. Only a float32 target (or the dtype
  it already has) can be cast: widening bfloat16 would not restore the checkpoint's float32 values.

  Args:
    target: a loaded `Target`.
    dtype: 'float32', 'bfloat16' or 'float16'.

  Returns:
    `target` itself when it computes in `dtype` already; else a `Target` sharing its config, tokenizer and
    mesh, with parameters in `dtype` (placed as the originals).
  """
  want = jnp.dtype(parse_dtype(dtype))
  have = jnp.dtype(compute_dtype(target.graphdef, target.params))
  if have == want:
    return target
  if have != jnp.dtype(jnp.float32):
    raise ValueError(f"Cannot cast a {have.name} target to {want.name}: load it in float32 "
                     f"(load_target(spec, dtype='float32')) or in {want.name} directly.")
  have_model = nnx.merge(target.graphdef, target.params)
  abstract = nnx.eval_shape(lambda: Transformer(target.config, dtype=want, rngs=nnx.Rngs(0),
                                                attention_impl=have_model.attention_impl, mesh=have_model.mesh))
  graphdef, _ = nnx.split(abstract)
  params = jax.tree.map(lambda x: x.astype(want), target.params)
  return dataclasses.replace(target, graphdef=graphdef, params=params)


def with_attention(target: Target, impl: str = "auto") -> Target:
  """The same target with its cache-free causal forwards through `impl` (`attention.causal_attention`'s kernels;
  "auto": the kernel for the platform of the target's mesh, "xla" on CPU, "splash" on TPU, "cudnn" on GPU).
  No parameter moves: only the static graph changes."""
  impl = attention.default_impl(target.mesh.devices.flat[0].platform) if impl == "auto" else impl
  if impl not in attention.IMPLS:
    raise ValueError(f"Unknown attention kernel {impl!r}: choose among {list(attention.IMPLS)} or 'auto'.")
  model = nnx.merge(target.graphdef, target.params)
  model.attention_impl, model.mesh = impl, (None if impl == "xla" else target.mesh)
  graphdef, params = nnx.split(model)
  return dataclasses.replace(target, graphdef=graphdef, params=params)


def _load_tokenizer(path: str):
  if not any(os.path.exists(os.path.join(path, f))
             for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
    logging.warning("%s has no tokenizer files; Target.tokenizer is None.", path)
    return None
  import transformers  # pylint: disable=g-import-not-at-top
  return transformers.AutoTokenizer.from_pretrained(path)


def cache_spec(config: ModelConfig, mesh: Mesh) -> jax.sharding.PartitionSpec:
  """The KV cache's `[B, S, G, Dh]` layout: batch over `'data'`; KV heads over `'model'` when they divide it,
  as the k/v projections split their heads there, so each device keeps only the heads it computes."""
  model = mesh.shape.get("model", 1)
  heads = "model" if model > 1 and config.num_kv_heads % model == 0 else None
  return jax.sharding.PartitionSpec("data", None, heads, None)


def new_cache(config: ModelConfig, batch: int, slots: int, dtype, mesh: Mesh) -> KVCache:
  """A zero cache placed as `cache_spec` says (call inside jit)."""
  cache = KVCache.zeros(config, batch, slots, dtype)
  spec = jax.sharding.NamedSharding(mesh, cache_spec(config, mesh))
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, spec), cache)


def pad_prompts(prompt_ids: Sequence[Sequence[int]], vocab_size: int, multiple: int,
                bucket: int = 16, min_width: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
  """Right-pads prompts into `[B', P]` (B' rounded up to `multiple`, P to `bucket`, at least `min_width`).

  A fixed `min_width` (≥ every prompt) gives every batch the same shape, hence one compilation.

  Returns:
    (tokens, lengths, real batch size). Padding rows repeat the first prompt and are dropped later.
  """
  if isinstance(prompt_ids, np.ndarray):
    prompt_ids = prompt_ids.tolist()
  if not prompt_ids or isinstance(prompt_ids[0], (int, np.integer)):
    raise ValueError("prompt_ids must be a non-empty list of token-id lists (one per prompt).")
  for i, p in enumerate(prompt_ids):
    if len(p) == 0:
      raise ValueError(f"Prompt {i} is empty: every prompt needs at least one token.")
  n = len(prompt_ids)
  rows = list(prompt_ids) + [prompt_ids[0]] * (-n % multiple)
  width = -(-max(max(len(p) for p in rows), int(min_width)) // bucket) * bucket
  tokens = np.zeros((len(rows), width), np.int32)
  for i, p in enumerate(rows):
    tokens[i, :len(p)] = p
  check_token_ids(tokens, vocab_size)
  return tokens, np.asarray([len(p) for p in rows], np.int32), n
