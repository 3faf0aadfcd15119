"""Token predictive entropy and the token filter (docs/METHOD.md §2).

Place in the pipeline: target forward → logits [B, T, V] → `token_entropy` → `entropy_filter_mask` → the
keep mask [B, T] that every layer statistic (matrix entropy, CKA; `layerwave.analysis.stats`) reads.
Near-deterministic tokens are accepted whatever the draft reads and would dominate the Gram statistics, so
only real positions whose predictive entropy is high enough are kept.

Two ways to set the cut:
  * an absolute threshold in nats (`threshold=`), usable inside a jitted streaming step as is;
  * the q-th percentile of the entropy over the kept-eligible tokens (`percentile=`). Inside one batch
    `entropy_filter_mask` computes it from that batch. For streaming over a corpus, run a calibration pass
    first: `percentile_threshold` takes the per-token entropies of the calibration batches (host side; one
    float per token) and returns the absolute threshold that the streaming pass then uses. The streamed cut is
    therefore the corpus percentile of the calibration sample, not of each batch.

Only the entropy (and at most the top-1) of each position is needed, so `entropy_from_hidden` computes them
from the final-normed states [B, T, D] a chunk of positions at a time: the full float32 logits [B, T, V] are
never held at once (for Gemma 3's V = 262,144 they are 1 MiB per token).

Legend (`layerwave.axes`): B batch, T tokens, D target width, V target vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from layerwave import inference

__all__ = [
    "token_entropy",
    "entropy_from_hidden",
    "masked_percentile",
    "entropy_filter_mask",
    "percentile_threshold",
    "check_kept",
]

_EMPTY_MESSAGE = (
    "the token filter kept no token: lower threshold / percentile, or check the attention / assistant mask "
    "(kept-eligible tokens: {eligible})"
)


def token_entropy(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
  """Predictive entropy of the next-token distribution, in nats.

  Args:
    logits: [..., V] target logits (any float dtype; computed in float32).
    temperature: softmax temperature (> 0).

  Returns:
    [...] float32 entropy H = -Σ_v p(v) log p(v) of softmax(logits / temperature).
  """
  if temperature <= 0:
    raise ValueError(f"temperature must be > 0, got {temperature}")
  logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
  # exp(logp) * logp is 0 * -inf = nan for exactly-zero probabilities; where() keeps it 0.
  p = jnp.exp(logp)
  return -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)


LOGITS_CHUNK = inference.LOGITS_CHUNK


def entropy_from_hidden(h: jax.Array, logits_fn, temperature: float = 1.0, chunk: int = LOGITS_CHUNK,
                        top1: bool = False):
  """Token entropy (and optionally the argmax) from final-normed states, `chunk` positions at a time.

  Equal to `token_entropy(logits_fn(h))` (and `argmax`), without materialising the [B, T, V] logits: the
  positions are cut into blocks of `chunk` and `inference.over_positions` runs the LM head, the log-softmax
  and the sums over one block at a time.

  Args:
    h: [B, T, D] final-normed hidden states (`TargetOutput.last_hidden`).
    logits_fn: [n, D] → [n, V] float32 logits (the target's LM head, `Transformer.logits`).
    temperature: softmax temperature (> 0).
    chunk: positions per block.
    top1: also return the argmax token of every position.

  Returns:
    entropy [B, T] float32, or (entropy [B, T], top1 [B, T] int32) with `top1`.
  """
  def block(x):
    logits = logits_fn(x)
    ent = token_entropy(logits, temperature)
    return (ent, jnp.argmax(logits, axis=-1).astype(jnp.int32)) if top1 else ent

  return inference.over_positions(h, block, chunk)


def masked_percentile(values: jax.Array, mask: jax.Array, q: float) -> jax.Array:
  """q-th percentile of `values` over the positions where `mask` is true (numpy 'linear' rule).

  Jittable with fixed shapes: masked-out entries are sorted to the end.

  Args:
    values: [...] float values.
    mask: [...] bool, same shape.
    q: percentile in [0, 100].

  Returns:
    float32 scalar; nan when the mask is empty.
  """
  v = jnp.where(mask, values.astype(jnp.float32), jnp.inf).reshape(-1)
  s = jnp.sort(v)
  n = jnp.sum(mask.reshape(-1).astype(jnp.int32))
  pos = (q / 100.0) * jnp.maximum(n - 1, 0).astype(jnp.float32)
  lo = jnp.floor(pos).astype(jnp.int32)
  hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0))
  frac = pos - lo.astype(jnp.float32)
  out = s[lo] + (s[hi] - s[lo]) * frac
  # inf - inf happens only when frac == 0 at the last valid element; guard it anyway.
  out = jnp.where(frac == 0, s[lo], out)
  return jnp.where(n > 0, out, jnp.nan)


def _is_traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def check_kept(keep: jax.Array, mask: jax.Array | None = None) -> int:
  """Host-side check that the filter kept at least one token.

  Args:
    keep: [...] bool keep mask (concrete).
    mask: optional [...] bool eligibility mask, only used for the error message.

  Returns:
    The number of kept tokens.

  Raises:
    ValueError: when no token is kept.
  """
  n = int(np.asarray(keep).sum())
  if n == 0:
    eligible = "?" if mask is None else int(np.asarray(mask).sum())
    raise ValueError(_EMPTY_MESSAGE.format(eligible=eligible))
  return n


def entropy_filter_mask(
    entropy: jax.Array,
    mask: jax.Array,
    threshold: float | None = None,
    percentile: float | None = None,
    *,
    check_nonempty: bool = True,
) -> jax.Array:
  """Keep mask of the token filter: real positions with entropy at or above the cut.

  Exactly one of `threshold` (absolute, nats) or `percentile` (q in [0, 100] of the entropy over the
  positions where `mask` is true) must be given. Under `jax.jit` the empty-set check cannot raise; call
  `check_kept` on the host (the streaming driver does this with the kept-token count).

  Args:
    entropy: [B, T] (or any shape) token entropies in nats.
    mask: same shape, bool: positions eligible for statistics (attention mask, assistant turns).
    threshold: absolute cut in nats.
    percentile: percentile q in [0, 100] of the masked entropies.
    check_nonempty: raise when nothing is kept (only when the inputs are concrete).

  Returns:
    bool keep mask, same shape as `entropy`.

  Raises:
    ValueError: both or neither of threshold/percentile, q outside [0, 100], or no token kept.
  """
  if (threshold is None) == (percentile is None):
    raise ValueError("give exactly one of threshold= (nats) or percentile= (q in [0, 100])")
  mask = jnp.asarray(mask, dtype=bool)
  entropy = jnp.asarray(entropy, dtype=jnp.float32)
  if entropy.shape != mask.shape:
    raise ValueError(f"entropy shape {entropy.shape} != mask shape {mask.shape}")
  if percentile is not None:
    if not 0.0 <= float(percentile) <= 100.0:
      raise ValueError(f"percentile must be in [0, 100], got {percentile}")
    cut = masked_percentile(entropy, mask, float(percentile))
  else:
    cut = jnp.float32(threshold)
  keep = mask & (entropy >= cut)
  if check_nonempty and not (_is_traced(keep) or _is_traced(mask)):
    check_kept(keep, mask)
  return keep


def percentile_threshold(
    entropies: Iterable[jax.Array | np.ndarray],
    masks: Iterable[jax.Array | np.ndarray],
    q: float = 50.0,
) -> float:
  """Absolute threshold = q-th percentile of token entropy over a calibration pass (host side).

  Use it before a streaming statistics pass, then filter every batch with `threshold=` the returned value.

  Args:
    entropies: iterable of [B, T] token-entropy arrays.
    masks: iterable of matching [B, T] bool eligibility masks.
    q: percentile in [0, 100].

  Returns:
    The threshold in nats (float).

  Raises:
    ValueError: q outside [0, 100] or no eligible token in the calibration pass.
  """
  if not 0.0 <= q <= 100.0:
    raise ValueError(f"percentile must be in [0, 100], got {q}")
  kept = [np.asarray(e, np.float64)[np.asarray(m, bool)] for e, m in zip(entropies, masks, strict=True)]
  values = np.concatenate(kept) if kept else np.zeros((0,))
  if values.size == 0:
    raise ValueError(_EMPTY_MESSAGE.format(eligible=0))
  return float(np.percentile(values, q))
