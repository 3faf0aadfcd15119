"""layerwave.sampling: the processed distribution against a float64 numpy reference, and draws from it."""

import dataclasses

import jax
import numpy as np
import pytest
from scipy import stats

from layerwave import sampling


def _reference_filter(logits, temperature, top_k, top_p):
  x = logits.astype(np.float64) / temperature
  if top_k:
    x = np.where(x < np.sort(x)[-top_k], -np.inf, x)
  p = np.exp(x - x.max())
  p /= p.sum()
  order = np.argsort(-p, kind="stable")
  keep = np.zeros_like(p, bool)
  mass = 0.0
  for i in order:
    if mass >= top_p:
      break
    keep[i] = True
    mass += p[i]
  p = np.where(keep, p, 0)
  return p / p.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                                     (1.0, 20, 0.5)])
def test_filters_match_reference(temperature, top_k, top_p):
  logits = np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32) * 3
  settings = sampling.SamplingParams(temperature, top_k, top_p)
  got = np.exp(np.asarray(sampling.log_probs(logits, settings)))
  for row in range(3):
    np.testing.assert_allclose(got[row], _reference_filter(logits[row], temperature, top_k, top_p),
                               atol=1e-5)


def test_filtered_tokens_are_minus_infinity_and_top_p_keeps_ties_at_the_cut():
  logits = np.array([[3.0, 1.0, 1.0, 0.0, -2.0]], np.float32)
  lp = np.asarray(sampling.log_probs(logits, sampling.SamplingParams(1.0, top_k=2)))
  assert np.isneginf(lp[0, 3:]).all() and np.isfinite(lp[0, :3]).all()  # the tie at the k-th value stays
  p = np.exp(np.asarray(sampling.log_probs(logits, sampling.SamplingParams(1.0, top_p=0.5))))
  assert p[0, 0] == pytest.approx(1.0)  # the first token alone carries more than half the mass
  # p = [0.75, 0.10, 0.10, 0.04, 0.01]: 0.8 is reached inside the tie, and the tie is kept whole.
  p = np.exp(np.asarray(sampling.log_probs(logits, sampling.SamplingParams(1.0, top_p=0.8))))
  assert (p[0, :3] > 0).all() and (p[0, 3:] == 0).all() and p[0, 1] == p[0, 2]


def test_greedy_sample_is_the_argmax_whatever_the_key():
  logits = np.random.default_rng(1).normal(size=(4, 7, 30)).astype(np.float32)
  greedy = sampling.SamplingParams()
  assert greedy.greedy
  for seed in range(3):
    got = np.asarray(sampling.sample(logits, jax.random.key(seed), greedy))
    np.testing.assert_array_equal(got, logits.argmax(-1))
    assert got.dtype == np.int32


def test_draws_follow_the_processed_distribution():
  logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)
  settings = sampling.SamplingParams(temperature=0.8, top_k=4)
  n = 20_000
  draws = np.asarray(sampling.sample(np.broadcast_to(logits, (n, 6)), jax.random.key(0), settings))
  expected = _reference_filter(logits, 0.8, 4, 1.0)
  counts = np.bincount(draws, minlength=6)
  assert counts[4:].sum() == 0  # outside the top 4: never drawn
  assert stats.chisquare(counts[:4], n * expected[:4]).pvalue > 1e-3


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be a non-negative integer"),
    (dict(top_k=2.5), "top_k must be a non-negative integer"),
])
def test_bad_settings(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sampling.SamplingParams(**kwargs)


def test_settings_are_hashable_values():  # static arguments of the jitted loops: equal values, one compile
  a, b = sampling.SamplingParams(0.7, 5, 0.9), sampling.SamplingParams(0.7, 5, 0.9)
  assert a == b and hash(a) == hash(b) and a != dataclasses.replace(a, top_p=0.8)
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.temperature = 1.0  # pytype: disable=not-writable
