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
    into minibatches of `hsic_batch_size` tokens; Σ of the unbiased HSIC [L+1, L+1] and the number of
    minibatches with ≥ 4 tokens (`cka.minibatch_hsic`). One minibatch at a time: transient memory
    (L+1) · m · (D + m) floats.
  * exact-CKA subsample (optional, `buffer_size` > 0): a uniform random sample without replacement of kept
    tokens of fixed size, kept by bottom-k of i.i.d. uniform priorities (so merging two buffers is exact too).
  * counts: kept tokens, sequences; per-layer count of NaN/inf entries seen (finalize raises naming layers).
Counts are int32 (fine up to 2³¹ tokens).

Across devices (`mesh=`): the accumulator is split over every device of the mesh along the layer axis, padded
to a multiple of the device count with dummy layers (`init(..., shards=)`; zero states, dropped by `finalize`),
so each chip keeps 1/N of the [L1, D, D] second moment and the [L1, R, D] subsample instead of all of it.
`update` runs per device (`jax.shard_map`): the hidden states arrive split over token positions, one
all-to-all gives each device all positions of its own layers, and every per-layer statistic (prompt entropy,
pooled moments, the subsample, its rows of the HSIC matrix) is computed there, one layer at a time; the only
other collective gathers each HSIC minibatch's m×m Grams. Every device derives the same token order and
subsample from the same key, so N devices compute the statistics of one. `finalize` likewise runs the
per-layer eigendecompositions on the device that holds the layer. Without a mesh the same per-device code runs
on all layers. `merge(a, b)` combines two accumulators of disjoint data (sums, and a bottom-k merge of the
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
from jax.sharding import PartitionSpec as P

from layerwave.analysis import cka as cka_lib
from layerwave.analysis import entropy as entropy_lib

__all__ = ["LayerStatsAccumulator", "LayerStats", "init", "update", "update_many", "merge", "finalize",
           "finalize_arrays", "partition_specs"]

_HI = jax.lax.Precision.HIGHEST


@flax.struct.dataclass
class LayerStatsAccumulator:
  """Running sums of the layer statistics (a pytree; static fields are hashed into jit).

  Shapes: see the module's legend; R = `buffer_size`.
  """

  prompt_entropy_sum: jax.Array  # [L1] Σ per-sequence entropy (every [L1, ...] padded: see `padded_layers`)
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
  ladder_ratio: float = flax.struct.field(pytree_node=False, default=entropy_lib.LADDER_RATIO)
  num_layers_plus_one: int = flax.struct.field(pytree_node=False, default=0)  # L1, the real layers

  @property
  def padded_layers(self) -> int:
    """Rows of the layer axis: L1 rounded up to a multiple of the shard count (`init`); rows ≥ L1 are dummies."""
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
    shards: int = 1,
    ladder_ratio: float = entropy_lib.LADDER_RATIO,
) -> LayerStatsAccumulator:
  """Empty accumulator.

  Args:
    num_layers_plus_one: L+1 (length of the hidden_states stack).
    dim: D.
    alpha: Rényi order of the matrix entropy (> 0).
    normalize: Skean normalisation for the entropies.
    hsic_batch_size: tokens per minibatch for the unbiased HSIC (≥ 4).
    buffer_size: tokens kept for exact CKA (0 = none).
    shards: devices the layer axis will be split over (`update(..., mesh=)`): the layer axis is padded up to
      a multiple of it with dummy layers.
    ladder_ratio: growth between the compacted lengths of the prompt entropy's eigendecompositions
      (`entropy.bucket_sizes`): each rung is one more eigendecomposition size to compile, so a coarser ladder
      compiles faster at long T (the same values; a kept count pads to a larger rung).

  Returns:
    LayerStatsAccumulator of zeros.
  """
  if float(alpha) <= 0:
    raise ValueError(f"Rényi order alpha must be > 0, got {alpha}")
  if hsic_batch_size < cka_lib.MIN_HSIC_TOKENS:
    raise ValueError(f"hsic_batch_size must be >= {cka_lib.MIN_HSIC_TOKENS}, got {hsic_batch_size}")
  if buffer_size < 0:
    raise ValueError(f"buffer_size must be >= 0, got {buffer_size}")
  if shards < 1:
    raise ValueError(f"shards must be >= 1, got {shards}")
  if not float(ladder_ratio) > 1.0:
    raise ValueError(f"ladder_ratio must be > 1, got {ladder_ratio}; set e.g. --config.analysis.ladder_ratio=2")
  d = int(dim)
  l1 = -(-int(num_layers_plus_one) // shards) * shards
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
      ladder_ratio=float(ladder_ratio),
      num_layers_plus_one=int(num_layers_plus_one),
  )


