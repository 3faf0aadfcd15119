"""Candidate trees: structure of the EAGLE-2 dynamic tree, and committing an accepted path in the cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layerwave.inference import cached_forward, new_cache
from layerwave.models.kv_cache import KVCache, causal_mask
from layerwave.speculative import decode
from layerwave.speculative import tree as tree_lib


def test_ancestor_mask_and_chain():
  parents = jnp.asarray([[0, 0, 0, 1, 3, 2]])
  mask = np.asarray(tree_lib.ancestor_mask(parents, 3))[0]
  want = np.eye(6, dtype=bool)
  for node, ancestors in {1: [0], 2: [0], 3: [0, 1], 4: [0, 1, 3], 5: [0, 2]}.items():
    want[node, ancestors] = True
  np.testing.assert_array_equal(mask, want)
  c = tree_lib.chain(jnp.asarray([7]), jnp.asarray([[1, 2, 3]]))
  np.testing.assert_array_equal(c.tokens, [[7, 1, 2, 3]])
  np.testing.assert_array_equal(c.mask[0], np.tril(np.ones((4, 4), bool)))
  np.testing.assert_array_equal(c.depths, [[0, 1, 2, 3]])


@pytest.mark.parametrize("depth,top_k,tokens", [(4, 3, 10), (3, 2, 10), (1, 4, 3), (2, 5, 30)])
def test_dynamic_tree_is_a_valid_tree(llama, depth, top_k, tokens):
  target, draft, _ = llama
  budget = tree_lib.TreeBudget(depth, top_k, tokens)
  b = 3
  lengths = jnp.asarray([5, 9, 2])
  h = jax.random.normal(jax.random.key(0), (b, draft.config.model.hidden_size))
  cache = KVCache.zeros(draft.config.model, b, 64)
  t = jax.jit(lambda h: tree_lib.dynamic_tree(draft, jnp.asarray([4, 5, 6]), h, lengths, cache,
                                              budget))(h)
  tok, par, dep, mask = (np.asarray(x) for x in (t.tokens, t.parents, t.depths, t.mask))
  assert tok.shape == (b, tokens + 1) and mask.shape == (b, tokens + 1, tokens + 1)
  np.testing.assert_array_equal(tok[:, 0], [4, 5, 6])
  for row in range(b):
    assert dep[row, 0] == 0 and dep[row].max() <= depth
    for i in range(1, tokens + 1):
      assert par[row, i] < i and dep[row, i] == dep[row, par[row, i]] + 1  # parents come first
    for i in range(tokens + 1):  # siblings carry distinct tokens
      kids = tok[row][(par[row] == i) & (np.arange(tokens + 1) > 0)]
      assert len(set(kids.tolist())) == len(kids) <= top_k
    np.testing.assert_array_equal(mask[row], np.asarray(tree_lib.ancestor_mask(t.parents, depth))[row])
  # Depth 1 holds the draft's top choices at the root.
  top = np.asarray(jax.lax.top_k(draft.logits(h), min(top_k, tokens))[1])
  for row in range(b):
    assert set(top[row].tolist()) <= set(tok[row][dep[row] == 1].tolist())


def _prefill(target, prompt, slots=64):
  graphdef, params = target.graphdef, target.params
  tokens = jnp.asarray([prompt])
  cache = new_cache(target.config, 1, slots, jnp.float32, target.mesh)
  out = cached_forward(graphdef, params, tokens, jnp.arange(len(prompt))[None],
                       causal_mask(jnp.ones_like(tokens)), cache, jnp.zeros((1,), jnp.int32))
  return out.cache, jnp.asarray([len(prompt)])


@pytest.mark.parametrize("kind", ["tree", "chain"])
def test_committed_cache_equals_a_fresh_prefill(llama, kind):
  """Verify candidates, keep one path, decode on: logits equal a plain forward over the kept tokens."""
  target, _, _ = llama
  prompt = [5, 17, 33, 8, 41, 12]
  cache, lengths = _prefill(target, prompt)
  if kind == "tree":
    parents = jnp.asarray([[0, 0, 0, 1, 3, 2]])
    cand = tree_lib.Tree(tokens=jnp.asarray([[9, 3, 4, 5, 1, 2]]), parents=parents,
                         depths=jnp.asarray([[0, 1, 1, 2, 3, 2]]),
                         mask=tree_lib.ancestor_mask(parents, 3))
    path, kept = jnp.asarray([[0, 2, 5]]), [9, 4, 2]  # root -> b -> e: non-contiguous slots
  else:
    cand = tree_lib.chain(jnp.asarray([9]), jnp.asarray([[3, 5, 1, 2]]))
    path, kept = jnp.asarray([[0, 1, 2]]), [9, 3, 5]  # accept 2 of 4 drafts
  out = cached_forward(target.graphdef, target.params, cand.tokens, lengths[:, None] + cand.depths,
                       cand.mask, cache, lengths)
  cache = decode._commit_path(out.cache, path, lengths) if kind == "tree" else out.cache
  lengths = lengths + path.shape[1]
  nxt = cached_forward(target.graphdef, target.params, jnp.asarray([[60, 61]]),
                       lengths[:, None] + jnp.arange(2)[None], causal_mask(jnp.ones((1, 2))), cache,
                       lengths)
  full = target.forward([prompt + kept + [60, 61]]).logits[:, -2:]
  np.testing.assert_allclose(nxt.logits, full, atol=2e-5, rtol=1e-5)
  # The verify logits of the kept path equal the plain forward's too.
  kept_logits = jnp.take_along_axis(out.logits, path[:, :, None], axis=1)
  np.testing.assert_allclose(kept_logits, target.forward([prompt + kept]).logits[:, -3:], atol=2e-5,
                             rtol=1e-5)
