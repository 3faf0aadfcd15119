"""The draft vocabulary: the V_d most frequent target tokens among training targets (METHOD §7).

EAGLE-3 drafts predict over a reduced vocabulary and carry two tables that map it to the target's:
`d2t[i] = target_id(i) - i` (an offset per draft id) and `t2d` (a boolean mask over the target vocabulary).
Draft ids are the chosen target ids sorted ascending, so `target_id = i + d2t[i]`.

Legend (`layerwave.axes`): V target vocabulary, V_d draft vocabulary.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Any

import numpy as np


def count_tokens(examples: Iterable[Mapping[str, Any]], vocab_size: int,
                 assistant_only: bool = True) -> np.ndarray:
  """Token frequencies `[V]` over the examples' assistant tokens (all tokens if not assistant_only)."""
  counts = np.zeros(vocab_size, np.int64)
  for ex in examples:
    ids = np.asarray(ex["input_ids"]).reshape(-1)
    if assistant_only and "assistant_mask" in ex:
      ids = ids[np.asarray(ex["assistant_mask"]).reshape(-1)[:ids.shape[0]].astype(bool)]
    counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
  return counts


def build_vocab(counts: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
  """Picks the `size` most frequent tokens (ties and unseen tokens by lower id).

  Args:
    counts: `[V]` token frequencies.
    size: V_d, at most V.

  Returns:
    (d2t `[V_d]` int32 offsets, t2d `[V]` bool mask).
  """
  v = counts.shape[0]
  if not 1 <= size <= v:
    raise ValueError(f"Draft vocabulary size {size} must be in [1, {v}] (the target's vocabulary).")
  if counts.sum() == 0:
    raise ValueError("No training target tokens were counted: the data has no assistant tokens "
                     "left (check the data source and max_length).")
  order = np.lexsort((np.arange(v), -counts))  # by count descending, then id ascending
  chosen = np.sort(order[:size])
  d2t = (chosen - np.arange(size)).astype(np.int32)
  t2d = np.zeros(v, bool)
  t2d[chosen] = True
  return d2t, t2d


def check_vocab(d2t: np.ndarray, t2d: np.ndarray) -> None:
  """Raises if the two tables disagree (they must describe the same sorted id set)."""
  d2t, t2d = np.asarray(d2t), np.asarray(t2d)
  ids = np.arange(d2t.shape[0]) + d2t
  if np.any(np.diff(ids) <= 0) or ids.min() < 0 or ids.max() >= t2d.shape[0]:
    raise ValueError("d2t does not map draft ids to strictly increasing target ids within the "
                     "target vocabulary.")
  if not np.array_equal(np.flatnonzero(t2d), ids):
    raise ValueError("t2d and d2t describe different token sets.")