def partition_specs(acc: LayerStatsAccumulator, axes) -> LayerStatsAccumulator:
  """Where each field lives on a mesh: the layer axis split over `axes` (a mesh axis name or a tuple of them),
  counts and the subsample's priorities replicated. A pytree of `PartitionSpec`s shaped like `acc`."""
  layer = lambda *rest: P(axes, *rest)  # noqa: E731
  return acc.replace(
      prompt_entropy_sum=layer(), prompt_entropy_norm_sum=layer(), num_prompts=P(), num_tokens=P(),
      num_sequences=P(), pooled_sum=layer(None), pooled_second_moment=layer(None, None), hsic_sum=layer(None),
      num_hsic_batches=P(), nonfinite=layer(), buffer=layer(None, None), buffer_priority=P())


def _pad_layers(x: jax.Array, rows: int) -> jax.Array:
  """Zero dummy layers appended along axis 0 up to `rows`."""
  extra = rows - x.shape[0]
  return x if extra == 0 else jnp.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1))


def _pooled(hidden: jax.Array, keep: jax.Array, normalize: bool) -> tuple[jax.Array, jax.Array]:
  """Mean over kept tokens per sequence: [L1, B, D] and validity [B] (a layer at a time: no float32 copy of
  the whole [L1, B, T, D])."""
  w = keep.astype(jnp.float32)
  n = jnp.sum(w, axis=-1)  # [B]

  def layer(h):
    v = jnp.einsum("btd,bt->bd", h.astype(jnp.float32), w, precision=_HI) / jnp.maximum(n, 1.0)[:, None]
    if normalize:
      norm = jnp.sqrt(jnp.sum(v * v, axis=-1, keepdims=True))
      v = v / jnp.where(norm > 0, norm, 1.0)
    return v

  valid = n >= 1
  return jax.lax.map(layer, hidden) * valid[None, :, None].astype(jnp.float32), valid


def _bottom_k(priority: jax.Array, tokens: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
  """Keeps the `size` smallest priorities: priority [n], tokens [L1, n, D] → [size], [L1, size, D]."""
  neg, idx = jax.lax.top_k(-priority, size)
  return -neg, tokens[:, idx]


def update(
    acc: LayerStatsAccumulator,
    hidden: jax.Array,
    keep_mask: jax.Array,
    key: jax.Array | None = None,
    *,
    mesh=None,
) -> LayerStatsAccumulator:
  """Adds one batch to the accumulator (pure; jit it once where it is called, donating `acc`).

  Args:
    acc: current accumulator.
    hidden: [L+1, B, T, D] hidden states (any float dtype; statistics in float32).
    keep_mask: [B, T] bool, token filter ∧ attention (∧ assistant) mask.
    key: PRNG key shuffling tokens across the batch before cutting HSIC minibatches and drawing the
      exact-CKA subsample priorities. Required when the accumulator has a buffer. Without a key, minibatches
      are consecutive kept tokens in (sequence, position) order.
    mesh: split the layers over every device of this mesh (`acc` made by `init(..., shards=mesh size)`, laid
      out by `partition_specs`); None computes every layer here.

  Returns:
    The updated accumulator.
  """
  return update_many((acc,), hidden, (keep_mask,), (key,), mesh=mesh)[0]


def update_many(accs, hidden: jax.Array, keep_masks, keys, *, mesh=None) -> tuple[LayerStatsAccumulator, ...]:
  """`update` of several accumulators from the same hidden states (the layers are moved to their devices once).

  Args:
    accs: accumulators of the same layer count and padding.
    hidden: [L+1, B, T, D].
    keep_masks: one [B, T] bool mask per accumulator.
    keys: one PRNG key (or None) per accumulator.
    mesh: as `update`.

  Returns:
    The updated accumulators, in order.
  """
  accs, keep_masks, keys = tuple(accs), tuple(keep_masks), tuple(keys)
  if not len(accs) == len(keep_masks) == len(keys):
    raise ValueError(f"update_many needs one mask and key per accumulator: {len(accs)} accumulators, "
                     f"{len(keep_masks)} masks, {len(keys)} keys")
  l1, b, t, d = hidden.shape
  for acc, keep, key in zip(accs, keep_masks, keys):
    if (l1, d) != (acc.num_layers_plus_one, acc.pooled_sum.shape[1]):
      raise ValueError(f"hidden [L+1={l1}, ..., D={d}] does not match the accumulator "
                       f"[L+1={acc.num_layers_plus_one}, D={acc.pooled_sum.shape[1]}]")
    if keep.shape != (b, t):
      raise ValueError(f"keep_mask shape {keep.shape} != (B, T) = {(b, t)}")
    if acc.buffer_size > 0 and key is None:
      raise ValueError("update needs a PRNG key when the accumulator keeps an exact-CKA buffer")
  rows = accs[0].padded_layers
  shards = 1 if mesh is None else mesh.devices.size
  if any(acc.padded_layers != rows for acc in accs) or rows % shards:
    raise ValueError(f"accumulators padded to {[a.padded_layers for a in accs]} layers cannot split over "
                     f"{shards} devices: make them with stats.init(..., shards={shards})")
  keeps = tuple(k.astype(bool) for k in keep_masks)
  if shards == 1:
    padded = _pad_layers(hidden, rows)
    return tuple(_update_local(a, padded, k, key, None) for a, k, key in zip(accs, keeps, keys))

  axes = tuple(mesh.axis_names)
  p = b * t
  # Split over token positions on the way in: the target's hidden states are whole on every chip of a 'model'
  # group, so taking 1/N of the positions is local, and one all-to-all below trades positions for layers.
  flat = hidden.reshape(l1, p, d)
  if p % shards:
    flat = jnp.pad(flat, ((0, 0), (0, -p % shards), (0, 0)))

  def per_device(accs, flat, keeps, keys):
    # Every layer at this device's share of the positions → this device's layers at all positions.
    local = jax.lax.all_to_all(_pad_layers(flat, rows), axes, 0, 1, tiled=True)
    local = local[:, :p].reshape(rows // shards, b, t, d)
    return tuple(_update_local(a, local, k, key, axes) for a, k, key in zip(accs, keeps, keys))

  specs = tuple(partition_specs(a, axes) for a in accs)
  return jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P(None, axes), P(), P()),
                       out_specs=specs)(accs, flat, keeps, keys)


