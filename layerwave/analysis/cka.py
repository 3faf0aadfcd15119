"""Linear CKA between layers — diversity (docs/METHOD.md §4).

Place in the pipeline: hidden states of the kept tokens → all-pairs CKA matrix [L+1, L+1] → C_ℓm for
`layerwave.selection` and the compartments of `layerwave.analysis.compartments`.

Two estimators:
  * exact (Kornblith et al. 2019): columns centred over the n valid tokens,
    CKA(X, Y) = ‖YᵀX‖_F² / (‖XᵀX‖_F ‖YᵀY‖_F). `all_pairs_cka` computes it for every pair of layers on a
    fixed token set (the reference; `stats` keeps a fixed-size random subsample of tokens for it).
  * minibatch (Nguyen et al. 2021): per minibatch of m tokens, the unbiased HSIC estimator (Song et al. 2012)
    from the m×m linear Grams with zeroed diagonals, summed over minibatches;
    CKA_ab = Σ HSIC_ab / √(Σ HSIC_aa Σ HSIC_bb) (`cka_from_hsic`). Constant memory in the number of tokens.
    The unbiased estimator needs m ≥ 4 valid tokens; minibatches with fewer contribute 0 (and are not counted).
    Features are centred within each minibatch before forming the Grams: the U-statistic is exactly invariant
    to that shift, and it removes the large-mean cancellation that float32 would otherwise suffer.

All functions are mask-aware: padding / filtered tokens are zeroed rows and excluded from every count. The
all-pairs functions also run inside `jax.shard_map` with the layers split over devices (`axis_name`): each
device forms its own layers' Grams and gathers the others' (an m×m Gram per layer, not the m×D features), so
the per-layer work is spread instead of repeated on every chip.

Legend (`layerwave.axes`): L target layers, B batch, T tokens, n kept tokens, m Gram size, D target width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "linear_cka",
    "masked_center",
    "all_pairs_cka",
    "unbiased_hsic_all_pairs",
    "cka_from_hsic",
    "gather_blocks",
    "minibatch_hsic",
    "MIN_HSIC_TOKENS",
]

_HI = jax.lax.Precision.HIGHEST
MIN_HSIC_TOKENS = 4  # the unbiased HSIC divides by m (m - 3) and (m - 2).


def masked_center(x: jax.Array, mask: jax.Array | None) -> jax.Array:
  """Centre the columns of x over the masked rows; masked rows become 0.

  Args:
    x: [..., n, D] features.
    mask: [..., n] bool (broadcastable), or None for all rows.

  Returns:
    [..., n, D] float32.
  """
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  if mask is None:
    return x - jnp.mean(x, axis=-2, keepdims=True)
  w = mask.astype(x.dtype)[..., None]
  n = jnp.maximum(jnp.sum(w, axis=-2, keepdims=True), 1.0)
  mu = jnp.sum(x * w, axis=-2, keepdims=True) / n
  return (x - mu) * w


def _safe_ratio(num, den):
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def linear_cka(x: jax.Array, y: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """Exact linear CKA between two representations of the same tokens.

  Args:
    x: [n, D].
    y: [n, D'] (its width may differ from x's).
    mask: optional [n] bool: rows to use.

  Returns:
    Scalar in [0, 1] (float32, or float64 for float64 inputs with x64 enabled); 0 if either side is constant.
  """
  x = jnp.asarray(x)
  y = jnp.asarray(y)
  if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
    raise ValueError(f"linear_cka expects x [n, D], y [n, D']; got {x.shape}, {y.shape}")
  xc = masked_center(x, mask)
  yc = masked_center(y, mask)
  xy = jnp.sum(jnp.square(jnp.einsum("nd,ne->de", xc, yc, precision=_HI)))
  xx = jnp.sqrt(jnp.sum(jnp.square(jnp.einsum("nd,ne->de", xc, xc, precision=_HI))))
  yy = jnp.sqrt(jnp.sum(jnp.square(jnp.einsum("nd,ne->de", yc, yc, precision=_HI))))
  return _safe_ratio(xy, xx * yy)


def _gather(x: jax.Array, axis_name) -> jax.Array:
  """All layers' values along axis 0 from every device's block (identity without an axis)."""
  return x if axis_name is None else jax.lax.all_gather(x, axis_name, tiled=True)


def _cross_frobenius_sq(xc: jax.Array, axis_name=None) -> jax.Array:
  """M_ab = ‖X_bᵀ X_a‖_F² = ⟨X_a X_aᵀ, X_b X_bᵀ⟩_F for this device's layers a and every layer b.

  xc: [L, n, D] centred (this device's block of layers under `axis_name`); returns [L, L_all].
  """
  num_layers, n, d = xc.shape
  if n <= d:
    # Sample space: one n×n Gram per layer, then inner products of the flattened Grams.
    grams = jnp.einsum("lnd,lmd->lnm", xc, xc, precision=_HI).reshape(num_layers, n * n)
    return jnp.einsum("ap,bp->ab", grams, _gather(grams, axis_name), precision=_HI)

  # Feature space: for each layer a, cross-covariances with all layers [L, D, D]; lax.map bounds memory to
  # one row of pairs at a time.
  every = _gather(xc, axis_name)

  def row(xa):
    cross = jnp.einsum("nd,lne->lde", xa, every, precision=_HI)
    return jnp.sum(jnp.square(cross), axis=(1, 2))

  return jax.lax.map(row, xc)


def gather_blocks(x: jax.Array, axis_name) -> jax.Array:
  """This device's block [L, ...] of a layer-split array → the whole [L · devices, ...] on every device.

  A psum of each block placed at its offset, so the result is the same everywhere (what `jax.shard_map`'s
  replicated outputs need; `all_gather` gives the same values typed as per-device). For small arrays: the
  statistics, not the features. Identity without an axis.
  """
  if axis_name is None:
    return x
  n = jax.lax.psum(1, axis_name)
  whole = jnp.zeros((x.shape[0] * n, *x.shape[1:]), x.dtype)
  start = (jax.lax.axis_index(axis_name) * x.shape[0],) + (0,) * (x.ndim - 1)
  return jax.lax.psum(jax.lax.dynamic_update_slice(whole, x, start), axis_name)


def all_pairs_cka(hidden: jax.Array, mask: jax.Array | None = None, axis_name=None) -> jax.Array:
  """Exact linear CKA for every pair of layers on the same tokens.

  Cost: L·n²·D + L²·n² when n ≤ D (Grams), else L²·n·D² (cross-covariances); memory O(L·n² ) or O(L·D²).

  Args:
    hidden: [L, n, D] representations of n tokens at L layers (inside `jax.shard_map` with `axis_name`: this
      device's contiguous block of layers, the blocks in device order).
    mask: optional [n] bool: tokens to use.
    axis_name: mesh axis (or tuple) the layers are split over, or None.

  Returns:
    [L, L] float32 symmetric matrix with unit diagonal (0 rows for constant layers); all layers' on every
    device under `axis_name`.
  """
  if hidden.ndim != 3:
    raise ValueError(f"all_pairs_cka expects hidden [L, n, D], got {hidden.shape}")
  m = None if mask is None else mask.astype(bool)[None, :]
  xc = masked_center(hidden, m)
  cross = gather_blocks(_cross_frobenius_sq(xc, axis_name), axis_name)
  cross = 0.5 * (cross + cross.T)
  diag = jnp.sqrt(jnp.clip(jnp.diagonal(cross), 0.0))
  return _safe_ratio(cross, diag[:, None] * diag[None, :])


def unbiased_hsic_all_pairs(hidden: jax.Array, mask: jax.Array | None = None,
                            axis_name=None) -> tuple[jax.Array, jax.Array]:
  """Unbiased HSIC (Song et al. 2012) of every pair of layers on one minibatch of tokens.

  HSIC₁(K, L) = [tr(K̃L̃) + 1ᵀK̃1 · 1ᵀL̃1 / ((m−1)(m−2)) − 2/(m−2) · 1ᵀK̃L̃1] / (m(m−3)), with K̃, L̃ the
  linear Grams with zeroed diagonals and m the number of valid tokens (masked rows are zero, so the padded
  sums equal the sums over valid tokens).

  Args:
    hidden: [L, m_pad, D] one minibatch of tokens at every layer (inside `jax.shard_map` with `axis_name`: this
      device's block of layers; the other blocks' Grams are gathered, m_pad² floats per layer).
    mask: optional [m_pad] bool valid tokens.
    axis_name: mesh axis (or tuple) the layers are split over, or None.

  Returns:
    (hsic, valid): [L, L_all] float32 HSIC estimates of this device's layers against every layer (0 when
    m < 4; [L, L] without `axis_name`) and a bool scalar, m ≥ 4.
  """
  num_layers, m_pad, _ = hidden.shape
  if mask is None:
    mask = jnp.ones((m_pad,), bool)
  mask = mask.astype(bool)
  xc = masked_center(hidden, mask[None, :])  # shift-invariant estimator; centring only for float32 accuracy
  g = jnp.einsum("lnd,lmd->lnm", xc, xc, precision=_HI)
  g = g * (1.0 - jnp.eye(m_pad, dtype=g.dtype))
  gf = g.reshape(num_layers, m_pad * m_pad)
  trace_term = jnp.einsum("ap,bp->ab", gf, _gather(gf, axis_name), precision=_HI)
  row = jnp.sum(g, axis=-1)  # [L, m] = K̃ 1
  total = jnp.sum(row, axis=-1)  # [L] = 1ᵀ K̃ 1
  row_term = jnp.einsum("an,bn->ab", row, _gather(row, axis_name), precision=_HI)  # 1ᵀ K̃ L̃ 1 (K̃ symmetric)
  m = jnp.sum(mask.astype(jnp.float32))
  valid = m >= MIN_HSIC_TOKENS
  ms = jnp.where(valid, m, float(MIN_HSIC_TOKENS + 1))
  hsic = (trace_term + jnp.outer(total, _gather(total, axis_name)) / ((ms - 1) * (ms - 2))
          - 2.0 / (ms - 2) * row_term) / (ms * (ms - 3))
  return jnp.where(valid, hsic, 0.0), valid


def _minibatch_order(keep_flat: jax.Array, key: jax.Array | None) -> jax.Array:
  """Token order: kept tokens first (shuffled when a key is given), stable otherwise."""
  p = keep_flat.shape[0]
  order = jnp.arange(p) if key is None else jax.random.permutation(key, p)
  rank = jnp.argsort(~keep_flat[order], stable=True)
  return order[rank]


def minibatch_hsic(hidden: jax.Array, keep: jax.Array, m: int, key, width: int | None = None,
                   axis_name=None) -> tuple[jax.Array, jax.Array]:
  """Σ unbiased HSIC over the minibatches of one batch's kept tokens (the streaming estimator's summand).

  The kept tokens (shuffled across the batch when a PRNG key is given, else in (sequence, position) order) are
  cut into minibatches of m. Kept tokens come first in the minibatch order, so only the first ⌈kept / m⌉
  minibatches hold any; one minibatch at a time (`lax.map`), the rest skipped by a `lax.cond` (they would add
  exact zeros).

  Args:
    hidden: [L, B, T, D] (under `axis_name`: this device's block of layers).
    keep: [B, T] bool.
    m: tokens per minibatch.
    key: PRNG key of the shuffle, or None.
    width: layers of the whole matrix (L · devices under `axis_name`; default L).
    axis_name: mesh axis (or tuple) the layers are split over, or None.

  Returns:
    ([L, width] Σ HSIC of these layers against every layer, the number of minibatches with ≥ 4 tokens).
  """
  l1, b, t, d = hidden.shape
  width = l1 if width is None else width
  p = b * t
  m = min(m, p)
  chunks = -(-p // m)
  tokens = hidden.reshape(l1, p, d)
  keep_flat = keep.reshape(p)
  order = _minibatch_order(keep_flat, key)
  pad = chunks * m - p
  idx = jnp.concatenate([order, jnp.zeros((pad,), order.dtype)]).reshape(chunks, m)
  mask = keep_flat[idx] & (jnp.arange(chunks * m) < p).reshape(chunks, m)
  needed = -(-jnp.sum(keep_flat.astype(jnp.int32)) // m)

  def one(i):
    def compute():
      # The barrier keeps XLA from fusing the gather into the Gram's dot: on CPU such a dot inside a loop is
      # emitted as a plain loop nest, 80x slower (75 s against 0.9 s for 8 minibatches of SmolLM2-135M).
      x = jax.lax.optimization_barrier(tokens[:, idx[i]])
      return unbiased_hsic_all_pairs(x, mask[i], axis_name)

    def skip():
      zeros = jnp.zeros((l1, width), jnp.float32)
      if axis_name is not None:  # shard_map types the other branch's rows as differing across devices
        zeros = jax.lax.pcast(zeros, axis_name, to="varying")
      return zeros, jnp.zeros((), bool)

    return jax.lax.cond(i < needed, compute, skip)

  hsic, valid = jax.lax.map(one, jnp.arange(chunks))
  return jnp.sum(hsic, axis=0), jnp.sum(valid.astype(jnp.int32))


def cka_from_hsic(sum_hsic: jax.Array) -> jax.Array:
  """Minibatch CKA from summed HSIC estimates (Nguyen et al. 2021).

  Args:
    sum_hsic: [L, L] Σ over minibatches of unbiased HSIC.

  Returns:
    [L, L] CKA_ab = Σ HSIC_ab / √(Σ HSIC_aa Σ HSIC_bb) (0 where a diagonal is ≤ 0). Being an estimator it
    may leave [0, 1] slightly on small samples; it is not clipped.
  """
  sum_hsic = jnp.asarray(sum_hsic, jnp.float32)
  sym = 0.5 * (sum_hsic + sum_hsic.T)
  diag = jnp.sqrt(jnp.clip(jnp.diagonal(sym), 0.0))
  return _safe_ratio(sym, diag[:, None] * diag[None, :])
