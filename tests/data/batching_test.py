"""Tests for layerwave/data/batching.py: shapes, padding, determinism, exact resume, host sharding."""

import numpy as np
import pytest

from layerwave.data import batching


def _source(n=23, seed=0):
  rng = np.random.default_rng(seed)
  examples = []
  for i in range(n):
    length = int(rng.integers(1, 12))
    examples.append({"input_ids": np.arange(100 * i + 1, 100 * i + 1 + length, dtype=np.int32),
                     "assistant_mask": (np.arange(length) % 2).astype(np.uint8)})
  return examples


def _collect(iterator, count):
  return [next(iterator) for _ in range(count)]


def test_shapes_padding_and_masks():
  source = _source()
  it = batching.BatchIterator(source, batch_size=4, seq_len=8, pad_id=2, seed=0,
                              process_index=0, process_count=1)
  batch = next(it)
  assert batch.input_ids.shape == batch.attention_mask.shape == batch.assistant_mask.shape == (4, 8)
  assert batch.input_ids.dtype == np.int32 and batch.example_mask.tolist() == [1, 1, 1, 1]
  for row, index in enumerate(batch.indices):
    ids = source[index]["input_ids"][:8]
    n = len(ids)
    np.testing.assert_array_equal(batch.input_ids[row, :n], ids)
    assert (batch.input_ids[row, n:] == 2).all()
    assert batch.attention_mask[row].tolist() == [1] * n + [0] * (8 - n)
    np.testing.assert_array_equal(batch.assistant_mask[row, :n], source[index]["assistant_mask"][:n])
    assert not batch.assistant_mask[row, n:].any()


def test_epochs_cover_every_example_once_and_differ():
  it = batching.BatchIterator(_source(), batch_size=5, seq_len=4, pad_id=0, seed=1, num_epochs=2,
                              process_index=0, process_count=1)
  assert it.steps_per_epoch == 4
  batches = list(it)
  assert len(batches) == 8
  first = np.concatenate([b.indices for b in batches[:4]])
  second = np.concatenate([b.indices for b in batches[4:]])
  assert len(set(first)) == 20 and len(set(second)) == 20 and not np.array_equal(first, second)
  assert batches[4].position == batching.Position(1, 0)


def test_deterministic_and_exact_resume():
  kwargs = dict(batch_size=4, seq_len=6, pad_id=0, seed=7, process_index=0, process_count=1)
  reference = _collect(batching.BatchIterator(_source(), **kwargs), 12)
  again = _collect(batching.BatchIterator(_source(), **kwargs), 12)
  assert all(np.array_equal(a.input_ids, b.input_ids) for a, b in zip(reference, again))
  first = batching.BatchIterator(_source(), **kwargs)
  _collect(first, 7)  # Crosses an epoch boundary (5 batches per epoch).
  saved = batching.Position.from_dict(first.position.to_dict())
  assert saved == batching.Position(1, 2)
  resumed = batching.BatchIterator(_source(), position=saved, **kwargs)
  for expected, got in zip(reference[7:], _collect(resumed, 5)):
    np.testing.assert_array_equal(expected.input_ids, got.input_ids)
    np.testing.assert_array_equal(expected.indices, got.indices)
  other_seed = next(batching.BatchIterator(_source(), **{**kwargs, "seed": 8}))
  assert not np.array_equal(other_seed.indices, reference[0].indices)


def test_keep_remainder_pads_rows():
  it = batching.BatchIterator(_source(n=10), batch_size=4, seq_len=4, pad_id=9, shuffle=False,
                              drop_remainder=False, num_epochs=1, process_index=0, process_count=1)
  batches = list(it)
  assert len(batches) == 3 and batches[0].indices.tolist() == [0, 1, 2, 3]
  last = batches[-1]
  assert last.example_mask.tolist() == [1, 1, 0, 0] and last.indices.tolist() == [8, 9, -1, -1]
  assert (last.input_ids[2:] == 9).all() and not last.attention_mask[2:].any()


def test_process_sharding_partitions_each_global_batch():
  kwargs = dict(batch_size=6, seq_len=4, pad_id=0, seed=3, num_epochs=1)
  full = list(batching.BatchIterator(_source(), process_index=0, process_count=1, **kwargs))
  shards = [list(batching.BatchIterator(_source(), process_index=p, process_count=3, **kwargs))
            for p in range(3)]
  assert all(len(s) == len(full) for s in shards)
  for step, batch in enumerate(full):
    assert shards[0][step].input_ids.shape == (2, 4)
    joined = np.concatenate([shards[p][step].indices for p in range(3)])
    np.testing.assert_array_equal(joined, batch.indices)


