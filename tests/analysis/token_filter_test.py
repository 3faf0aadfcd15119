"""Tests for layerwave.analysis.token_filter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layerwave.analysis import token_filter


def _np_entropy(logits, temperature=1.0):
  x = np.asarray(logits, np.float64) / temperature
  x = x - x.max(-1, keepdims=True)
  p = np.exp(x)
  p /= p.sum(-1, keepdims=True)
  return -(p * np.log(np.where(p > 0, p, 1.0))).sum(-1)


def test_token_entropy_matches_numpy():
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 11)) * 3, jnp.bfloat16)
  for temp in (1.0, 0.7):
    got = token_filter.token_entropy(logits, temp)
    assert got.dtype == jnp.float32 and got.shape == (2, 5)
    np.testing.assert_allclose(got, _np_entropy(np.asarray(logits.astype(jnp.float32)), temp), rtol=1e-5, atol=1e-5)


def test_token_entropy_extremes():
  v = 7
  uniform = token_filter.token_entropy(jnp.zeros((v,)))
  np.testing.assert_allclose(uniform, np.log(v), rtol=1e-6)
  peaked = token_filter.token_entropy(jnp.array([0.0, -1e30, -jnp.inf]))
  assert float(peaked) == 0.0
  with pytest.raises(ValueError):
    token_filter.token_entropy(jnp.zeros((3,)), temperature=0.0)


def test_masked_percentile_matches_numpy():
  rng = np.random.default_rng(1)
  vals = rng.normal(size=(3, 9))
  mask = rng.random((3, 9)) < 0.6
  for q in (0, 13, 50, 87.5, 100):
    got = token_filter.masked_percentile(jnp.asarray(vals), jnp.asarray(mask), q)
    np.testing.assert_allclose(got, np.percentile(vals[mask], q), rtol=1e-5, atol=1e-6)
  assert np.isnan(token_filter.masked_percentile(jnp.asarray(vals), jnp.zeros((3, 9), bool), 50))


def test_filter_threshold_and_percentile():
  ent = jnp.array([[0.1, 0.5, 2.0, 3.0], [1.0, 0.0, 4.0, 0.2]])
  mask = jnp.array([[True, True, True, False], [True, True, True, True]])
  keep = token_filter.entropy_filter_mask(ent, mask, threshold=0.5)
  np.testing.assert_array_equal(keep, [[False, True, True, False], [True, False, True, False]])
  keep = token_filter.entropy_filter_mask(ent, mask, percentile=50)
  ref = np.percentile(np.asarray(ent)[np.asarray(mask)], 50)
  np.testing.assert_array_equal(keep, np.asarray(mask) & (np.asarray(ent) >= ref))
  assert not bool(keep[0, 3])  # masked position is never kept


def test_filter_jits_and_argument_errors():
  ent = jnp.arange(8.0).reshape(2, 4)
  mask = jnp.ones((2, 4), bool)
  jitted = jax.jit(lambda e, m: token_filter.entropy_filter_mask(e, m, percentile=75))
  np.testing.assert_array_equal(jitted(ent, mask), np.asarray(ent) >= np.percentile(np.arange(8.0), 75))
  with pytest.raises(ValueError, match="exactly one"):
    token_filter.entropy_filter_mask(ent, mask)
  with pytest.raises(ValueError, match="exactly one"):
    token_filter.entropy_filter_mask(ent, mask, threshold=1.0, percentile=50)
  with pytest.raises(ValueError, match="percentile"):
    token_filter.entropy_filter_mask(ent, mask, percentile=101)


def test_filter_empty_kept_set_is_an_error():
  ent = jnp.ones((2, 3))
  with pytest.raises(ValueError, match="kept no token"):
    token_filter.entropy_filter_mask(ent, jnp.ones((2, 3), bool), threshold=5.0)
  with pytest.raises(ValueError, match="kept no token"):
    token_filter.entropy_filter_mask(ent, jnp.zeros((2, 3), bool), percentile=50)
  with pytest.raises(ValueError, match="kept no token"):
    token_filter.check_kept(jnp.zeros((4,), bool))


def test_percentile_threshold_calibration_pass():
  rng = np.random.default_rng(2)
  ents = [rng.random((2, 5)) for _ in range(3)]
  masks = [rng.random((2, 5)) < 0.7 for _ in range(3)]
  thr = token_filter.percentile_threshold(ents, masks, q=40)
  allv = np.concatenate([e[m] for e, m in zip(ents, masks)])
  assert thr == pytest.approx(np.percentile(allv, 40))
  with pytest.raises(ValueError, match="kept no token"):
    token_filter.percentile_threshold([np.ones((1, 2))], [np.zeros((1, 2), bool)])


@pytest.mark.parametrize("chunk", [1, 5, 7, 64])
def test_entropy_from_hidden_in_chunks_equals_the_full_logits(chunk):
  """Any chunking (dividing B*T or not) gives the entropy and argmax of the full [B, T, V] logits."""
  rng = np.random.default_rng(3)
  h = jnp.asarray(rng.normal(size=(3, 7, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(8, 50)) * 2, jnp.float32)
  logits_fn = lambda x: x @ w  # noqa: E731
  full = h @ w
  ent, top = token_filter.entropy_from_hidden(h, logits_fn, temperature=0.7, chunk=chunk, top1=True)
  np.testing.assert_allclose(ent, token_filter.token_entropy(full, 0.7), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(top, np.argmax(np.asarray(full), -1))
  assert ent.shape == top.shape == (3, 7) and top.dtype == jnp.int32
  np.testing.assert_allclose(token_filter.entropy_from_hidden(h, logits_fn, chunk=chunk),
                             token_filter.token_entropy(full), rtol=1e-5, atol=1e-6)


def test_entropy_from_hidden_never_builds_the_full_logits():
  """The compiled computation holds one chunk's logits, not [B, T, V] (V = 262,144 as Gemma 3)."""
  h = jax.ShapeDtypeStruct((4, 512, 16), jnp.float32)
  w = jnp.zeros((16, 262144), jnp.float32)
  fn = jax.jit(lambda x: token_filter.entropy_from_hidden(x, lambda y: y @ w, chunk=128))
  text = fn.lower(h).as_text()
  assert "128x262144" in text and "2048x262144" not in text and "4x512x262144" not in text
