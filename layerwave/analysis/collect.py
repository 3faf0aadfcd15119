"""Streaming collection: batches → target forward → token filter → layer statistics, all on device.

Place in the pipeline: token batches of one or a few shapes (`layerwave.data.BatchIterator`) → `collect_stats`
→ a `CollectResult` (finalised `LayerStats` with and without the token filter, counts, the filter threshold) →
`layerwave.selection` and `layerwave.analysis.report`.

One jitted `stats_step` per batch fuses the target forward (hidden states [L+1, B, T, D]), the token entropy
(docs/METHOD.md §2; from the final states a chunk of positions at a time, so the [B, T, V] logits are never
held at once: `token_filter.entropy_from_hidden`), the filter and `stats.update` of two accumulators:
*filtered* (eligible tokens whose predictive entropy passes the cut) and *unfiltered* (the control without the
filter: by default a random, same-size subset of each sequence's eligible tokens, see
`CollectOptions.unfiltered`). Eligible = real (attention mask) and, with `assistant_only`, inside an assistant
turn; a position's own mask decides (the hidden state at t and its next-token entropy H_t go together).
Hidden states never leave the device; the accumulators are fixed-size sums (`layerwave.analysis.stats`), so
memory does not grow with the number of tokens.

The percentile cut needs a threshold before accumulating: a calibration pass runs the forward alone over the
first `calibration_batches` batches, and `token_filter.percentile_threshold` turns their eligible tokens'
entropies into an absolute threshold that the statistics pass then applies to every batch (the calibration
batches are processed again). The kept fraction over the whole stream is reported, and sits near 1 − q/100.

Devices: the batch is sharded over the mesh's 'data' axis (the target's own layout splits its weights over
'model'). The accumulators are split over every device of the mesh along the layer axis (`state_shardings`;
L+1 padded up to a multiple of the device count with dummy layers that `finalize` drops): each chip keeps
1/N of the [L+1, D, D] second moments and computes the per-layer statistics of its own layers only
(`stats.update_many` under `jax.shard_map`). Every device derives the same token order and subsample from the
same key, so any number of devices computes the statistics of one (minibatches for HSIC are cut from the
global batch, not per device). `state_shardings(config, options, mesh)` is the layout the launcher and an
ahead-of-time compile (experiments/aot_analysis_probe.py) both use.

Length buckets: the batches may come in a few shapes (`BatchIterator`'s `widths`, `analysis.bucket_widths`):
[B·T/w, w] for a few widths w, so short sequences are not padded to T. Every statistic is a sum over
sequences or over kept tokens, so it does not depend on how sequences are grouped into batches, except the
HSIC minibatches (cut from each batch's kept tokens: another partition, the same expectation), the exact-CKA
subsample, the matched control's random draws and which sequences the calibration batches hold. The step
compiles once per shape (at most `MAX_SHAPES`).

Stability: with `halves=True`, even and odd batches (of each shape) feed two separate accumulator sets (the same
total work); the full-data statistics are their `stats.merge`, and the halves are returned for the agreement
report. Its cost is memory: a second resident state (`state_bytes`). For Llama-3.1-8B (D = 4096) with the
matched control and a 2,048-token subsample one state is 5.2 GiB of float32 (two [33, D, D] second moments and
a [33, 2048, D] subsample); split over 8 chips (33 layers padded to 40) it is 0.78 GiB per chip, so the halves
cost 0.78 GiB more per chip. `halves=False` (`analysis.stability`) drops it and the agreement report.

Legend (`layerwave.axes`): B batch, T tokens, L target layers, D target width, V target vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding

from layerwave import inference
from layerwave import options as options_lib
from layerwave import sharding
from layerwave.analysis import entropy as entropy_lib
from layerwave.analysis import stats as stats_lib
from layerwave.analysis import token_filter

__all__ = ["CollectOptions", "CollectResult", "collect_stats", "empty_state", "init_state", "options_from_config",
           "state_bytes", "state_shardings", "stats_step", "update_from_entropy", "update_from_outputs"]

_FILTER_MODES = ("percentile", "threshold")
_UNFILTERED = ("matched", "all", "none")
_NORMALIZE = {"skean": True, "none": False}
HISTOGRAM_BINS = 60
MAX_SHAPES = 8  # distinct batch shapes a stream may have: each compiles the step again


@dataclasses.dataclass(frozen=True)
class CollectOptions:
  """Settings of one collection pass (docs/METHOD.md §2–4 flags).

  Attributes:
    temperature: softmax temperature of the token entropy.
    filter_mode: "percentile" (keep H ≥ the q-th percentile, calibrated) or "threshold" (keep H ≥ nats).
    percentile: q in [0, 100] for "percentile".
    threshold: cut in nats for "threshold".
    calibration_batches: batches of the percentile calibration pass (≥ 1).
    assistant_only: only assistant-turn tokens are eligible.
    alpha: Rényi order of the matrix entropy.
    normalize: Skean normalisation (centre, unit rows).
    hsic_batch_size: tokens per minibatch of the unbiased HSIC.
    ladder_ratio: growth between the compacted lengths of the prompt entropy's eigendecompositions
      (`stats.init`): 1.3 wastes least work; a coarser ladder (2) compiles far fewer sizes at long T.
    exact_cka_tokens: size of the token subsample for exact CKA (filtered statistics; 0 = none).
    unfiltered: the statistics without the filter: "matched" (default) — in each sequence a uniform random
      subset of its eligible tokens as large as its kept set, so both sides have the same n per sequence
      (matrix entropy grows with log n; a same-size control isolates *which* tokens the filter keeps, and
      costs the same as the filtered side); "all" — every eligible token (about 4× the eigendecomposition
      cost at q = 50); "none".
    halves: accumulate even and odd batches separately (stability report). Doubles the resident accumulator
      state (see the module's Stability paragraph and `state_bytes`); turn it off when memory is short.
    num_batches: stop after this many batches (0 = until the iterator ends or `max_tokens`).
    max_tokens: stop once this many eligible tokens have been read (0 = no limit).
    seed: PRNG seed of the HSIC minibatch shuffle and the exact-CKA subsample.
    log_every: log progress every this many batches.
  """

  temperature: float = 1.0
  filter_mode: str = "percentile"
  percentile: float = 50.0
  threshold: float = 0.0
  calibration_batches: int = 4
  assistant_only: bool = True
  alpha: float = 1.0
  normalize: bool = True
  hsic_batch_size: int = 256
  ladder_ratio: float = entropy_lib.LADDER_RATIO
  exact_cka_tokens: int = 0
  unfiltered: str = "matched"
  halves: bool = True
  num_batches: int = 0
  max_tokens: int = 0
  seed: int = 0
  log_every: int = 10

  def __post_init__(self):
    if self.filter_mode not in _FILTER_MODES:
      raise ValueError(f"unknown filter mode {self.filter_mode!r}; use one of {_FILTER_MODES}")
    if self.filter_mode == "percentile" and not 0.0 <= self.percentile <= 100.0:
      raise ValueError(f"percentile must be in [0, 100], got {self.percentile}")
    if self.calibration_batches < 1:
      raise ValueError(f"calibration_batches must be >= 1, got {self.calibration_batches}")
    if self.temperature <= 0:
      raise ValueError(f"temperature must be > 0, got {self.temperature}")
    if self.alpha <= 0:
      raise ValueError(f"Rényi order alpha must be > 0, got {self.alpha}")
    if not self.ladder_ratio > 1.0:
      raise ValueError(f"analysis.ladder_ratio must be > 1, got {self.ladder_ratio}; set "
                       "--config.analysis.ladder_ratio=2 (or leave it at 1.3)")
    if self.unfiltered not in _UNFILTERED:
      raise ValueError(f"unknown unfiltered mode {self.unfiltered!r}; use one of {_UNFILTERED}")
    if self.num_batches < 0 or self.max_tokens < 0:
      raise ValueError("num_batches and max_tokens must be >= 0 (0 = no limit)")


def options_from_config(analysis: Any) -> CollectOptions:
  """`CollectOptions` from a config's `analysis` section (configs/smollm2_135m.py).

  The section names two fields differently (`filter` → `filter_mode`, `stability` → `halves`) and gives
  `normalize` as "skean" / "none".
  """
  normalize = options_lib.convert(analysis.get("normalize", "skean"), str, "analysis.normalize")
  if normalize not in _NORMALIZE:
    raise ValueError(f"analysis.normalize must be one of {sorted(_NORMALIZE)}, got {normalize!r}; set "
                     "--config.analysis.normalize=skean.")
  return options_lib.from_section(CollectOptions, analysis, "analysis",
                                  aliases={"filter_mode": "filter", "halves": "stability"},
                                  normalize=_NORMALIZE[normalize])


@dataclasses.dataclass(frozen=True)
class CollectResult:
  """Finalised statistics of one pass (host values).

  Attributes:
    filtered: statistics of the kept tokens (filter applied).
    unfiltered: statistics without the filter (`CollectOptions.unfiltered`), or None.
    halves: {"filtered": (even, odd), "unfiltered": (even, odd)} statistics of the even / odd batches (of each
      shape), or None.
    threshold: the entropy cut in nats that was applied.
    counts: positions (real tokens), eligible, kept, batches, padded positions (token slots, the batches' B x T
      summed), batch_size and seq_len (of the widest batch) and `shapes`: [[B, T, batches], ...] by width.
    token_entropy: mean H over eligible / kept tokens, histogram of H over eligible and kept tokens
      (`HISTOGRAM_BINS` bins over [0, log V]) and its bin edges.
    seconds: wall time of the statistics pass, less the first batch of each shape (its compilation).
    options: the settings used.
  """

  filtered: stats_lib.LayerStats
  unfiltered: stats_lib.LayerStats | None
  halves: dict | None
  threshold: float
  counts: dict
  token_entropy: dict
  seconds: float
  options: CollectOptions


# ----------------------------------------------------------------------------------------------------------
# Jitted steps.


def _eligible(attention_mask, assistant_mask, assistant_only: bool):
  real = attention_mask.astype(bool)
  return real & assistant_mask.astype(bool) if assistant_only else real


def token_entropy_step(graphdef, params, tokens, attention_mask, assistant_mask, *, temperature: float,
                       assistant_only: bool):
  """Calibration: the forward without hidden states → token entropy [B, T] and eligibility [B, T]."""
  out = inference.forward_fn(graphdef, params, tokens, attention_mask, compute_logits=False)
  entropy = token_filter.entropy_from_hidden(out.last_hidden, nnx.merge(graphdef, params).logits, temperature)
  return entropy, _eligible(attention_mask, assistant_mask, assistant_only)


def _token_state(num_layers_plus_one: int) -> dict:
  i32, f32 = jnp.int32, jnp.float32
  return {"positions": jnp.zeros((), i32), "eligible": jnp.zeros((), i32), "kept": jnp.zeros((), i32),
          "entropy_sum_eligible": jnp.zeros((), f32), "entropy_sum_kept": jnp.zeros((), f32),
          "hist_eligible": jnp.zeros((HISTOGRAM_BINS,), i32), "hist_kept": jnp.zeros((HISTOGRAM_BINS,), i32),
          "nonfinite_logits": jnp.zeros((), i32), "nonfinite_hidden": jnp.zeros((num_layers_plus_one,), i32)}


def _histogram(values, weights, top: float):
  bins = jnp.clip((values / top * HISTOGRAM_BINS).astype(jnp.int32), 0, HISTOGRAM_BINS - 1)
  return jnp.zeros((HISTOGRAM_BINS,), jnp.int32).at[bins.reshape(-1)].add(weights.reshape(-1).astype(jnp.int32))


def _matched(eligible, keep, key):
  """Per sequence, a uniform random subset of the eligible tokens of the kept set's size: [B, T] bool."""
  priority = jnp.where(eligible, jax.random.uniform(key, eligible.shape), jnp.inf)
  n = jnp.sum(keep.astype(jnp.int32), axis=-1)  # [B]
  cut = jnp.take_along_axis(jnp.sort(priority, axis=-1), jnp.maximum(n - 1, 0)[:, None], axis=-1)
  return eligible & (priority <= cut) & (n[:, None] > 0)


def stats_step(graphdef, params, state, tokens, attention_mask, assistant_mask, threshold, index, *,
               options: CollectOptions, mesh=None):
  """One batch: forward → token entropy → filter → both accumulators (pure; jit once per stream, donating).

  Args:
    graphdef, params: the target (`Target.graphdef`, `Target.params`).
    state: {"filtered": acc, "unfiltered": acc (optional), "tokens": counters}.
    tokens, attention_mask, assistant_mask: [B, T] int32 (batch sharded over 'data').
    threshold: float32 scalar, the entropy cut in nats.
    index: int32 scalar, the batch number (PRNG stream for HSIC shuffles and the exact-CKA subsample).
    options: static settings.
    mesh: the mesh the state's layers are split over (`state_shardings`), or None (every layer here).

  Returns:
    The updated state.
  """
  out = inference.forward_fn(graphdef, params, tokens, attention_mask, return_hidden_states=True,
                             compute_logits=False)
  model = nnx.merge(graphdef, params)
  entropy = token_filter.entropy_from_hidden(out.last_hidden, model.logits, options.temperature)
  return update_from_entropy(state, out.hidden_states, entropy, model.config.vocab_size, attention_mask,
                             assistant_mask, threshold, index, options=options, mesh=mesh)


def update_from_outputs(state, hidden, logits, attention_mask, assistant_mask, threshold, index, *,
                        options: CollectOptions, mesh=None):
  """The statistics half of `stats_step`, from target outputs (hidden [L+1, B, T, D], logits [B, T, V]).

  Args and returns as `stats_step`; used alone by benchmarks/bench_stats.py (statistics without the forward).
  """
  entropy = token_filter.token_entropy(logits, options.temperature)  # [B, T]
  return update_from_entropy(state, hidden, entropy, logits.shape[-1], attention_mask, assistant_mask, threshold,
                             index, options=options, mesh=mesh)


def update_from_entropy(state, hidden, entropy, vocab_size: int, attention_mask, assistant_mask, threshold, index,
                        *, options: CollectOptions, mesh=None):
  """`update_from_outputs` from the token entropy [B, T] (nats) instead of the logits; V sizes the histogram."""
  eligible = _eligible(attention_mask, assistant_mask, options.assistant_only)
  finite = jnp.isfinite(entropy)
  keep = eligible & finite & (entropy >= threshold)
  key_f, key_u = jax.random.split(jax.random.fold_in(jax.random.key(options.seed), index))
  new = dict(state)
  kinds, masks, keys = ["filtered"], [keep], [key_f]
  if "unfiltered" in state:
    key_u, key_m = jax.random.split(key_u)
    kinds.append("unfiltered")
    masks.append(_matched(eligible, keep, key_m) if options.unfiltered == "matched" else eligible)
    keys.append(key_u)
  # Both accumulators from one move of the layers to their devices.
  new.update(zip(kinds, stats_lib.update_many([state[k] for k in kinds], hidden, masks, keys, mesh=mesh)))
  t = state["tokens"]
  top = math.log(vocab_size)
  h = jnp.where(finite, entropy, 0.0)
  new["tokens"] = {
      "positions": t["positions"] + jnp.sum(attention_mask.astype(jnp.int32)),
      "eligible": t["eligible"] + jnp.sum(eligible.astype(jnp.int32)),
      "kept": t["kept"] + jnp.sum(keep.astype(jnp.int32)),
      "entropy_sum_eligible": t["entropy_sum_eligible"] + jnp.sum(jnp.where(eligible, h, 0.0)),
      "entropy_sum_kept": t["entropy_sum_kept"] + jnp.sum(jnp.where(keep, h, 0.0)),
      "hist_eligible": t["hist_eligible"] + _histogram(h, eligible & finite, top),
      "hist_kept": t["hist_kept"] + _histogram(h, keep, top),
      "nonfinite_logits": t["nonfinite_logits"] + jnp.sum((eligible & ~finite).astype(jnp.int32)),
      "nonfinite_hidden": t["nonfinite_hidden"] + entropy_lib.nonfinite_layers(hidden, eligible).astype(jnp.int32),
  }
  return new


# ----------------------------------------------------------------------------------------------------------
# The driver.


def empty_state(config, options: CollectOptions, mesh=None) -> dict:
  """The empty state of `stats_step` (pure: `jax.eval_shape` gives its shapes): both accumulators, their layer
  axis padded for `mesh` (`stats.init(..., shards=)`), and the token counters.

  Args:
    config: the target's `ModelConfig` (L, D).
    options: the collection settings.
    mesh: the mesh the layers will be split over, or None.
  """
  make = functools.partial(stats_lib.init, config.num_layers + 1, config.hidden_size, alpha=options.alpha,
                           normalize=options.normalize, hsic_batch_size=options.hsic_batch_size,
                           ladder_ratio=options.ladder_ratio,
                           shards=1 if mesh is None else mesh.devices.size)
  state = {"filtered": make(buffer_size=options.exact_cka_tokens), "tokens": _token_state(config.num_layers + 1)}
  if options.unfiltered != "none":
    state["unfiltered"] = make(buffer_size=0)
  return state


def state_shardings(config, options: CollectOptions, mesh) -> dict:
  """Where `empty_state(config, options, mesh)` lives: each accumulator's layer axis split over every device of
  the mesh (`stats.partition_specs`), the token counters replicated. A pytree of `NamedSharding`s, the
  in / out shardings of `stats_step` (the launcher's and an ahead-of-time compile's)."""
  shapes = jax.eval_shape(lambda: empty_state(config, options, mesh))
  axes = tuple(mesh.axis_names)
  out = {"tokens": jax.tree.map(lambda _: sharding.replicated(mesh), shapes["tokens"])}
  for kind in ("filtered", "unfiltered"):
    if kind in shapes:
      out[kind] = jax.tree.map(lambda spec: NamedSharding(mesh, spec), stats_lib.partition_specs(shapes[kind], axes))
  return out


def state_bytes(config, options: CollectOptions, mesh) -> tuple[int, int]:
  """(bytes of one state in all, bytes of it per device) under `state_shardings`; `halves` keeps two."""
  shapes = jax.eval_shape(lambda: empty_state(config, options, mesh))
  total = per_device = 0
  for leaf, where in zip(jax.tree.leaves(shapes), jax.tree.leaves(state_shardings(config, options, mesh))):
    size = jnp.dtype(leaf.dtype).itemsize
    total += math.prod(leaf.shape) * size
    per_device += math.prod(where.shard_shape(leaf.shape)) * size
  return total, per_device


def stats_step_jit(graphdef, config, options: CollectOptions, mesh):
  """`stats_step` jitted as `collect_stats` runs it: the state donated and kept split as `state_shardings` says.
  The one jit of the analysis step, which `layerwave.aot` compiles for TPU topologies too (`config`: the
  target's `ModelConfig`)."""
  return jax.jit(functools.partial(stats_step, graphdef, options=options, mesh=mesh), donate_argnums=(1,),
                 out_shardings=state_shardings(config, options, mesh))


def init_state(target, options: CollectOptions, mesh) -> dict:
  """Empty state for `stats_step`, made in place on the mesh under `state_shardings`."""
  make = jax.jit(lambda: empty_state(target.config, options, mesh),
                 out_shardings=state_shardings(target.config, options, mesh))
  return make()


def put_batch(batch, mesh) -> list[jax.Array]:
  """A host batch's [B, T] input_ids, attention_mask and assistant_mask as int32 arrays over the mesh's 'data'
  axis (each process passes its own rows), in the order `stats_step` takes them."""
  arrays = [np.asarray(a, np.int32) for a in (batch.input_ids, batch.attention_mask, batch.assistant_mask)]
  if arrays[0].ndim != 2 or any(a.shape != arrays[0].shape for a in arrays):
    raise ValueError(f"a batch needs input_ids / attention_mask / assistant_mask of one shape [B, T]; got "
                     f"{[a.shape for a in arrays]}")
  _, blocks = sharding.data_position(mesh)
  sharding.check_batch(mesh, arrays[0].shape[0] * blocks)  # the global batch: every process's rows
  return sharding.global_batch(mesh, arrays)


def _calibrate(target, calibration: list, options: CollectOptions, mesh) -> float:
  step = jax.jit(functools.partial(token_entropy_step, target.graphdef, temperature=options.temperature,
                                   assistant_only=options.assistant_only))
  entropies, masks = [], []
  for batch in calibration:
    entropy, eligible = step(target.params, *put_batch(batch, mesh))
    entropy, eligible = sharding.to_host(entropy), sharding.to_host(eligible)  # the global batch's
    entropies.append(entropy)
    masks.append(eligible & np.isfinite(entropy))
  threshold = token_filter.percentile_threshold(entropies, masks, options.percentile)
  logging.info("Calibration over %d batches (%d eligible tokens): the %.1f-th percentile of token entropy "
               "is %.4f nats.", len(calibration), int(sum(m.sum() for m in masks)), options.percentile,
               threshold)
  return threshold


def _host_eligible(batch, assistant_only: bool) -> int:
  m = np.asarray(batch.attention_mask).astype(bool)
  if assistant_only:
    m &= np.asarray(batch.assistant_mask).astype(bool)
  return int(m.sum())


def collect_stats(target, batches: Iterable, options: CollectOptions | None = None,
                  mesh=None) -> CollectResult:
  """Runs the target over `batches` and accumulates every layer statistic on device.

  Args:
    target: a `layerwave.Target` (graphdef, params, config).
    batches: iterable of `layerwave.data.Batch` (or anything with input_ids, attention_mask,
      assistant_mask [B, T]): fixed-shape batches, or up to `MAX_SHAPES` shapes (length buckets); B divisible
      by the mesh's 'data' axis.
    options: settings (default `CollectOptions()`).
    mesh: the device mesh (default `target.mesh`).

  Returns:
    CollectResult.

  Raises:
    ValueError: no batch, more than `MAX_SHAPES` batch shapes, no eligible token, or the filter kept no token.
    FloatingPointError: NaN/inf in a hidden state (names the layers) or in the logits.
  """
  options = options or CollectOptions()
  mesh = target.mesh if mesh is None else mesh
  stream = iter(batches)
  if options.num_batches:
    stream = itertools.islice(stream, options.num_batches)

  threshold = float(options.threshold)
  if options.filter_mode == "percentile":
    calibration = list(itertools.islice(stream, options.calibration_batches))
    if not calibration:
      raise ValueError("collect_stats got no batch: the data source is empty (check the dataset split)")
    threshold = _calibrate(target, calibration, options, mesh)
    stream = itertools.chain(calibration, stream)

  step = stats_step_jit(target.graphdef, target.config, options, mesh)
  num_halves = 2 if options.halves else 1
  states = [init_state(target, options, mesh) for _ in range(num_halves)]
  threshold_arr = np.float32(threshold)
  seen_eligible = num_batches = 0
  shapes: dict[tuple[int, int], int] = {}  # global [B, T] -> batches
  start = last_time = None
  compile_seconds = 0.0  # the first batch of every later shape: its compilation is not throughput
  last_positions = 0
  for index, batch in enumerate(stream):
    arrays = put_batch(batch, mesh)
    shape = tuple(arrays[0].shape)
    new_shape = shape not in shapes
    if new_shape and len(shapes) == MAX_SHAPES:
      raise ValueError(f"batch {index} has shape {shape}, a new one after {sorted(shapes)}: every shape compiles "
                       f"the step again, and a stream may have at most {MAX_SHAPES}. Use fixed-shape batches "
                       "(BatchIterator with one seq_len) or a few length buckets (analysis.bucket_widths).")
    shapes[shape] = shapes.get(shape, 0) + 1
    # Even / odd batches of each shape: with length buckets both halves get the same mix of lengths (a batch of
    # one width holds sequences of similar length); with one shape, even / odd batches.
    half = (shapes[shape] - 1) % num_halves
    if new_shape and start is not None:
      jax.block_until_ready(states)
      compile_start = time.perf_counter()
    states[half] = step(target.params, states[half], *arrays, threshold_arr, np.int32(index))
    if new_shape and start is not None:
      jax.block_until_ready(states[half])
      compile_seconds += time.perf_counter() - compile_start
      last_time += time.perf_counter() - compile_start  # nor in the logged rate
      logging.info("batch %d: compiled the step for a new shape %s.", index + 1, shape)
    num_batches += 1
    seen_eligible += sharding.process_sum(_host_eligible(batch, options.assistant_only))  # global: all stop together
    if index == 0:
      jax.block_until_ready(states[half])  # compilation + first batch: not part of the throughput
      start = last_time = time.perf_counter()
    elif options.log_every and num_batches % options.log_every == 0:
      counts = _counts(states)
      now = time.perf_counter()
      logging.info("batch %d: %d tokens (%d eligible, %d kept), %.0f tokens/s.", num_batches,
                   counts["positions"], counts["eligible"], counts["kept"],
                   (counts["positions"] - last_positions) / max(now - last_time, 1e-9))
      last_time, last_positions = now, counts["positions"]
    if options.max_tokens and seen_eligible >= options.max_tokens:
      break
  if num_batches == 0:
    raise ValueError("collect_stats got no batch: the data source is empty (check the dataset split)")
  jax.block_until_ready(states)
  seconds = time.perf_counter() - start - compile_seconds if num_batches > len(shapes) else float("nan")
  return _finish(states, threshold, options, num_batches, shapes, seconds, target.config.vocab_size, mesh)


def _counts(states: list[dict]) -> dict:
  tokens = jax.tree.map(lambda *xs: sum(np.asarray(x) for x in xs), *[s["tokens"] for s in states])
  return {k: (int(v) if np.ndim(v) == 0 else v) for k, v in tokens.items()}


def _finish(states, threshold, options, num_batches, shapes, seconds, vocab_size, mesh) -> CollectResult:
  tok = _counts(states)
  entropy_lib.check_finite(tok["nonfinite_hidden"])  # names the layers
  if tok["nonfinite_logits"]:
    raise FloatingPointError(f"NaN/inf in the target logits at {tok['nonfinite_logits']} eligible positions "
                             "(check the weights and dtype)")
  if tok["eligible"] == 0:
    raise ValueError("no eligible token in the data: every position is padding"
                     + (" or outside assistant turns (set analysis.assistant_only=False for plain text)"
                        if options.assistant_only else ""))
  if tok["kept"] == 0:
    raise ValueError(f"the token filter kept no token of {tok['eligible']} eligible (threshold "
                     f"{threshold:.4f} nats): lower analysis.threshold / analysis.percentile, or check the "
                     "attention / assistant masks")
  kinds = ["filtered"] + (["unfiltered"] if options.unfiltered != "none" else [])
  merged = {k: functools.reduce(stats_lib.merge, [s[k] for s in states]) for k in kinds}
  final = {k: stats_lib.finalize(v, mesh) for k, v in merged.items()}
  halves = None
  if len(states) == 2:
    halves = {k: tuple(stats_lib.finalize(s[k], mesh) if int(s[k].num_tokens) else None for s in states)
              for k in kinds}
  b, t = max(shapes, key=lambda shape: shape[1])
  counts = {"batches": num_batches, "batch_size": b, "seq_len": t,
            "padded_positions": sum(rows * width * n for (rows, width), n in shapes.items()),
            "shapes": [[rows, width, n] for (rows, width), n in sorted(shapes.items(), key=lambda x: x[0][1])],
            "positions": tok["positions"], "eligible": tok["eligible"], "kept": tok["kept"],
            "kept_fraction": tok["kept"] / tok["eligible"]}
  entropy = {
      "mean_eligible": tok["entropy_sum_eligible"] / tok["eligible"],
      "mean_kept": tok["entropy_sum_kept"] / tok["kept"],
      "histogram_eligible": np.asarray(tok["hist_eligible"]).tolist(),
      "histogram_kept": np.asarray(tok["hist_kept"]).tolist(),
      "histogram_edges": np.linspace(0.0, math.log(vocab_size), HISTOGRAM_BINS + 1).tolist(),
  }
  return CollectResult(filtered=final["filtered"], unfiltered=final.get("unfiltered"), halves=halves,
                       threshold=float(threshold), counts=counts, token_entropy=entropy, seconds=seconds,
                       options=options)
