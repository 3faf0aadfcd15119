"""Building blocks of the decoders: RMSNorm, rotary embeddings, attention, gated MLP.

Llama's blocks, and Gemma 3's variants of them: the (1 + w) RMSNorm, attention scaled by a configured
scalar, tanh soft-capping of the logits, and the GELU-tanh gated MLP.

Shared by the target (`target.py`) and the EAGLE-3 draft. Parameters are stored as `[in, out]` kernels so a
layer is `x @ kernel`; the weight loaders transpose Hugging Face's `[out, in]` tensors once at load time.
Norms, softmax and rotary angles run in float32 whatever the parameter dtype.

Legend (`layerwave.axes`): B batch, T tokens, S cache slots, H query heads, G key/value heads, Dh head width.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Array = jax.Array


@jax.custom_vjp
def matmul_low(x: Array, kernel: Array) -> Array:
  """`x @ kernel` for a low-precision `x` (bfloat16): the kernel cast to x's dtype, accumulated in float32.

  The backward pass keeps the same precision: its two dots read the incoming cotangent rounded to x's dtype
  (as mixed-precision training does), so they too run as bf16 x bf16 -> f32, where autodiff of the forward
  would mix a float32 cotangent with a bf16 operand and XLA:CPU would convert both to float32 (BENCHMARKS.md,
  "Throughput"). dx is returned in x's dtype; the kernel's gradient is accumulated in float32 and returned in
  the kernel's own dtype, so float32 master weights get a float32 gradient.

  Args:
    x: `[..., in]` bfloat16 (or float16) activations.
    kernel: `[in, out]` parameters of any floating dtype.

  Returns:
    `[..., out]` float32.
  """
  return jnp.dot(x, kernel.astype(x.dtype), preferred_element_type=jnp.float32)


def _matmul_low_fwd(x, kernel):
  return matmul_low(x, kernel), (x, kernel)


def _row_major_transpose(x: Array) -> Array:
  """`x.T` for a 2-D `x`, written so that XLA materialises it row-major.

  A plain transpose feeding a dot is folded into the dot's dimension numbers, and XLA:CPU converts a bf16 dot
  that contracts its lhs' leading dimension to float32 (BENCHMARKS.md, "Throughput": the weight gradient
  x^T g ran at float32 speed). Splitting the rows into blocks of 16 first makes it a real copy (same values).
  """
  n, k = x.shape
  block = next((b for b in (16, 8, 4, 2) if n % b == 0), 1)
  if block == 1:
    return x.T
  return x.reshape(n // block, block, k).transpose(2, 0, 1).reshape(k, n)


def _matmul_low_bwd(res, g):
  x, kernel = res
  low = x.dtype
  g = g.astype(low)
  w = kernel.astype(low)
  dx = jnp.dot(g, _row_major_transpose(w), preferred_element_type=jnp.float32).astype(low)
  x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
  dw = jnp.dot(_row_major_transpose(x2), g2, preferred_element_type=jnp.float32).astype(kernel.dtype)
  return dx, dw


matmul_low.defvjp(_matmul_low_fwd, _matmul_low_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum_low(spec: str, a: Array, b: Array) -> Array:
  """`jnp.einsum(spec, a, b)` accumulated in float32, with a backward pass in the operands' precision.

  As `matmul_low`: the cotangent is rounded to the operands' dtype, so both transposed einsums also read
  low-precision operands. For float32 operands it is plain float32 einsum with its exact gradient. `spec` has
  two operands, no repeated index within one, and every index of an operand appears in the output or in the
  other operand (attention's score and value einsums).

  Returns:
    float32.
  """
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _einsum_low_fwd(spec, a, b):
  return einsum_low(spec, a, b), (a, b)


def _einsum_low_bwd(spec, res, g):
  a, b = res
  ins, out = spec.replace(" ", "").split("->")
  sa, sb = ins.split(",")
  low = a.dtype if jnp.finfo(a.dtype).bits <= jnp.finfo(b.dtype).bits else b.dtype
  g = g.astype(low)
  da = jnp.einsum(f"{out},{sb}->{sa}", g, b.astype(low), preferred_element_type=jnp.float32)
  db = jnp.einsum(f"{sa},{out}->{sb}", a.astype(low), g, preferred_element_type=jnp.float32)
  return da.astype(a.dtype), db.astype(b.dtype)


einsum_low.defvjp(_einsum_low_fwd, _einsum_low_bwd)


class Linear(nnx.Module):
  """`y = x @ kernel (+ bias)`, kernel `[in, out]`; a bfloat16 `x` runs through `matmul_low`."""

  def __init__(self, d_in: int, d_out: int, *, use_bias: bool = False, dtype=jnp.float32,
               rngs: nnx.Rngs):
    init = nnx.initializers.normal(stddev=1.0 / math.sqrt(d_in))
    self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out), dtype))
    self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if use_bias else None

  def __call__(self, x: Array) -> Array:
    # Accumulated in float32 and returned in x's dtype. For bfloat16 x this also lets XLA:CPU keep the
    # bfloat16 operands in its library matmul; without it the dot is converted to float32 (BENCHMARKS.md).
    kernel = self.kernel[...]
    if x.dtype == jnp.float32:
      y = jnp.dot(x, kernel.astype(x.dtype), preferred_element_type=jnp.float32)
    else:
      y = matmul_low(x, kernel)
    y = y.astype(x.dtype)
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
