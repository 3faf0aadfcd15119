"""Acceptance rules on hand-made trees and synthetic distributions: exact paths, and lossless in law."""

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from layerwave.sampling import SamplingParams
from layerwave.speculative import tree as tree_lib
from layerwave.speculative import verify

GREEDY = SamplingParams()
V = 6


def _hand_tree(batch=1):
  """root(0) -> a(1)=3, b(2)=4; a -> c(3)=5; c -> d(4)=1; b -> e(5)=2."""
  parents = jnp.asarray([[0, 0, 0, 1, 3, 2]] * batch)
  return tree_lib.Tree(tokens=jnp.asarray([[9, 3, 4, 5, 1, 2]] * batch), parents=parents,
                       depths=jnp.asarray([[0, 1, 1, 2, 3, 2]] * batch),
                       mask=tree_lib.ancestor_mask(parents, 3))


def _one_hot_logits(argmaxes):
  return jax.nn.one_hot(jnp.asarray(argmaxes), V) * 10.0


def test_greedy_accepts_the_longest_matching_path():
  t = _hand_tree(3)
  # Row 0: target says 4 at the root -> b; at b says 2 -> e; at e says 0 (bonus). m = 2.
  # Row 1: root 3 -> a; a 5 -> c; c 1 -> d; d says 4 (bonus). m = 3.
  # Row 2: root 0: nothing matches; bonus 0. m = 0.
  logits = _one_hot_logits([[4, 5, 2, 1, 4, 0], [3, 5, 2, 1, 4, 0], [0, 5, 2, 1, 4, 3]])
  acc = verify.accept_deterministic(t, logits, jax.random.key(0), GREEDY, 3)
  np.testing.assert_array_equal(acc.num_accepted, [2, 3, 0])
  np.testing.assert_array_equal(acc.path, [[0, 2, 5, 0], [0, 1, 3, 4], [0, 0, 0, 0]])
  np.testing.assert_array_equal(acc.new_tokens, [[4, 2, 0, 0], [3, 5, 1, 4], [0, 0, 0, 0]])
  np.testing.assert_array_equal(acc.bonus, [0, 4, 0])


def test_chain_greedy_is_the_cumulative_product_of_matches():
  drafted = jnp.asarray([[1, 2, 3], [1, 2, 3]])
  t = tree_lib.chain(jnp.asarray([0, 0]), drafted)
  logits = _one_hot_logits([[1, 2, 5, 4], [1, 0, 3, 4]])  # row 1: 3rd matches but the 2nd does not
  acc = verify.accept_deterministic(t, logits, jax.random.key(0), GREEDY, 3)
  np.testing.assert_array_equal(acc.num_accepted, [2, 1])
  np.testing.assert_array_equal(acc.new_tokens, [[1, 2, 5, 0], [1, 0, 0, 0]])


def _first_tokens_chi2(first, p, n):
  counts = np.bincount(np.asarray(first), minlength=V)
  keep = p > 0
  assert counts[~keep].sum() == 0
  return stats.chisquare(counts[keep], p[keep] / p[keep].sum() * n).pvalue


def test_tree_sampling_emits_target_distribution():
  n = 100_000
  logits = jax.random.normal(jax.random.key(1), (1, 6, V)) * 1.5
  params = SamplingParams(temperature=1.0)
  acc = jax.jit(lambda k: verify.accept_deterministic(
      _hand_tree(n), jnp.broadcast_to(logits, (n, 6, V)), k, params, 3))(jax.random.key(2))
  p = np.asarray(jax.nn.softmax(logits[0]), np.float64)
  assert _first_tokens_chi2(acc.new_tokens[:, 0], p[0], n) > 0.01
  # Given the first accepted draft is a (token 3), the next token follows node a's distribution.
  at_a = np.asarray(acc.num_accepted >= 1) & (np.asarray(acc.new_tokens[:, 0]) == 3)
  assert at_a.sum() > 1000
  assert _first_tokens_chi2(np.asarray(acc.new_tokens[:, 1])[at_a], p[1], at_a.sum()) > 0.01


def test_sampled_chain_rejection_is_lossless():
  n = 100_000
  k = 2
  key_p, key_q, key_x, key_a = jax.random.split(jax.random.key(3), 4)
  logits = jax.random.normal(key_p, (1, k + 1, V)) * 1.5
  q = jax.nn.softmax(jax.random.normal(key_q, (1, k, V)) * 1.5)
  drafted = jax.random.categorical(key_x, jnp.log(q), shape=(n, k))  # x_i ~ q_i
  params = SamplingParams(temperature=1.0)
  acc = jax.jit(lambda key: verify.accept_sampled_chain(
      tree_lib.chain(jnp.zeros((n,), jnp.int32), drafted), jnp.broadcast_to(logits, (n, k + 1, V)),
      jnp.broadcast_to(q, (n, k, V)), key, params))(key_a)
  p = np.asarray(jax.nn.softmax(logits[0]), np.float64)
  assert _first_tokens_chi2(acc.new_tokens[:, 0], p[0], n) > 0.01
  # The acceptance rate of the first draft is sum_x min(p, q).
  rate = np.minimum(p[0], np.asarray(q[0, 0], np.float64)).sum()
  assert abs(float(np.mean(np.asarray(acc.num_accepted) >= 1)) - rate) < 0.01
