"""The target LLM in Flax NNX: a Llama-family or Gemma 3 decoder that returns every layer's hidden states.

This is the first stage of the pipeline: the analysis reads its hidden states, the draft trains on them and
the speculative loop verifies with it. One forward serves every use:

* a plain forward over `[B, T]` tokens (analysis, training), causal with padding masked;
* prefill and cached decoding against a preallocated, functional `KVCache` (arrays in, arrays out);
* verification of several new tokens against the cache under any mask among them (a chain or a tree).

The cache, how new tokens are written into it and what each one reads are `layerwave.models.kv_cache`.
Gemma 3's sliding layers read only keys less than `sliding_window` positions behind the query, in all three
uses (`kv_cache.window_mask`); the cache itself stays full length, so a window never needs a ring buffer.

Hidden states follow Hugging Face's convention (docs/METHOD.md §1): index 0 is the embedding output,
index i (1 <= i < L) the output of block i-1, index L the final RMSNorm of the last block's output.

Legend (`layerwave.axes`): B batch, T tokens, L target layers, D target width, V target vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax import struct

from layerwave.models import attention
from layerwave.models import kv_cache
from layerwave.models import layers
from layerwave.models.config import ModelConfig
from layerwave.models.kv_cache import KVCache

Array = jax.Array


@struct.dataclass
class TargetOutput:
  """What one target call returns.

  Attributes:
    logits: `[B, T, V]` float32, or None when not asked for.
    hidden_states: `[L+1, B, T, D]` (all depths) or `[len(hidden_layers), B, T, D]`, or None.
    last_hidden: `[B, T, D]`, the final-normed state (hidden_states[L]); lm_head applies to it.
    cache: the updated cache, or None for a cache-free forward.
  """

  logits: Array | None
  hidden_states: Array | None
  last_hidden: Array
  cache: KVCache | None


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE, optional q/k/v bias (Qwen2) and q/k norm (Qwen3, Gemma 3)."""

  def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs, d_in: int | None = None):
    c = config
    d_in = c.hidden_size if d_in is None else d_in  # the EAGLE-3 draft reads 2 * hidden_size
    self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
    bias = c.attention_bias
    self.q_proj = layers.Linear(d_in, c.num_heads * c.head_dim, use_bias=bias, dtype=dtype,
                                rngs=rngs)
    self.k_proj = layers.Linear(d_in, c.num_kv_heads * c.head_dim, use_bias=bias, dtype=dtype,
                                rngs=rngs)
    self.v_proj = layers.Linear(d_in, c.num_kv_heads * c.head_dim, use_bias=bias, dtype=dtype,
                                rngs=rngs)
    self.o_proj = layers.Linear(c.num_heads * c.head_dim, c.hidden_size, dtype=dtype, rngs=rngs)
    if c.qk_norm:
      self.q_norm = layers.RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype, unit_offset=c.gemma)
      self.k_norm = layers.RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype, unit_offset=c.gemma)
    else:
      self.q_norm = self.k_norm = None
    self.scale = None if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar ** -0.5

  def __call__(self, x, positions, inv_freq, mask, cache_kv, lengths, read_slots=None, causal=None):
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q = layers.apply_rope(q, positions, inv_freq)
    k = layers.apply_rope(k, positions, inv_freq)
    if causal is not None:  # the new tokens read only each other (cache-free, or a prefill into an empty
      # cache): the kernel `causal.impl` names, [T, T] never whole
      out = attention.causal_attention(q, k, v, causal.valid, scale=self.scale, window=causal.window,
                                       impl=causal.impl, mesh=causal.mesh)
    if cache_kv is not None:
      k = kv_cache.write(cache_kv[0], k, lengths)
      v = kv_cache.write(cache_kv[1], v, lengths)
      cache_kv = (k, v)
      if read_slots is not None:  # attention reads the first `read_slots` slots only (static)
        k, v = k[:, :read_slots], v[:, :read_slots]
    if causal is None:
      out = layers.attend(q, k.astype(q.dtype), v.astype(q.dtype), mask, self.scale)
    return self.o_proj(out.reshape(b, t, -1)), cache_kv


