"""Tests for layerwave.analysis.compartments: DP optimality and block recovery."""

import itertools

import numpy as np
import pytest

from layerwave.analysis import compartments


def _block_matrix(sizes, inside=0.9, outside=0.2, noise=0.0, seed=0):
  n = sum(sizes)
  c = np.full((n, n), outside)
  start = 0
  for s in sizes:
    c[start:start + s, start:start + s] = inside
    start += s
  if noise:
    e = np.random.default_rng(seed).normal(scale=noise, size=(n, n))
    c = c + (e + e.T) / 2
  np.fill_diagonal(c, 1.0)
  return c


def _brute_force(c, g, beta, weighting):
  """Score every segmentation into g contiguous blocks by direct definition."""
  n = c.shape[0]
  best, best_blocks = -np.inf, None
  for cuts in itertools.combinations(range(1, n), g - 1):
    edges = (0,) + cuts + (n,)
    blocks = list(zip(edges[:-1], edges[1:]))
    total = 0.0
    for s, e in blocks:
      if e - s >= 2:
        for i in range(s, e):
          excess = [c[i, j] - beta for j in range(s, e) if j != i]
          total += np.sum(excess) if weighting == "pairs" else np.mean(excess)
    if total > best + 1e-12:
      best, best_blocks = total, tuple(blocks)
  return best, best_blocks


@pytest.mark.parametrize("g", [1, 2, 3, 4])
@pytest.mark.parametrize("beta", [0.0, None])
@pytest.mark.parametrize("weighting", ["pairs", "layers"])
def test_dp_equals_brute_force(g, beta, weighting):
  rng = np.random.default_rng(g)
  a = rng.random((8, 8))
  c = (a + a.T) / 2
  np.fill_diagonal(c, 1.0)
  seg = compartments.segment_fixed(c, g, baseline=beta, weighting=weighting)
  ref_score, _ = _brute_force(c, g, seg.baseline, weighting)
  assert seg.score == pytest.approx(ref_score)
  assert seg.num_blocks == g
  # Blocks tile [0, n) contiguously.
  assert seg.blocks[0][0] == 0 and seg.blocks[-1][1] == 8
  assert all(b[1] == nb[0] for b, nb in zip(seg.blocks, seg.blocks[1:]))


def test_recovers_block_diagonal_structure_with_fixed_g():
  c = _block_matrix([4, 6, 3, 5], noise=0.05)
  seg = compartments.segment_fixed(c, 4)
  assert seg.blocks == ((0, 4), (4, 10), (10, 13), (13, 18))
  assert seg.boundaries == (4, 10, 13)


def test_automatic_g_recovers_blocks_and_offset():
  c = _block_matrix([5, 3, 7], noise=0.05, seed=1)
  seg = compartments.segment(c, offset=1)
  assert seg.blocks == ((1, 6), (6, 9), (9, 16))
  assert len(seg.scores_by_g) == 15
  np.testing.assert_array_equal(compartments.labels_from_blocks(seg.blocks, 15, offset=1),
                                [0] * 5 + [1] * 3 + [2] * 7)


def test_whole_matrix_block_scores_zero_with_default_baseline():
  c = _block_matrix([3, 4], noise=0.1, seed=2)
  assert compartments.segment_fixed(c, 1).score == pytest.approx(0.0, abs=1e-9)


def test_outlier_layer_becomes_a_singleton():
  c = _block_matrix([1, 9], inside=0.9, outside=0.1)
  seg = compartments.segment(c)
  assert seg.blocks == ((0, 1), (1, 10))


def test_min_blocks_and_penalty():
  c = _block_matrix([6, 6], noise=0.02)
  assert compartments.segment(c).num_blocks == 2
  assert compartments.segment(c, min_blocks=3).num_blocks == 3
  assert compartments.segment(c, penalty=100.0).num_blocks == 1


def test_argument_errors():
  with pytest.raises(ValueError, match="square"):
    compartments.segment(np.zeros((3, 4)))
  with pytest.raises(ValueError, match="num_blocks"):
    compartments.segment_fixed(np.eye(3), 4)
  with pytest.raises(ValueError, match="NaN"):
    compartments.segment(np.full((2, 2), np.nan))
  with pytest.raises(ValueError, match="weighting"):
    compartments.segment(np.eye(3), weighting="nope")
  with pytest.raises(ValueError, match="penalty"):
    compartments.segment(np.eye(3), penalty=-1.0)