def test_errors():
  with pytest.raises(ValueError, match="empty"):
    batching.BatchIterator([], batch_size=1, seq_len=1, pad_id=0, process_index=0, process_count=1)
  with pytest.raises(ValueError, match="fewer than one global batch"):
    batching.BatchIterator(_source(n=3), batch_size=4, seq_len=4, pad_id=0, process_index=0,
                           process_count=1)
  with pytest.raises(ValueError, match="divisible"):
    batching.BatchIterator(_source(), batch_size=5, seq_len=4, pad_id=0, process_index=0,
                           process_count=2)
  with pytest.raises(ValueError, match="past the end"):
    batching.BatchIterator(_source(), batch_size=4, seq_len=4, pad_id=0, process_index=0,
                           process_count=1, position=batching.Position(0, 5))


def test_default_process_and_tfds_source(tokenizer, tmp_path):
  from layerwave.data import tfds_builders  # pylint: disable=g-import-not-at-top
  dataset = tfds_builders.build_chat_dataset(tokenizer, "mtbench", max_length=64,
                                             heldout_fraction=0.0, min_assistant_tokens=0,
                                             data_dir=str(tmp_path))
  it = batching.BatchIterator(dataset.source("train"), batch_size=8, seq_len=32,
                              pad_id=tokenizer.pad_token_id)
  batch = next(it)
  assert batch.input_ids.shape == (8, 32) and batch.attention_mask.all()
  assert not batch.assistant_mask.any()  # MT-bench prompts have no assistant replies.


# -- length buckets --------------------------------------------------------------------------------------


def _bucketed(source, **kwargs):
  args = dict(batch_size=2, seq_len=8, pad_id=2, seed=3, process_index=0, process_count=1, widths=(2, 4))
  return batching.BatchIterator(source, **{**args, **kwargs})


