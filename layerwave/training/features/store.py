"""The feature store on disk: its format, its manifest, writing one shard, and reading a store back checked.

Place in the pipeline: `extraction.extract` runs the frozen target over the chat dataset once and writes a
store here; offline draft training (`train.features=DIR`) reads it through `open_store` and
`batches.FeatureBatchIterator` instead of running the target in every step.

Layout of a store directory:

    manifest.json               the header (the store's contract: target and tokenizer fingerprints, the
                                chat dataset, depths, dtype, D, seq_len, ...) and, once every process has
                                finished, the merged per-split counts and shard names
    manifest-p00000.json        process 0's part: its shards per split with their sequence / token counts
    train-p00000-00000/         one shard: up to `shard_sequences` sequences, real tokens only (ragged)
      hidden.npy                `[n_d, n_tok, D]` the stored depths other than L, in `stored_depths` order
      final.npy                 `[n_tok, D]` h_L, the target's final-norm hidden state (depth L)
      argmax.npy                `[n_tok]` int32, the target's full-vocabulary argmax
      input_ids.npy             `[n_tok]` int32
      assistant_mask.npy        `[n_tok]` uint8
      offsets.npy               `[n_seq + 1]` int64, sequence i is tokens offsets[i]:offsets[i+1]
      index.npy                 `[n_seq]` int64, the sequence's index in the chat dataset's split

Hidden states follow the HF convention (docs/METHOD.md §1): depth 0 = embeddings, i = output of block i-1,
L = the final norm. bfloat16 arrays are saved as their uint16 bit pattern (numpy has no bfloat16 `.npy`);
`dtype` in the manifest says how to view them. Each shard is written under a temporary name and renamed
(`layerwave.atomic`), so a shard directory is complete or absent; the reader merges the processes' parts,
memory-maps the shards (`np.load(mmap_mode='r')`) and orders sequences by their dataset index, so a store
reads the same whatever the number of processes that wrote it.

Legend (`layerwave.axes`): L target layers, D target width.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

import ml_dtypes
import numpy as np

from layerwave import atomic
from layerwave import options as options_lib

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DTYPES = {"bfloat16": (np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16)),
          "float32": (np.dtype(np.float32), np.dtype(np.float32))}  # name -> (in memory, on disk)
# Header fields a resumed extraction must share with the store it continues.
CONTRACT = ("format_version", "target_fingerprint", "tokenizer_fingerprint", "target", "dataset", "data",
            "depths", "stored_depths", "dtype", "hidden_size", "seq_len", "shard_sequences", "process_count",
            "compute_dtype")
# Contract fields a header carries only when they differ from their default (absent = the target's own dtype),
# so that stores written before they existed keep their fingerprint and resume.
OPTIONAL_CONTRACT = ("compute_dtype",)
_TOKEN_FIELDS = {"argmax": np.int32, "input_ids": np.int32, "assistant_mask": np.uint8}


class StoreError(ValueError):
  """A feature store that cannot serve this run: missing, incomplete, damaged, or made for another one."""


def part_name(process_index: int) -> str:
  return f"manifest-p{process_index:05d}.json"


def shard_name(split: str, process_index: int, shard: int) -> str:
  return f"{split}-p{process_index:05d}-{shard:05d}"


def bytes_per_token(num_hidden: int, hidden_size: int, dtype: str) -> int:
  """Disk bytes of one stored token: `num_hidden` depths + h_L, argmax, input id, assistant mask."""
  return (num_hidden + 1) * hidden_size * DTYPES[dtype][1].itemsize + 4 + 4 + 1


def parse_depths(value: Any, num_layers: int, default: Sequence[int] = ()) -> tuple[int, ...]:
  """`features.depths` → sorted unique depths: "" = `default`, "all" = 0..L, "2,15,27" or a sequence."""
  if isinstance(value, str):
    text = value.strip().lower()
    if text == "all":
      return tuple(range(num_layers + 1))
    if not text:
      ids = list(default)
      if not ids:
        raise StoreError("No depths to store: give --config.features.depths=2,15,27 (or 'all'), or "
                         "--config.layers=... (the default is the layers you will train).")
    else:
      try:
        ids = [int(x) for x in text.split(",") if x.strip()]
      except ValueError as e:
        raise StoreError(f"features.depths must be comma-separated integers or 'all', got {value!r}.") from e
  else:
    ids = [int(x) for x in value]
  bad = sorted(i for i in ids if not 0 <= i <= num_layers)
  if bad:
    raise StoreError(f"features.depths {bad} are out of range for a target with L={num_layers} (valid: "
                     f"0..{num_layers}, HF hidden-state convention).")
  return tuple(sorted(set(ids)))


def contract_mismatch(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
  """The contract fields on which two headers differ."""
  a, b = atomic.jsonable(dict(old)), atomic.jsonable(dict(new))
  return [k for k in CONTRACT if a.get(k) != b.get(k)]


def write_shard(directory: str, name: str, arrays: Mapping[str, np.ndarray], process_index: int) -> None:
  """Writes one shard directory atomically (temporary name, then rename; removed on any error).

  Args:
    directory: the store.
    name: `shard_name(...)`.
    arrays: `hidden`, `final` (storage dtype: uint16 bits for bfloat16), `argmax`, `input_ids`,
      `assistant_mask`, `offsets`, `index`.
    process_index: tags the temporary name, so a process cleans up only its own leftovers.
  """
  with atomic.atomic_directory(os.path.join(directory, name), prefix=tmp_prefix(process_index)) as tmp:
    for key, value in arrays.items():
      np.save(os.path.join(tmp, key + ".npy"), value, allow_pickle=False)


def tmp_prefix(process_index: int) -> str:
  return f".tmp-p{process_index:05d}-"


def _npy_header(path: str) -> tuple[tuple[int, ...], np.dtype]:
  """(shape, dtype) of a `.npy` file, from its header alone."""
  with open(path, "rb") as f:
    major, _ = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(f)
  return tuple(shape), np.dtype(dtype)


@dataclasses.dataclass(frozen=True)
class Shard:
  """One shard's place in a split: its directory name and counts."""
  name: str
  sequences: int
  tokens: int


