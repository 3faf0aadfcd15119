"""Streaming layer statistics over a corpus (docs/METHOD.md §3–4).

Place in the pipeline: for every batch, target hidden states [L+1, B, T, D] and the token-filter keep mask
[B, T] go through one jitted `update` of a `LayerStatsAccumulator`; after the corpus, `finalize` turns the
sums into a `LayerStats` record of small numpy arrays (per-layer entropy profiles, CKA matrices, counts) that
`layerwave.selection` and the plots read.

What is accumulated (all float32 sums unless noted; memory independent of the number of tokens):
  * prompt entropy: Σ over sequences of the per-sequence matrix entropy (raw and normalised) per layer, and the
    number of sequences with ≥ 2 kept tokens (`entropy.prompt_entropy`); finalize divides.
  * dataset entropy: one mean-pooled vector per sequence (mean over its kept tokens); Σ v and Σ v vᵀ per layer
    ([L+1, D] and [L+1, D, D]); the mean is subtracted at the end (`entropy.covariance_entropy`).
    With normalize=True each pooled vector is scaled to unit L2 norm *before* accumulation: the Skean order
    (centre, then normalise rows) needs the dataset mean, which a single pass does not know. This is the one
    place where streaming deviates from the in-memory definition.
  * minibatch CKA: the kept tokens of the batch (shuffled across the batch when a PRNG key is given) are cut
    into minibatches of `hsic_batch_size` tokens; Σ of the unbiased HSIC [L+1, L+1] (`cka.unbiased_hsic_all_
    pairs`) and the number of minibatches with ≥ 4 tokens. The Grams of the minibatches that hold kept tokens
    (at most ⌈B·T / m⌉) are formed at once (vmap): transient memory ⌈B·T / m⌉ · (L+1) · m² floats per update.
  * exact-CKA subsample (optional, `buffer_size` > 0): a uniform random sample without replacement of kept
    tokens of fixed size, kept by bottom-k of i.i.d. uniform priorities (so merging two buffers is exact too).
  * counts: kept tokens, sequences; per-layer count of NaN/inf entries seen (finalize raises naming layers).
Counts are int32 (fine up to 2³¹ tokens).

Across devices: `layerwave.analysis.collect` jits `update` with the batch sharded over the mesh's 'data'
axis and the accumulator replicated, so XLA's partitioner inserts the cross-device sums; no per-device code
is needed. `merge(a, b)` combines two accumulators of disjoint data (sums, and a bottom-k merge of the
buffers); collect uses it to join the two halves of the stability check.

Legend (`layerwave.axes`): L target layers, L1 hidden-state depths, B batch, T tokens, n kept tokens, m Gram size,
R subsample size, D target width.
"""

from __future__ import annotations

import dataclasses as _dc

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from layerwave.analysis import cka as cka_lib
from layerwave.analysis import entropy as entropy_lib

__all__ = ["LayerStatsAccumulator", "LayerStats", "init", "update", "merge", "finalize"]

_HI = jax.lax.Precision.HIGHEST


@flax.struct.dataclass
class LayerStatsAccumulator:
  """Running sums of the layer statistics (a pytree; static fields are hashed into jit).

  Shapes: see the module's legend; R = `buffer_size`.
  """

  prompt_entropy_sum: jax.Array  # [L1] Σ per-sequence entropy
  prompt_entropy_norm_sum: jax.Array  # [L1] Σ per-sequence entropy / log(min(n, D))
  num_prompts: jax.Array  # [] int32 sequences with >= 2 kept tokens
  num_tokens: jax.Array  # [] int32 kept tokens
  num_sequences: jax.Array  # [] int32 sequences with >= 1 kept token (pooled vectors)
  pooled_sum: jax.Array  # [L1, D] Σ pooled vectors
  pooled_second_moment: jax.Array  # [L1, D, D] Σ v vᵀ
  hsic_sum: jax.Array  # [L1, L1] Σ unbiased HSIC
  num_hsic_batches: jax.Array  # [] int32 minibatches with >= 4 tokens
  nonfinite: jax.Array  # [L1] int32 batches in which the layer held NaN/inf at kept positions
  buffer: jax.Array  # [L1, R, D] exact-CKA token subsample
  buffer_priority: jax.Array  # [R] float32, +inf = empty slot
  alpha: float = flax.struct.field(pytree_node=False, default=1.0)
  normalize: bool = flax.struct.field(pytree_node=False, default=True)
  hsic_batch_size: int = flax.struct.field(pytree_node=False, default=256)

  @property
  def num_layers_plus_one(self) -> int:
    return self.pooled_sum.shape[0]

  @property
  def buffer_size(self) -> int:
    return self.buffer_priority.shape[0]


