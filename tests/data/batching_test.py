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
