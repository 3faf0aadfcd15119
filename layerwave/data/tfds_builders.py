"""Tokenised datasets on disk: the third stage of the data pipeline (records → array_record files).

`build_chat_dataset(tokenizer, source, max_length=...)` tokenises a source with `chat.encode_record`
(conversations through the chat template, or as plain text with `chat_format="plain"` for base models)
and writes it once as a TensorFlow Datasets `array_record` dataset with two splits, "train" and
"heldout"; later calls with the same inputs reuse it. Reading is random access through tfds's
`ArrayRecordDataSource` (`ChatDataset.source(split)`), which `layerwave.data.batching` turns into
fixed-shape batches.

No TensorFlow is needed, nor installed: a `tfds.core.GeneratorBasedBuilder` with
`file_format="array_record"` serialises examples with tfds's own protobuf code and writes with
`array_record`; `as_data_source()` reads them back. (`tfds.load` / `as_dataset` / tfrecord would need
TensorFlow.) tfds writes into an `incomplete.*` directory and renames it when done, so a dataset
directory is either complete or absent. tfds shuffles examples at write time (by a hash of the key),
so on-disk order is deterministic but not source order: batching shuffles anyway.

Each example holds `input_ids` int32 [T], `assistant_mask` uint8 [T], `length` int32, `id` (the
record id, bytes when read back) and `index` (position in the source). A record goes to "heldout"
when a hash of `(split_seed, record.split_key)` falls below `heldout_fraction`: the assignment of one
record never depends on which other records are present, and the parts of one ShareGPT conversation
stay together.

The cache lives under `default_data_dir()` = `$LAYERWAVE_CACHE/tfds` (default `~/.cache/layerwave/tfds`),
in `chat_tokens/<config>/<version>/`, where the config name is keyed by everything that changes the
tokens: the tokenizer's fingerprint (its tokenizer.json, chat template and special tokens), a hash of
the records, max_length, the split settings, the chat format (keyed only when not "template", so the
caches built before it existed stay valid) and the builder version. A different tokenizer or source
therefore never reuses a stale dataset.

Legend (`layerwave.axes`): T tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from typing import Any, Mapping, Sequence

import numpy as np
import tensorflow_datasets as tfds

from layerwave.data import chat
from layerwave.data import sources
from layerwave.models import hub

# Bump when the example format or the tokenisation / masking rules change: old caches are then ignored.
FORMAT_VERSION = "1.0.0"
SPLITS = ("train", "heldout")


def default_data_dir() -> str:
  """`$LAYERWAVE_CACHE/tfds`, default `~/.cache/layerwave/tfds`."""
  return os.path.join(hub.cache_root(), "tfds")


def _sha(*parts: str) -> str:
  digest = hashlib.sha256()
  for part in parts:
    digest.update(part.encode("utf-8", "surrogatepass"))
    digest.update(b"\0")
  return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
  """A hash that changes whenever the tokenizer would produce different tokens or masks.

  Args:
    tokenizer: a transformers tokenizer.

  Returns:
    A hex sha256 of its serialized tokenizer.json (vocabulary, merges, normaliser, pre-tokeniser,
    added tokens), its chat template and its special-token map.
  """
  backend = getattr(tokenizer, "backend_tokenizer", None)
  if backend is not None:
    body = backend.to_str()
  else:
    body = json.dumps(sorted(tokenizer.get_vocab().items()))
  template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(
      tokenizer.chat_template, sort_keys=True)
  specials = json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str)
  return _sha(body, template or "", specials)


def records_fingerprint(records: Sequence[sources.Record]) -> str:
  """A hex sha256 over the ids, split keys, messages and texts of the records, in order."""
  digest = hashlib.sha256()
  for r in records:
    digest.update(json.dumps([r.id, r.split_key, r.text, list(r.messages)],
                             ensure_ascii=False).encode("utf-8", "surrogatepass"))
  return digest.hexdigest()


def split_of(split_key: str, heldout_fraction: float, seed: int = 0) -> str:
  """The split of one record: "heldout" with probability `heldout_fraction`, by hash, else "train"."""
  value = int.from_bytes(hashlib.sha256(f"{seed}:{split_key}".encode()).digest()[:8], "big")
  return "heldout" if value / 2.0**64 < heldout_fraction else "train"


class ChatTokens(tfds.core.GeneratorBasedBuilder):
  """tfds builder for tokenised chat / text examples; constructed by `build_chat_dataset`."""

  VERSION = tfds.core.Version(FORMAT_VERSION)
  RELEASE_NOTES = {FORMAT_VERSION: "input_ids, assistant_mask, length, id, index."}

  def __init__(self, *, records: Sequence[sources.Record], tokenizer: Any, max_length: int,
               heldout_fraction: float, split_seed: int, min_assistant_tokens: int,
               metadata: Mapping[str, Any], chat_format: str = "template", **kwargs: Any):
    self._records = records
    self._chat_format = chat_format
    self._tokenizer = tokenizer
    self._max_length = max_length
    self._heldout_fraction = heldout_fraction
    self._split_seed = split_seed
    self._min_assistant_tokens = min_assistant_tokens
    self._metadata = tfds.core.MetadataDict(metadata)
    super().__init__(**kwargs)

  # tfds looks for URL checksums next to the builder's source file, and the probe for that file
  # imports the `importlib_resources` backport, which tfds only requires on Python < 3.9. Nothing is
  # downloaded here, so there is no checksum file: say so and skip the probe.
  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> None:
    return None

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description="Tokenised examples with assistant masks, written by layerwave.",
        features=tfds.features.FeaturesDict({
            "input_ids": tfds.features.Tensor(shape=(None,), dtype=np.int32),
            "assistant_mask": tfds.features.Tensor(shape=(None,), dtype=np.uint8),
            "length": np.int32,
            "id": tfds.features.Text(),
            "index": np.int64,
        }),
        metadata=self._metadata,
    )

  def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
    del dl_manager  # Nothing to download: records are in memory.
    # Tokenise up front so that a split whose examples are all dropped is left out (tfds refuses to
    # write an empty split). tfds buffers every example for its write-time shuffle anyway.
    kept: dict[str, list[tuple[int, chat.Encoded]]] = {split: [] for split in SPLITS}
    for split in SPLITS:
      for key in ("dropped", "tokens", "assistant_tokens"):
        self._metadata[f"{split}_{key}"] = 0  # Saved in metadata.json when the build finishes.
    for n, record in enumerate(self._records):
      split = split_of(record.split_key, self._heldout_fraction, self._split_seed)
      encoded = chat.encode_record(self._tokenizer, record, max_length=self._max_length,
                                   chat_format=self._chat_format)
      assistant = int(encoded.assistant_mask.sum())
      if assistant < self._min_assistant_tokens:
        self._metadata[f"{split}_dropped"] += 1
        continue
      self._metadata[f"{split}_tokens"] += encoded.length
      self._metadata[f"{split}_assistant_tokens"] += assistant
      kept[split].append((n, encoded))
    dropped = sum(self._metadata[f"{split}_dropped"] for split in SPLITS)
    if dropped == len(self._records):
      raise ValueError(_all_dropped_message(self._min_assistant_tokens, self._max_length))
    if dropped:
      logging.info("Dropped %d examples with fewer than %d assistant tokens after truncation to %d.",
                   dropped, self._min_assistant_tokens, self._max_length)
    return {split: self._generate_examples(examples) for split, examples in kept.items() if examples}

  def _generate_examples(self, examples: Sequence[tuple[int, chat.Encoded]]):
    for n, encoded in examples:
      record = self._records[n]
      yield record.id, {
          "input_ids": encoded.input_ids,
          "assistant_mask": encoded.assistant_mask,
          "length": encoded.length,
          "id": record.id,
          "index": n,
      }


def _all_dropped_message(min_assistant_tokens: int, max_length: int) -> str:
  return (f"Every example was dropped: none has {min_assistant_tokens} assistant tokens within "
          f"max_length={max_length}. Raise max_length, or pass min_assistant_tokens=0 for a "
          "prompt-only source (MT-bench, HumanEval and GSM8K without references).")


@dataclasses.dataclass(frozen=True)
class ChatDataset:
  """A built dataset on disk.

  Attributes:
    directory: the dataset's version directory (holds dataset_info.json and the array_record shards).
    name: the tfds config name (the cache key).
    num_examples: examples per split, e.g. {"train": 16400, "heldout": 850}.
    metadata: build settings: source, tokenizer fingerprint, max_length, split settings, counts.
  """
  directory: str
  name: str
  num_examples: Mapping[str, int]
  metadata: Mapping[str, Any]

  def source(self, split: str = "train") -> Any:
    """Random-access data source of one split (`len`, `[i]`, `__getitems__`); no TensorFlow."""
    if split not in self.num_examples:
      raise KeyError(f"Split {split!r} is not in {self.directory}; it has {sorted(self.num_examples)} "
                     "(a split with no examples is not written: raise the held-out fraction or use more "
                     "records).")
    return open_split(self.directory, split)


def open_split(directory: str, split: str = "train") -> Any:
  """Opens one split of a dataset directory written by `build_chat_dataset`.

  Args:
    directory: the version directory (`ChatDataset.directory`).
    split: "train" or "heldout".

  Returns:
    A tfds `ArrayRecordDataSource`; items are dicts of numpy arrays (`id` as bytes).
  """
  builder = tfds.builder_from_directory(directory)
  return builder.as_data_source(split=split)


def build_chat_dataset(tokenizer: Any, source: str | Sequence[sources.Record], *, max_length: int,
                       heldout_fraction: float = 0.05, split_seed: int = 0,
                       source_options: Mapping[str, Any] | None = None,
                       source_name: str | None = None, min_assistant_tokens: int = 1,
                       data_dir: str | None = None, chat_format: str = "template") -> ChatDataset:
  """Tokenises a source and writes it as an array_record tfds dataset, or reuses the cached one.

  Args:
    tokenizer: a fast transformers tokenizer with a chat template.
    source: a source name for `sources.get_source` ("sharegpt", "mtbench", ...) or a list of records.
    max_length: right-truncate every example to this many tokens.
    heldout_fraction: expected fraction of records in the "heldout" split, in [0, 1).
    split_seed: seed of the split hash.
    source_options: options for the reader (e.g. {"limit": 50}) when `source` is a name.
    source_name: name used in the cache key when `source` is a list (default: the records' source).
    min_assistant_tokens: drop examples with fewer assistant-mask tokens after truncation (e.g. a
      conversation whose first user turn fills max_length); 0 keeps everything.
    data_dir: tfds data directory; default `default_data_dir()`.
    chat_format: how conversations become text, one of `chat.CHAT_FORMATS`: "template" (the tokenizer's
      chat template) or "plain" ("User: ...\n\nAssistant: ...", for base models without a template).

  Returns:
    The `ChatDataset` (splits with no examples are absent from `num_examples`).

  Raises:
    sources.SourceError: the source is missing or empty.
    ValueError: bad settings, a chat template asked of a tokenizer without one, or every example was
      dropped.
  """
  if max_length <= 0:
    raise ValueError(f"max_length must be positive, got {max_length}")
  if not 0.0 <= heldout_fraction < 1.0:
    raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
  if isinstance(source, str):
    records = sources.get_source(source, **dict(source_options or {}))
    source_name = source_name or source
  else:
    records = list(source)
    if not records:
      raise sources.SourceError("build_chat_dataset got an empty list of records; pass a non-empty "
                                "source.")
    source_name = source_name or records[0].source
  if any(r.messages and not r.text for r in records):
    chat.check_chat_format(tokenizer, chat_format)
  tok_fp = tokenizer_fingerprint(tokenizer)
  rec_fp = records_fingerprint(records)
  settings = {
      "source": source_name, "tokenizer_fingerprint": tok_fp, "records_fingerprint": rec_fp,
      "num_records": len(records), "max_length": int(max_length),
      "heldout_fraction": float(heldout_fraction), "split_seed": int(split_seed),
      "min_assistant_tokens": int(min_assistant_tokens), "format_version": FORMAT_VERSION,
      "tokenizer_name": str(getattr(tokenizer, "name_or_path", "")),
  }
  if chat_format != "template":  # keyed only when set, so the caches written before the option stay valid
    settings["chat_format"] = chat_format
  key = _sha(json.dumps({k: v for k, v in settings.items() if k != "tokenizer_name"},
                        sort_keys=True))
  safe_source = "".join(c if c.isalnum() else "_" for c in source_name.lower())
  name = f"{safe_source}_tok{tok_fp[:8]}_len{max_length}_{key[:12]}"
  config = tfds.core.BuilderConfig(name=name, version=FORMAT_VERSION,
                                   description=json.dumps(settings, sort_keys=True))
  builder = ChatTokens(records=records, tokenizer=tokenizer, max_length=max_length,
                       heldout_fraction=heldout_fraction, split_seed=split_seed,
                       min_assistant_tokens=min_assistant_tokens, metadata=settings, config=config,
                       chat_format=chat_format,
                       data_dir=data_dir or default_data_dir(), file_format="array_record")
  directory = str(builder.data_dir)
  if not builder.is_prepared():
    start = time.perf_counter()
    try:
      builder.download_and_prepare()
    except OSError:
      # Another process finished the same dataset first: tfds's final rename of its incomplete.*
      # directory then fails. The key fixes the content, so the finished copy is the one we want.
      if not os.path.exists(os.path.join(directory, "dataset_info.json")):
        raise
      logging.info("%s was built concurrently by another process; reusing it.", name)
    else:
      logging.info("Built %s (%d records) in %.1f s at %s.", name, len(records),
                   time.perf_counter() - start, directory)
  info = tfds.builder_from_directory(directory).info
  num_examples = {split: int(s.num_examples) for split, s in info.splits.items() if s.num_examples}
  if not num_examples:
    raise ValueError(_all_dropped_message(min_assistant_tokens, max_length))
  return ChatDataset(directory=directory, name=name, num_examples=num_examples,
                     metadata=dict(info.metadata or settings))
