"""Repetition loops in generated answers: finding them, and cutting an answer after the loop's first block.

Place in the pipeline: the self-distillation stage (`layerwave.data.distill`) cuts the target's answers with
it. A small model often ends an answer by repeating a phrase until its token budget runs out; training a
draft on hundreds of copies of one phrase teaches it little.

What counts as a loop: some block of p tokens (1 <= p <= `max_period`) repeated back to back, i.e. a stretch
`x[s : s + n]` with `x[i] == x[i + p]` throughout, covering n >= `min_repeats` * p tokens and n >= `min_tokens`
tokens (a partial last repeat counts). For each p, the stretches are found at once from the running count of
mismatches `x[i] != x[i + p]` (a window of n - p zero mismatches). The earliest stretch wins, and at that start
the smallest period (the fundamental block, not a multiple of it). The answer is cut after the block's first
occurrence, `x[: s + p]`, so the text says it once. A loop that starts mid-block (the repeated block is a
rotation of the phrase, e.g. "...is 5. The answer is 5. The answer is 5.") starts where the repetition does.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["cut_loop", "find_loop"]


def find_loop(tokens: Sequence[int], max_period: int = 64, min_repeats: int = 3,
              min_tokens: int = 32) -> tuple[int, int] | None:
  """Finds the earliest repetition loop in a token sequence (the module docstring says what a loop is).

  Args:
    tokens: the answer's token ids.
    max_period: the longest repeated block considered (0 = never a loop).
    min_repeats: the loop must cover at least this many periods (a partial last one counts).
    min_tokens: ...and at least this many tokens.

  Returns:
    `(start, period)`: `tokens[start : start + period]` is the block's first occurrence. None if no loop.
  """
  x = np.asarray(tokens, np.int64)
  n = x.shape[0]
  best = None
  for p in range(1, max_period + 1):
    need = max(min_repeats * p, min_tokens, p + 1)  # tokens the periodic stretch must cover
    if need > n:
      break  # `need` grows with p
    if best is not None and best[0] == 0:
      break
    # equal[i]: x[i] == x[i + p]. A stretch x[s : s + m + p] has period p iff equal[s : s + m] is all True.
    mismatches = np.concatenate([[0], np.cumsum(x[p:] != x[:-p])])
    m = need - p
    starts = np.flatnonzero(mismatches[m:] == mismatches[:-m])
    if starts.size and (best is None or starts[0] < best[0]):
      best = (int(starts[0]), p)
  return best


def cut_loop(tokens: Sequence[int], max_period: int = 64, min_repeats: int = 3,
             min_tokens: int = 32) -> tuple[list[int], bool]:
  """`tokens` cut after the first occurrence of its earliest loop's block; and whether it was cut."""
  loop = find_loop(tokens, max_period, min_repeats, min_tokens) if max_period else None
  if loop is None:
    return list(tokens), False
  return list(tokens[:loop[0] + loop[1]]), True