class StoreSplit:
  """One split of a store, random access: `len`, `[i]` → a dict of memory-mapped views (no copy).

  Sequence i is the i-th by dataset index. Items: `input_ids`, `assistant_mask`, `argmax` `[n]`,
  `final` `[n, D]` and `hidden` `[n_d, n, D]` (storage dtype viewed as `dtype`), cut to `max_length`.
  """

  def __init__(self, store: "FeatureStore", shards: Sequence[Shard], max_length: int | None = None,
               cache_shards: int = 16):
    self._store = store
    self._shards = list(shards)
    self._max_length = max_length
    self._open: collections.OrderedDict[int, dict[str, np.ndarray]] = collections.OrderedDict()
    self._cache_shards = cache_shards  # each memory map holds a file descriptor: keep a bounded number
    index, shard_of, local = [], [], []
    for s, shard in enumerate(self._shards):
      index.append(np.load(os.path.join(store.path, shard.name, "index.npy")))
      shard_of.append(np.full(shard.sequences, s, np.int64))
      local.append(np.arange(shard.sequences, dtype=np.int64))
    index = np.concatenate(index) if index else np.zeros(0, np.int64)
    order = np.argsort(index, kind="stable")
    self.dataset_index = index[order]
    self._shard_of = np.concatenate(shard_of)[order] if shard_of else index
    self._local = np.concatenate(local)[order] if local else index

  def __len__(self) -> int:
    return int(self.dataset_index.shape[0])

  @property
  def store(self) -> "FeatureStore":
    return self._store

  def head(self, n: int) -> "StoreSplit":
    """The first `n` sequences by dataset index (all of them if the split holds fewer), as a split of its own
    (`train.max_sequences`: a data-limited run on a prefix of a larger store, as `data.max_records` cuts a
    dataset)."""
    part = StoreSplit(self._store, [], self._max_length, self._cache_shards)
    part._shards = self._shards  # pylint: disable=protected-access
    n = max(0, min(int(n), len(self)))
    part.dataset_index, part._shard_of, part._local = (  # pylint: disable=protected-access
        self.dataset_index[:n], self._shard_of[:n], self._local[:n])
    return part

  @property
  def dtype(self) -> np.dtype:
    """The in-memory dtype of `hidden` and `final` (bfloat16 or float32)."""
    return DTYPES[self._store.dtype][0]

  @property
  def hidden_size(self) -> int:
    return self._store.hidden_size

  def _arrays(self, s: int) -> dict[str, np.ndarray]:
    if s in self._open:
      self._open.move_to_end(s)
      return self._open[s]
    path = os.path.join(self._store.path, self._shards[s].name)
    arrays = {key: np.load(os.path.join(path, key + ".npy"), mmap_mode="r") for key in FIELDS}
    memory = DTYPES[self._store.dtype][0]
    arrays["hidden"], arrays["final"] = arrays["hidden"].view(memory), arrays["final"].view(memory)
    self._open[s] = arrays
    while len(self._open) > self._cache_shards:
      self._open.popitem(last=False)
    return arrays

  def lengths(self) -> np.ndarray:
    """int64 `[len(self)]`: each sequence's stored tokens (cut to `max_length`), from the shards' offsets
    without reading the features (what `BatchIterator`'s length buckets need)."""
    per_shard = [np.diff(np.load(os.path.join(self._store.path, shard.name, "offsets.npy")))
                 for shard in self._shards]
    n = np.asarray([per_shard[s][j] for s, j in zip(self._shard_of, self._local)], np.int64)
    return n if self._max_length is None else np.minimum(n, self._max_length)

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    if not 0 <= i < len(self):
      raise IndexError(f"sequence {i} of a split of {len(self)}")
    arrays = self._arrays(int(self._shard_of[i]))
    j = int(self._local[i])
    a, b = int(arrays["offsets"][j]), int(arrays["offsets"][j + 1])
    if self._max_length is not None:
      b = min(b, a + self._max_length)
    return {"input_ids": arrays["input_ids"][a:b], "assistant_mask": arrays["assistant_mask"][a:b],
            "argmax": arrays["argmax"][a:b], "final": arrays["final"][a:b],
            "hidden": arrays["hidden"][:, a:b]}


