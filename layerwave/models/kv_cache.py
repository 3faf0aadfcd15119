"""The KV cache and the masks of a call against it, shared by the target, the draft and the decoding loops.

A `KVCache` is preallocated and functional: arrays in, arrays out. A call runs T new tokens per row against it
under a `[B, T, T]` mask among the new tokens (`causal_mask` for a chain or a prompt, an ancestor mask for a
tree). New tokens of row b are written to slots `lengths[b] ... lengths[b] + T - 1` (`write`); a query reads
every slot below `lengths[b]` (the committed prefix) plus the new slots its mask row allows (`cache_mask`).
Slots at or beyond `lengths[b] + T` are never read, so rolling back a rejected suffix is just not advancing
`lengths`. Every caller keeps committed slot s holding the token at position s (a tree's accepted path is
moved into contiguous slots before it is committed), which is what lets `window_mask` know a committed key's
position from its slot.

Legend (`layerwave.axes`): B batch, T tokens, S cache slots, G key/value heads, Dh head width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from layerwave.models.config import ModelConfig

Array = jax.Array


@struct.dataclass
class KVCache:
  """Per-layer key/value buffers, each `[B, S, G, Dh]` (keys stored after RoPE)."""

  keys: tuple[Array, ...]
  values: tuple[Array, ...]

  @classmethod
  def zeros(cls, config: ModelConfig, batch: int, slots: int, dtype=jnp.float32) -> "KVCache":
    """Empty buffers in `dtype`, the compute dtype of the model that writes them (`Model.compute_dtype`).

    Raises:
      TypeError: for a non-floating dtype: keys and values written into an integer buffer are truncated
        toward zero without an error (as happens when the dtype is taken from an integer parameter, such as
        a vocabulary table).
    """
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
      raise TypeError(f"A KV cache must have a floating dtype, got {jnp.dtype(dtype)}: pass the model's "
                      "compute dtype (`model.compute_dtype`), not the dtype of an arbitrary parameter.")
    shape = (batch, slots, config.num_kv_heads, config.head_dim)
    return cls(keys=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
               values=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)))

  @property
  def slots(self) -> int:
    return self.keys[0].shape[1]


def causal_mask(attention_mask: Array) -> Array:
  """`[B, T, T]` mask: causal, and padding keys (attention_mask == 0) hidden."""
  t = attention_mask.shape[1]
  tri = jnp.tril(jnp.ones((t, t), bool))
  return tri[None] & attention_mask.astype(bool)[:, None, :]


def cache_mask(new_mask: Array, lengths: Array, slots: int) -> Array:
  """Lifts a `[B, T, T]` mask among new tokens to `[B, T, S]` over the cache after writing them.

  Args:
    new_mask: `[B, T, T]` which new tokens each new token may read.
    lengths: `[B]` committed cache length per row (the new tokens sit at slots `lengths[b] + i`).
    slots: S.

  Returns:
    `[B, T, S]` boolean: the committed prefix, and the new slots `new_mask` allows.
  """
  t = new_mask.shape[-1]
  slot = jnp.arange(slots)[None, :]  # [1, S]
  rel = slot - lengths[:, None]  # [B, S]: index among the new tokens, if any
  in_new = (rel >= 0) & (rel < t)
  gathered = jnp.take_along_axis(new_mask, jnp.clip(rel, 0, t - 1)[:, None, :], axis=2)
  return (rel < 0)[:, None, :] | (in_new[:, None, :] & gathered)


def window_mask(positions: Array, window: int, lengths: Array | None = None,
                slots: int | None = None) -> Array:
  """Sliding-window restriction: a query reads only keys fewer than `window` positions behind it.

  Combine it with the causal / tree mask (`&`); on its own it also allows keys ahead of the query.
  Positions, not slot or column indices, decide, so left padding and tree nodes at equal depth are handled.

  Args:
    positions: `[B, T]` RoPE positions of the new tokens (the queries).
    window: the sliding window (HF's `sliding_window`: the query's own key counts as one).
    lengths: `[B]` committed cache length per row, or None for a cache-free call.
    slots: S, with `lengths`.

  Returns:
    `[B, T, T]` without a cache, `[B, T, S]` with one (committed slot s holds position s; the new tokens sit
    at slots `lengths[b] + i` with `positions[b, i]`).
  """
  if lengths is None:
    key_pos = positions
  else:
    t = positions.shape[1]
    slot = jnp.arange(slots)[None, :]
    rel = slot - lengths[:, None]  # [B, S]
    new_pos = jnp.take_along_axis(positions, jnp.clip(rel, 0, t - 1), axis=1)
    key_pos = jnp.where(rel < 0, slot, new_pos)
  return (positions[:, :, None] - key_pos[:, None, :]) < window


def write(buffer: Array, new: Array, lengths: Array) -> Array:
  """Writes `new [B, T, G, Dh]` into `buffer [B, S, G, Dh]` at per-row offsets `lengths [B]`."""
  return jax.vmap(lambda buf, x, at: jax.lax.dynamic_update_slice_in_dim(buf, x, at, axis=0))(
      buffer, new.astype(buffer.dtype), lengths)
