"""Tests for layerwave/data/tfds_builders.py: array_record build + read round trip without TensorFlow."""

import os
import sys

import numpy as np
import pytest

from layerwave.data import chat
from layerwave.data import sources
from layerwave.data import tfds_builders


@pytest.fixture(scope="module")
def records():
  return sources.get_source("sharegpt", limit=50)


@pytest.fixture(scope="module")
def built(tokenizer, records, tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  return tfds_builders.build_chat_dataset(tokenizer, records, max_length=1024, heldout_fraction=0.2,
                                          data_dir=data_dir), data_dir


def test_round_trip_matches_direct_encoding(tokenizer, records, built):
  dataset, _ = built
  assert "tensorflow" not in sys.modules
  assert set(dataset.num_examples) == {"train", "heldout"}
  by_id = {r.id: r for r in records}
  seen = 0
  for split, count in dataset.num_examples.items():
    source = dataset.source(split)
    assert len(source) == count
    for i in range(count):
      example = source[i]
      record = by_id[example["id"].decode()]
      assert tfds_builders.split_of(record.split_key, 0.2) == split
      encoded = chat.encode_record(tokenizer, record, max_length=1024)
      np.testing.assert_array_equal(example["input_ids"], encoded.input_ids)
      np.testing.assert_array_equal(example["assistant_mask"], encoded.assistant_mask)
      assert example["length"] == encoded.length and records[example["index"]] is record
      seen += 1
  dropped = dataset.metadata["train_dropped"] + dataset.metadata["heldout_dropped"]
  assert seen + dropped == len(records)
  assert os.path.basename(os.path.dirname(dataset.directory)) == dataset.name


def test_cache_reuse_and_stale_keying(tokenizer, records, built):
  dataset, data_dir = built
  again = tfds_builders.build_chat_dataset(tokenizer, records, max_length=1024, heldout_fraction=0.2,
                                           data_dir=data_dir)
  assert again.directory == dataset.directory
  mtime = os.path.getmtime(os.path.join(dataset.directory, "dataset_info.json"))
  assert os.path.getmtime(os.path.join(again.directory, "dataset_info.json")) == mtime
  # A different max_length, record set, split setting or tokenizer gets its own directory.
  names = {
      tfds_builders.build_chat_dataset(tokenizer, records[:10], max_length=64,
                                       data_dir=data_dir).name,
      tfds_builders.build_chat_dataset(tokenizer, records[:10], max_length=64, split_seed=1,
                                       data_dir=data_dir).name,
      tfds_builders.build_chat_dataset(tokenizer, records[:9], max_length=64,
                                       data_dir=data_dir).name,
  }
  assert len(names) == 3 and dataset.name not in names
  assert not any(n.startswith("incomplete") for n in os.listdir(os.path.dirname(dataset.directory)))


def test_tokenizer_fingerprint_changes_with_template(tokenizer):
  base = tfds_builders.tokenizer_fingerprint(tokenizer)
  assert base == tfds_builders.tokenizer_fingerprint(tokenizer)
  template = tokenizer.chat_template
  try:
    tokenizer.chat_template = template.replace("SmolLM", "SmolLM-x")
    assert tfds_builders.tokenizer_fingerprint(tokenizer) != base
  finally:
    tokenizer.chat_template = template


def test_splits_are_deterministic_and_independent_of_other_records():
  keys = [f"conv{i}" for i in range(2000)]
  splits = [tfds_builders.split_of(k, 0.1, seed=3) for k in keys]
  assert splits == [tfds_builders.split_of(k, 0.1, seed=3) for k in reversed(keys)][::-1]
  assert 150 < splits.count("heldout") < 250
  assert splits != [tfds_builders.split_of(k, 0.1, seed=4) for k in keys]
  assert all(tfds_builders.split_of(k, 0.0) == "train" for k in keys[:50])


def test_text_source_and_errors(tokenizer, tmp_path):
  text = tfds_builders.build_chat_dataset(tokenizer, "text", max_length=128, heldout_fraction=0.0,
                                          source_options={"limit": 5}, data_dir=str(tmp_path))
  assert text.num_examples == {"train": 5}
  example = text.source("train")[0]
  assert example["assistant_mask"].all() and example["length"] == 128
  with pytest.raises(KeyError, match="heldout"):
    text.source("heldout")
  with pytest.raises(ValueError, match="min_assistant_tokens=0"):
    tfds_builders.build_chat_dataset(tokenizer, "mtbench", max_length=64, data_dir=str(tmp_path))
  assert not [n for n in os.listdir(os.path.join(tmp_path, "chat_tokens")) if n.startswith("mtbench")
              and os.listdir(os.path.join(tmp_path, "chat_tokens", n))]
  with pytest.raises(sources.SourceError, match="empty"):
    tfds_builders.build_chat_dataset(tokenizer, [], max_length=8, data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="heldout_fraction"):
    tfds_builders.build_chat_dataset(tokenizer, "text", max_length=8, heldout_fraction=1.0,
                                     data_dir=str(tmp_path))


def test_plain_format_has_its_own_cache_and_template_keys_stay(tokenizer, records, built, tmp_path):
  dataset, data_dir = built
  # The template format (the default) keeps the key it had before the option existed.
  assert "chat_format" not in dataset.metadata
  assert tfds_builders.build_chat_dataset(tokenizer, records, max_length=1024, heldout_fraction=0.2,
                                          data_dir=data_dir, chat_format="template").name == dataset.name
  plain = tfds_builders.build_chat_dataset(tokenizer, records[:10], max_length=64, data_dir=data_dir,
                                           chat_format="plain")
  template = tfds_builders.build_chat_dataset(tokenizer, records[:10], max_length=64, data_dir=data_dir)
  assert plain.name != template.name and plain.metadata["chat_format"] == "plain"
  example = plain.source("train")[0]
  encoded = chat.encode_record(tokenizer, records[int(example["index"])], max_length=64, chat_format="plain")
  np.testing.assert_array_equal(example["input_ids"], encoded.input_ids)
  np.testing.assert_array_equal(example["assistant_mask"], encoded.assistant_mask)
  template_string = tokenizer.chat_template
  try:
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat_format=plain"):
      tfds_builders.build_chat_dataset(tokenizer, records[:10], max_length=64, data_dir=str(tmp_path))
  finally:
    tokenizer.chat_template = template_string
