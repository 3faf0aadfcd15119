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

All functions are mask-aware: padding / filtered tokens are zeroed rows and excluded from every count.

Legend (`layerwave.axes`): L target layers, n kept tokens, m Gram size, D target width.
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


def _cross_frobenius_sq(xc: jax.Array) -> jax.Array:
  """M_ab = ‖X_bᵀ X_a‖_F² = ⟨X_a X_aᵀ, X_b X_bᵀ⟩_F for every layer pair; xc [L, n, D] centred."""
  num_layers, n, d = xc.shape
  if n <= d:
    # Sample space: one n×n Gram per layer, then inner products of the flattened Grams.
    grams = jnp.einsum("lnd,lmd->lnm", xc, xc, precision=_HI).reshape(num_layers, n * n)
    return jnp.einsum("ap,bp->ab", grams, grams, precision=_HI)

  # Feature space: for each layer a, cross-covariances with all layers [L, D, D]; lax.map bounds memory to
  # one row of pairs at a time.
  def row(xa):
    cross = jnp.einsum("nd,lne->lde", xa, xc, precision=_HI)
    return jnp.sum(jnp.square(cross), axis=(1, 2))

  return jax.lax.map(row, xc)


def all_pairs_cka(hidden: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """Exact linear CKA for every pair of layers on the same tokens.

  Cost: L·n²·D + L²·n² when n ≤ D (Grams), else L²·n·D² (cross-covariances); memory O(L·n² ) or O(L·D²).

  Args:
    hidden: [L, n, D] representations of n tokens at L layers.
    mask: optional [n] bool: tokens to use.

  Returns:
    [L, L] float32 symmetric matrix with unit diagonal (0 rows for constant layers).
  """
  if hidden.ndim != 3:
    raise ValueError(f"all_pairs_cka expects hidden [L, n, D], got {hidden.shape}")
  m = None if mask is None else mask.astype(bool)[None, :]
  xc = masked_center(hidden, m)
  cross = _cross_frobenius_sq(xc)
  cross = 0.5 * (cross + cross.T)
  diag = jnp.sqrt(jnp.clip(jnp.diagonal(cross), 0.0))
  return _safe_ratio(cross, diag[:, None] * diag[None, :])


def unbiased_hsic_all_pairs(hidden: jax.Array, mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Unbiased HSIC (Song et al. 2012) of every pair of layers on one minibatch of tokens.

  HSIC₁(K, L) = [tr(K̃L̃) + 1ᵀK̃1 · 1ᵀL̃1 / ((m−1)(m−2)) − 2/(m−2) · 1ᵀK̃L̃1] / (m(m−3)), with K̃, L̃ the
  linear Grams with zeroed diagonals and m the number of valid tokens (masked rows are zero, so the padded
  sums equal the sums over valid tokens).

  Args:
    hidden: [L, m_pad, D] one minibatch of tokens at every layer.
    mask: optional [m_pad] bool valid tokens.

  Returns:
    (hsic, valid): [L, L] float32 HSIC estimates (0 when m < 4) and a bool scalar, m ≥ 4.
  """
  num_layers, m_pad, _ = hidden.shape
  if mask is None:
    mask = jnp.ones((m_pad,), bool)
  mask = mask.astype(bool)
  xc = masked_center(hidden, mask[None, :])  # shift-invariant estimator; centring only for float32 accuracy
  g = jnp.einsum("lnd,lmd->lnm", xc, xc, precision=_HI)
  g = g * (1.0 - jnp.eye(m_pad, dtype=g.dtype))
  gf = g.reshape(num_layers, m_pad * m_pad)
  trace_term = jnp.einsum("ap,bp->ab", gf, gf, precision=_HI)
  row = jnp.sum(g, axis=-1)  # [L, m] = K̃ 1
  total = jnp.sum(row, axis=-1)  # [L] = 1ᵀ K̃ 1
  row_term = jnp.einsum("an,bn->ab", row, row, precision=_HI)  # 1ᵀ K̃ L̃ 1 (K̃ symmetric)
  m = jnp.sum(mask.astype(jnp.float32))
  valid = m >= MIN_HSIC_TOKENS
  ms = jnp.where(valid, m, float(MIN_HSIC_TOKENS + 1))
  hsic = (trace_term + jnp.outer(total, total) / ((ms - 1) * (ms - 2)) - 2.0 / (ms - 2) * row_term) / (
      ms * (ms - 3))
  return jnp.where(valid, hsic, 0.0), valid


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
