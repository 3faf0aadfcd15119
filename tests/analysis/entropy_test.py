"""Tests for layerwave.analysis.matrix_entropy against a float64 numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layerwave.analysis import entropy


def _ref_entropy(z, alpha=1.0, normalize=True):
  """Independent float64 reference: always the n×n Gram, full eigendecomposition."""
  z = np.asarray(z, np.float64)
  if normalize:
    z = z - z.mean(0)
    z = z / np.linalg.norm(z, axis=1, keepdims=True)
  k = z @ z.T
  lam = np.clip(np.linalg.eigvalsh(k / np.trace(k)), 0, None)
  p = lam / lam.sum()
  p = p[p > 1e-12]
  if alpha == 1.0:
    return float(-(p * np.log(p)).sum())
  return float(np.log((p ** alpha).sum()) / (1 - alpha))


def _low_rankish(rng, n, d, rank=4):
  # A spectrum with structure (not isotropic) so that alpha matters.
  return rng.normal(size=(n, rank)) @ rng.normal(size=(rank, d)) * 3 + 0.3 * rng.normal(size=(n, d)) + 5.0


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("n,d", [(7, 12), (20, 6)])  # Gram path (n <= D) and covariance path (n > D)
@pytest.mark.parametrize("normalize", [True, False])
def test_matrix_entropy_matches_reference(alpha, n, d, normalize):
  z = _low_rankish(np.random.default_rng(n * d), n, d)
  got = entropy.matrix_entropy(jnp.asarray(z, jnp.float32), alpha=alpha, normalize=normalize)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(float(got), _ref_entropy(z, alpha, normalize), rtol=2e-4, atol=2e-4)


def test_alpha_limits_and_ordering():
  z = jnp.asarray(_low_rankish(np.random.default_rng(3), 9, 16), jnp.float32)
  near_one = entropy.matrix_entropy(z, alpha=1.0 + 1e-3)
  np.testing.assert_allclose(near_one, entropy.matrix_entropy(z, alpha=1.0), rtol=2e-3)
  # Rényi entropy is non-increasing in alpha.
  values = [float(entropy.matrix_entropy(z, alpha=a)) for a in (0.5, 1.0, 2.0, 3.0)]
  assert all(a >= b - 1e-5 for a, b in zip(values, values[1:]))


def test_isotropic_gives_log_rank_and_bad_alpha():
  z = jnp.eye(6, dtype=jnp.float32)
  for alpha in (0.5, 1.0, 2.0):
    np.testing.assert_allclose(entropy.matrix_entropy(z, alpha=alpha, normalize=False), np.log(6), rtol=1e-5)
  for bad in (0.0, -1.0):
    with pytest.raises(ValueError, match="alpha"):
      entropy.matrix_entropy(z, alpha=bad)


@pytest.mark.parametrize("t,d", [(10, 16), (12, 5)])
def test_masked_equals_unmasked_on_subset(t, d):
  rng = np.random.default_rng(t + d)
  z = _low_rankish(rng, t, d)
  mask = np.zeros(t, bool)
  mask[[0, 2, 3, 6, 7, 9]] = True
  for alpha in (0.5, 1.0, 2.0):
    h, hn = entropy.masked_matrix_entropy(jnp.asarray(z, jnp.float32), jnp.asarray(mask), alpha)
    ref = _ref_entropy(z[mask], alpha)
    np.testing.assert_allclose(h, ref, rtol=3e-4, atol=3e-4)
    np.testing.assert_allclose(hn, ref / np.log(min(mask.sum(), d)), rtol=3e-4, atol=3e-4)


def test_masked_degenerate_sequences_are_zero():
  z = jnp.ones((5, 4))
  h, hn = entropy.masked_matrix_entropy(z, jnp.array([True, False, False, False, False]))
  assert float(h) == 0.0 and float(hn) == 0.0
  h, _ = entropy.masked_matrix_entropy(z, jnp.zeros((5,), bool))
  assert float(h) == 0.0


def test_prompt_entropy_all_layers_vmapped_and_jitted():
  rng = np.random.default_rng(5)
  l1, b, t, d = 3, 2, 9, 6
  hidden = rng.normal(size=(l1, b, t, d)) * np.arange(1, l1 + 1)[:, None, None, None]
  mask = rng.random((b, t)) < 0.7
  mask[:, :3] = True
  fn = jax.jit(entropy.prompt_entropy, static_argnums=(2, 3))
  h, hn = fn(jnp.asarray(hidden, jnp.float32), jnp.asarray(mask), 1.0, True)
  assert h.shape == hn.shape == (l1, b)
  for layer in range(l1):
    for seq in range(b):
      ref = _ref_entropy(hidden[layer, seq][mask[seq]])
      np.testing.assert_allclose(h[layer, seq], ref, rtol=3e-4, atol=3e-4)
      np.testing.assert_allclose(hn[layer, seq], ref / np.log(min(mask[seq].sum(), d)), rtol=3e-4, atol=3e-4)


def test_covariance_entropy_equals_centred_gram_entropy():
  rng = np.random.default_rng(6)
  x = _low_rankish(rng, 11, 7)
  s2 = jnp.asarray(x.T @ x, jnp.float32)
  s1 = jnp.asarray(x.sum(0), jnp.float32)
  for alpha in (0.5, 1.0, 2.0):
    h, hn = entropy.covariance_entropy(s2, s1, 11, alpha)
    xc = x - x.mean(0)
    ref = _ref_entropy(xc, alpha, normalize=False)
    np.testing.assert_allclose(h, ref, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(hn, ref / np.log(7), rtol=1e-3, atol=1e-3)


def test_nonfinite_layers_names_the_layer():
  hidden = jnp.zeros((4, 2, 3, 5))
  assert not np.any(entropy.nonfinite_layers(hidden))
  hidden = hidden.at[2, 1, 0, 3].set(jnp.nan).at[3, 0, 2, 0].set(jnp.inf)
  flags = jax.jit(entropy.nonfinite_layers)(hidden)
  np.testing.assert_array_equal(flags, [False, False, True, True])
  with pytest.raises(FloatingPointError, match=r"\[2, 3\]"):
    entropy.check_finite(flags)
  # A NaN at a masked-out (padding) position is ignored when a mask is given.
  mask = jnp.ones((2, 3), bool).at[0, 2].set(False)
  np.testing.assert_array_equal(entropy.nonfinite_layers(hidden, mask), [False, False, True, False])


def test_prompt_entropy_bucketed_compaction_is_exact():
  # Kept counts per batch pick different rungs of the ladder; results equal the uncompacted computation.
  rng = np.random.default_rng(11)
  l1, b, t, d = 2, 3, 40, 48
  assert entropy.bucket_sizes(t, d) == (16, 24, 32, 40)
  assert entropy.bucket_sizes(700, 576)[-2:] == (576, 700)  # T > D: last rung keeps the D×D covariance
  hidden = jnp.asarray(rng.normal(size=(l1, b, t, d)), jnp.float32)
  fn = jax.jit(entropy.prompt_entropy, static_argnums=(2, 3, 4))
  for counts in ((3, 9, 14), (20, 2, 5), (40, 31, 0)):
    mask = np.zeros((b, t), bool)
    for row, n in enumerate(counts):
      mask[row, rng.choice(t, n, replace=False)] = True
    got = fn(hidden, jnp.asarray(mask), 1.0, True, None)
    want = fn(hidden, jnp.asarray(mask), 1.0, True, (t,))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="buckets"):
    entropy.prompt_entropy(hidden, jnp.asarray(mask), buckets=(8, 16))
