"""Autoregressive decoding: the baseline every speculative speedup is measured against.

One jitted call per `generate`: a prefill of the (right-padded, ragged) prompts into a preallocated
`KVCache`, then one `lax.while_loop` that feeds each sampled token back until every row has produced EOS or
`max_new_tokens`. The batch is sharded over the mesh's `'data'` axis. Shapes are bucketed (prompt width to a
multiple of 16, cache slots to a multiple of 64) so calls with similar lengths reuse one compilation.

This module's `generate` is the public `layerwave.generate`. The speculative loop
(`layerwave.speculative.generate`, same arguments and output) reuses its host-side helpers: `cache_slots`,
`check_lengths`, `is_eos`, `cut_after_eos`, `compute_dtype`, `logits_fn`.

Legend (`layerwave.axes`): B batch.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from layerwave import sharding
from layerwave import continuous
from layerwave.inference import Target, cached_forward, compute_dtype, logits_fn, new_cache, pad_prompts
from layerwave.models.kv_cache import KVCache, causal_mask
from layerwave.sampling import SamplingParams, sample

SLOT_BUCKET = 64


@struct.dataclass
class DecodeState:
  """The while-loop carry. `tokens [B, max_new_tokens]` holds generated tokens; `step` how many are written."""

  step: jax.Array
  tokens: jax.Array
  last: jax.Array  # [B] the most recent token, not yet in the cache
  lengths: jax.Array  # [B] committed cache length
  done: jax.Array  # [B] row has produced EOS
  cache: KVCache
  rng: jax.Array


def cache_slots(prompt_width: int, max_new_tokens: int) -> int:
  """Cache slots for the padded prompt plus the new tokens, rounded up to `SLOT_BUCKET`."""
  return -(-(prompt_width + max_new_tokens) // SLOT_BUCKET) * SLOT_BUCKET


def check_lengths(lengths: np.ndarray, max_new_tokens: int, config) -> None:
  longest = int(lengths.max()) + max_new_tokens
  if longest > config.max_position_embeddings:
    raise ValueError(
        f"Longest prompt ({int(lengths.max())} tokens) + max_new_tokens ({max_new_tokens}) = {longest} "
        f"exceeds the model's max_position_embeddings ({config.max_position_embeddings}); shorten the "
        "prompt or lower max_new_tokens.")


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
  if not eos_ids:
    return jnp.zeros(tokens.shape, bool)
  return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "mesh", "max_new_tokens",
                                             "slots", "sampling", "eos_ids"))
def _generate(graphdef, params, tokens, lengths, rng, *, config, mesh, max_new_tokens, slots,
              sampling, eos_ids):
  """Jitted prefill + decode loop. Returns generated tokens `[B, max_new_tokens]` and the step count."""
  b, width = tokens.shape
  cache = new_cache(config, b, slots, compute_dtype(graphdef, params), mesh)
  valid = (jnp.arange(width)[None, :] < lengths[:, None]).astype(jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width))
  out = cached_forward(graphdef, params, tokens, positions, causal_mask(valid), cache,
                       jnp.zeros((b,), jnp.int32), compute_logits=False, valid=valid)
  model_logits = logits_fn(graphdef, params)
  last_h = jnp.take_along_axis(out.last_hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
  rng, key = jax.random.split(rng)
  first = sample(model_logits(last_h), key, sampling)
  state = DecodeState(
      step=jnp.asarray(1, jnp.int32),
      tokens=jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(first),
      last=first, lengths=lengths, done=is_eos(first, eos_ids), cache=out.cache, rng=rng)

  def cond(s: DecodeState):
    return (s.step < max_new_tokens) & ~jnp.all(s.done)

  def body(s: DecodeState):
    o = cached_forward(graphdef, params, s.last[:, None], s.lengths[:, None],
                       jnp.ones((b, 1, 1), bool), s.cache, s.lengths)
    rng, key = jax.random.split(s.rng)
    nxt = sample(o.logits[:, 0], key, sampling)
    return DecodeState(step=s.step + 1, tokens=s.tokens.at[:, s.step].set(nxt), last=nxt,
                       lengths=s.lengths + 1, done=s.done | is_eos(nxt, eos_ids), cache=o.cache,
                       rng=rng)

  state = jax.lax.while_loop(cond, body, state)
  return state.tokens, state.step


def generate(target: Target, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             ignore_eos: bool = False, return_stats: bool = False, prompt_width: int = 0,
             slots: int = 0, stop_fn=None, chunk_steps: int = 16):
  """Decodes new tokens for a batch of prompts.

  Args:
    target: a loaded `Target`.
    prompt_ids: one list of token ids per prompt (lengths may differ).
    max_new_tokens: the most tokens to generate per prompt.
    temperature: 0 for greedy decoding, otherwise the sampling temperature.
    top_k: sample among the k most likely tokens (0 = off).
    top_p: nucleus sampling mass in (0, 1] (1 = off).
    seed: PRNG seed for sampling.
    ignore_eos: decode exactly `max_new_tokens` per row (benchmarks).
    return_stats: also return `{'steps': decode steps run}`.
    prompt_width: pad prompts to at least this many tokens (one compilation for batches of any width
      up to it).
    slots: > 0 streams the prompts through this many decoding rows (continuous batching,
      `layerwave.continuous`): a finished row takes the next prompt, and attention reads only the slots the
      live rows reach. Greedy output is the same; sampled output draws prompt i's tokens from its own stream
      (`continuous` says how), so it differs from the static path's. 0 = one static batch.
    stop_fn: with `slots`: `stop_fn(tokens) -> bool` ends a live row early (e.g. at a repetition loop).
    chunk_steps: with `slots`: decode steps between host refills.

  Returns:
    One list of new tokens per prompt, each cut after its first EOS token (included).
  """
  if slots:
    return continuous.generate_continuous(
        target, prompt_ids, max_new_tokens, slots, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed, ignore_eos=ignore_eos, stop_fn=stop_fn, chunk_steps=chunk_steps, return_stats=return_stats)
  if stop_fn is not None:
    raise ValueError("stop_fn needs continuous batching: pass slots > 0.")
  sampling = SamplingParams(float(temperature), int(top_k), float(top_p))
  if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens}.")
  config = target.config
  tokens, lengths, n = pad_prompts(prompt_ids, config.vocab_size, sharding.data_size(target.mesh),
                                   min_width=prompt_width)
  check_lengths(lengths, max_new_tokens, config)
  slots = cache_slots(tokens.shape[1], max_new_tokens)
  batch = sharding.batch_sharding(target.mesh)
  out, steps = _generate(
      target.graphdef, target.params, sharding.from_host(tokens, batch),
      sharding.from_host(lengths, sharding.batch_sharding(target.mesh, 1)), jax.random.key(seed),
      config=config, mesh=target.mesh, max_new_tokens=int(max_new_tokens), slots=slots, sampling=sampling,
      eos_ids=() if ignore_eos else target.eos_token_ids)
  # Every process gathers the whole batch (`to_host`), so each returns the same rows.
  result = cut_after_eos(sharding.to_host(out)[:n], int(steps), () if ignore_eos else target.eos_token_ids)
  return (result, {"steps": int(steps)}) if return_stats else result


def cut_after_eos(tokens: np.ndarray, steps: int, eos_ids: tuple[int, ...]) -> list[list[int]]:
  """Host-side: each row's first `steps` tokens, cut after the first EOS."""
  rows = []
  eos = set(eos_ids)
  for row in tokens[:, :steps].tolist():
    for i, t in enumerate(row):
      if t in eos:
        row = row[:i + 1]
        break
    rows.append(row)
  return rows