class JoinedSplit:
  """Splits of several stores read as one source, each after the one before (`train.extra_features`: a store's
  train split with other text's beside it): `len`, `[i]`, `lengths()`, `dtype` and `hidden_size` as
  `StoreSplit`'s. The parts must store the same dtype and width (and, for the caller, the same layers)."""

  def __init__(self, parts: Sequence[StoreSplit]):
    if not parts:
      raise ValueError("JoinedSplit needs at least one split.")
    first = parts[0]
    for part in parts[1:]:
      if (part.dtype, part.hidden_size) != (first.dtype, first.hidden_size):
        raise StoreError(
            f"The feature store {part.store.path} stores {part.store.dtype} features of width "
            f"{part.hidden_size}, {first.store.path} {first.store.dtype} of width {first.hidden_size}: stores "
            "trained from together must match; extract it again with --config.features.dtype="
            f"{first.store.dtype}.")
    self._parts = list(parts)
    self._ends = np.cumsum([len(p) for p in self._parts])

  def __len__(self) -> int:
    return int(self._ends[-1])

  @property
  def dtype(self) -> np.dtype:
    return self._parts[0].dtype

  @property
  def hidden_size(self) -> int:
    return self._parts[0].hidden_size

  @property
  def sizes(self) -> list[int]:
    """Sequences per part, in order."""
    return [len(p) for p in self._parts]

  def lengths(self) -> np.ndarray:
    return np.concatenate([p.lengths() for p in self._parts])

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    if not 0 <= i < len(self):
      raise IndexError(f"sequence {i} of a split of {len(self)}")
    k = int(np.searchsorted(self._ends, i, side="right"))
    return self._parts[k][i - (int(self._ends[k - 1]) if k else 0)]


FIELDS = ("hidden", "final", "argmax", "input_ids", "assistant_mask", "offsets", "index")