def _update_local(acc: LayerStatsAccumulator, hidden: jax.Array, keep: jax.Array, key,
                  axis_name) -> LayerStatsAccumulator:
  """`update` on this device's block of layers (all of them when `axis_name` is None): hidden is this block's
  layers, batch and tokens (`[L1, B, T, D]` for the whole block on one device)."""
  b, t = keep.shape
  n_seq = jnp.sum(keep.astype(jnp.int32), axis=-1)  # [B]

  bad = entropy_lib.nonfinite_layers(hidden, keep).astype(jnp.int32)

  buckets = entropy_lib.bucket_sizes(t, hidden.shape[-1], ratio=acc.ladder_ratio)
  h, hn = entropy_lib.prompt_entropy(hidden, keep, acc.alpha, acc.normalize, buckets)  # per layer of the block, per sequence
  prompt_ok = (n_seq >= 2).astype(jnp.float32)
  pe_sum = acc.prompt_entropy_sum + jnp.sum(h * prompt_ok, axis=-1)
  pen_sum = acc.prompt_entropy_norm_sum + jnp.sum(hn * prompt_ok, axis=-1)

  v, pooled_ok = _pooled(hidden, keep, acc.normalize)
  second = acc.pooled_second_moment + jnp.einsum("lbd,lbe->lde", v, v, precision=_HI)
  first = acc.pooled_sum + jnp.sum(v, axis=1)

  hsic_key = buf_key = None
  if key is not None:
    hsic_key, buf_key = jax.random.split(key)
  hsic, n_hsic = cka_lib.minibatch_hsic(hidden, keep, acc.hsic_batch_size, hsic_key, acc.hsic_sum.shape[1],
                                        axis_name)

  buffer, priority = acc.buffer, acc.buffer_priority
  if acc.buffer_size > 0:
    # The same priorities on every device (the same key): each keeps the same tokens of its own layers.
    new_priority = jnp.where(keep.reshape(-1), jax.random.uniform(buf_key, (b * t,)), jnp.inf)
    tokens = hidden.reshape(hidden.shape[0], b * t, hidden.shape[-1])
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
  for name in ("alpha", "normalize", "hsic_batch_size", "ladder_ratio", "num_layers_plus_one"):
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


