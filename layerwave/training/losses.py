"""The training-time-test (TTT) loss of an EAGLE-3 draft (METHOD §7), and the targets it trains towards.

Step 0 reads the fused target features g_t; step j > 0 reads the draft's own output features at the same
positions, with the input tokens shifted by one more token and RoPE positions offset by j. At step j, draft
position t reads token x_{t+1+j} and is trained towards the target's distribution over x_{t+2+j} (the
target's logits at position t+1+j), restricted to the draft vocabulary and renormalised, by soft
cross-entropy. Positions whose target argmax lies outside the draft vocabulary, padding, and (by flag)
non-assistant tokens are masked from the loss. Total = Σ_j decay^j L_j.

The loss takes those targets ready-made, `[B, T, V_d]` log-probs and a `[B, T]` in-vocabulary mask, from
one computation: `offline_targets` builds them from the final-norm hidden states h_L, the target's LM-head
rows of the draft vocabulary and the full-vocabulary argmax. The offline step reads those from a feature
store; the online step (`online_targets`) computes the same three from the target in the step, the argmax a
block of positions at a time as extraction does, so offline == online holds by construction.
`target_targets` reads them off the full `[B, T, V]` logits: the reference both are tested against.

The accuracy `acc_j` counts every predictable position, and a position whose target argmax is outside the
draft vocabulary as a miss: such a token can never be drafted, so it can never be accepted (as EAGLE-3 and
SpecForge count it). `acc_in_vocab_j` is the same agreement over in-vocabulary positions only.

Legend (`layerwave.axes`): B batch, T tokens, k selected layers, D target width, V target vocabulary,
V_d draft vocabulary, K draft depth (the unrolled steps), G key/value heads, Dh head width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from layerwave.inference import LOGITS_CHUNK, over_positions
from layerwave.models.draft import TTT_QUERY_BLOCK, Draft


def argmax(x: jax.Array, block: int = 1024) -> jax.Array:
  """`jnp.argmax(x, axis=-1)` (the first maximum, NaN counting as the largest), much faster on XLA:CPU.

  XLA:CPU runs argmax as a variadic (value, index) reduction that does not vectorise, far slower than a plain
  max over the same logits (BENCHMARKS.md, "Feature store"). So: the max of each block of `block` entries (a
  plain reduction), the argmax over those few block maxima, then the argmax within the winning block.
  Identical results, ties included. XLA's vectorised max may drop a NaN, so an input whose sum is NaN (a
  NaN, or both infinities) takes `jnp.argmax` itself.
  """
  v = x.shape[-1]
  if v <= block:
    return jnp.argmax(x, axis=-1)

  def blocked(x):
    pad = -v % block
    if pad:
      x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    blocks = x.reshape(*x.shape[:-1], -1, block)
    best = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
    inner = jnp.take_along_axis(blocks, best[..., None, None], axis=-2)[..., 0, :]
    return best * block + jnp.argmax(inner, axis=-1)

  return jax.lax.cond(jnp.isnan(jnp.sum(x)), lambda x: jnp.argmax(x, axis=-1), blocked, x)


def target_targets(target_logits: jax.Array, draft: Draft) -> tuple[jax.Array, jax.Array]:
  """From the target's logits `[B, T, V]`: its log-probs over the draft vocabulary `[B, T, V_d]` and whether its
  argmax is in it `[B, T]`."""
  in_vocab = jnp.take(draft.t2d[...], argmax(target_logits))
  restricted = jnp.take(target_logits, draft.draft_token_ids(), axis=-1)
  return jax.nn.log_softmax(restricted.astype(jnp.float32), axis=-1), in_vocab


def offline_targets(final_hidden: jax.Array, head_rows: jax.Array, target_argmax: jax.Array,
                    draft: Draft) -> tuple[jax.Array, jax.Array]:
  """`target_targets` without the target: from its final-norm hidden states and stored argmax.

  Args:
    final_hidden: `[B, T, D]` the target's final-norm hidden states h_L (a feature store's `final`).
    head_rows: `[D, V_d]` the target's LM head restricted to the draft vocabulary (`head[:, draft ids]`).
    target_argmax: `[B, T]` int the target's full-vocabulary argmax (stored at extraction).
    draft: the draft (its `t2d` table).

  Returns:
    (log-probs `[B, T, V_d]` float32, in-vocabulary mask `[B, T]` bool).
  """
  restricted = jnp.dot(final_hidden, head_rows.astype(final_hidden.dtype),
                       preferred_element_type=jnp.float32)
  in_vocab = jnp.take(draft.t2d[...], target_argmax)
  return jax.nn.log_softmax(restricted.astype(jnp.float32), axis=-1), in_vocab


def head_rows(target, draft: Draft) -> jax.Array:
  """`[D, V_d]` the target's LM head restricted to the draft vocabulary (the transposed embedding when tied)."""
  ids = draft.draft_token_ids()
  if target.lm_head is None:
    return jnp.take(target.embed_tokens.embedding[...], ids, axis=0).T
  return jnp.take(target.lm_head.kernel[...], ids, axis=1)