@flax.struct.dataclass
class LayerStats:
  """Finalised statistics (host numpy values). L1 = L+1 layers, HF hidden_states indexing.

  Attributes:
    prompt_entropy: [L1] mean over sequences of the per-sequence matrix entropy (nats).
    prompt_entropy_normalized: [L1] same, each sequence divided by log(min(n, D)).
    dataset_entropy: [L1] entropy of the covariance of mean-pooled sequence vectors (nats).
    dataset_entropy_normalized: [L1] / log(min(num_sequences, D)).
    cka_minibatch: [L1, L1] minibatch (unbiased HSIC) CKA.
    cka_exact: [L1, L1] exact CKA on the token subsample, or None when no buffer was kept.
    num_tokens, num_prompts, num_sequences, num_hsic_batches, num_exact_tokens: counts.
    alpha: Rényi order used; normalize: Skean normalisation used.
  """

  prompt_entropy: np.ndarray
  prompt_entropy_normalized: np.ndarray
  dataset_entropy: np.ndarray
  dataset_entropy_normalized: np.ndarray
  cka_minibatch: np.ndarray
  cka_exact: np.ndarray | None
  num_tokens: int
  num_prompts: int
  num_sequences: int
  num_hsic_batches: int
  num_exact_tokens: int
  alpha: float = flax.struct.field(pytree_node=False, default=1.0)
  normalize: bool = flax.struct.field(pytree_node=False, default=True)

  def as_dict(self) -> dict:
    """JSON-friendly dict (lists and Python scalars)."""
    out = {}
    for f in _dc.fields(self):
      v = getattr(self, f.name)
      out[f.name] = v.tolist() if isinstance(v, np.ndarray) else v
    return out

  @classmethod
  def from_dict(cls, d: dict) -> LayerStats:
    """The inverse of `as_dict` (arrays as float64)."""
    arrays = {"prompt_entropy", "prompt_entropy_normalized", "dataset_entropy", "dataset_entropy_normalized",
              "cka_minibatch", "cka_exact"}
    fields = {f.name for f in _dc.fields(cls)}
    return cls(**{k: (np.asarray(v, np.float64) if k in arrays and v is not None else v)
                  for k, v in d.items() if k in fields})


def init(
    num_layers_plus_one: int,
    dim: int,
    *,
    alpha: float = 1.0,
    normalize: bool = True,
    hsic_batch_size: int = 256,
    buffer_size: int = 0,
) -> LayerStatsAccumulator:
  """Empty accumulator.

  Args:
    num_layers_plus_one: L+1 (length of the hidden_states stack).
    dim: D.
    alpha: Rényi order of the matrix entropy (> 0).
    normalize: Skean normalisation for the entropies.
    hsic_batch_size: tokens per minibatch for the unbiased HSIC (≥ 4).
    buffer_size: tokens kept for exact CKA (0 = none).

  Returns:
    LayerStatsAccumulator of zeros.
  """
  if float(alpha) <= 0:
    raise ValueError(f"Rényi order alpha must be > 0, got {alpha}")
  if hsic_batch_size < cka_lib.MIN_HSIC_TOKENS:
    raise ValueError(f"hsic_batch_size must be >= {cka_lib.MIN_HSIC_TOKENS}, got {hsic_batch_size}")
  if buffer_size < 0:
    raise ValueError(f"buffer_size must be >= 0, got {buffer_size}")
  l1, d = int(num_layers_plus_one), int(dim)
  f32, i32 = jnp.float32, jnp.int32
  return LayerStatsAccumulator(
      prompt_entropy_sum=jnp.zeros((l1,), f32),
      prompt_entropy_norm_sum=jnp.zeros((l1,), f32),
      num_prompts=jnp.zeros((), i32),
      num_tokens=jnp.zeros((), i32),
      num_sequences=jnp.zeros((), i32),
      pooled_sum=jnp.zeros((l1, d), f32),
      pooled_second_moment=jnp.zeros((l1, d, d), f32),
      hsic_sum=jnp.zeros((l1, l1), f32),
      num_hsic_batches=jnp.zeros((), i32),
      nonfinite=jnp.zeros((l1,), i32),
      buffer=jnp.zeros((l1, buffer_size, d), f32),
      buffer_priority=jnp.full((buffer_size,), jnp.inf, f32),
      alpha=float(alpha),
      normalize=bool(normalize),
      hsic_batch_size=int(hsic_batch_size),
  )