def _finalize_local(acc: LayerStatsAccumulator, axis_name=None) -> dict:
  """The statistics of this device's block of layers, gathered whole (every output is the same everywhere)."""
  n_prompts = jnp.maximum(acc.num_prompts, 1).astype(jnp.float32)
  # One layer's D×D eigendecomposition at a time.
  de, den = jax.lax.map(lambda a: entropy_lib.covariance_entropy(a[0], a[1], acc.num_sequences, acc.alpha),
                        (acc.pooled_second_moment, acc.pooled_sum))
  whole = lambda x: cka_lib.gather_blocks(x, axis_name)  # noqa: E731
  out = {
      "prompt_entropy": whole(acc.prompt_entropy_sum / n_prompts),
      "prompt_entropy_normalized": whole(acc.prompt_entropy_norm_sum / n_prompts),
      "dataset_entropy": whole(de),
      "dataset_entropy_normalized": whole(den),
      "cka_minibatch": cka_lib.cka_from_hsic(whole(acc.hsic_sum)),
      "nonfinite": whole(acc.nonfinite),
  }
  if acc.buffer_size > 0:
    out["cka_exact"] = cka_lib.all_pairs_cka(acc.buffer, jnp.isfinite(acc.buffer_priority), axis_name)
  return out


def finalize_arrays(acc: LayerStatsAccumulator, mesh=None) -> dict:
  """The device half of `finalize` (traceable): statistics over the padded layers, replicated.

  Args:
    acc: accumulator after the corpus.
    mesh: the mesh its layers are split over (as `update`), or None.

  Returns:
    {"prompt_entropy", "prompt_entropy_normalized", "dataset_entropy", "dataset_entropy_normalized": [L1p],
     "cka_minibatch" (and "cka_exact" with a buffer): [L1p, L1p], "nonfinite": [L1p]}; rows ≥ L1 are dummies.
  """
  shards = 1 if mesh is None else mesh.devices.size
  if shards == 1 or acc.padded_layers % shards:
    return _finalize_local(acc)
  axes = tuple(mesh.axis_names)
  out_specs = {k: P() for k in ("prompt_entropy", "prompt_entropy_normalized", "dataset_entropy",
                                "dataset_entropy_normalized", "cka_minibatch", "nonfinite")}
  if acc.buffer_size > 0:
    out_specs["cka_exact"] = P()
  return jax.shard_map(lambda a: _finalize_local(a, axes), mesh=mesh, in_specs=(partition_specs(acc, axes),),
                       out_specs=out_specs)(acc)


_finalize_jit = jax.jit(finalize_arrays, static_argnames=("mesh",))


def finalize(acc: LayerStatsAccumulator, mesh=None) -> LayerStats:
  """Turns the sums into statistics (host side; one small jitted computation inside).

  Args:
    acc: accumulator after the corpus.
    mesh: the mesh its layers are split over (as `update`; each device then decomposes its own layers), or
      None.

  Returns:
    LayerStats of numpy arrays.

  Raises:
    ValueError: no token was kept.
    FloatingPointError: a layer held NaN/inf at a kept position (the message names the layer indices).
  """
  num_tokens = int(acc.num_tokens)
  if num_tokens == 0:
    raise ValueError("the token filter kept no token: lower threshold / percentile, or check the masks")
  l1 = acc.num_layers_plus_one
  out = jax.tree.map(np.asarray, _finalize_jit(acc, mesh=mesh))
  entropy_lib.check_finite(out["nonfinite"][:l1])
  cut = lambda name: out[name][:l1] if out[name].ndim == 1 else out[name][:l1, :l1]  # noqa: E731
  return LayerStats(
      prompt_entropy=cut("prompt_entropy"),
      prompt_entropy_normalized=cut("prompt_entropy_normalized"),
      dataset_entropy=cut("dataset_entropy"),
      dataset_entropy_normalized=cut("dataset_entropy_normalized"),
      cka_minibatch=cut("cka_minibatch"),
      cka_exact=cut("cka_exact") if "cka_exact" in out else None,
      num_tokens=num_tokens,
      num_prompts=int(acc.num_prompts),
      num_sequences=int(acc.num_sequences),
      num_hsic_batches=int(acc.num_hsic_batches),
      num_exact_tokens=int(np.isfinite(np.asarray(acc.buffer_priority)).sum()),
      alpha=acc.alpha,
      normalize=acc.normalize,
  )
