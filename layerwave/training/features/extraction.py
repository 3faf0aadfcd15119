"""Feature extraction: the frozen target runs over the chat dataset once and its features go to a store.

Place in the pipeline: after the data stage (the chat dataset of `config.data`) and before offline draft
training (`train.features=DIR`), which then trains any number of drafts on the stored depths without running
the target (`layerwave.training.step.train_step_offline`). `run(config)` is the stage (called by
experiments/extract_features.py); `extract(target, dataset, out_dir, depths=...)` the library call.

Per sequence only the real tokens are stored (ragged, with offsets: no padding on disk): the hidden states of
the chosen depths, h_L (the final-norm state, from which the training step recomputes the draft-vocabulary
logits as h_L @ head[:, draft ids]), the target's full-vocabulary argmax, the input ids and the assistant
mask (format: `store`). The forward is one jitted function with the batch sharded over the mesh's `'data'`
axis, as in training. The argmax is taken `inference.LOGITS_CHUNK` positions at a time
(`inference.over_positions`): the [B, T, V] float32 logits are never held (4 GiB for an [8, 512] batch of
Gemma 3's V = 262,144), and the top-1 is bit-identical to the full computation's.

Before writing, the store's size is estimated and printed, and the extraction refuses to start when it would
not fit on the disk. It resumes: finished shards are skipped (a shard is written under a temporary name and
renamed), and a disk that fills mid-write removes the partial shard and stops with one message. Multi-host:
every process extracts its own slice of every split (sequences p, p + P, p + 2P, ...) in lock step, writes its
own shards (the process index is in their names) and a manifest part; the reader merges the parts. On a TPU
pod this needs a filesystem all hosts share (README, "Devices").

Legend (`layerwave.axes`): B batch, T tokens, L target layers, V target vocabulary.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import shutil
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from layerwave import atomic
from layerwave import layer_ids
from layerwave import options as options_lib
from layerwave import sharding
from layerwave.analysis import report as report_lib
from layerwave.data import batching
from layerwave.data import tfds_builders
from layerwave.data.options import DataOptions
from layerwave.inference import LOGITS_CHUNK, Target, load_target, over_positions, positions_from_mask, with_dtype
from layerwave.inference import target_fingerprint
from layerwave.models.kv_cache import causal_mask
from layerwave.training import losses
from layerwave.training.features import store as store_lib

__all__ = ["FeatureOptions", "extract", "run"]

SPLITS = tfds_builders.SPLITS


@dataclasses.dataclass(frozen=True)
class FeatureOptions:
  """`config.features`: where and what experiments/extract_features.py stores.

  Attributes:
    dir: the store directory (training reads it with `--config.train.features=DIR`).
    depths: "" = the layers of `config.layers` (or the union of every set in `selection.path`), a list
      "2,15,27", or "all" (0..L). L is always stored (h_L feeds the loss).
    dtype: "bfloat16" (default, half the disk) or "float32": how the features are *stored*.
    compute_dtype: "" = the target's own `config.dtype`; "bfloat16" runs the training split's extraction
      forward on a bfloat16 copy of the target (1.3-1.6x faster on this CPU, BENCHMARKS.md "Throughput") while
      the store still serves drafts of the `config.dtype` target (its fingerprint; the header records
      `compute_dtype`, so a run's store fingerprint tells the two apart). The held-out split is always
      computed in `config.dtype`: it stands for inference, where the draft reads the target's own states.
      What bf16 changes in the draft is measured by `make extract-dtype-check` (within seed noise).
    shard_sequences: sequences per shard file.
    batch_size: global batch of the extraction forward (divisible by the mesh's data axis).
    splits: which splits of the chat dataset, "train,heldout".
  """

  dir: str = ""
  depths: str = ""
  dtype: str = "bfloat16"
  compute_dtype: str = ""
  shard_sequences: int = 256
  batch_size: int = 8
  splits: str = "train,heldout"

  def __post_init__(self):
    if self.dtype not in store_lib.DTYPES:
      raise ValueError(f"features.dtype must be one of {sorted(store_lib.DTYPES)}, got {self.dtype!r}; set "
                       "--config.features.dtype=bfloat16.")
    if self.compute_dtype not in ("", "float32", "bfloat16", "float16"):
      raise ValueError(f"features.compute_dtype must be '' (the target's config.dtype), 'float32', 'bfloat16' or "
                       f"'float16', got {self.compute_dtype!r}.")
    for name in ("shard_sequences", "batch_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"features.{name} must be >= 1, got {getattr(self, name)}.")
    bad = [s for s in self.split_names if s not in SPLITS]
    if bad or not self.split_names:
      raise ValueError(f"features.splits must name splits among {list(SPLITS)}, got {self.splits!r}.")

  @property
  def split_names(self) -> tuple[str, ...]:
    return tuple(s.strip() for s in self.splits.split(",") if s.strip())


def _gib(n: float) -> str:
  """A byte count for people: '3.21 GiB', '412.0 MiB', '48.3 KiB'."""
  for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
    if n >= size:
      return f"{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
  return f"{n / 2**10:.1f} KiB"


def target_dtype_name(target: Target) -> str:
  """The target's compute dtype as its config name ('float32', 'bfloat16', ...)."""
  return jnp.dtype(target.params["embed_tokens"]["embedding"][...].dtype).name


@functools.lru_cache(maxsize=8)
def forward_step(mesh: Mesh, graphdef, hidden_layers: tuple[int, ...], dtype, chunk: int = LOGITS_CHUNK) -> Any:
  """The jitted extraction forward for one mesh / depth set: (hidden, final, argmax), batch over 'data'.

  The argmax comes from the final states `chunk` positions at a time (never the [B, T, V] logits).
  """
  rows, feats = NamedSharding(mesh, P("data")), NamedSharding(mesh, P(None, "data"))

  def fn(params, tokens, mask):
    model = nnx.merge(graphdef, params)
    out = model(tokens, positions_from_mask(mask), causal_mask(mask), return_hidden_states=bool(hidden_layers),
                hidden_layers=hidden_layers or None, compute_logits=False, valid=mask)
    b, t = tokens.shape
    hidden = (out.hidden_states.astype(dtype) if hidden_layers else
              jnp.zeros((0, b, t, out.last_hidden.shape[-1]), dtype))
    top1 = over_positions(out.last_hidden, lambda h: losses.argmax(model.logits(h)).astype(jnp.int32), chunk)
    return hidden, out.last_hidden.astype(dtype), top1

  return jax.jit(fn, out_shardings=(feats, rows, rows))


def _host_local(x: jax.Array, axis: int) -> np.ndarray:
  """This process's rows of a global array sharded over 'data' along `axis`."""
  if x.is_fully_addressable:
    return np.asarray(x)
  pieces = {}
  for shard in x.addressable_shards:
    pieces.setdefault(shard.index[axis].start or 0, shard.data)
  return np.concatenate([np.asarray(pieces[k]) for k in sorted(pieces)], axis=axis)


def _all_agree(flag: bool) -> bool:
  """True when every process says True (one process: the flag itself)."""
  if jax.process_count() == 1:
    return flag
  return bool(np.all(multihost_utils.process_allgather(np.asarray([flag]))))


def _dir_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def make_header(target: Target, dataset: tfds_builders.ChatDataset, *, depths: Sequence[int], dtype: str,
                shard_sequences: int, process_count: int, data: Mapping[str, Any] | None,
                model: str = "", compute_dtype: str = "") -> dict[str, Any]:
  """The store's manifest header (`store.CONTRACT` plus what is informational); `compute_dtype` only when the
  forward ran in another dtype than the target's own."""
  c = target.config
  all_depths = sorted(set(depths) | {c.num_layers})
  own = target_dtype_name(target)
  extra = {"compute_dtype": compute_dtype} if compute_dtype and compute_dtype != own else {}
  return extra | {
      "format_version": store_lib.FORMAT_VERSION,
      "target_fingerprint": target_fingerprint(target),
      "tokenizer_fingerprint": tfds_builders.tokenizer_fingerprint(target.tokenizer),
      "target": {"num_layers": c.num_layers, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
                 "dtype": target_dtype_name(target)},
      "model": model or target.path or "",
      "dataset": dataset.name,
      "data": dict(data or {}),
      "dataset_metadata": {k: v for k, v in dict(dataset.metadata).items() if k != "tokenizer_name"},
      "depths": all_depths,
      "stored_depths": [d for d in all_depths if d != c.num_layers],
      "dtype": dtype,
      "hidden_size": c.hidden_size,
      "seq_len": int(dataset.metadata["max_length"]),
      "shard_sequences": int(shard_sequences),
      "process_count": int(process_count),
      "bytes_per_token": store_lib.bytes_per_token(len(all_depths) - 1, c.hidden_size, dtype),
      "complete": False,
  }


def _estimate(dataset, splits: Sequence[str], header: Mapping[str, Any]) -> tuple[int, int]:
  """(tokens, bytes) of the whole store for `splits` (8 + 8 bytes of offsets and index per sequence)."""
  tokens = sequences = 0
  for split in splits:
    n = dataset.num_examples.get(split, 0)
    tokens += int(dataset.metadata.get(f"{split}_tokens", n * header["seq_len"]))  # else an upper bound
    sequences += n
  return tokens, tokens * header["bytes_per_token"] + 16 * sequences


def _fetch(source, indices: np.ndarray) -> list[Mapping[str, Any]]:
  if not len(indices):
    return []
  getitems = getattr(source, "__getitems__", None)
  if getitems is not None:
    return list(getitems([int(i) for i in indices]))
  return [source[int(i)] for i in indices]


# Extraction batches are padded to a multiple of this many tokens (see _length_sorted).
WIDTH_STEP = 64


def _length_sorted(lengths: np.ndarray, n: int, n_proc: int, p: int, s: int, shard_sequences: int, local: int,
                   seq_len: int) -> tuple[np.ndarray, list[int]]:
  """Process p's sequences of shard s, longest first, and each batch's padded width.

  Every process sorts its own slice of the shard the same way and pads batch b to the smallest multiple of
  WIDTH_STEP (at most seq_len) that holds the longest sequence any process has in batch b, so all processes run
  one global [P * local, width] forward in lock step, and a batch of short sequences stops paying for a full
  seq_len of padding (the forward on real tokens does not depend on the width: causal attention, masked
  padding). Multiples of 64 rather than powers of two: 1.14 padded tokens per real one instead of 1.40 on the
  campaign's answers (BENCHMARKS.md, "Feature store"), for at most seq_len / 64 compiled widths.
  """
  slices = [np.arange(q, n, n_proc, dtype=np.int64)[s * shard_sequences:(s + 1) * shard_sequences]
            for q in range(n_proc)]
  slices = [sl[np.argsort(-lengths[sl], kind="stable")] for sl in slices]
  rows = max(len(sl) for sl in slices)
  widths = []
  for start in range(0, rows, local):
    longest = max((int(lengths[sl[start:start + local]].max()) for sl in slices if len(sl) > start), default=1)
    widths.append(min(seq_len, -(-max(longest, 1) // WIDTH_STEP) * WIDTH_STEP))
  return slices[p], widths


def extract(target: Target, dataset: tfds_builders.ChatDataset, out_dir: str, *, depths: Sequence[int],
            dtype: str = "bfloat16", splits: Sequence[str] = SPLITS, batch_size: int = 8,
            shard_sequences: int = 256, data: Mapping[str, Any] | None = None, model: str = "",
            process_index: int | None = None, process_count: int | None = None,
            log_every_s: float = 30.0, compute_target: Target | None = None) -> dict[str, Any]:
  """Runs the frozen target over `dataset` once and writes (or completes) a feature store at `out_dir`.

  Args:
    target: the target (on its mesh; the batch is sharded over its `'data'` axis).
    dataset: the chat dataset (`DataOptions.build`); sequences are its examples, T = its max_length.
    out_dir: the store directory (created; an existing store with the same contract is resumed).
    depths: hidden-state depths to store (HF convention); L (h_L) is always added.
    dtype: "bfloat16" or "float32".
    splits: the dataset's splits to extract (absent ones are skipped).
    batch_size: global batch of the forward (process_count * local rows).
    shard_sequences: sequences per shard.
    data: the data options the dataset was built from (recorded; training checks its own against them).
    model: the target's spec, recorded for people.
    process_index, process_count: this process and their number; default jax's.
    log_every_s: progress log interval.
    compute_target: the same checkpoint loaded in another dtype (e.g. bfloat16) to run the training split's
      forward with; the store still serves `target` (its fingerprint and dtype) and records `compute_dtype`.
      The held-out split is always computed by `target` itself (it stands for inference).

  Returns:
    A summary: the header, per-split counts of this process, tokens/s of this run and the store's bytes.

  Raises:
    store.StoreError: `out_dir` holds a store with another contract, or bad depths.
    OSError: (ENOSPC) the store would not fit on the disk (before writing), or the disk filled.
  """
  p = jax.process_index() if process_index is None else int(process_index)
  n_proc = jax.process_count() if process_count is None else int(process_count)
  c = target.config
  depths = store_lib.parse_depths(list(depths), c.num_layers)
  if target.tokenizer is None:
    raise ValueError("The target has no tokenizer: a feature store records the tokenizer's fingerprint.")
  if batch_size % n_proc:
    raise ValueError(f"features.batch_size={batch_size} must be divisible by the process count {n_proc}.")
  local = batch_size // n_proc
  sharding.check_batch(target.mesh, local * jax.process_count())
  compute_dtype = ""
  if "train" not in splits:
    compute_target = None  # only the training split runs on it (a held-out-only store is the target's own)
  if compute_target is not None:
    if (compute_target.config.identity() != c.identity() or
        jax.tree_util.tree_structure(compute_target.params) != jax.tree_util.tree_structure(target.params)):
      raise ValueError("compute_target must be the target's own checkpoint loaded in another dtype.")
    compute_dtype = target_dtype_name(compute_target)
  else:
    compute_target = target
  header = make_header(target, dataset, depths=depths, dtype=dtype, shard_sequences=shard_sequences,
                       process_count=n_proc, data=data, model=model, compute_dtype=compute_dtype)
  os.makedirs(out_dir, exist_ok=True)
  manifest = os.path.join(out_dir, store_lib.MANIFEST)
  if os.path.exists(manifest):
    old = store_lib.read_header(out_dir)
    differ = store_lib.contract_mismatch(old, header)
    if differ:
      raise store_lib.StoreError(
          f"{out_dir} holds a feature store with other settings (differing: {', '.join(differ)}). Resume it "
          "with the same config, or extract into a new --config.features.dir (or delete it).")
  elif p == 0 or jax.process_count() == 1:
    atomic.write_json(manifest, header)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("layerwave_features_header")
  for name in os.listdir(out_dir):  # this process's leftovers of a killed write
    if name.startswith(store_lib.tmp_prefix(p)):
      shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)

  splits = [s for s in splits if dataset.num_examples.get(s)]
  total_tokens, total_bytes = _estimate(dataset, splits, header)
  done_bytes = sum(_dir_bytes(os.path.join(out_dir, n)) for n in os.listdir(out_dir)
                   if any(n.startswith(s + "-p") for s in splits))
  free = shutil.disk_usage(out_dir).free
  need = max(total_bytes - done_bytes, 0)
  logging.info("Feature store %s: ~%s for %d tokens (%d bytes/token: %d depths + h_L x D=%d in %s, ids, "
               "masks); %s already written, %s free.", out_dir, _gib(total_bytes), total_tokens,
               header["bytes_per_token"], len(header["stored_depths"]), c.hidden_size, dtype, _gib(done_bytes),
               _gib(free))
  if need > free:
    raise OSError(errno.ENOSPC,
                  f"The feature store at {out_dir} needs ~{_gib(need)} more ({total_tokens} tokens x "
                  f"{header['bytes_per_token']} bytes/token for depths {header['depths']} in {dtype}), but only "
                  f"{_gib(free)} are free there. Free space, store fewer depths (--config.features.depths) or "
                  "bfloat16, or train online without a store (leave train.features unset).")

  store_dtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
  # The held-out split stands for inference, where the draft reads the target's own states: it is always
  # computed by `target`; only the training split runs on `compute_target` (BENCHMARKS.md, "Throughput").
  runs = {split: target if split == "heldout" else compute_target for split in splits}
  forwards = {}
  for t in runs.values():
    if id(t) not in forwards:
      forwards[id(t)] = (t, forward_step(t.mesh, t.graphdef, tuple(header["stored_depths"]), store_dtype))
  rows = NamedSharding(target.mesh, P("data"))
  pad_id = int(target.tokenizer.pad_token_id or 0)
  seq_len = header["seq_len"]
  parts: dict[str, list[dict[str, int | str]]] = {}
  part_path = os.path.join(out_dir, store_lib.part_name(p))
  if os.path.exists(part_path):
    with open(part_path) as f:
      parts.update(json.load(f)["splits"])
  tic, computed, finished = time.perf_counter(), 0, 0
  last_log = tic
  for split in splits:
    source = dataset.source(split)
    forward_target, fn = forwards[id(runs[split])]
    n = len(source)
    mine = np.arange(p, n, n_proc, dtype=np.int64)
    largest = len(range(0, n, n_proc))  # process 0's slice: every process runs as many batches
    num_shards = -(-largest // shard_sequences)
    collator = batching.BatchIterator(source, batch_size=local, seq_len=seq_len, pad_id=pad_id,
                                      shuffle=False, drop_remainder=False, process_index=0, process_count=1)
    lengths_all = None  # read when a shard is computed (not on a resume that skips every shard)
    shards = []
    for s in range(num_shards):
      name = store_lib.shard_name(split, p, s)
      path = os.path.join(out_dir, name)
      seqs = mine[s * shard_sequences:(s + 1) * shard_sequences]
      exists = os.path.isdir(path)
      if exists:
        offsets = np.load(os.path.join(path, "offsets.npy"))
        shards.append({"name": name, "sequences": int(offsets.shape[0] - 1), "tokens": int(offsets[-1])})
        finished += int(offsets[-1])
      if _all_agree(exists or not len(seqs)):
        continue
      rows_in_shard = min(shard_sequences, largest - s * shard_sequences)
      pieces = {k: [] for k in ("hidden", "final", "argmax", "input_ids", "assistant_mask")}
      lengths, index = [], []
      if lengths_all is None:
        lengths_all = collator.lengths()
      seqs, widths = _length_sorted(lengths_all, n, n_proc, p, s, shard_sequences, local, seq_len)
      for start, width in zip(range(0, rows_in_shard, local), widths):
        idx = seqs[start:start + local]
        batch = collator.collate(_fetch(source, idx), idx, batching.Position(), shape=(local, width))
        tokens = jax.make_array_from_process_local_data(rows, batch.input_ids)
        mask = jax.make_array_from_process_local_data(rows, batch.attention_mask)
        hidden, final, argmax = fn(forward_target.params, tokens, mask)
        hidden, final, argmax = _host_local(hidden, 1), _host_local(final, 0), _host_local(argmax, 0)
        for r in range(len(idx)):
          m = int(batch.attention_mask[r].sum())
          # Copies of the real tokens only, so that the padded batch arrays are freed.
          pieces["hidden"].append(hidden[:, r, :m].copy())
          pieces["final"].append(final[r, :m].copy())
          pieces["argmax"].append(argmax[r, :m].copy())
          pieces["input_ids"].append(batch.input_ids[r, :m])
          pieces["assistant_mask"].append(batch.assistant_mask[r, :m].astype(np.uint8))
          lengths.append(m)
          index.append(int(idx[r]))
        computed += int(batch.attention_mask.sum())
        now = time.perf_counter()
        if now - last_log >= log_every_s:
          last_log = now
          rate = computed / (now - tic)
          left = max(total_tokens // n_proc - finished - computed, 0)
          logging.info("extract %s: shard %d/%d, %d tokens this run, %.0f tokens/s, ETA %.0f s", split, s + 1,
                       num_shards, computed, rate, left / max(rate, 1e-9))
      if exists or not len(seqs):
        continue  # another process needed this shard; this one had it already
      storage = store_lib.DTYPES[dtype][1]
      arrays = {
          "hidden": np.concatenate(pieces["hidden"], axis=1).view(storage),
          "final": np.concatenate(pieces["final"], axis=0).view(storage),
          "argmax": np.concatenate(pieces["argmax"]).astype(np.int32),
          "input_ids": np.concatenate(pieces["input_ids"]).astype(np.int32),
          "assistant_mask": np.concatenate(pieces["assistant_mask"]),
          "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
          "index": np.asarray(index, np.int64),
      }
      try:
        store_lib.write_shard(out_dir, name, arrays, p)
      except OSError as e:
        if e.errno != errno.ENOSPC:
          raise
        raise OSError(errno.ENOSPC,
                      f"The disk filled while writing shard {name} of the feature store at {out_dir} "
                      f"({_gib(shutil.disk_usage(out_dir).free)} free now). The partial shard was removed; "
                      f"the {len(shards)} finished shards of {split!r} are kept and a rerun resumes after "
                      "them. Free space, store fewer depths or bfloat16, or train online (leave "
                      "train.features unset).") from e
      shards.append({"name": name, "sequences": len(lengths), "tokens": int(sum(lengths))})
      logging.info("extract %s: wrote %s (%d sequences, %d tokens); %d tokens/s", split, name, len(lengths),
                   sum(lengths), computed / max(time.perf_counter() - tic, 1e-9))
    parts[split] = shards
  atomic.write_json(part_path, {"process_index": p, "splits": parts})
  seconds = time.perf_counter() - tic
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("layerwave_features_parts")
  if (p == 0 or jax.process_count() == 1) and all(
      os.path.exists(os.path.join(out_dir, store_lib.part_name(i))) for i in range(n_proc)):
    _write_merged(out_dir, header)
  return {"header": header, "splits": parts, "tokens_computed": computed, "seconds": seconds,
          "tokens_per_s": computed / max(seconds, 1e-9), "bytes": _dir_bytes(out_dir)}


def _write_merged(out_dir: str, header: Mapping[str, Any]) -> None:
  """manifest.json with the merged per-split counts and shards (what `store.open_store` reads, checked)."""
  store = store_lib.open_store(out_dir)
  splits = {}
  for split, shards in store.splits.items():
    sequences, tokens = store.counts(split)
    splits[split] = {"sequences": sequences, "tokens": tokens, "shards": [s.name for s in shards]}
  atomic.write_json(os.path.join(out_dir, store_lib.MANIFEST),
                    {**header, "complete": True, "splits": splits, "bytes": _dir_bytes(out_dir)})


def default_depths(config, num_layers: int) -> tuple[int, ...]:
  """The layers the user will train: `config.layers`, else the union of every set in `selection.path`."""
  ids = layer_ids.parse_layer_ids(config.layers)  # () when none given (--config.layers= gives ('',))
  if ids:
    return ids
  path = config.selection.path
  if path and os.path.exists(path):
    return tuple(sorted({i for s in report_lib.load_selections(path).values() for i in s.ids}))
  return ()


def run(config) -> dict[str, Any]:
  """The extraction stage: `config.features` into `features.dir`, from the chat dataset of `config.data`."""
  opts = options_lib.from_section(FeatureOptions, config.features, "features")
  data = options_lib.from_section(DataOptions, config.data, "data")
  if not opts.dir:
    raise ValueError("Give the store's directory: --config.features.dir=DIR.")
  sharding.use_compilation_cache(config.get("compilation_cache", ""))
  sharding.maybe_initialize_distributed(config.distributed)
  sharding.check_processes_agree(config, "Feature extraction")
  mesh = sharding.make_mesh(config.mesh)
  target = load_target(config.model, dtype=config.dtype, mesh=mesh)
  if target.tokenizer is None:
    raise ValueError(f"{config.model} has no tokenizer; the chat data cannot be tokenised.")
  depths = store_lib.parse_depths(opts.depths, target.config.num_layers,
                                  default=default_depths(config, target.config.num_layers))
  dataset = data.build(target.tokenizer)
  compute_target = None
  if opts.compute_dtype and opts.compute_dtype != target_dtype_name(target) and "train" in opts.split_names:
    # The float32 target's parameters cast (what loading in that dtype gives, `with_dtype`), as online
    # training's `train.target_dtype` does; a narrower target is widened by loading the checkpoint again.
    compute_target = (with_dtype(target, opts.compute_dtype) if target_dtype_name(target) == "float32" else
                      load_target(config.model, dtype=opts.compute_dtype, mesh=mesh))
  return extract(target, dataset, opts.dir, depths=depths, dtype=opts.dtype, splits=opts.split_names,
                 batch_size=opts.batch_size, shard_sequences=opts.shard_sequences,
                 data=data.record(), model=config.model, compute_target=compute_target)
