"""Matrix (Gram) entropy of layer representations — informativeness (docs/METHOD.md §3).

Place in the pipeline: hidden states [L+1, B, T, D] + the token-filter keep mask [B, T] → per-sequence,
per-layer matrix entropy [L+1, B] (prompt entropy; averaged over sequences by `layerwave.analysis.stats`)
and, from streamed second moments, dataset entropy [L+1] → Ê_ℓ for `layerwave.selection`.

Definition for Z ∈ R^{n×D} (the kept tokens of one sequence at one layer):
  1. (normalize=True, Skean et al. 2025) centre over tokens, then scale each row to unit L2 norm;
  2. K = Z Zᵀ (n×n) or the D×D covariance ZᵀZ, whichever is smaller (same nonzero spectrum), / tr K;
  3. eigenvalues clipped at a rank tolerance (m · eps_f32 · λ_max, below which float32 cannot resolve them;
     this also removes the exact zeros contributed by padding rows), p_i = λ_i / Σλ;
  4. Rényi entropy S_α = log Σ p_i^α / (1 − α); α = 1 → −Σ p log p; α = 2 → −log(‖K‖_F² / (tr K)²) with no
     eigendecomposition.
Normalised entropy divides by log(min(n, D)).

Everything is mask-aware with fixed shapes so that one jitted, vmapped call handles all layers and sequences;
the Gram/covariance choice is static (padded length against D). The eigendecompositions run layer by layer
(`jax.lax.map`), each one batched `eigvalsh` over [B, m, m], so the transient memory is one layer's.

Cost. The α ≠ 2 eigendecomposition is cubic in m, and it dominates the analysis (a 512×512 `eigvalsh` for each
of 31 layers of one sequence costs about as much as SmolLM2-135M's forward over it). Only the kept tokens matter
(masked rows are zero and add zero eigenvalues), so `prompt_entropy` first moves each sequence's kept tokens to
the front and cuts the padded length to the smallest size of a static ladder (`bucket_sizes`) that holds the
batch's largest kept count, choosing the branch with `lax.switch` inside the jit: every branch has static
shapes, the result is exact, and the cost follows the number of kept tokens instead of the padded length.

Legend (`layerwave.axes`): L target layers, B batch, T tokens, n kept tokens, m Gram size, D target width.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "entropy_from_gram",
    "entropy_from_eigenvalues",
    "matrix_entropy",
    "masked_matrix_entropy",
    "normalize_representations",
    "prompt_entropy",
    "bucket_sizes",
    "covariance_entropy",
    "eigvalsh",
    "nonfinite_layers",
    "check_finite",
]

_HI = jax.lax.Precision.HIGHEST  # TF32 matmuls on GPU would cost ~3 digits of the spectrum.


def _check_alpha(alpha: float) -> float:
  alpha = float(alpha)
  if not alpha > 0:
    raise ValueError(f"Rényi order alpha must be > 0, got {alpha}")
  return alpha


def entropy_from_eigenvalues(eigenvalues: jax.Array, alpha: float = 1.0) -> jax.Array:
  """Rényi entropy of the spectrum of a PSD matrix.

  Args:
    eigenvalues: [..., m] eigenvalues (any scale; tiny negatives and values below the float32 rank
      tolerance m · eps · λ_max are treated as 0).
    alpha: Rényi order (> 0); 1 is the Shannon limit.

  Returns:
    [...] entropy in nats (0 for an all-zero spectrum).
  """
  alpha = _check_alpha(alpha)
  lam = eigenvalues.astype(jnp.float32)
  m = lam.shape[-1]
  lam_max = jnp.max(lam, axis=-1, keepdims=True)
  tol = m * jnp.finfo(jnp.float32).eps * lam_max
  lam = jnp.where(lam > tol, lam, 0.0)
  total = jnp.sum(lam, axis=-1, keepdims=True)
  p = lam / jnp.where(total > 0, total, 1.0)
  if alpha == 1.0:
    h = -jnp.sum(jax.scipy.special.xlogy(p, p), axis=-1)
  else:
    s = jnp.sum(jnp.where(p > 0, p, 0.0) ** alpha, axis=-1)
    h = jnp.log(jnp.where(s > 0, s, 1.0)) / (1.0 - alpha)
  return jnp.where(total[..., 0] > 0, h, 0.0)


def entropy_from_gram(k: jax.Array, alpha: float = 1.0) -> jax.Array:
  """Rényi entropy of a PSD Gram/covariance matrix normalised by its trace.

  Args:
    k: [..., m, m] symmetric PSD matrices.
    alpha: Rényi order (> 0). α = 2 uses −log(‖K‖_F² / (tr K)²) without an eigendecomposition.

  Returns:
    [...] entropy in nats (0 when tr K = 0).
  """
  alpha = _check_alpha(alpha)
  k = k.astype(jnp.float32)
  tr = jnp.trace(k, axis1=-2, axis2=-1)
  if alpha == 2.0:
    fro2 = jnp.sum(k * k, axis=(-2, -1))
    safe = jnp.where(tr > 0, tr, 1.0)
    return jnp.where(tr > 0, -jnp.log(fro2 / (safe * safe)), 0.0)
  k = k / jnp.where(tr > 0, tr, 1.0)[..., None, None]
  return entropy_from_eigenvalues(eigvalsh(k), alpha)


# Matrices per call of TPU's Jacobi kernel: with 8 at a time it ran out of on-chip scoped memory (VMEM) for
# sizes 776-936 (8 × 808 in the analysis step at T = 2048), and one at a time it compiled at every size tried
# from 16 to 4096; batches of up to 8 compiled at every size up to 768.
_TPU_EIGH_GROUP = 8
_TPU_EIGH_GROUP_MAX_SIZE = 512


def _jacobi_eigvalsh(k: jax.Array) -> jax.Array:
  *batch, m, _ = k.shape
  n = math.prod(batch)
  group = _TPU_EIGH_GROUP if m <= _TPU_EIGH_GROUP_MAX_SIZE else 1
  eigh = lambda x: jax.lax.linalg.eigh(  # noqa: E731
      x, implementation=jax.lax.linalg.EighImplementation.JACOBI, sort_eigenvalues=False)[1]
  if n <= group:
    return eigh(k)
  flat = jnp.pad(k.reshape(n, m, m), ((0, -n % group), (0, 0), (0, 0)))  # zero matrices: zero spectra, cut
  w = jax.lax.map(eigh, flat.reshape(-1, group, m, m))
  return w.reshape(-1, m)[:n].reshape(*batch, m)


def eigvalsh(k: jax.Array) -> jax.Array:
  """Eigenvalues of symmetric matrices [..., m, m] → [..., m] (in no particular order on TPU).

  `jnp.linalg.eigvalsh` everywhere but on TPU, where JAX's default (QDWH spectral divide and conquer) is a
  large program traced per matrix size: compiled for a v5e on a 2-core host it took 130 s for one
  [8, 512, 512] batch, and the analysis step holds one size per rung of `bucket_sizes` (two accumulators × up
  to 18 rungs). XLA's Jacobi kernel compiles in 3-10 s at any size up to 4096 (its speed on a chip is not
  measured here), given a few matrices per call (`_TPU_EIGH_GROUP`: a `lax.map` over groups of the batch).
  Only the entropy of the spectrum is used, so the order does not matter. Under `vmap` the groups cannot be
  seen: pass the batch explicitly.
  """
  return jax.lax.platform_dependent(k, tpu=_jacobi_eigvalsh, default=jnp.linalg.eigvalsh)


def normalize_representations(z: jax.Array, mask: jax.Array) -> jax.Array:
  """Skean normalisation: centre over the masked tokens, then unit-L2 rows; masked rows become 0.

  Args:
    z: [T, D] representations.
    mask: [T] bool.

  Returns:
    [T, D] float32.
  """
  z = z.astype(jnp.float32)
  w = mask.astype(jnp.float32)[:, None]
  n = jnp.maximum(jnp.sum(w), 1.0)
  mu = jnp.sum(z * w, axis=0) / n
  zc = (z - mu) * w
  norm = jnp.sqrt(jnp.sum(zc * zc, axis=-1, keepdims=True))
  return zc / jnp.where(norm > 0, norm, 1.0)


def _gram_small(z: jax.Array) -> jax.Array:
  """Z Zᵀ [T, T] or Zᵀ Z [D, D], whichever is smaller (static choice on the padded shape)."""
  t, d = z.shape
  if t <= d:
    return jnp.einsum("td,sd->ts", z, z, precision=_HI)
  return jnp.einsum("td,te->de", z, z, precision=_HI)


def masked_matrix_entropy(
    z: jax.Array, mask: jax.Array, alpha: float = 1.0, normalize: bool = True
) -> tuple[jax.Array, jax.Array]:
  """Matrix entropy of the masked rows of z (fixed shapes; jittable, vmappable).

  Masked rows contribute nothing: centring uses the masked mean and n = mask.sum(). With fewer than 2 valid
  rows the (centred) matrix is 0 and the entropy is reported as 0; callers drop such sequences.

  Args:
    z: [T, D] representations.
    mask: [T] bool, rows to use.
    alpha: Rényi order (> 0, static).
    normalize: Skean normalisation (centre + unit rows) if True, raw rows otherwise (masked rows zeroed).

  Returns:
    (entropy, normalized): float32 scalars; normalized = entropy / log(min(n, D)) (0 when min(n, D) < 2).
  """
  alpha = _check_alpha(alpha)
  h = entropy_from_gram(_masked_gram(z, mask, normalize), alpha)
  return h, _normalized(h, mask, z.shape[-1])


def _masked_gram(z: jax.Array, mask: jax.Array, normalize: bool) -> jax.Array:
  """The Gram (or covariance) of the masked rows of z [T, D], Skean-normalised or raw (masked rows zeroed)."""
  mask = mask.astype(bool)
  if normalize:
    zn = normalize_representations(z, mask)
  else:
    zn = z.astype(jnp.float32) * mask.astype(jnp.float32)[:, None]
  return _gram_small(zn)


def _normalized(h: jax.Array, mask: jax.Array, dim: int) -> jax.Array:
  """h / log(min(n, D)) with n = mask.sum(-1) (0 when min(n, D) < 2)."""
  n = jnp.sum(mask.astype(jnp.float32), axis=-1)
  denom = jnp.log(jnp.minimum(n, float(dim)))
  return jnp.where(denom > 0, h / jnp.where(denom > 0, denom, 1.0), 0.0)


def matrix_entropy(z: jax.Array, alpha: float = 1.0, normalize: bool = True) -> jax.Array:
  """Matrix entropy S_α of the rows of z, in nats.

  Args:
    z: [n, D] representations (n samples).
    alpha: Rényi order (> 0).
    normalize: centre over rows, then unit-L2 rows (Skean); raw Gram otherwise.

  Returns:
    float32 scalar.
  """
  z = jnp.asarray(z)
  if z.ndim != 2:
    raise ValueError(f"matrix_entropy expects z [n, D], got shape {z.shape}")
  return _matrix_entropy_jit(z, float(alpha), bool(normalize))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _matrix_entropy_jit(z, alpha, normalize):
  return masked_matrix_entropy(z, jnp.ones(z.shape[:1], bool), alpha, normalize)[0]


LADDER_RATIO = 1.3  # `bucket_sizes`' default growth between rungs


def bucket_sizes(length: int, dim: int, smallest: int = 16, ratio: float = LADDER_RATIO) -> tuple[int, ...]:
  """Static ladder of compacted lengths for `prompt_entropy` (each ≈ `ratio` × the previous, multiples of 8).

  The ladder stops at min(length, dim); when length > dim a last rung of `length` keeps the padded shape, where
  the D×D covariance is the smaller matrix anyway.

  Args:
    length: padded sequence length T.
    dim: width D.
    smallest: first rung.
    ratio: growth factor between rungs (> 1); the eigendecomposition cost grows ~ratio³ per rung.

  Returns:
    Increasing tuple of lengths; the last one ≥ every possible kept count.
  """
  cap = min(int(length), int(dim))
  sizes, m = [], max(1, min(int(smallest), cap))
  while m < cap:
    sizes.append(m)
    m = max(m + 1, -(-int(np.ceil(m * ratio)) // 8) * 8)
  sizes.append(cap)
  if length > cap:
    sizes.append(int(length))
  return tuple(sizes)


def _compaction(mask: jax.Array, m: int) -> jax.Array | None:
  """Positions of each sequence's kept tokens first (stable order), cut to m: [B, m] (None: keep all T)."""
  if m >= mask.shape[-1]:
    return None
  return jnp.argsort(~mask, axis=-1, stable=True)[:, :m]