class FeatureStore:
  """A complete, checked feature store (`open_store`).

  Attributes:
    path: the store directory.
    header: manifest.json's contract fields.
    splits: per split, its shards (merged over the processes' parts).
  """

  def __init__(self, path: str, header: Mapping[str, Any], splits: Mapping[str, list[Shard]]):
    self.path = path
    self.header = dict(header)
    self.splits = dict(splits)

  @property
  def depths(self) -> tuple[int, ...]:
    """Every depth the store can serve (including L, from h_L)."""
    return tuple(self.header["depths"])

  @property
  def stored_depths(self) -> tuple[int, ...]:
    """The depths in `hidden.npy`, in order (all but L)."""
    return tuple(self.header["stored_depths"])

  @property
  def num_layers(self) -> int:
    return int(self.header["target"]["num_layers"])

  @property
  def dtype(self) -> str:
    return self.header["dtype"]

  @property
  def seq_len(self) -> int:
    return int(self.header["seq_len"])

  @property
  def hidden_size(self) -> int:
    return int(self.header["hidden_size"])

  @property
  def fingerprint(self) -> str:
    """A hash of the contract and the shard list: recorded in training checkpoints, checked on resume."""
    return options_lib.fingerprint({"header": {k: self.header.get(k) for k in CONTRACT
                                               if k in self.header or k not in OPTIONAL_CONTRACT},
                                    "splits": {s: [dataclasses.astuple(x) for x in v]
                                               for s, v in sorted(self.splits.items())}})

  def counts(self, split: str) -> tuple[int, int]:
    """(sequences, tokens) of a split (0, 0 if absent)."""
    shards = self.splits.get(split, [])
    return sum(s.sequences for s in shards), sum(s.tokens for s in shards)

  def split(self, name: str, max_length: int | None = None) -> StoreSplit:
    """Random access to one split, sequences cut to `max_length` tokens (default all)."""
    if not self.counts(name)[0]:
      raise StoreError(f"Feature store {self.path} has no {name!r} sequences; it has "
                       f"{sorted(s for s in self.splits if self.counts(s)[0])}. Extract it with "
                       f"--config.features.splits=train,heldout.")
    return StoreSplit(self, self.splits[name], max_length)

  def layer_slots(self, layer_ids: Sequence[int]) -> list[int]:
    """Where each requested layer sits: its row in `hidden.npy`, or -1 for L (served from `final`)."""
    missing = [i for i in layer_ids if i not in self.depths]
    if missing:
      raise StoreError(f"Feature store {self.path} has no layer {', '.join(map(str, missing))}: it stores "
                       f"depths {list(self.depths)}. Extract a store with these layers "
                       "(--config.features.depths=... or 'all') or train online (leave train.features unset).")
    return [-1 if i == self.num_layers else self.stored_depths.index(i) for i in layer_ids]


def read_header(path: str) -> dict[str, Any]:
  manifest = os.path.join(path, MANIFEST)
  if not os.path.exists(manifest):
    raise StoreError(f"No feature store at {path} ({MANIFEST} is missing): extract one with "
                     "experiments/extract_features.py, or train online (leave train.features unset).")
  with open(manifest) as f:
    return json.load(f)


def open_store(path: str) -> FeatureStore:
  """Opens a finished store: merges the processes' parts and checks every shard against the manifest.

  Raises:
    StoreError: no store, an unknown format, an unfinished extraction, or a shard whose arrays' dtype or
      shape disagree with the manifest.
  """
  path = os.path.abspath(path)
  header = read_header(path)
  if header.get("format_version") != FORMAT_VERSION:
    raise StoreError(f"Feature store {path} has format version {header.get('format_version')}; this "
                     f"layerwave reads version {FORMAT_VERSION}. Extract it again.")
  if header.get("dtype") not in DTYPES:
    raise StoreError(f"Feature store {path}: its manifest names dtype {header.get('dtype')!r}; a store holds "
                     f"one of {sorted(DTYPES)}. The manifest is damaged: extract the store again.")
  splits: dict[str, list[Shard]] = {}
  for p in range(int(header["process_count"])):
    part = os.path.join(path, part_name(p))
    if not os.path.exists(part):
      raise StoreError(f"Feature store {path} is incomplete: process {p} of {header['process_count']} has "
                       f"not finished ({part_name(p)} is missing). Rerun the extraction; it resumes.")
    with open(part) as f:
      for split, shards in json.load(f)["splits"].items():
        splits.setdefault(split, []).extend(Shard(**s) for s in shards)
  store = FeatureStore(path, header, splits)
  for split, shards in splits.items():
    for shard in shards:
      _check_shard(store, shard)
  return store