class DecoderLayer(nnx.Module):
  """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.

  Gemma 3 wraps both sublayers in norms: `x + post_attn_norm(attn(norm(x)))`, then
  `x + post_ffw_norm(mlp(pre_ffw_norm(x)))`, every norm (1 + w) (HF's attribute names, so weights map).
  """

  def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
    d, eps, gemma = config.hidden_size, config.rms_norm_eps, config.gemma
    self.input_layernorm = layers.RMSNorm(d, eps, dtype=dtype, unit_offset=gemma)
    self.self_attn = Attention(config, dtype=dtype, rngs=rngs)
    self.post_attention_layernorm = layers.RMSNorm(d, eps, dtype=dtype, unit_offset=gemma)
    if gemma:
      self.pre_feedforward_layernorm = layers.RMSNorm(d, eps, dtype=dtype, unit_offset=True)
      self.post_feedforward_layernorm = layers.RMSNorm(d, eps, dtype=dtype, unit_offset=True)
    else:
      self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
    self.mlp = layers.MLP(d, config.intermediate_size, dtype=dtype, rngs=rngs, gelu=gemma)

  def __call__(self, x, positions, inv_freq, mask, cache_kv, lengths, read_slots=None, causal=None):
    h, cache_kv = self.self_attn(self.input_layernorm(x), positions, inv_freq, mask, cache_kv,
                                 lengths, read_slots, causal)
    if self.pre_feedforward_layernorm is None:
      x = x + h
      x = x + self.mlp(self.post_attention_layernorm(x))
    else:
      x = x + self.post_attention_layernorm(h)
      x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
    return x, cache_kv


@dataclasses.dataclass(frozen=True)
class CausalKernel:
  """A causal forward's attention among its new tokens through `attention.causal_attention` (per layer: `window`)."""

  valid: Array
  impl: str
  mesh: Any
  window: int | None = None