def prompt_entropy(
    hidden: jax.Array, mask: jax.Array, alpha: float = 1.0, normalize: bool = True,
    buckets: tuple[int, ...] | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Per-sequence matrix entropy for every layer (prompt entropy before averaging).

  Layer by layer (`jax.lax.map`), one batched eigendecomposition over [B, m, m] each, with m the smallest rung
  of `buckets` that holds the batch's largest kept count (min(m, D) × min(m, D) matrices): the transient
  memory is one layer's compacted tokens and Grams, not all L+1 layers' at once (at T = 2048, D = 4096, B = 8
  that is 0.4 GB against 13 GB in float32). Exact: only the kept tokens enter the Grams. Under `vmap` the
  `lax.switch` over rungs becomes a select that runs every rung; call it unbatched.

  Args:
    hidden: [L+1, B, T, D] hidden states (HF indexing; any leading count of layers).
    mask: [B, T] bool keep mask (token filter ∧ attention mask).
    alpha: Rényi order (> 0, static).
    normalize: Skean normalisation (static).
    buckets: static ladder of compacted lengths, increasing, last ≥ T or ≥ D (default `bucket_sizes(T, D)`);
      `(T,)` disables compaction.

  Returns:
    (entropy, normalized): [L+1, B] float32 each. Sequences with fewer than 2 kept tokens give 0; weight them
    out with `mask.sum(-1) >= 2`.
  """
  alpha = _check_alpha(alpha)
  _, _, t, d = hidden.shape
  buckets = bucket_sizes(t, d) if buckets is None else tuple(int(m) for m in buckets)
  if not buckets or list(buckets) != sorted(set(buckets)) or buckets[-1] < min(t, d):
    raise ValueError(f"buckets must be increasing with the last >= min(T={t}, D={d}), got {buckets}")
  mask = mask.astype(bool)
  grams = jax.vmap(functools.partial(_masked_gram, normalize=normalize))

  def over_batch(h, kept):  # one layer: [B, m, D], [B, m] → [B], [B]
    # The Grams [B, m, m] go to one batched eigendecomposition (not one per sequence under vmap: `eigvalsh`
    # groups them on TPU).
    e = entropy_from_gram(grams(h, kept), alpha)
    return e, _normalized(e, kept, d)

  rows = jnp.arange(mask.shape[0])[:, None]

  def rung(m):
    def run(hidden, mask):
      order = _compaction(mask, m)  # shared by every layer
      if order is None:
        return jax.lax.map(lambda h: over_batch(h, mask), hidden)
      kept = mask[rows, order]
      return jax.lax.map(lambda h: over_batch(h[rows, order], kept), hidden)
    return run

  if len(buckets) == 1:
    return rung(buckets[0])(hidden, mask)
  most = jnp.max(jnp.sum(mask.astype(jnp.int32), axis=-1))
  index = jnp.minimum(jnp.searchsorted(jnp.asarray(buckets), most), len(buckets) - 1)
  return jax.lax.switch(index, [rung(m) for m in buckets], hidden, mask)


def covariance_entropy(
    second_moment: jax.Array, total: jax.Array, count: jax.Array, alpha: float = 1.0
) -> tuple[jax.Array, jax.Array]:
  """Entropy of the centred covariance rebuilt from streamed sums (dataset entropy).

  C = Σ x xᵀ − (Σ x)(Σ x)ᵀ / N; the entropy of C / tr C equals that of the centred N×N Gram.

  Args:
    second_moment: [..., D, D] Σ x xᵀ (float32).
    total: [..., D] Σ x.
    count: [...] or scalar: the number of samples n.
    alpha: Rényi order (> 0).

  Returns:
    (entropy, normalized): [...] each; normalized divides by log(min(n, D)).
  """
  alpha = _check_alpha(alpha)
  count = jnp.asarray(count, jnp.float32)
  safe = jnp.where(count > 0, count, 1.0)
  s = total.astype(jnp.float32)
  cov = second_moment.astype(jnp.float32) - jnp.einsum(
      "...d,...e->...de", s, s, precision=_HI) / safe[..., None, None]
  cov = 0.5 * (cov + jnp.swapaxes(cov, -1, -2))
  h = entropy_from_gram(cov, alpha)
  denom = jnp.log(jnp.minimum(count, float(second_moment.shape[-1])))
  return h, jnp.where(denom > 0, h / jnp.where(denom > 0, denom, 1.0), 0.0)


def nonfinite_layers(hidden: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """Per-layer flag: does any (masked) entry of the hidden state hold NaN or inf? Runs on device.

  Args:
    hidden: [L+1, B, T, D].
    mask: optional [B, T] bool; only these positions are checked.

  Returns:
    [L+1] bool.
  """
  bad = ~jnp.isfinite(hidden)
  bad = jnp.any(bad, axis=-1)  # [L+1, B, T]
  if mask is not None:
    bad = bad & mask.astype(bool)[None]
  return jnp.any(bad.reshape(bad.shape[0], -1), axis=-1)


def check_finite(flags: jax.Array | np.ndarray, what: str = "hidden state") -> None:
  """Host-side: raise naming the layers flagged by `nonfinite_layers` (or counts of bad entries).

  Args:
    flags: [L+1] bool (or counts; nonzero = bad).
    what: name used in the message.

  Raises:
    FloatingPointError: when any layer is flagged.
  """
  bad = np.flatnonzero(np.asarray(flags))
  if bad.size:
    raise FloatingPointError(
        f"NaN/inf in the {what} at layer index(es) {bad.tolist()} (HF hidden_states indexing: 0 = embeddings)"
    )