def online_targets(target, final_hidden: jax.Array, draft: Draft,
                   chunk: int = LOGITS_CHUNK) -> tuple[jax.Array, jax.Array]:
  """`offline_targets` with what a feature store holds computed here, so online and offline training share
  one path: the top-1 of h_L over the full vocabulary, `chunk` positions at a time (as extraction stores it;
  never the `[B, T, V]` logits), and the LM head's draft-vocabulary columns.

  Args:
    target: the target `Transformer` (merged, inside a transform).
    final_hidden: `[B, T, D]` its final-norm hidden states h_L.
    draft: the draft (its vocabulary tables).
    chunk: positions whose full-vocabulary logits exist at once.
  """
  top1 = over_positions(final_hidden, lambda h: argmax(target.logits(h)).astype(jnp.int32), chunk)
  return offline_targets(final_hidden, head_rows(target, draft), top1, draft)


def _shift(x: jax.Array, by: jax.Array, length: int) -> jax.Array:
  """`x[:, by : by + length]` along axis 1 for `x` already padded at the end."""
  return jax.lax.dynamic_slice_in_dim(x, by, length, axis=1)


def ttt_loss(draft: Draft, features: jax.Array, target_logp: jax.Array, in_vocab: jax.Array,
             tokens: jax.Array, attention_mask: jax.Array, loss_mask: jax.Array, *, steps: int,
             decay: float = 0.8, remat: bool = False, gate_step: jax.Array | None = None):
  """Unrolled TTT loss (plus, for a gated draft, its gates' regulariser: `layerwave.models.gates`).

  Args:
    draft: the draft (merged NNX module, inside a transform).
    features: `[k, B, T, D]` the selected target layers' hidden states.
    target_logp: `[B, T, V_d]` float32 target log-probs over the draft vocabulary, renormalised (position p
      predicts token p+1): `target_targets` or `offline_targets`.
    in_vocab: `[B, T]` whether the target's full-vocabulary argmax at p lies in the draft vocabulary.
    tokens: `[B, T]` token ids.
    attention_mask: `[B, T]` 1 on real tokens.
    loss_mask: `[B, T]` 1 on tokens the loss may predict (assistant tokens, or every real token).
    steps: K, the unrolled steps (static).
    decay: weight of step j is decay**j.
    remat: the memory-saving path for long sequences: every unrolled step is rematerialised in the backward pass
      (`jax.checkpoint`), so only what crosses steps is kept, not each step's attention scores and [B, T, V_d]
      logits, and the attention takes `draft.TTT_QUERY_BLOCK` query rows at a time. The same loss; gradients
      equal to float rounding (XLA fuses the recomputation differently).
    gate_step: a gated draft's training step (its gates are sampled from it), None at evaluation (deterministic
      gates); ignored by an ungated draft.

  Returns:
    (scalar loss, metrics dict of per-step arrays `[K]`: `loss_j`; `acc_j` = `hits_j / tokens_j`, top-1
    agreement with the target's full-vocabulary argmax over every predictable position (out-of-vocabulary
    targets are misses); `acc_in_vocab_j` over the `in_vocab_j` positions whose target argmax is in the
    draft vocabulary (the loss's positions)).
  """
  _, t = tokens.shape
  pad = steps + 1
  logp = target_logp
  predictable = (loss_mask * attention_mask).astype(bool)
  tokens_p = jnp.pad(tokens, ((0, 0), (0, pad)))
  logp_p = jnp.pad(logp, ((0, 0), (0, pad), (0, 0)))
  in_vocab_p = jnp.pad(in_vocab, ((0, 0), (0, pad)))
  predictable_p = jnp.pad(predictable, ((0, 0), (0, pad)))
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
  key_mask = attention_mask.astype(bool)

  def step_terms(j, h_logits):
    tgt = _shift(logp_p, j + 1, t)  # target at position t+1+j predicts x_{t+2+j}
    counted = _shift(predictable_p, j + 2, t).astype(jnp.float32)
    mask = counted * _shift(in_vocab_p, j + 1, t).astype(jnp.float32)
    logq = jax.nn.log_softmax(h_logits, axis=-1)
    ce = -jnp.sum(jnp.exp(tgt) * logq, axis=-1)
    n = jnp.sum(mask)
    loss = jnp.sum(ce * mask) / jnp.maximum(n, 1.0)
    # Within the draft vocabulary the restricted argmax is the full one; outside it (mask = 0) the
    # draft's token can never equal the target's, so those positions count as misses.
    hits = jnp.sum((argmax(h_logits) == argmax(tgt)).astype(jnp.float32) * mask)
    return loss, jnp.stack([hits, jnp.sum(counted), n])

  g = draft.fuse(features, gate_step)
  diag = draft.ttt_init(tokens.shape[0], t, steps, dtype=g.dtype)

  def draft_step(h, j, base, diag, **kwargs):
    """Unrolled step j: `Draft.ttt_step` on its shifted inputs, then its loss terms."""
    h, logits, base, diag = draft.ttt_step(h, _shift(tokens_p, j + 1, t), positions + j, j, base, diag, key_mask,
                                           **kwargs)
    return h, base, diag, step_terms(j, logits)

  if remat:
    losses, counts = _ttt_scan(draft_step, g, diag, steps)
  else:
    losses, counts = _ttt_unrolled_first(draft_step, g, diag, steps)
  hits, tokens_j, in_vocab_j = counts[:, 0], counts[:, 1], counts[:, 2]
  weights = decay ** jnp.arange(steps, dtype=jnp.float32)
  total = jnp.sum(weights * losses)
  if draft.gates is not None:
    total = total + draft.gate_penalty()
  return total, {"loss_j": losses, "acc_j": hits / jnp.maximum(tokens_j, 1.0),
                 "acc_in_vocab_j": hits / jnp.maximum(in_vocab_j, 1.0), "hits_j": hits,
                 "tokens_j": tokens_j, "in_vocab_j": in_vocab_j}


