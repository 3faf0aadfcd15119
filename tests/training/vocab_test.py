"""Draft vocabulary: most frequent assistant tokens, d2t offsets and t2d mask consistent."""

import numpy as np
import pytest

from layerwave.training import vocab


def test_most_frequent_tokens_sorted_with_consistent_maps():
  examples = [{"input_ids": np.array([5, 5, 5, 7, 9, 9, 1]),
               "assistant_mask": np.array([1, 1, 1, 1, 1, 1, 0])},
              {"input_ids": np.array([3, 9, 1, 1]), "assistant_mask": np.array([0, 1, 1, 1])}]
  counts = vocab.count_tokens(examples, 12)
  assert counts[5] == 3 and counts[9] == 3 and counts[1] == 2 and counts[3] == 0
  d2t, t2d = vocab.build_vocab(counts, 3)
  np.testing.assert_array_equal(np.arange(3) + d2t, [1, 5, 9])
  np.testing.assert_array_equal(np.flatnonzero(t2d), [1, 5, 9])
  vocab.check_vocab(d2t, t2d)
  d2t_all, _ = vocab.build_vocab(counts, 12)
  np.testing.assert_array_equal(d2t_all, 0)  # full vocabulary: identity


def test_errors():
  with pytest.raises(ValueError, match=r"must be in \[1, 4\]"):
    vocab.build_vocab(np.ones(4), 5)
  with pytest.raises(ValueError, match="no assistant tokens"):
    vocab.build_vocab(np.zeros(4), 2)
  with pytest.raises(ValueError, match="different token sets"):
    vocab.check_vocab(np.array([0, 1]), np.array([True, True, False, False]))