def test_buckets_fit_each_batch_to_its_width_and_cover_the_epoch():
  source = _source(n=60)
  it = _bucketed(source, drop_remainder=False)
  assert it.widths == (2, 4, 8) and [it.rows(w) for w in it.widths] == [8, 4, 2]
  seen, widths = [], set()
  for _ in range(it.steps_per_epoch):
    batch = next(it)
    b, t = batch.input_ids.shape
    assert b * t == 16  # every batch holds batch_size * seq_len token slots
    widths.add(t)
    for row, index in enumerate(batch.indices):
      if index < 0:
        assert not batch.attention_mask[row].any()
        continue
      n = min(len(source[index]["input_ids"]), 8)
      assert n <= t and (t == 2 or n > t // 2 or t == 4 and n > 2)  # the smallest width that holds it
      np.testing.assert_array_equal(batch.input_ids[row, :n], source[index]["input_ids"][:n])
      assert batch.attention_mask[row].sum() == n
      seen.append(int(index))
  assert sorted(seen) == list(range(60)) and widths == {2, 4, 8}
  assert it.position == batching.Position(1, 0)
  # Fewer padding slots than fixed [2, 8] batches over the same epoch.
  fixed = batching.BatchIterator(source, batch_size=2, seq_len=8, pad_id=2, seed=3, process_index=0,
                                 process_count=1, drop_remainder=False)
  slots = lambda its: sum(next(its).input_ids.size for _ in range(its.steps_per_epoch))  # noqa: E731
  assert slots(_bucketed(source, drop_remainder=False)) < slots(fixed)
  lengths = np.minimum([len(e["input_ids"]) for e in source], 8)
  assert fixed.epoch_fill() == pytest.approx(lengths.sum() / (30 * 16))
  assert _bucketed(source, drop_remainder=False).epoch_fill() == pytest.approx(
      lengths.sum() / slots(_bucketed(source, drop_remainder=False)))


def test_buckets_drop_remainders_resume_exactly_and_reshuffle_per_epoch():
  source = _source(n=60)
  it = _bucketed(source)
  first = _collect(it, it.steps_per_epoch)
  per_width = {w: sum(1 for b in first if b.input_ids.shape[1] == w) for w in it.widths}
  lengths = np.minimum([len(e["input_ids"]) for e in source], 8)
  counts = {2: (lengths <= 2).sum(), 4: ((lengths > 2) & (lengths <= 4)).sum(), 8: (lengths > 4).sum()}
  assert per_width == {w: counts[w] // it.rows(w) for w in it.widths}
  second = _collect(it, it.steps_per_epoch)
  assert [b.indices.tolist() for b in first] != [b.indices.tolist() for b in second]
  again = _bucketed(source, position=first[5].position)
  for expected in first[5:] + second[:3]:
    got = next(again)
    np.testing.assert_array_equal(got.input_ids, expected.input_ids)
    assert got.position == expected.position


def test_buckets_split_rows_over_processes():
  source = _source(n=60)
  whole = _collect(_bucketed(source, batch_size=4), 6)
  parts = [_collect(_bucketed(source, batch_size=4, process_index=p, process_count=2), 6) for p in range(2)]
  for step, batch in enumerate(whole):
    np.testing.assert_array_equal(np.concatenate([parts[0][step].indices, parts[1][step].indices]),
                                  batch.indices)


def test_buckets_use_the_source_lengths_when_it_has_them():
  class WithLengths(list):
    def lengths(self):
      return np.asarray([len(e["input_ids"]) for e in self])

  plain, known = _bucketed(_source(n=40)), _bucketed(WithLengths(_source(n=40)))
  for _ in range(plain.steps_per_epoch):
    np.testing.assert_array_equal(next(plain).input_ids, next(known).input_ids)


def test_a_bucket_too_small_for_one_batch_joins_the_next_width():
  source = [{"input_ids": np.arange(1 + i % 7)} for i in range(40)]  # lengths 1..7: 12 of them <= 2
  it = _bucketed(source, widths=(1, 2, 4))  # width 1 would hold 6 examples, fewer than its 16 rows
  assert it.widths == (2, 4, 8) and it.rows(2) == 8
  seen = [int(i) for _ in range(it.steps_per_epoch) for i in next(it).indices]
  assert any(len(source[i]["input_ids"]) == 1 for i in seen)


def test_bucket_errors():
  source = _source(n=60)
  with pytest.raises(ValueError, match="must be in \\[1, seq_len=8\\]"):
    _bucketed(source, widths=(16,))
  with pytest.raises(ValueError, match="width 4 holds 4 rows .* fewer than the 8 the processes / devices need"):
    _bucketed(source, widths=(4,), row_multiple=8)
  with pytest.raises(ValueError, match="row_multiple must be >= 1"):
    _bucketed(source, row_multiple=0)


def test_bucket_rows_are_a_multiple_of_the_devices():
  """64 slots on 4 devices: width 3 holds 21 rows → 20, width 6 10 → 8; the full width keeps batch_size."""
  source = [{"input_ids": np.arange(1 + i % 16)} for i in range(200)]
  it = _bucketed(source, batch_size=4, seq_len=16, widths=(3, 6), row_multiple=4, drop_remainder=False)
  assert (it.rows(3), it.rows(6), it.rows(16)) == (20, 8, 4)
  batches = [next(it) for _ in range(it.steps_per_epoch)]
  assert all(b.input_ids.shape[0] % 4 == 0 for b in batches)
  seen = sorted(int(i) for b in batches for i, m in zip(b.indices, b.example_mask) if m)
  assert seen == list(range(200))  # every example once per epoch
  plain = _bucketed(source, batch_size=4, seq_len=16, widths=(3, 6))
  assert (plain.rows(3), plain.rows(6)) == (21, 10)  # one device: every row that fits



def test_a_width_that_does_not_divide_the_slots_takes_the_rows_that_fit():
  """16 slots at width 3: 5 rows of 3 (15 slots); with 2 processes, 24 slots at width 8 → 3 rows → 2."""
  source = _source(n=60)
  it = _bucketed(source, widths=(3,), drop_remainder=False)
  assert it.rows(3) == 5 and it.rows(8) == 2
  batches = [next(it) for _ in range(it.steps_per_epoch)]
  assert {b.input_ids.shape for b in batches} == {(5, 3), (2, 8)}
  seen = sorted(int(i) for b in batches for i, m in zip(b.indices, b.example_mask) if m)
  assert seen == list(range(60))  # every example once per epoch, none lost to the smaller batches
  lengths = it.lengths()
  assert it.epoch_fill() == pytest.approx(lengths.sum() / sum(b.input_ids.size for b in batches))
  two = [_bucketed(source, widths=(8,), seq_len=12, batch_size=2, process_count=2, process_index=p)
         for p in (0, 1)]
  assert two[0].rows(8) == two[1].rows(8) == 2 and two[0].rows(12) == 2