class Transformer(nnx.Module):
  """Llama-family or Gemma 3 causal LM. Attribute names mirror Hugging Face's so weights map one to one.

  `attention_impl` (static, in the graphdef) names the kernel of cache-free causal forwards given `valid`
  (`attention.causal_attention`: "xla" is the dense path every other call takes; "splash" on TPU, "cudnn" on
  GPU, "chunked" anywhere never materialise the [T, T] scores); `mesh` is the mesh the kernel shards over.
  `inference.with_attention` sets both on a loaded target.
  """

  def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, attention_impl: str = "xla",
               mesh=None):
    self.config = config
    self.attention_impl = attention_impl
    self.mesh = mesh
    self.compute_dtype = jnp.dtype(dtype)  # static (in the graphdef): the KV cache's dtype
    self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                  param_dtype=dtype, rngs=rngs)
    self.layers = nnx.List([DecoderLayer(config, dtype=dtype, rngs=rngs)
                            for _ in range(config.num_layers)])
    self.norm = layers.RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                               unit_offset=config.gemma)
    self.lm_head = None if config.tie_word_embeddings else layers.Linear(
        config.hidden_size, config.vocab_size, dtype=dtype, rngs=rngs)

  def logits(self, h: Array) -> Array:
    """LM head on final-normed states `[..., D]` → float32 logits `[..., V]` (soft-capped if configured)."""
    if self.lm_head is None:
      w = self.embed_tokens.embedding[...]
      out = jnp.einsum("...d,vd->...v", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    else:
      out = jnp.dot(h, self.lm_head.kernel[...].astype(h.dtype), preferred_element_type=jnp.float32)
    return layers.softcap(out, self.config.final_logit_softcapping)

  def embed(self, tokens: Array) -> Array:
    """Token embeddings `[B, T, D]`; Gemma scales them by sqrt(D), rounded to the embedding dtype as HF does."""
    x = self.embed_tokens(tokens)
    if self.config.gemma:
      x = x * jnp.asarray(self.config.hidden_size ** 0.5, self.embed_tokens.embedding[...].dtype)
    return x

  def __call__(
      self,
      tokens: Array,
      positions: Array,
      mask: Array,
      cache: KVCache | None = None,
      lengths: Array | None = None,
      *,
      return_hidden_states: bool = False,
      hidden_layers: tuple[int, ...] | None = None,
      compute_logits: bool = True,
      read_slots: int | None = None,
      valid: Array | None = None,
  ) -> TargetOutput:
    """Runs the decoder.

    Args:
      tokens: `[B, T]` int ids.
      positions: `[B, T]` RoPE positions.
      mask: `[B, T, T]` boolean mask among the new tokens (see `kv_cache.causal_mask`).
      cache: optional cache; the new tokens' keys/values are written at `lengths`.
      lengths: `[B]` committed cache length per row (required with a cache).
      return_hidden_states: return hidden states (all L+1, or `hidden_layers`).
      hidden_layers: static subset of depths (HF convention) to return, in the given order.
      compute_logits: also apply the LM head to every position.
      read_slots: with a cache, attention reads only its first `read_slots` slots (static; every row's
        `lengths + T` must not exceed it), so a step costs what the live context costs, not the whole
        preallocated cache. None reads every slot.
      valid: `[B, T]` real tokens of a causal forward whose `mask` is `causal_mask(valid)`, cache-free or a
        prefill into an empty cache (`lengths` all zero: the new tokens read only each other): attention then
        runs through the target's `attention_impl` kernel (the same values; "xla" is the dense path itself).

    Returns:
      A `TargetOutput`.
    """
    c = self.config
    inv_freq = jnp.asarray(layers.rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling_dict),
                           jnp.float32)
    read = None if cache is None else (cache.slots if read_slots is None else min(int(read_slots), cache.slots))
    bound = None if read_slots is None else read  # what the attention layers slice the cache to
    full_mask = mask if cache is None else kv_cache.cache_mask(mask, lengths, read)
    local_mask = local_freq = None
    if c.sliding_window is not None:  # Gemma 3's sliding layers: a narrower mask and their own RoPE base
      local_mask = full_mask & kv_cache.window_mask(positions, c.sliding_window, lengths, read)
      local_freq = jnp.asarray(layers.rope_inv_freq(c.head_dim, c.rope_local_theta, None), jnp.float32)
    x = self.embed(tokens)
    wanted = set(range(c.num_layers + 1) if hidden_layers is None else hidden_layers)
    collected = {0: x} if return_hidden_states and 0 in wanted else {}
    new_k, new_v = [], []
    kernel = None
    if valid is not None and self.attention_impl != "xla":
      kernel = CausalKernel(valid, self.attention_impl, self.mesh)
    for i, layer in enumerate(self.layers):
      kv = None if cache is None else (cache.keys[i], cache.values[i])
      if c.is_sliding(i):
        local = None if kernel is None else dataclasses.replace(kernel, window=c.sliding_window)
        x, kv = layer(x, positions, local_freq, local_mask, kv, lengths, bound, local)
      else:
        x, kv = layer(x, positions, inv_freq, full_mask, kv, lengths, bound, kernel)
      if kv is not None:
        new_k.append(kv[0])
        new_v.append(kv[1])
      if return_hidden_states and i + 1 < c.num_layers and i + 1 in wanted:
        collected[i + 1] = x
    h = self.norm(x)
    if return_hidden_states and c.num_layers in wanted:
      collected[c.num_layers] = h
    hidden = None
    if return_hidden_states:
      order = range(c.num_layers + 1) if hidden_layers is None else hidden_layers
      hidden = jnp.stack([collected[i] for i in order])
    return TargetOutput(
        logits=self.logits(h) if compute_logits else None,
        hidden_states=hidden,
        last_hidden=h,
        cache=None if cache is None else KVCache(tuple(new_k), tuple(new_v)),
    )
