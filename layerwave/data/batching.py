"""Fixed-shape batches: the last stage of the data pipeline (random-access examples → numpy batches).

`BatchIterator` walks a random-access source (a tfds `ArrayRecordDataSource` from
`layerwave.data.tfds_builders`, or any sequence of dicts with `input_ids` and optionally
`assistant_mask`) in a seeded order and yields `Batch`es of fixed shape [B, T], so a jitted step
compiles once. Every epoch is a fresh permutation drawn from `(seed, epoch)`; the iterator's
`Position(epoch, step)` names the next global batch, so saving it and passing it back resumes the
stream exactly (`BatchIterator(..., position=saved)`).

Length buckets (`widths`): instead of padding every sequence to `seq_len`, each epoch groups the permuted
examples by the smallest width w >= their length (`seq_len` is always the last width) and cuts each group
into batches of floor(`batch_size * seq_len / w`) rows (rounded down to a multiple of the processes and of
`row_multiple`, the devices), so every
batch holds about the same number of token slots (exactly, for widths that divide them) and a jitted step
compiles once per width; the batches of all widths are then shuffled together. A width too few
examples fall into for one batch is merged into the next one up (else they would never be visited). Every example
is visited once per epoch (less each width's last partial batch under `drop_remainder`), and fewer slots are
padding when lengths vary (self-distilled answers: 228 of 512 on average).

Multi-host: `batch_size` is the global batch. Every process draws the same permutation, cuts it into
global batches of `batch_size` examples, and keeps rows `[p * B/P, (p+1) * B/P)` of each, where
p = process_index and P = process_count; all processes stay in lock step and share one `Position`.

Legend (`layerwave.axes`): B batch, T tokens.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Mapping, Sequence

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Position:
  """Where a stream stands: the next batch is global batch `step` of epoch `epoch`."""
  epoch: int = 0
  step: int = 0

  def to_dict(self) -> dict[str, int]:
    return {"epoch": self.epoch, "step": self.step}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Position":
    return cls(epoch=int(d["epoch"]), step=int(d["step"]))


@dataclasses.dataclass(frozen=True)
class Batch:
  """One process's share of a global batch (B = batch_size / process_count rows, T = seq_len).

  Attributes:
    input_ids: int32 [B, T], right-padded with `pad_id`.
    attention_mask: int32 [B, T], 1 on real tokens.
    assistant_mask: int32 [B, T], 1 on assistant tokens (all real tokens for plain text), 0 on padding.
    example_mask: int32 [B], 0 on the filler rows of a last partial batch (`drop_remainder=False`).
    indices: int64 [B], the examples' indices in the source (-1 on filler rows).
    position: the stream position of this batch (resume from `BatchIterator.position` instead).
  """
  input_ids: np.ndarray
  attention_mask: np.ndarray
  assistant_mask: np.ndarray
  example_mask: np.ndarray
  indices: np.ndarray
  position: Position

  def arrays(self) -> dict[str, np.ndarray]:
    """The [B, T] / [B] arrays as a dict, e.g. for `jax.device_put`."""
    return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
            "assistant_mask": self.assistant_mask, "example_mask": self.example_mask}


def epoch_order(num_examples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
  """The example order of one epoch: a permutation drawn from `(seed, epoch)`, or identity.

  Args:
    num_examples: size of the source.
    seed: stream seed.
    epoch: epoch number (each epoch gets a different permutation).
    shuffle: False gives 0, 1, 2, ...

  Returns:
    int64 [num_examples].
  """
  if not shuffle:
    return np.arange(num_examples, dtype=np.int64)
  return np.random.default_rng([seed, epoch]).permutation(num_examples).astype(np.int64)


class BatchIterator:
  """Deterministic, resumable iterator of fixed-shape batches over a random-access source.

  Example:
    >>> it = BatchIterator(ds.source("train"), batch_size=8, seq_len=512, pad_id=tok.pad_token_id)
    >>> batch = next(it); saved = it.position          # ... later, after a restart:
    >>> it = BatchIterator(ds.source("train"), batch_size=8, seq_len=512, pad_id=..., position=saved)
  """

  def __init__(self, source: Sequence[Mapping[str, Any]], *, batch_size: int, seq_len: int,
               pad_id: int, seed: int = 0, shuffle: bool = True, drop_remainder: bool = True,
               num_epochs: int | None = None, position: Position | None = None,
               process_index: int | None = None, process_count: int | None = None,
               widths: Sequence[int] = (), row_multiple: int = 1):
    """Creates the iterator.

    Args:
      source: random-access examples (`len`, `[i]`, optionally `__getitems__`); each a mapping with
        `input_ids` [T_i] and optionally `assistant_mask` [T_i] (default all ones).
      batch_size: global batch size, divisible by `process_count`.
      seq_len: T; longer examples are cut to their first `seq_len` tokens.
      pad_id: token id for padding (e.g. `tokenizer.pad_token_id`).
      seed: seed of the per-epoch permutations.
      shuffle: False walks the source in order.
      drop_remainder: drop the last incomplete global batch of each epoch; if False, it is filled
        with padding rows marked 0 in `example_mask`.
      num_epochs: stop after this many epochs; None repeats forever.
      position: where to start (from a previous iterator's `position`); default the beginning.
      process_index: this process; default `jax.process_index()`.
      process_count: number of processes; default `jax.process_count()`.
      widths: length buckets (see the module docstring); empty = every batch is [batch_size, seq_len].
        Each width must be <= seq_len; its batches hold as many rows as fit batch_size * seq_len slots, rounded
        down to a multiple of `process_count` and `row_multiple`. Lengths come from the source's `lengths()` if
        it has one, else from one pass over it.
      row_multiple: the bucket batches' global rows are a multiple of this too (pass the mesh's 'data' axis,
        `sharding.data_size(mesh)`, so every width splits over the devices); fixed batches keep `batch_size`.

    Raises:
      ValueError: empty source, bad sizes or widths, or a source smaller than one batch with drop_remainder.
    """
    self._source = source
    self._n = len(source)
    self._process_index = jax.process_index() if process_index is None else int(process_index)
    self._process_count = jax.process_count() if process_count is None else int(process_count)
    if self._n == 0:
      raise ValueError("The data source is empty; build it from a non-empty source.")
    if batch_size <= 0 or seq_len <= 0:
      raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
    if not 0 <= self._process_index < self._process_count:
      raise ValueError(f"process_index {self._process_index} not in [0, {self._process_count})")
    if row_multiple < 1:
      raise ValueError(f"row_multiple must be >= 1, got {row_multiple}")
    if batch_size % self._process_count:
      raise ValueError(f"Global batch_size {batch_size} must be divisible by the process count "
                       f"{self._process_count}.")
    if drop_remainder and self._n < batch_size:
      raise ValueError(f"The source has {self._n} examples, fewer than one global batch of "
                       f"{batch_size}: lower batch_size or pass drop_remainder=False.")
    self._batch_size = batch_size
    self._local = batch_size // self._process_count
    self._seq_len = seq_len
    self._pad_id = int(pad_id)
    self._seed = seed
    self._shuffle = shuffle
    self._drop_remainder = drop_remainder
    self._num_epochs = num_epochs
    self._position = position or Position()
    self._order_epoch, self._order = -1, np.zeros(0, np.int64)
    self._widths, self._rows, self._bucket = (), {}, None
    self._row_multiple = math.lcm(self._process_count, int(row_multiple))
    if widths:
      self._init_buckets(widths)
    if self._position.step >= self.steps_per_epoch:
      raise ValueError(f"Position {self._position} is past the end of an epoch of "
                       f"{self.steps_per_epoch} batches (a different source, batch size or widths?).")
    self._plan_epoch, self._plan = -1, []

  def _init_buckets(self, widths: Sequence[int]) -> None:
    ws = sorted({int(w) for w in widths} | {self._seq_len})
    slots = self._batch_size * self._seq_len
    for w in ws:
      if not 0 < w <= self._seq_len:
        raise ValueError(f"Length bucket width {w} must be in [1, seq_len={self._seq_len}]; drop it from "
                         "the widths.")
      # As many rows as fit batch_size * seq_len slots, rounded down to a multiple of the processes (and of
      # row_multiple, the devices): a width that does not divide the slots (e.g. 384 of 4096) holds fewer.
      rows = slots // w
      self._rows[w] = rows - rows % self._row_multiple
      if self._rows[w] == 0:
        raise ValueError(f"Length bucket width {w} holds {rows} rows of batch_size x seq_len = {slots} slots, "
                         f"fewer than the {self._row_multiple} the processes / devices need: drop it from the "
                         "widths or raise batch_size.")
    bucket = np.searchsorted(np.asarray(ws), self.lengths())  # index into ws
    # A width with fewer examples than one batch would drop them every epoch: they join the next width
    # (without drop_remainder they fill one partial batch of their own width).
    for b in range(len(ws) - 1):
      if self._drop_remainder and (bucket == b).sum() < self._rows[ws[b]]:
        bucket[bucket == b] = b + 1
    used = sorted(set(bucket.tolist()))
    self._widths = tuple(ws[b] for b in used)
    self._bucket = np.searchsorted(np.asarray(used), bucket)  # index into self._widths
    self._bucket_steps = 0  # batches per epoch: fixed by the bucket sizes (read on every step)
    for b, w in enumerate(self._widths):
      full, rest = divmod(int((self._bucket == b).sum()), self._rows[w])
      self._bucket_steps += full + (1 if rest and not self._drop_remainder else 0)

  def lengths(self) -> np.ndarray:
    """Every example's length cut to seq_len: the source's `lengths()` if it has one, else one pass."""
    lengths = getattr(self._source, "lengths", None)
    if lengths is not None:
      n = np.asarray(lengths(), np.int64)
    else:
      n = np.asarray([np.asarray(ex["input_ids"]).size for start in range(0, self._n, 256)
                      for ex in self._fetch(range(start, min(start + 256, self._n)))], np.int64)
    return np.minimum(n, self._seq_len)

  def epoch_fill(self, epoch: int = 0) -> float:
    """The share of an epoch's token slots (global rows x width, summed over its batches) that hold real
    tokens: what the length buckets raise."""
    lengths = self.lengths()
    if self._widths:
      plan = self._epoch_plan(epoch)
    else:
      order = self._epoch_order(epoch)
      plan = [(order[i * self._batch_size:(i + 1) * self._batch_size], self._seq_len)
              for i in range(self.steps_per_epoch)]
    real = sum(int(lengths[idx].sum()) for idx, _ in plan)
    slots = sum((self._rows[w] if self._widths else self._batch_size) * w for _, w in plan)
    return real / max(slots, 1)

  @property
  def widths(self) -> tuple[int, ...]:
    """The length buckets' widths (empty: fixed [batch_size, seq_len] batches)."""
    return self._widths

  def rows(self, width: int) -> int:
    """Global rows of a batch of `width` tokens."""
    return self._rows[width] if self._widths else self._batch_size

  @property
  def steps_per_epoch(self) -> int:
    """Global batches per epoch."""
    if not self._widths:
      full, rest = divmod(self._n, self._batch_size)
      return full + (1 if rest and not self._drop_remainder else 0)
    return self._bucket_steps

  @property
  def position(self) -> Position:
    """Position of the next batch; pass it back to resume exactly."""
    return self._position

  def _epoch_order(self, epoch: int) -> np.ndarray:
    if epoch != self._order_epoch:
      self._order_epoch, self._order = epoch, epoch_order(self._n, self._seed, epoch, self._shuffle)
    return self._order

  def _fetch(self, indices: Sequence[int]) -> list[Mapping[str, Any]]:
    getitems = getattr(self._source, "__getitems__", None)
    if getitems is not None:
      return list(getitems([int(i) for i in indices]))
    return [self._source[int(i)] for i in indices]

  def __iter__(self) -> Iterator[Batch]:
    return self

  def __next__(self) -> Batch:
    pos = self._position
    if self._num_epochs is not None and pos.epoch >= self._num_epochs:
      raise StopIteration
    if self._widths:
      indices, width = self._epoch_plan(pos.epoch)[pos.step]
      local = self._rows[width] // self._process_count
      indices = indices[self._process_index * local:(self._process_index + 1) * local]
    else:
      order = self._epoch_order(pos.epoch)
      start = pos.step * self._batch_size + self._process_index * self._local
      indices, width, local = order[start:start + self._local], self._seq_len, self._local
    batch = self.collate(self._fetch(indices), indices, pos, shape=(local, width))
    step = pos.step + 1
    self._position = Position(pos.epoch + 1, 0) if step >= self.steps_per_epoch else Position(
        pos.epoch, step)
    return batch

  def _epoch_plan(self, epoch: int) -> list[tuple[np.ndarray, int]]:
    """Length buckets: one epoch's global batches as (example indices, width), from `(seed, epoch)`."""
    if epoch != self._plan_epoch:
      order = self._epoch_order(epoch)
      plan = []
      for b, w in enumerate(self._widths):
        members = order[self._bucket[order] == b]
        rows = self._rows[w]
        stop = len(members) - len(members) % rows if self._drop_remainder else len(members)
        plan += [(members[i:i + rows], w) for i in range(0, stop, rows)]
      if self._shuffle:
        plan = [plan[i] for i in np.random.default_rng([self._seed, epoch, 1]).permutation(len(plan))]
      self._plan_epoch, self._plan = epoch, plan
    return self._plan

  def collate(self, examples: Sequence[Mapping[str, Any]], indices: np.ndarray,
              position: Position, shape: tuple[int, int] | None = None) -> Batch:
    """Pads / truncates examples into one [B, T] batch (filler rows past `len(examples)`); `shape` = (B, T),
    default (local batch, seq_len)."""
    b, t = shape or (self._local, self._seq_len)
    input_ids = np.full((b, t), self._pad_id, np.int32)
    attention = np.zeros((b, t), np.int32)
    assistant = np.zeros((b, t), np.int32)
    example_mask = np.zeros((b,), np.int32)
    rows = np.full((b,), -1, np.int64)
    for row, example in enumerate(examples):
      ids = np.asarray(example["input_ids"]).reshape(-1)[:t]
      n = ids.shape[0]
      input_ids[row, :n] = ids
      attention[row, :n] = 1
      mask = example.get("assistant_mask")
      assistant[row, :n] = 1 if mask is None else np.asarray(mask).reshape(-1)[:n]
      example_mask[row] = 1
      rows[row] = indices[row]
    return Batch(input_ids, attention, assistant, example_mask, rows, position)