def _check_shard(store: FeatureStore, shard: Shard) -> None:
  d, n, s = store.hidden_size, shard.tokens, shard.sequences
  disk = DTYPES[store.dtype][1]
  want = {"hidden": ((len(store.stored_depths), n, d), disk), "final": ((n, d), disk),
          "offsets": ((s + 1,), np.dtype(np.int64)), "index": ((s,), np.dtype(np.int64))}
  want.update({k: ((n,), np.dtype(v)) for k, v in _TOKEN_FIELDS.items()})
  for key, (shape, dtype) in want.items():
    file = os.path.join(store.path, shard.name, key + ".npy")
    if not os.path.exists(file):
      raise StoreError(f"Feature store {store.path} is damaged: {shard.name}/{key}.npy is missing. "
                       "Extract the store again (delete the directory first).")
    got_shape, got_dtype = _npy_header(file)
    if got_shape != shape or got_dtype != dtype:
      raise StoreError(f"Feature store {store.path}: {shard.name}/{key}.npy holds {got_dtype} {got_shape}, but "
                       f"the manifest says {dtype} {shape} (dtype {store.dtype}, {len(store.stored_depths)} "
                       f"stored depths, D = {d}, {n} tokens). The store is damaged or mixes two "
                       "extractions: delete it and extract again.")


def check_for_training(store: FeatureStore, *, target_config, target_dtype: str, target_fingerprint: str,
                       tokenizer_fingerprint: str, layer_ids: Sequence[int], data: Mapping[str, Any]) -> None:
  """Refuses a store that cannot stand in for the online target in this training run.

  Args:
    store: the opened store.
    target_config: the run's target `ModelConfig`.
    target_dtype: the run's `config.dtype` (the target's compute dtype).
    target_fingerprint: `layerwave.inference.target_fingerprint` of the run's target.
    tokenizer_fingerprint: `layerwave.data.tokenizer_fingerprint` of its tokenizer.
    layer_ids: the draft's layers.
    data: the run's data options as a dict (`DataOptions.record()`).

  Raises:
    StoreError: naming the mismatch and the fix.
  """
  online = "or train online (leave train.features unset)"
  h = store.header
  shape = (target_config.num_layers, target_config.hidden_size, target_config.vocab_size)
  stored = tuple(h["target"][k] for k in ("num_layers", "hidden_size", "vocab_size"))
  if shape == stored and h["target"].get("dtype") != target_dtype:
    raise StoreError(f"Feature store {store.path} holds what the target computed in {h['target'].get('dtype')}; "
                     f"this run loads it in {target_dtype}. Set --config.dtype={h['target'].get('dtype')} or "
                     f"extract a store in {target_dtype}.")
  if shape != stored or h["target_fingerprint"] != target_fingerprint:
    raise StoreError(f"Feature store {store.path} was extracted from another target: {h.get('model')!r} "
                     f"(L, D, V) = {stored}, fingerprint {h['target_fingerprint'][:12]}; this run's target has "
                     f"(L, D, V) = {shape}, fingerprint {target_fingerprint[:12]}. Extract a store with this "
                     f"target (experiments/extract_features.py with the same --config.model) {online}.")
  if h["tokenizer_fingerprint"] != tokenizer_fingerprint:
    raise StoreError(f"Feature store {store.path} was tokenised by another tokenizer (fingerprint "
                     f"{h['tokenizer_fingerprint'][:12]}, this run's {tokenizer_fingerprint[:12]}): its token ids "
                     f"mean other text. Extract a store with this run's tokenizer {online}.")
  store.layer_slots(layer_ids)
  if int(data["max_length"]) > store.seq_len:
    raise StoreError(f"data.max_length={data['max_length']} exceeds the feature store's seq_len "
                     f"({store.seq_len}): its sequences were cut at {store.seq_len} tokens when extracted. Set "
                     f"--config.data.max_length={store.seq_len} (or less), or extract a store with longer "
                     "sequences.")
  stored_data = dict(h.get("data", {}))
  differ = [k for k, v in sorted(stored_data.items()) if k != "max_length" and data.get(k) != v]
  if differ:
    theirs = ", ".join(f"data.{k}={stored_data[k]!r}" for k in differ)
    ours = ", ".join(f"data.{k}={data.get(k)!r}" for k in differ)
    raise StoreError(f"Feature store {store.path} was extracted from other data ({theirs}) than this run's "
                     f"config names ({ours}). Set "
                     + " ".join(f"--config.data.{k}={stored_data[k]}" for k in differ)
                     + f" so the run records the data it trains on, or extract a store for this data.")
