"""Candidate trees for one verification: a chain of K drafted tokens, or an EAGLE-2 dynamic tree.

The speculative loop (`decode.py`) drafts candidates, the target verifies them all in one call, and
`verify.py` accepts a path. Both drafting shapes are expressed as one `Tree` of static size: node 0 is the
root, the pending token the target has sampled but not yet cached; every other node is a drafted token whose
parent is the token before it. The target reads the tree against its cache with `Tree.mask` (each node sees
its ancestors and itself) at RoPE positions `lengths + depth`.

The EAGLE-2 dynamic tree (Li et al. 2024) under a static budget (`depth`, `top_k`, `tokens`):

1. expansion: the root's draft distribution gives the top-W depth-1 nodes (the beam); for each further
   level the draft runs on the beam, every beam node proposes its top-W children, and the W best of the W*W
   children by cumulative draft log-probability form the next beam. Every proposed node joins a pool of
   `top_k + (depth - 1) * top_k**2` nodes (W = `top_k`, K = `depth`).
2. reranking: the `tokens` pool nodes with the highest cumulative log-probability are verified. A child's
   score never exceeds its parent's and the pool lists parents first (`lax.top_k` breaks ties towards the
   lower index), so the chosen set always contains every chosen node's ancestors.

Expansion re-runs the draft on all beams so far (with the tree mask among them) rather than keeping the
beams' keys in the draft cache: the cache contract (committed prefix + new tokens) stays untouched, and the
draft is one small layer.

Legend (`layerwave.axes`): B batch, N tree nodes (N + 1 with the root), K draft depth, W tree width,
V_d draft vocabulary, d draft width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

Array = jax.Array


@struct.dataclass
class Tree:
  """Candidates for one verification call.

  Attributes:
    tokens: `[B, N+1]` target token ids; index 0 is the root (the pending token).
    parents: `[B, N+1]` index of each node's parent (the root is its own parent).
    depths: `[B, N+1]` distance from the root (RoPE position = committed length + depth).
    mask: `[B, N+1, N+1]` node i may read node j iff j is i or an ancestor of i.
  """

  tokens: Array
  parents: Array
  depths: Array
  mask: Array


@dataclasses.dataclass(frozen=True)
class TreeBudget:
  """The static shape of an EAGLE-2 dynamic tree.

  Attributes:
    depth: levels below the root (the longest acceptable path).
    top_k: children proposed per expanded node, and beam width.
    tokens: drafted nodes sent to the target (the root comes on top).
  """

  depth: int
  top_k: int
  tokens: int

  def __post_init__(self):
    for name in ("depth", "top_k", "tokens"):
      value = getattr(self, name)
      if int(value) != value or value < 1:
        raise ValueError(f"tree_{name} must be a positive integer, got {value}.")
    if not self.depth <= self.tokens <= self.pool_size:
      raise ValueError(
          f"Inconsistent tree budget: tree_tokens ({self.tokens}) must lie between tree_depth "
          f"({self.depth}) and the nodes expansion proposes, tree_top_k + (tree_depth - 1) * "
          f"tree_top_k**2 = {self.pool_size}.")

  @property
  def pool_size(self) -> int:
    return self.top_k + (self.depth - 1) * self.top_k ** 2

  def check_vocab(self, draft_vocab_size: int) -> None:
    if self.top_k > draft_vocab_size:
      raise ValueError(f"tree_top_k ({self.top_k}) exceeds the draft vocabulary ({draft_vocab_size}).")


def ancestor_mask(parents: Array, max_depth: int) -> Array:
  """`[B, N+1, N+1]` ancestor-or-self relation from `parents [B, N+1]` (the root is its own parent)."""
  t = parents.shape[1]
  eye = jnp.eye(t, dtype=bool)[None]
  anc = jnp.broadcast_to(eye, parents.shape + (t,))
  for _ in range(max_depth):  # each pass adds one more generation of ancestors
    anc = eye | jnp.take_along_axis(anc, parents[:, :, None], axis=1)
  return anc


def chain(root: Array, drafted: Array) -> Tree:
  """A chain: `root [B]` followed by `drafted [B, K]`, each node the child of the one before (N = K)."""
  b, k = drafted.shape
  idx = jnp.arange(k + 1, dtype=jnp.int32)
  return Tree(tokens=jnp.concatenate([root[:, None], drafted], axis=1).astype(jnp.int32),
              parents=jnp.broadcast_to(jnp.maximum(idx - 1, 0), (b, k + 1)),
              depths=jnp.broadcast_to(idx, (b, k + 1)),
              mask=jnp.broadcast_to(jnp.tril(jnp.ones((k + 1, k + 1), bool)), (b, k + 1, k + 1)))


def dynamic_tree(draft, root: Array, root_h: Array, lengths: Array, cache, budget: TreeBudget
                 ) -> Tree:
  """Drafts an EAGLE-2 dynamic tree below the pending token.

  Args:
    draft: the merged NNX `Draft`.
    root: `[B]` the pending token (target id), not yet in either cache.
    root_h: `[B, d]` the draft's feature at the last committed position; its logits propose depth 1.
    lengths: `[B]` committed length of the draft cache; beams are drafted at positions `lengths + depth - 1`.
    cache: the draft's `KVCache` (read only: expansion results are discarded).
    budget: the static `TreeBudget`.

  Returns:
    The `Tree` of `budget.tokens + 1` nodes, drafted nodes in pool order (parents before children).
  """
  b, w = root.shape[0], budget.top_k
  lp = jax.nn.log_softmax(draft.logits(root_h), axis=-1)  # [B, V_d]
  beam_score, beam_ids = jax.lax.top_k(lp, w)
  beam_tokens = draft.draft_to_target(beam_ids).astype(jnp.int32)
  pool_score, pool_token = [beam_score], [beam_tokens]
  pool_parent = [jnp.full((b, w), -1, jnp.int32)]
  pool_depth = [np.ones(w, np.int32)]
  beam_pool = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))  # beam -> pool index
  seq_tokens, seq_g = [beam_tokens], [jnp.broadcast_to(root_h[:, None], (b, w, root_h.shape[-1]))]
  seq_anc = jnp.broadcast_to(jnp.eye(w, dtype=bool), (b, w, w))  # among all beams so far
  for level in range(1, budget.depth):
    tokens = jnp.concatenate(seq_tokens, axis=1)  # [B, level * W]
    positions = lengths[:, None] + jnp.asarray(np.repeat(np.arange(level), w), jnp.int32)[None]
    h, logits, _ = draft(jnp.concatenate(seq_g, axis=1), tokens, positions, seq_anc, cache, lengths)
    h_beam, lp = h[:, -w:], jax.nn.log_softmax(logits[:, -w:], axis=-1)  # the deepest beam
    child_score, child_ids = jax.lax.top_k(lp, w)  # [B, W, W]
    cum = (beam_score[:, :, None] + child_score).reshape(b, w * w)
    child_tokens = draft.draft_to_target(child_ids).reshape(b, w * w).astype(jnp.int32)
    offset = sum(x.shape[0] for x in pool_depth)
    pool_score.append(cum)
    pool_token.append(child_tokens)
    pool_parent.append(jnp.repeat(beam_pool, w, axis=1))
    pool_depth.append(np.full(w * w, level + 1, np.int32))
    if level + 1 == budget.depth:
      break
    beam_score, pick = jax.lax.top_k(cum, w)  # the next beam
    parent_slot = pick // w  # which node of the current beam
    beam_pool = offset + pick
    seq_tokens.append(jnp.take_along_axis(child_tokens, pick, axis=1))
    seq_g.append(jnp.take_along_axis(h_beam, parent_slot[:, :, None], axis=1))
    parent_rows = jnp.take_along_axis(seq_anc, ((level - 1) * w + parent_slot)[:, :, None], axis=1)
    width = (level + 1) * w
    rows = jnp.pad(parent_rows, ((0, 0), (0, 0), (0, w))) | jnp.eye(w, width, level * w, bool)[None]
    seq_anc = jnp.concatenate([jnp.pad(seq_anc, ((0, 0), (0, 0), (0, w))), rows], axis=1)
  return _rerank(root, jnp.concatenate(pool_score, 1), jnp.concatenate(pool_token, 1),
                 jnp.concatenate(pool_parent, 1), np.concatenate(pool_depth), budget)


def _rerank(root, score, token, parent, depth, budget: TreeBudget) -> Tree:
  """Keeps the `budget.tokens` best pool nodes (in pool order) and links them into a `Tree`."""
  b, n = root.shape[0], budget.tokens
  _, chosen = jax.lax.top_k(score, n)
  chosen = jnp.sort(chosen, axis=1)  # pool order: parents before children
  tree_index = jnp.zeros(score.shape, jnp.int32).at[jnp.arange(b)[:, None], chosen].set(
      jnp.arange(1, n + 1, dtype=jnp.int32))
  parent_pool = jnp.take_along_axis(parent, chosen, axis=1)
  parents = jnp.where(parent_pool < 0, 0,
                      jnp.take_along_axis(tree_index, jnp.maximum(parent_pool, 0), axis=1))
  zero = jnp.zeros((b, 1), jnp.int32)
  parents = jnp.concatenate([zero, parents], axis=1)
  depths = jnp.concatenate([zero, jnp.take(jnp.asarray(depth), chosen)], axis=1)
  tokens = jnp.concatenate([root[:, None].astype(jnp.int32), jnp.take_along_axis(token, chosen, 1)], 1)
  return Tree(tokens=tokens, parents=parents, depths=depths,
              mask=ancestor_mask(parents, budget.depth))
