"""Accepting drafted tokens after the target has verified a `Tree` in one call (docs/METHOD.md §8).

Both rules here are exactly lossless: the tokens they emit are distributed as plain decoding from the target's
processed distribution p (`layerwave.sampling.log_probs`: temperature, top-k, top-p), and equal greedy
decoding token for token at temperature 0.

* `accept_deterministic` serves drafts whose candidates are chosen deterministically (argmax chain, EAGLE-2
  top-k tree), i.e. q is one-hot per candidate. The recursive multi-draft rule (SpecInfer; Chen et al.
  2023 with one-hot q) then reads: at a node with children c_1..c_k, accept c_j with probability r(c_j),
  else r <- norm(max(0, r - onehot(c_j))), and after the last child emit a sample of r. That process is the
  same in law as drawing y ~ p once at the node and moving to the child whose token is y (emitting y as the
  bonus when no child has it), which is how it is computed: one target draw per node, all nodes at once; a
  node is accepted iff every node on its path matches its parent's draw. Greedy is the case y = argmax p.
* `accept_sampled_chain` serves a chain whose tokens were sampled from the draft's q: accept x_i with
  probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit a sample of norm(max(0, p_i - q_i));
  if all K are accepted emit a sample of p_K (Leviathan et al. 2023).

Legend (`layerwave.axes`): B batch, T tokens (the tree's nodes with the root first), K draft depth, V target vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from layerwave.sampling import SamplingParams, log_probs, sample
from layerwave.speculative.tree import Tree

Array = jax.Array


@struct.dataclass
class Acceptance:
  """The accepted path of one verification.

  Attributes:
    num_accepted: `[B]` m, drafted tokens accepted (the path's depth).
    path: `[B, K+1]` tree index of the accepted node at each depth (`path[:, 0] = 0`, the root); entries
      beyond m are 0.
    new_tokens: `[B, K+1]` the tokens this step emits: the m accepted drafts, then the bonus at index m
      (entries beyond m are 0).
    bonus: `[B]` the target's token after the accepted path (the next pending token).
  """

  num_accepted: Array
  path: Array
  new_tokens: Array
  bonus: Array


def accept_deterministic(tree: Tree, logits: Array, rng: Array, sampling: SamplingParams,
                         max_depth: int) -> Acceptance:
  """Longest path of drafted tokens that match the target's draw at their parents.

  Args:
    tree: the verified `Tree` (children of a node carry distinct tokens).
    logits: `[B, T, V]` target logits at every node (the distribution of the node's next token).
    rng: PRNG key (unused when greedy).
    sampling: the target's sampling settings.
    max_depth: K, the tree's static depth.

  Returns:
    The `Acceptance`.
  """
  draws = sample(logits, rng, sampling)  # [B, T] the target's next token at every node
  t = draws.shape[1]
  match = (tree.tokens == jnp.take_along_axis(draws, tree.parents, axis=1)) | (jnp.arange(t) == 0)
  accepted = ~jnp.any(tree.mask & ~match[:, None, :], axis=-1)  # the whole path matches
  best = jnp.argmax(jnp.where(accepted, tree.depths, -1), axis=1)  # the deepest accepted node
  m = jnp.take_along_axis(tree.depths, best[:, None], axis=1)[:, 0]
  on_path = jnp.take_along_axis(tree.mask, best[:, None, None], axis=1)[:, 0]  # [B, T]
  at_depth = tree.depths[:, None, :] == jnp.arange(max_depth + 1)[None, :, None]  # [B, K+1, T]
  path = jnp.argmax(at_depth & on_path[:, None, :], axis=-1).astype(jnp.int32)
  bonus = jnp.take_along_axis(draws, best[:, None], axis=1)[:, 0]
  return _finish(m, path, tree.tokens, bonus)


def accept_sampled_chain(tree: Tree, logits: Array, draft_probs: Array, rng: Array,
                         sampling: SamplingParams) -> Acceptance:
  """Rejection sampling for a chain sampled from the draft.

  Args:
    tree: a chain (`tree.chain`) of K drafted tokens.
    logits: `[B, K+1, V]` target logits at the root and every drafted token.
    draft_probs: `[B, K, V]` the draft's processed distribution each drafted token was sampled from,
      over the target vocabulary.
    rng: PRNG key.
    sampling: the target's sampling settings (temperature > 0).

  Returns:
    The `Acceptance` (path = 0..K).
  """
  b, k = draft_probs.shape[:2]
  p = jnp.exp(log_probs(logits, sampling))  # [B, K+1, V]
  x = tree.tokens[:, 1:]
  px = jnp.take_along_axis(p[:, :k], x[:, :, None], axis=-1)[..., 0]
  qx = jnp.take_along_axis(draft_probs, x[:, :, None], axis=-1)[..., 0]
  key_u, key_r = jax.random.split(rng)
  ok = jax.random.uniform(key_u, (b, k)) * qx < px  # probability min(1, p / q)
  m = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
  residual = jnp.concatenate([jnp.maximum(p[:, :k] - draft_probs, 0.0), p[:, k:]], axis=1)
  r = jnp.take_along_axis(residual, m[:, None, None], axis=1)[:, 0]
  p_m = jnp.take_along_axis(p, m[:, None, None], axis=1)[:, 0]
  r = jnp.where(jnp.sum(r, axis=-1, keepdims=True) > 0, r, p_m)  # p == q exactly: never rejected
  bonus = jax.random.categorical(key_r, jnp.log(r), axis=-1).astype(jnp.int32)
  path = jnp.broadcast_to(jnp.arange(k + 1, dtype=jnp.int32), (b, k + 1))
  return _finish(m, path, tree.tokens, bonus)


def _finish(m: Array, path: Array, tokens: Array, bonus: Array) -> Acceptance:
  depth = jnp.arange(path.shape[1])[None]
  path = jnp.where(depth <= m[:, None], path, 0)
  accepted = jnp.take_along_axis(tokens, jnp.roll(path, -1, axis=1), axis=1)  # token at depth j + 1
  new_tokens = jnp.where(depth < m[:, None], accepted, jnp.where(depth == m[:, None], bonus[:, None], 0))
  return Acceptance(num_accepted=m.astype(jnp.int32), path=path, new_tokens=new_tokens.astype(jnp.int32),
                    bonus=bonus.astype(jnp.int32))
