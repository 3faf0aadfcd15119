"""Causal self-attention for a cache-free forward, with the kernel picked for the devices it compiles for.

The target's plain forward (analysis, feature extraction, draft training) attends causally over `[B, T]`
tokens with padding hidden. `layers.attend` does it from a dense `[B, T, T]` mask and builds float32 scores
`[B, G, r, T, T]`, which dominate memory at long T on an 8B model. `causal_attention` computes the same
thing from the `[B, T]` padding flags alone, with one of four kernels:

* "xla": the dense mask and `layers.attend`, bit for bit today's numbers (the choice on CPU);
* "chunked": pure-JAX flash attention (online softmax over key blocks, a hand-written backward that
  recomputes each block), never more than one `[c, c]` block of scores per head; any backend;
* "splash": the Pallas TPU splash-attention kernel;
* "cudnn": cuDNN's fused attention on GPU, through `jax.nn.dot_product_attention`.

"auto" picks by platform (`default_impl`). The platform must be that of the devices the program is compiled
for, which is not the host's when a TPU program is compiled ahead of time on a CPU machine (libtpu and
`jax.experimental.topologies`): callers pass `platform=mesh.devices.flat[0].platform`, or the mesh itself.
Cached decoding and tree verification keep `layers.attend` with their own masks (`kv_cache`).

Legend (`layerwave.axes`): B batch, T tokens, H query heads, G key/value heads, Dh head width.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
from absl import logging
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec as P

from layerwave.models import kv_cache
from layerwave.models import layers

Array = jax.Array
IMPLS = ("auto", "xla", "chunked", "splash", "cudnn")
_PLATFORM_IMPL = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn", "rocm": "cudnn", "cpu": "xla"}
_LANES = 128  # splash's blocks are multiples of the TPU lane width


def default_impl(platform: str) -> str:
  """The kernel "auto" uses on `platform` ("tpu", "gpu", "cuda", "rocm" or "cpu")."""
  if platform not in _PLATFORM_IMPL:
    raise ValueError(f"Unknown platform {platform!r}: pass one of {sorted(_PLATFORM_IMPL)}, as "
                     "`mesh.devices.flat[0].platform` gives it, or name the kernel with `impl=`.")
  return _PLATFORM_IMPL[platform]


def causal_attention(q: Array, k: Array, v: Array, valid: Array, *, scale: float | None = None,
                     window: int | None = None, impl: str = "auto", platform: str | None = None,
                     mesh: jax.sharding.Mesh | None = None) -> Array:
  """Causal grouped-query self-attention with padding keys hidden (optionally a sliding window).

  Equals `layers.attend(q, k, v, kv_cache.causal_mask(valid), scale)` at every real query, and with `window`
  that mask `& kv_cache.window_mask(positions, window)`. Rows of padding queries differ between kernels
  (finite in all). Columns stand for positions: the window assumes a real query and a real key i - j
  columns apart are i - j positions apart, as when padding sits only at the ends of a row (left or right)
  and positions count one per real token (`inference.positions_from_mask`, or `arange`).

  Args:
    q: queries `[B, T, H, Dh]`.
    k: keys `[B, T, G, Dh]`, H a multiple of G.
    v: values `[B, T, G, Dh]`.
    valid: `[B, T]` bool or int, True (nonzero) on real tokens.
    scale: a Python float (static) multiplying the scores; `1 / sqrt(Dh)` when None.
    window: Gemma 3's sliding window, a Python int (a query reads keys fewer than `window` positions behind
      it), or None.
    impl: "auto", "xla", "chunked", "splash" or "cudnn" (module docstring).
    platform: the platform of the devices the program is compiled for, for "auto"; from `mesh` when None,
      else `jax.default_backend()` (wrong when compiling for a TPU topology from a CPU host).
    mesh: the mesh the caller jits over, batch on axis 'data' and heads on 'model'. "splash" is a Mosaic
      custom call that XLA's partitioner cannot split, so with a mesh it runs under `jax.shard_map` over those
      axes; without one it compiles for a single device only (for more, lowering fails with "Mosaic kernels
      cannot be automatically partitioned"). The other kernels ignore it: XLA partitions them.

  Returns:
    `[B, T, H, Dh]` in q's dtype.
  """
  _check(q, k, v, valid, window, impl)
  window = None if window is None else int(window)
  if impl == "auto":
    if platform is None:
      platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    impl = default_impl(platform)
  if impl == "xla":
    return xla_attention(q, k, v, valid, scale=scale, window=window)
  if impl == "chunked":
    return chunked_attention(q, k, v, valid, scale=scale, window=window)
  if impl == "splash":
    return splash_attention(q, k, v, valid, scale=scale, window=window, mesh=mesh)
  return cudnn_attention(q, k, v, valid, scale=scale, window=window)


def _check(q, k, v, valid, window, impl):
  """One ValueError that names the fix, before any kernel sees a bad input."""
  if impl not in IMPLS:
    raise ValueError(f"Unknown attention impl {impl!r}: pass one of {IMPLS}.")
  if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
    raise ValueError(f"Expected q [B, T, H, Dh] and k, v [B, T, G, Dh] of one shape, got q {q.shape}, "
                     f"k {k.shape}, v {v.shape}: reshape the projections to (batch, tokens, heads, width).")
  (b, t, h, dh), (bk, tk, g, dhk) = q.shape, k.shape
  if (b, t, dh) != (bk, tk, dhk):
    raise ValueError(f"q {q.shape} and k {k.shape} must agree in batch, tokens and head width: this is "
                     "self-attention over one sequence (use layers.attend for a cache).")
  if h % g:
    raise ValueError(f"Query heads H={h} must be a multiple of key/value heads G={g}: check num_heads and "
                     "num_kv_heads of the config.")
  if valid.shape != (b, t):
    raise ValueError(f"valid must be [B, T] = {(b, t)}, got {valid.shape}: pass the attention mask of the "
                     "tokens, not a [B, T, T] mask.")
  if window is not None and (not isinstance(window, numbers.Integral) or window < 1):
    raise ValueError(f"window must be a positive int or None, got {window!r}.")


def _scale(scale: float | None, dh: int) -> float:
  return 1.0 / math.sqrt(dh) if scale is None else float(scale)


def xla_attention(q, k, v, valid, *, scale=None, window=None) -> Array:
  """Today's path: the dense `[B, T, T]` mask (`kv_cache`) and `layers.attend`."""
  valid = valid.astype(bool)
  mask = kv_cache.causal_mask(valid)
  if window is not None:
    columns = jnp.broadcast_to(jnp.arange(valid.shape[1], dtype=jnp.int32), valid.shape)
    mask = mask & kv_cache.window_mask(columns, window)
  return layers.attend(q, k, v, mask, scale)


# ---- "chunked": flash attention in pure JAX ------------------------------------------------------------
# q is held as [B, Tp, G, r, Dh] (r = H / G, Tp = T padded to a multiple of the block c); query block i and
# key block j are columns [i c, (i + 1) c) of it and of k / v. Both passes visit only the blocks the causal
# (and window) mask touches: key blocks lo(i)..i for query block i.


def _slice(x, i, c):
  return jax.lax.dynamic_slice_in_dim(x, i * c, c, axis=1)


def _key_blocks(i, c, window):
  """[lo, hi) of the key blocks that query block i reads."""
  lo = 0 if window is None else jnp.maximum(0, (i * c - window + 1) // c)
  return lo, i + 1


def _query_blocks(j, c, window, n):
  """[lo, hi) of the query blocks that read key block j."""
  hi = n if window is None else jnp.minimum(n, (j * c + c + window - 2) // c + 1)
  return j, hi


def _block_scores(qb, kb, valid_kb, i, j, c, scale, window):
  """Scaled scores of query block i against key block j, -inf where the mask hides a key: [B, G, r, c, c]."""
  rows = i * c + jnp.arange(c)[:, None]
  cols = j * c + jnp.arange(c)[None, :]
  ok = cols <= rows
  if window is not None:
    ok = ok & (rows - cols < window)
  ok = ok[None] & valid_kb[:, None, :]
  s = jnp.einsum("bqgrd,bkgd->bgrqk", qb, kb, preferred_element_type=jnp.float32) * scale
  return jnp.where(ok[:, None, None], s, -jnp.inf)


def _flash_forward(q, k, v, valid, scale, window, c):
  """Output `[B, Tp, G, r, Dh]` and the log-sum-exp of each row, `[n, B, G, r, c]` (+inf on empty rows)."""
  b, tp, g, r, dh = q.shape

  def query_block(i):
    qb = _slice(q, i, c)

    def body(j, carry):
      m, l, acc = carry
      s = _block_scores(qb, _slice(k, j, c), _slice(valid, j, c), i, j, c, scale, window)
      m_new = jnp.maximum(m, s.max(-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with no key yet: exp(-inf - 0) = 0
      p = jnp.exp(s - m_safe[..., None])
      alpha = jnp.exp(m - m_safe)
      acc = alpha[..., None] * acc + jnp.einsum("bgrqk,bkgd->bgrqd", p.astype(v.dtype), _slice(v, j, c),
                                                preferred_element_type=jnp.float32)
      return m_new, alpha * l + p.sum(-1), acc

    init = (jnp.full((b, g, r, c), -jnp.inf), jnp.zeros((b, g, r, c)), jnp.zeros((b, g, r, c, dh)))
    m, l, acc = jax.lax.fori_loop(*_key_blocks(i, c, window), body, init)
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]  # a padding row that reads nothing: 0
    return out, jnp.where(l == 0, jnp.inf, m + jnp.log(l))

  out, lse = jax.lax.map(query_block, jnp.arange(tp // c))  # [n, B, G, r, c, Dh], [n, B, G, r, c]
  return out.transpose(1, 0, 4, 2, 3, 5).reshape(q.shape).astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, valid, scale, window, c):
  return _flash_forward(q, k, v, valid, scale, window, c)[0]


def _flash_fwd(q, k, v, valid, scale, window, c):
  out, lse = _flash_forward(q, k, v, valid, scale, window, c)
  return out, (q, k, v, valid, out, lse)


def _flash_bwd(scale, window, c, res, dout):
  """FlashAttention-2's backward: probabilities recomputed per block from the saved log-sum-exp."""
  q, k, v, valid, out, lse = res
  b, tp, g, r, dh = q.shape
  n = tp // c
  delta = jnp.einsum("btgrd,btgrd->bgrt", dout.astype(jnp.float32), out.astype(jnp.float32))
  delta = delta.reshape(b, g, r, n, c).transpose(3, 0, 1, 2, 4)  # [n, B, G, r, c], as lse

  def grads_of_scores(i, j, qb, dob, kb, vb):
    p = jnp.exp(_block_scores(qb, kb, _slice(valid, j, c), i, j, c, scale, window) - lse[i][..., None])
    dp = jnp.einsum("bqgrd,bkgd->bgrqk", dob, vb, preferred_element_type=jnp.float32)
    return p, p * (dp - delta[i][..., None])

  def dq_block(i):
    qb, dob = _slice(q, i, c), _slice(dout, i, c)

    def body(j, dq):
      kb = _slice(k, j, c)
      _, ds = grads_of_scores(i, j, qb, dob, kb, _slice(v, j, c))
      return dq + jnp.einsum("bgrqk,bkgd->bqgrd", ds.astype(k.dtype), kb, preferred_element_type=jnp.float32)

    return jax.lax.fori_loop(*_key_blocks(i, c, window), body, jnp.zeros((b, c, g, r, dh))) * scale

  def dkv_block(j):
    kb, vb = _slice(k, j, c), _slice(v, j, c)

    def body(i, carry):
      dk, dv = carry
      qb, dob = _slice(q, i, c), _slice(dout, i, c)
      p, ds = grads_of_scores(i, j, qb, dob, kb, vb)
      dv = dv + jnp.einsum("bgrqk,bqgrd->bkgd", p.astype(dout.dtype), dob, preferred_element_type=jnp.float32)
      dk = dk + jnp.einsum("bgrqk,bqgrd->bkgd", ds.astype(q.dtype), qb, preferred_element_type=jnp.float32)
      return dk, dv

    zeros = jnp.zeros((b, c, g, dh))
    dk, dv = jax.lax.fori_loop(*_query_blocks(j, c, window, n), body, (zeros, zeros))
    return dk * scale, dv

  dq = jax.lax.map(dq_block, jnp.arange(n)).transpose(1, 0, 2, 3, 4, 5).reshape(q.shape)
  dk, dv = jax.lax.map(dkv_block, jnp.arange(n))  # [n, B, c, G, Dh]
  dk, dv = (x.transpose(1, 0, 2, 3, 4).reshape(k.shape) for x in (dk, dv))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_tokens(x, tp):
  return jnp.pad(x, [(0, 0), (0, tp - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def chunked_attention(q, k, v, valid, *, scale=None, window=None, block_size: int = 512) -> Array:
  """Flash attention in pure JAX: scores one `[block, block]` tile at a time, forward and backward.

  Differentiable (a custom VJP that recomputes the tiles), O(T Dh) memory per head; T is padded up to a
  multiple of the block. Padding query rows come out 0. Arguments as `causal_attention`.
  """
  b, t, h, dh = q.shape
  g = k.shape[2]
  c = min(block_size, t)
  tp = -(-t // c) * c
  q5 = _pad_tokens(q, tp).reshape(b, tp, g, h // g, dh)
  out = _flash(q5, _pad_tokens(k, tp), _pad_tokens(v, tp), _pad_tokens(valid.astype(bool), tp),
               _scale(scale, dh), window, c)
  return out.reshape(b, tp, h, dh)[:, :t]


# ---- "splash": the Pallas TPU kernel -----------------------------------------------------------------


def _splash_kernel(heads: int, t: int, block: int, window: int | None, interpret: bool):
  """A multi-head splash kernel over `[heads, t, Dh]`, built where it is traced (its arrays are constants of
  the trace; splash caches the numpy mask tables, so a retrace does not rebuild them)."""
  mask = (splash.CausalMask((t, t)) if window is None else
          splash.LocalMask((t, t), window_size=(window - 1, 0), offset=0))
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                            block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                            block_kv_dq=block)
  return splash.make_splash_mha(splash.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1,
                                q_seq_shards=1, interpret=interpret)


def splash_attention(q, k, v, valid, *, scale=None, window=None, block_size: int = 512,
                     mesh: jax.sharding.Mesh | None = None, interpret: bool = False) -> Array:
  """Splash attention (TPU): heads-major `[H, T, Dh]` per row, vmapped over the batch.

  Grouped-query attention runs in the kernel's multi-head form with G key/value heads (query head h reads
  key head h // r), so K and V are never repeated. The scale is folded into q. Padding: real tokens are
  segment 1 and padding segment 0, so a real query reads only real keys, and every row (a padding one
  reads the padding keys before it) stays non-empty. T is padded up to a multiple of 128 with padding
  tokens, and the block is the largest multiple of 128 up to `block_size` that divides it.

  With `mesh` (needed whenever the program spans more than one device: XLA cannot partition the kernel),
  it runs under `jax.shard_map`: batch over 'data' and heads over 'model' where the mesh has those axes and
  they divide B and G (else that dimension is replicated over the axis, logged). `interpret` runs the
  kernel in Pallas' interpreter (tests on CPU). Other arguments as `causal_attention`.
  """
  b, t, _, dh = q.shape
  g = k.shape[2]
  tp = -(-t // _LANES) * _LANES
  block = max(c for c in range(_LANES, max(block_size, _LANES) + 1, _LANES) if tp % c == 0)
  q = (q.astype(jnp.float32) * _scale(scale, dh)).astype(q.dtype)
  q, k, v = (_pad_tokens(x, tp) for x in (q, k, v))
  segments = _pad_tokens(valid.astype(jnp.int32), tp)

  def local(q, k, v, segments):
    kernel = _splash_kernel(q.shape[2], tp, block, window, interpret)
    heads_major = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]
    out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s)))(*heads_major,
                                                                                             segments)
    return out.transpose(0, 2, 1, 3)

  if mesh is None:
    out = local(q, k, v, segments)
  else:
    batch, heads = _mesh_axis(mesh, "data", b, "batch"), _mesh_axis(mesh, "model", g, "key/value heads")
    spec = P(batch, None, heads, None)
    out = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, P(batch, None)), out_specs=spec,
                        check_vma=False)(q, k, v, segments)
  return out[:, :t]


def _mesh_axis(mesh, name, size, what):
  """`name` if the mesh has that axis and it divides `size`, else None (replicated, logged)."""
  if name not in mesh.axis_names:
    return None
  if size % mesh.shape[name]:
    logging.warning("splash attention: %s %d do not divide over mesh axis %r (%d); replicated over it.",
                    what, size, name, mesh.shape[name])
    return None
  return name


# ---- "cudnn": cuDNN's fused attention (GPU) ----------------------------------------------------------


def cudnn_attention(q, k, v, valid, *, scale=None, window=None, implementation: str | None = "cudnn") -> Array:
  """cuDNN flash attention through `jax.nn.dot_product_attention`, padding given as sequence lengths.

  cuDNN's padding masks hide a suffix, so each row is rotated left by its count of leading padding tokens
  (making a left-padded row right-padded) and rotated back after; the real tokens of a row must be
  contiguous. Falls back to `implementation=None` (jax's XLA attention, dense scores) when cuDNN refuses:
  a dtype other than float16 / bfloat16, or a shape or version it does not support (logged). `implementation`
  is jax's argument ("xla" runs the same path on any backend, for tests). Other arguments as
  `causal_attention`.
  """
  t = valid.shape[1]
  valid = valid.astype(bool)
  lengths = valid.sum(axis=1, dtype=jnp.int32)
  shift = jnp.argmax(valid, axis=1)  # the first real column (0 for a row of padding only)
  columns = jnp.arange(t)[None]
  rotate = lambda x, idx: jnp.take_along_axis(x, idx[:, :, None, None], axis=1)
  forward, back = (columns + shift[:, None]) % t, (columns - shift[:, None]) % t
  q, k, v = (rotate(x, forward) for x in (q, k, v))
  kwargs = dict(scale=scale, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                local_window_size=None if window is None else (window - 1, 0))
  if implementation == "cudnn" and q.dtype not in (jnp.bfloat16, jnp.float16):
    logging.info("cudnn attention takes float16 / bfloat16, not %s: XLA attention instead.", q.dtype)
    implementation = None
  try:
    out = jax.nn.dot_product_attention(q, k, v, implementation=implementation, **kwargs)
  except (ValueError, NotImplementedError, RuntimeError) as e:
    if implementation != "cudnn":
      raise
    logging.warning("cudnn attention refused (%s): XLA attention instead.", e)
    out = jax.nn.dot_product_attention(q, k, v, implementation=None, **kwargs)
  return rotate(out, back)
