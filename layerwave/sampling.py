"""Turning logits into the distribution a decoder samples from: temperature, top-k, top-p.

Autoregressive decoding and the speculative loop share these functions, so the speculative loop's lossless
acceptance compares against exactly the distribution plain decoding samples from.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Decoding settings. Hashable: it is a static argument of the jitted loops.

  Attributes:
    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens (0 = no limit).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1.0 = no limit).
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
    if int(self.top_k) != self.top_k or self.top_k < 0:
      raise ValueError(f"top_k must be a non-negative integer (0 = off), got {self.top_k}.")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def log_probs(logits: Array, sampling: SamplingParams) -> Array:
  """Log-probabilities `[..., V]` after temperature, top-k and top-p (filtered tokens at -inf).

  Only meaningful for sampling (temperature > 0); greedy decoding uses `argmax` directly.
  """
  x = logits.astype(jnp.float32) / max(sampling.temperature, 1e-6)
  if sampling.top_k:
    kth = jax.lax.top_k(x, sampling.top_k)[0][..., -1:]
    x = jnp.where(x < kth, -jnp.inf, x)
  if sampling.top_p < 1.0:
    sorted_x = -jnp.sort(-x, axis=-1)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    # Keep a token if the mass strictly before it is below top_p (the first token is always kept);
    # the smallest kept logit is the cut (ties with it are kept too).
    before = jnp.cumsum(probs, axis=-1) - probs
    cut = jnp.min(jnp.where(before < sampling.top_p, sorted_x, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x < cut, -jnp.inf, x)
  return jax.nn.log_softmax(x, axis=-1)


def sample(logits: Array, rng: Array, sampling: SamplingParams) -> Array:
  """Draws one token per row from `logits [..., V]` (argmax when greedy)."""
  if sampling.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(rng, log_probs(logits, sampling), axis=-1).astype(jnp.int32)