def _ttt_scan(draft_step, g, diag, steps):
  """Every unrolled step, step 0 included, as one rematerialised `lax.scan` body (the memory-saving path): the
  attention in `TTT_QUERY_BLOCK` query rows at a time.

  The step is compiled once, not twice (step 0 outside the loop, steps 1..K-1 in it): an 8B-wide draft step
  with its backward takes minutes to compile for a TPU (BENCHMARKS.md, "At scale"). Step 0's keys and values
  become the base the later steps read (`Draft.ttt_step(base_at_zero=True)`).
  """
  kv_shape = diag[0][0].shape[1:]  # [B, T, G, Dh]
  base = tuple((jnp.zeros(kv_shape, kd.dtype), jnp.zeros(kv_shape, vd.dtype)) for kd, vd in diag)

  @jax.checkpoint
  def body(carry, j):
    h, base, diag = carry
    h, base, diag, terms = draft_step(h, j, base, diag, query_block=TTT_QUERY_BLOCK, base_at_zero=True)
    return (h, base, diag), terms

  _, (losses, counts) = jax.lax.scan(body, (g, base, diag), jnp.arange(steps, dtype=jnp.int32))
  return losses, counts


def _ttt_unrolled_first(draft_step, g, diag, steps):
  """Step 0 (which computes the base keys) then steps 1..K-1 in a `lax.scan`, nothing rematerialised."""
  h, base, diag, (loss0, counts0) = draft_step(g, jnp.asarray(0, jnp.int32), None, diag)

  def body(carry, j):
    h, _, diag, terms = draft_step(carry[0], j, base, carry[1])
    return (h, diag), terms

  if steps == 1:
    return loss0[None], counts0[None]
  _, (losses, counts) = jax.lax.scan(body, (h, diag), jnp.arange(1, steps, dtype=jnp.int32))
  return jnp.concatenate([loss0[None], losses]), jnp.concatenate([counts0[None], counts])


def simulated_tau(acc: jax.Array) -> jax.Array:
  """Expected accepted length of a greedy chain from per-step top-1 agreement `[K]`.

  Treats step j's agreement as the chance of accepting draft token j given tokens < j were accepted:
  τ ≈ 1 + Σ_j Π_{i<=j} acc_i (the leading 1 is the target's bonus token).
  """
  return 1.0 + jnp.sum(jnp.cumprod(acc))