def _pooled(hidden: jax.Array, keep: jax.Array, normalize: bool) -> tuple[jax.Array, jax.Array]:
  """Mean over kept tokens per sequence: [L1, B, D] and validity [B]."""
  w = keep.astype(jnp.float32)
  n = jnp.sum(w, axis=-1)  # [B]
  v = jnp.einsum("lbtd,bt->lbd", hidden.astype(jnp.float32), w, precision=_HI) / jnp.maximum(n, 1.0)[:, None]
  if normalize:
    norm = jnp.sqrt(jnp.sum(v * v, axis=-1, keepdims=True))
    v = v / jnp.where(norm > 0, norm, 1.0)
  valid = n >= 1
  return v * valid[None, :, None].astype(jnp.float32), valid


def _minibatch_order(keep_flat: jax.Array, key: jax.Array | None) -> jax.Array:
  """Token order: kept tokens first (shuffled when a key is given), stable otherwise."""
  p = keep_flat.shape[0]
  order = jnp.arange(p) if key is None else jax.random.permutation(key, p)
  rank = jnp.argsort(~keep_flat[order], stable=True)
  return order[rank]


def _chunk_ladder(chunks: int) -> tuple[int, ...]:
  """Static numbers of minibatches to compute: 1, 2, 3, 4, 6, 8, 12, ... up to `chunks` (≤ 1.5× waste)."""
  sizes, c = [], 1
  while c < chunks:
    sizes.append(c)
    c = c + 1 if c < 2 else (c * 3 // 2 if c & (c - 1) == 0 else c * 4 // 3)
  sizes.append(chunks)
  return tuple(sorted(set(sizes)))


def _hsic_update(hidden: jax.Array, keep: jax.Array, m: int, key) -> tuple[jax.Array, jax.Array]:
  """Σ unbiased HSIC over the minibatches of this batch: [L1, L1] and number of valid minibatches.

  Kept tokens come first in the minibatch order, so only the first ⌈kept / m⌉ minibatches hold any; a
  `lax.switch` over a static ladder of minibatch counts computes just those (the rest would add exact zeros).
  """
  l1, b, t, d = hidden.shape
  p = b * t
  m = min(m, p)
  chunks = -(-p // m)
  tokens = hidden.reshape(l1, p, d)
  keep_flat = keep.reshape(p)
  order = _minibatch_order(keep_flat, key)
  pad = chunks * m - p
  idx = jnp.concatenate([order, jnp.zeros((pad,), order.dtype)])
  in_range = jnp.arange(chunks * m) < p
  mask = (keep_flat[idx] & in_range).reshape(chunks, m)

  def first(c):
    def fn(idx, mask):
      x = jnp.moveaxis(tokens[:, idx[:c * m]].reshape(l1, c, m, d), 1, 0)  # [c, L1, m, D]
      hsic, valid = jax.vmap(cka_lib.unbiased_hsic_all_pairs)(x, mask[:c])
      return jnp.sum(hsic, axis=0), jnp.sum(valid.astype(jnp.int32))
    return fn

  ladder = _chunk_ladder(chunks)
  if len(ladder) == 1:
    return first(chunks)(idx, mask)
  needed = -(-jnp.sum(keep_flat.astype(jnp.int32)) // m)
  index = jnp.minimum(jnp.searchsorted(jnp.asarray(ladder), needed), len(ladder) - 1)
  return jax.lax.switch(index, [first(c) for c in ladder], idx, mask)


def _bottom_k(priority: jax.Array, tokens: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
  """Keeps the `size` smallest priorities: priority [n], tokens [L1, n, D] → [size], [L1, size, D]."""
  neg, idx = jax.lax.top_k(-priority, size)
  return -neg, tokens[:, idx]


def update(
    acc: LayerStatsAccumulator,
    hidden: jax.Array,
    keep_mask: jax.Array,
    key: jax.Array | None = None,
) -> LayerStatsAccumulator:
  """Adds one batch to the accumulator (pure; jit it once where it is called, donating `acc`).

  Args:
    acc: current accumulator.
    hidden: [L+1, B, T, D] hidden states (any float dtype; statistics in float32).
    keep_mask: [B, T] bool, token filter ∧ attention (∧ assistant) mask.
    key: PRNG key shuffling tokens across the batch before cutting HSIC minibatches and drawing the
      exact-CKA subsample priorities. Required when the accumulator has a buffer. Without a key, minibatches
      are consecutive kept tokens in (sequence, position) order.

  Returns:
    The updated accumulator.
  """
  l1, b, t, d = hidden.shape
  if (l1, d) != acc.pooled_sum.shape:
    raise ValueError(f"hidden [L+1={l1}, ..., D={d}] does not match the accumulator "
                     f"[L+1={acc.pooled_sum.shape[0]}, D={acc.pooled_sum.shape[1]}]")
  if keep_mask.shape != (b, t):
    raise ValueError(f"keep_mask shape {keep_mask.shape} != (B, T) = {(b, t)}")
  keep = keep_mask.astype(bool)
  n_seq = jnp.sum(keep.astype(jnp.int32), axis=-1)  # [B]

  bad = entropy_lib.nonfinite_layers(hidden, keep).astype(jnp.int32)

  h, hn = entropy_lib.prompt_entropy(hidden, keep, acc.alpha, acc.normalize)  # [L1, B]
  prompt_ok = (n_seq >= 2).astype(jnp.float32)
  pe_sum = acc.prompt_entropy_sum + jnp.sum(h * prompt_ok, axis=-1)
  pen_sum = acc.prompt_entropy_norm_sum + jnp.sum(hn * prompt_ok, axis=-1)

  v, pooled_ok = _pooled(hidden, keep, acc.normalize)
  second = acc.pooled_second_moment + jnp.einsum("lbd,lbe->lde", v, v, precision=_HI)
  first = acc.pooled_sum + jnp.sum(v, axis=1)

  hsic_key = buf_key = None
  if key is not None:
    hsic_key, buf_key = jax.random.split(key)
  hsic, n_hsic = _hsic_update(hidden, keep, acc.hsic_batch_size, hsic_key)

  buffer, priority = acc.buffer, acc.buffer_priority
  if acc.buffer_size > 0:
    if key is None:
      raise ValueError("update needs a PRNG key when the accumulator keeps an exact-CKA buffer")
    new_priority = jnp.where(keep.reshape(-1), jax.random.uniform(buf_key, (b * t,)), jnp.inf)
    tokens = hidden.reshape(l1, b * t, d)
    # Bottom-k of the batch first (a gather of at most buffer_size tokens), then of the union with the buffer:
    # the same set as bottom-k over everything, without concatenating all B·T tokens to the buffer.
    new_priority, tokens = _bottom_k(new_priority, tokens, min(acc.buffer_size, b * t))
    priority, buffer = _bottom_k(jnp.concatenate([priority, new_priority]),
                                 jnp.concatenate([buffer, tokens.astype(jnp.float32)], axis=1),
                                 acc.buffer_size)

  return acc.replace(
      prompt_entropy_sum=pe_sum,
      prompt_entropy_norm_sum=pen_sum,
      num_prompts=acc.num_prompts + jnp.sum(n_seq >= 2).astype(jnp.int32),
      num_tokens=acc.num_tokens + jnp.sum(n_seq).astype(jnp.int32),
      num_sequences=acc.num_sequences + jnp.sum(pooled_ok).astype(jnp.int32),
      pooled_sum=first,
      pooled_second_moment=second,
      hsic_sum=acc.hsic_sum + hsic,
      num_hsic_batches=acc.num_hsic_batches + n_hsic,
      nonfinite=acc.nonfinite + bad,
      buffer=buffer,
      buffer_priority=priority,
  )


_SUM_FIELDS = ("prompt_entropy_sum", "prompt_entropy_norm_sum", "num_prompts", "num_tokens", "num_sequences",
               "pooled_sum", "pooled_second_moment", "hsic_sum", "num_hsic_batches", "nonfinite")


def merge(a: LayerStatsAccumulator, b: LayerStatsAccumulator) -> LayerStatsAccumulator:
  """Combines two accumulators of disjoint data (associative, commutative up to float rounding).

  Sum fields add; the exact-CKA buffers merge by bottom-k of their priorities.

  Args:
    a, b: accumulators with the same static configuration and shapes.

  Returns:
    The merged accumulator.
  """
  for name in ("alpha", "normalize", "hsic_batch_size"):
    if getattr(a, name) != getattr(b, name):
      raise ValueError(f"cannot merge accumulators with different {name}: {getattr(a, name)} vs {getattr(b, name)}")
  if a.buffer.shape != b.buffer.shape or a.pooled_sum.shape != b.pooled_sum.shape:
    raise ValueError("cannot merge accumulators of different shapes")
  sums = {name: getattr(a, name) + getattr(b, name) for name in _SUM_FIELDS}
  buffer, priority = a.buffer, a.buffer_priority
  if a.buffer_size > 0:
    priority, buffer = _bottom_k(jnp.concatenate([a.buffer_priority, b.buffer_priority]),
                                 jnp.concatenate([a.buffer, b.buffer], axis=1), a.buffer_size)
  return a.replace(buffer=buffer, buffer_priority=priority, **sums)


def _finalize_device(acc: LayerStatsAccumulator):
  n_prompts = jnp.maximum(acc.num_prompts, 1).astype(jnp.float32)
  de, den = entropy_lib.covariance_entropy(acc.pooled_second_moment, acc.pooled_sum, acc.num_sequences, acc.alpha)
  out = {
      "prompt_entropy": acc.prompt_entropy_sum / n_prompts,
      "prompt_entropy_normalized": acc.prompt_entropy_norm_sum / n_prompts,
      "dataset_entropy": de,
      "dataset_entropy_normalized": den,
      "cka_minibatch": cka_lib.cka_from_hsic(acc.hsic_sum),
  }
  if acc.buffer_size > 0:
    out["cka_exact"] = cka_lib.all_pairs_cka(acc.buffer, jnp.isfinite(acc.buffer_priority))
  return out


_finalize_jit = jax.jit(_finalize_device)


def finalize(acc: LayerStatsAccumulator) -> LayerStats:
  """Turns the sums into statistics (host side; one small jitted computation inside).

  Args:
    acc: accumulator after the corpus.

  Returns:
    LayerStats of numpy arrays.

  Raises:
    ValueError: no token was kept.
    FloatingPointError: a layer held NaN/inf at a kept position (the message names the layer indices).
  """
  entropy_lib.check_finite(np.asarray(acc.nonfinite))
  num_tokens = int(acc.num_tokens)
  if num_tokens == 0:
    raise ValueError("the token filter kept no token: lower threshold / percentile, or check the masks")
  out = jax.tree.map(np.asarray, _finalize_jit(acc))
  return LayerStats(
      prompt_entropy=out["prompt_entropy"],
      prompt_entropy_normalized=out["prompt_entropy_normalized"],
      dataset_entropy=out["dataset_entropy"],
      dataset_entropy_normalized=out["dataset_entropy_normalized"],
      cka_minibatch=out["cka_minibatch"],
      cka_exact=out.get("cka_exact"),
      num_tokens=num_tokens,
      num_prompts=int(acc.num_prompts),
      num_sequences=int(acc.num_sequences),
      num_hsic_batches=int(acc.num_hsic_batches),
      num_exact_tokens=int(np.isfinite(np.asarray(acc.buffer_priority)).sum()),
      alpha=acc.alpha,
      normalize=acc.normalize,
  )
