"""Tests for layerwave.analysis.cka: properties, float64 reference, minibatch estimator, masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layerwave.analysis import cka


def _ref_cka(x, y):
  """Float64 HSIC-form reference: centred Grams, biased HSIC ratio."""
  x = np.asarray(x, np.float64)
  y = np.asarray(y, np.float64)
  n = x.shape[0]
  h = np.eye(n) - 1.0 / n
  k = h @ x @ x.T @ h
  l = h @ y @ y.T @ h
  return float((k * l).sum() / np.sqrt((k * k).sum() * (l * l).sum()))


def _ref_unbiased_hsic(x, y):
  n = x.shape[0]
  k = x @ x.T
  l = y @ y.T
  np.fill_diagonal(k, 0)
  np.fill_diagonal(l, 0)
  one = np.ones(n)
  return (np.trace(k @ l) + (one @ k @ one) * (one @ l @ one) / ((n - 1) * (n - 2))
          - 2.0 / (n - 2) * one @ k @ l @ one) / (n * (n - 3))


def _pair(seed, n=30, dx=8, dy=5):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, dx)) + 2.0
  y = x[:, :dy] @ rng.normal(size=(dy, dy)) + 0.5 * rng.normal(size=(n, dy))
  return x, y


def test_linear_cka_matches_reference_and_properties():
  x, y = _pair(0)
  xj, yj = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
  val = float(cka.linear_cka(xj, yj))
  np.testing.assert_allclose(val, _ref_cka(x, y), rtol=1e-5)
  assert 0.0 <= val <= 1.0
  np.testing.assert_allclose(cka.linear_cka(xj, xj), 1.0, rtol=1e-6)
  np.testing.assert_allclose(cka.linear_cka(yj, xj), val, rtol=1e-6)  # symmetric
  q, _ = np.linalg.qr(np.random.default_rng(1).normal(size=(8, 8)))
  np.testing.assert_allclose(cka.linear_cka(jnp.asarray(x @ q * 7.5, jnp.float32), yj), val, rtol=1e-5)
  np.testing.assert_allclose(cka.linear_cka(xj, yj * 0.01 + 3.0), val, rtol=1e-5)


def test_linear_cka_range_on_random_pairs():
  rng = np.random.default_rng(2)
  for _ in range(5):
    x = rng.normal(size=(12, 4))
    y = rng.normal(size=(12, 9))
    v = float(cka.linear_cka(jnp.asarray(x), jnp.asarray(y)))
    assert 0.0 <= v <= 1.0 + 1e-6
    np.testing.assert_allclose(v, _ref_cka(x, y), rtol=1e-5)


def test_linear_cka_mask_equals_subset():
  x, y = _pair(3)
  mask = np.random.default_rng(3).random(30) < 0.5
  got = cka.linear_cka(jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask))
  np.testing.assert_allclose(got, _ref_cka(x[mask], y[mask]), rtol=1e-5)


@pytest.mark.parametrize("n,d", [(6, 10), (25, 4)])  # Gram path and feature path
def test_all_pairs_cka_matches_pairwise_reference(n, d):
  rng = np.random.default_rng(n)
  base = rng.normal(size=(n, d))
  hidden = np.stack([base + s * rng.normal(size=(n, d)) for s in (0.0, 0.3, 1.0, 3.0)])
  mask = np.ones(n, bool)
  mask[[1, 4]] = False
  got = np.asarray(jax.jit(cka.all_pairs_cka)(jnp.asarray(hidden, jnp.float32), jnp.asarray(mask)))
  ref = np.array([[_ref_cka(a[mask], b[mask]) for b in hidden] for a in hidden])
  np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(got, got.T)
  np.testing.assert_allclose(np.diag(got), 1.0, rtol=1e-6)


def test_unbiased_hsic_matches_reference_and_mask():
  x, y = _pair(4, n=11)
  hidden = np.stack([x[:, :5], y])
  hsic, valid = cka.unbiased_hsic_all_pairs(jnp.asarray(hidden, jnp.float32))
  assert bool(valid)
  ref = np.array([[_ref_unbiased_hsic(a, b) for b in hidden] for a in hidden])
  np.testing.assert_allclose(hsic, ref, rtol=1e-4, atol=1e-4)
  # Padding rows are excluded: a masked batch equals the unmasked subset.
  mask = np.ones(11, bool)
  mask[[0, 5, 6]] = False
  padded = hidden.copy()
  padded[:, ~mask] = 1e3  # garbage at padding
  hsic_m, _ = cka.unbiased_hsic_all_pairs(jnp.asarray(padded, jnp.float32), jnp.asarray(mask))
  ref_m = np.array([[_ref_unbiased_hsic(a[mask], b[mask]) for b in hidden] for a in hidden])
  np.testing.assert_allclose(hsic_m, ref_m, rtol=1e-4, atol=1e-4)


def test_unbiased_hsic_needs_four_tokens():
  hidden = jnp.asarray(np.random.default_rng(5).normal(size=(2, 6, 3)), jnp.float32)
  hsic, valid = cka.unbiased_hsic_all_pairs(hidden, jnp.array([True, True, True, False, False, False]))
  assert not bool(valid)
  np.testing.assert_array_equal(hsic, 0.0)
  _, valid = cka.unbiased_hsic_all_pairs(hidden, jnp.array([True, True, True, True, False, False]))
  assert bool(valid)


def test_minibatch_cka_close_to_exact_on_large_n():
  rng = np.random.default_rng(6)
  n, d, m = 2048, 6, 128
  base = rng.normal(size=(n, d)) + 4.0
  hidden = np.stack([base, base @ rng.normal(size=(d, d)), base + rng.normal(size=(n, d)),
                     rng.normal(size=(n, d))]).astype(np.float32)
  exact = np.asarray(cka.all_pairs_cka(jnp.asarray(hidden)))
  batches = jnp.asarray(hidden).reshape(4, n // m, m, d).transpose(1, 0, 2, 3)
  hsic, valid = jax.vmap(cka.unbiased_hsic_all_pairs)(batches)
  assert bool(valid.all())
  approx = np.asarray(cka.cka_from_hsic(hsic.sum(0)))
  np.testing.assert_allclose(approx, exact, atol=0.03)
  np.testing.assert_allclose(np.diag(approx), 1.0, rtol=1e-5)
