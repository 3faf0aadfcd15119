"""Building blocks of the decoders: RMSNorm, rotary embeddings, attention, gated MLP.

Llama's blocks, and Gemma 3's variants of them: the (1 + w) RMSNorm, attention scaled by a configured
scalar, tanh soft-capping of the logits, and the GELU-tanh gated MLP.

Shared by the target (`target.py`) and the EAGLE-3 draft. Parameters are stored as `[in, out]` kernels so a
layer is `x @ kernel`; the weight loaders transpose Hugging Face's `[out, in]` tensors once at load time.
Norms, softmax and rotary angles run in float32 whatever the parameter dtype.

Legend (`layerwave.axes`): B batch, T tokens, S cache slots, H query heads, G key/value heads, Dh head width.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Array = jax.Array


class Linear(nnx.Module):
  """`y = x @ kernel (+ bias)`, kernel `[in, out]`."""

  def __init__(self, d_in: int, d_out: int, *, use_bias: bool = False, dtype=jnp.float32,
               rngs: nnx.Rngs):
    init = nnx.initializers.normal(stddev=1.0 / math.sqrt(d_in))
    self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out), dtype))
    self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if use_bias else None

  def __call__(self, x: Array) -> Array:
    # Accumulated in float32 and returned in x's dtype. For bfloat16 x this also lets XLA:CPU keep the
    # bfloat16 operands in its library matmul; without it the dot is converted to float32 (BENCHMARKS.md).
    y = jnp.dot(x, self.kernel[...].astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(y.dtype)
    return y


class RMSNorm(nnx.Module):
  """Root-mean-square norm with a learned scale, computed in float32 (as Hugging Face's Llama).

  With `unit_offset` (Gemma) the stored weight w multiplies as (1 + w), w initialised to 0.
  """

  def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, unit_offset: bool = False):
    self.scale = nnx.Param(jnp.zeros((dim,), dtype) if unit_offset else jnp.ones((dim,), dtype))
    self.eps = eps
    self.unit_offset = unit_offset

  def __call__(self, x: Array) -> Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...].astype(jnp.float32)
    return ((1.0 + scale if self.unit_offset else scale) * x32).astype(x.dtype)


def softcap(x: Array, cap: float | None) -> Array:
  """`cap * tanh(x / cap)` (Gemma's soft-capping), or `x` when `cap` is None."""
  return x if cap is None else cap * jnp.tanh(x / cap)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
  """Inverse RoPE frequencies `[Dh/2]`, with `linear` or `llama3` scaling applied (float64 numpy)."""
  inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  if not scaling:
    return inv_freq
  factor = float(scaling["factor"])
  if scaling["rope_type"] == "linear":
    return inv_freq / factor
  # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
  low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
  old_len = float(scaling["original_max_position_embeddings"])
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return np.where(medium, smoothed, scaled)


def apply_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
  """Rotates `x [B, T, H or G, Dh]` by `positions [B, T]` (Hugging Face's half-split layout)."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def attend(q: Array, k: Array, v: Array, mask: Array, scale: float | None = None) -> Array:
  """Grouped-query attention.

  Args:
    q: queries `[B, T, H, Dh]`.
    k: keys `[B, S, G, Dh]`, with H a multiple of G.
    v: values `[B, S, G, Dh]`.
    mask: `[B, T, S]` boolean, True where a query may read a key.
    scale: multiplies the scores; `1 / sqrt(Dh)` when None (Gemma: `query_pre_attn_scalar ** -0.5`).

  Returns:
    `[B, T, H, Dh]`.
  """
  b, t, h, dh = q.shape
  g = k.shape[2]
  q = q.reshape(b, t, g, h // g, dh)  # r = H / G query heads per key/value head
  scores = jnp.einsum("btgrd,bsgd->bgrts", q, k, preferred_element_type=jnp.float32)
  scores = scores / math.sqrt(dh) if scale is None else scores * scale
  scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bgrts,bsgd->btgrd", probs, v)
  return out.reshape(b, t, h, dh)


class MLP(nnx.Module):
  """Gated MLP: `down(act(gate(x)) * up(x))`, act SiLU (SwiGLU, Llama) or tanh-approximated GELU (Gemma)."""

  def __init__(self, dim: int, hidden: int, *, dtype=jnp.float32, rngs: nnx.Rngs, gelu: bool = False):
    self.gate_proj = Linear(dim, hidden, dtype=dtype, rngs=rngs)
    self.up_proj = Linear(dim, hidden, dtype=dtype, rngs=rngs)
    self.down_proj = Linear(hidden, dim, dtype=dtype, rngs=rngs)
    self.gelu = gelu

  def __call__(self, x: Array) -> Array:
    gate = self.gate_proj(x)
    act = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)
    return self.down_proj(act * self.up_proj(x))
