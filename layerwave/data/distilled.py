"""A self-distilled dataset on disk: the workdir's files, its array_record builder and who wrote it.

Place in the pipeline: the one module that knows a distillation workdir's layout. `layerwave.data.distill`
writes it (`check_settings`, `write_chunk`, `build_dataset`) and records in its manifest who wrote it
(`target_fingerprint`, `tfds_builders.tokenizer_fingerprint`); `layerwave.data.release` packs its chunks and
rebuilds them (`finished_chunks`, `write_chunk`, `content_fingerprint`); `sources.read_distilled` reads the
dataset back as `Record`s; `DataOptions.build` calls `check_source` so that analysis and training refuse data
another target or tokenizer wrote, or data read in another chat format than its prompts were written in.

The workdir: `settings.json` (the settings fingerprint and the settings it hashes, written before the first
chunk), `chunks/NNNNN.json` (one per finished chunk: its index, the fingerprint, the conversation ids it
covers, its counters, and its records, each with `answer_tokens`, the kept token ids of every answer),
`dataset/` (built from the chunks, records without `answer_tokens`) and `manifest.json` (written last).

The dataset has the record schema of the ShareGPT source: `id`, `group`, `index` (position in the prompt
source) and `messages` (a sequence of `role` / `content` texts), in one split, "train" (`build_chat_dataset`
splits it later by `group`, as it does the source).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import shutil
from typing import Any, Sequence

import jax
import numpy as np
import tensorflow_datasets as tfds
from absl import logging

from layerwave import atomic
from layerwave.data import sources
from layerwave.data import tfds_builders
from layerwave.inference import Target

__all__ = ["DistilledChat", "SETTINGS", "build_dataset", "check_settings", "check_source", "checkpoint_fingerprint",
           "chunk_path", "content_fingerprint", "dataset_records", "finished_chunks", "read_chunk", "read_settings",
           "target_fingerprint", "write_chunk"]

DATASET_NAME = "distilled_chat"
SETTINGS = "settings.json"


# -- fingerprints ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def _directory_fingerprint(path: str, stamp: tuple) -> str:
  del stamp  # part of the cache key only: a rewritten file is hashed again
  digest = hashlib.sha256()
  with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
    digest.update(json.dumps(json.load(f), sort_keys=True).encode())
  for name in _weight_files(path):
    digest.update(os.path.basename(name).encode() + b"\0")
    with open(name, "rb") as f:
      while block := f.read(1 << 24):
        digest.update(block)
  return digest.hexdigest()[:16]


def _weight_files(path: str) -> list[str]:
  return sorted(glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(os.path.join(path, "*.bin")))


def checkpoint_fingerprint(path: str) -> str | None:
  """A hash of a checkpoint directory's config.json (parsed) and weight files (bytes): the model's identity.

  Args:
    path: an HF-layout directory (what `hub.resolve` returns and `Target.path` holds).

  Returns:
    16 hex digits (one read of every weight file, then cached until a file changes), or None if `path` is
    no checkpoint.
  """
  if not path or not os.path.isfile(os.path.join(path, "config.json")):
    return None
  files = [os.path.join(path, "config.json")] + _weight_files(path)
  stamp = tuple((f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files)
  return _directory_fingerprint(os.path.realpath(path), stamp)


def target_fingerprint(target: Target) -> str:
  """The target's identity: its checkpoint directory's fingerprint (independent of the compute dtype).

  A target built in memory (no checkpoint directory) is hashed from its parameters instead.
  """
  found = checkpoint_fingerprint(target.path)
  if found is not None:
    return found
  digest = hashlib.sha256(json.dumps(target.config.identity(), sort_keys=True, default=str).encode())
  for leaf in jax.tree.leaves(target.params):
    digest.update(np.asarray(leaf, np.float32).tobytes())
  return digest.hexdigest()[:16]


def check_source(source: str, tokenizer: Any, chat_format: str | None = None) -> None:
  """Refuses a distilled dataset written by another target or tokenizer than the one reading it, or read in
  another chat format than its prompts were written in.

  Args:
    source: a data source string (`config.data.source`); anything but a distilled dataset passes.
    tokenizer: the reading target's tokenizer.
    chat_format: the format the reader renders conversations in (`config.data.chat_format`; None = not
      checked). The answers continue prompts in the manifest's `prompts.chat_format` ("template" in
      manifests written before the option), so reading them in the other one would train on contexts the
      target never answered in.

  Analysis and training call this (through `DataOptions.build`) with the target's tokenizer; the target's
  identity is the checkpoint directory the tokenizer was loaded from (`tokenizer.name_or_path`, which
  `load_target` sets to the target's directory). Other sources pass.

  Raises:
    ValueError: the manifest names another tokenizer, target or chat format, with the fix.
  """
  directory = sources.distilled_path(source)
  if directory is None:
    return
  manifest = sources.read_distilled_manifest(directory)
  wrote_format = manifest.get("prompts", {}).get("chat_format", "template")
  if chat_format is not None and chat_format != wrote_format:
    raise ValueError(f"{directory} holds answers to prompts in the {wrote_format!r} chat format; read as "
                     f"{chat_format!r} they would sit in contexts the target did not answer. Read it with "
                     f"--config.data.chat_format={wrote_format}, or distil again with --config.data.chat_format="
                     f"{chat_format} into a new --workdir.")
  wrote = manifest["target"]
  fix = (f"Distil the data with this model (python experiments/distill.py --config.model=MODEL "
         f"--workdir=NEW_DIR) or read it with the model that wrote it (--config.model={wrote['model']}).")
  tok_fp = tfds_builders.tokenizer_fingerprint(tokenizer)
  if manifest["tokenizer"]["fingerprint"] != tok_fp:
    raise ValueError(f"{directory} was distilled with another tokenizer (fingerprint "
                     f"{manifest['tokenizer']['fingerprint']}, {manifest['tokenizer']['name']}) than the one "
                     f"reading it ({tok_fp}, {getattr(tokenizer, 'name_or_path', '')}). {fix}")
  model_fp = checkpoint_fingerprint(str(getattr(tokenizer, "name_or_path", "") or ""))
  if model_fp is None:
    logging.warning("Cannot identify the model reading %s (its tokenizer was not loaded from a checkpoint "
                     "directory); only the tokenizer was checked.", directory)
  elif model_fp != wrote["fingerprint"]:
    raise ValueError(f"{directory} holds the answers of another target ({wrote['model']}, fingerprint "
                     f"{wrote['fingerprint']}) than the one reading it ({tokenizer.name_or_path}, fingerprint "
                     f"{model_fp}): a draft trained on them would learn another model. {fix}")


# -- the workdir's settings and chunks ---------------------------------------------------------------

def chunk_path(workdir: str, k: int) -> str:
  """Where chunk k's file lives."""
  return os.path.join(workdir, "chunks", f"{k:05d}.json")


def read_settings(workdir: str) -> dict[str, Any] | None:
  """`settings.json` ({"fingerprint", "settings"}), or None when the workdir has none."""
  path = os.path.join(workdir, SETTINGS)
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def check_settings(workdir: str, settings: dict[str, Any], fingerprint: str) -> None:
  """Refuses a workdir holding a run with other settings (naming the fields that differ); records this run's
  settings in a new one."""
  old = read_settings(workdir)
  if old is not None:
    if old.get("fingerprint") != fingerprint:
      before = old.get("settings", {})
      diff = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
      raise ValueError(
          f"{workdir} holds distilled data made with other settings (fingerprint {old.get('fingerprint')} vs "
          f"{fingerprint}; differing: {', '.join(diff) or 'format'}). Mixing them would give a dataset "
          "whose answers disagree: rerun with the same settings (only num_prompts, batch_size, slots and "
          "chunk_steps may change) or use a new --workdir.")
    return
  if os.path.isfile(os.path.join(workdir, sources.DISTILLED_MANIFEST)) or glob.glob(
      os.path.join(workdir, "chunks", "*.json")):
    raise ValueError(f"{workdir} holds distilled chunks but no {SETTINGS}; use a new --workdir.")
  atomic.write_json(os.path.join(workdir, SETTINGS), {"fingerprint": fingerprint, "settings": settings})


def read_chunk(workdir: str, k: int, ids: list[str], fingerprint: str) -> dict[str, Any] | None:
  """Chunk k's file if it is finished and holds exactly `ids` under `fingerprint`, else None (missing or stale)."""
  path = chunk_path(workdir, k)
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    chunk = json.load(f)
  if chunk.get("fingerprint") != fingerprint or chunk.get("ids") != ids:
    return None
  return chunk


def write_chunk(workdir: str, chunk: dict[str, Any]) -> None:
  """Writes a finished chunk ({"chunk", "fingerprint", "ids", "stats", "records"}) atomically."""
  atomic.write_json(chunk_path(workdir, int(chunk["chunk"])), chunk)


def finished_chunks(workdir: str) -> list[dict[str, Any]]:
  """The workdir's chunk files that belong to its settings, in chunk order ([] without settings)."""
  settings = read_settings(workdir)
  if settings is None:
    return []
  chunks = []
  for path in sorted(glob.glob(os.path.join(workdir, "chunks", "[0-9]*.json"))):
    with open(path, encoding="utf-8") as f:
      chunk = json.load(f)
    if chunk.get("fingerprint") == settings["fingerprint"]:
      chunks.append(chunk)
  return chunks


def dataset_records(chunks: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """The dataset's records of these chunks, in order: the chunk records less their `answer_tokens`."""
  return [{k: v for k, v in r.items() if k != "answer_tokens"} for c in chunks for r in c["records"]]


def content_fingerprint(records: Sequence[dict[str, Any]]) -> str:
  """The manifest's `dataset.content`: a hash of the dataset's records (what a rebuilt workdir must match)."""
  text = json.dumps(list(records), sort_keys=True)
  return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


# -- the dataset on disk -----------------------------------------------------------------------------

class DistilledChat(tfds.core.GeneratorBasedBuilder):
  """tfds builder of the regenerated conversations; `build_dataset` constructs it from the finished chunks."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "id, group, index, messages (role, content)."}

  def __init__(self, *, records: Sequence[dict[str, Any]], **kwargs: Any):
    self._records = records
    super().__init__(**kwargs)

  @tfds.core.utils.classproperty
  @classmethod
  def name(cls) -> str:
    return DATASET_NAME

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> None:  # nothing is downloaded: no checksum file (see tfds_builders.ChatTokens)
    return None

  def _info(self) -> tfds.core.DatasetInfo:
    text = tfds.features.Text()
    return tfds.core.DatasetInfo(
        builder=self, description="Conversations whose assistant turns the target wrote (layerwave).",
        features=tfds.features.FeaturesDict({
            "id": text, "group": text, "index": np.int64,
            "messages": tfds.features.Sequence({"role": text, "content": text}),
        }))

  def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
    del dl_manager
    return {"train": self._generate_examples()}

  def _generate_examples(self):
    for r in self._records:
      yield r["id"], {"id": r["id"], "group": r["group"], "index": r["index"], "messages": r["messages"]}


def build_dataset(workdir: str, records: Sequence[dict[str, Any]]) -> str:
  """Writes the array_record dataset into `workdir/dataset` atomically; returns its path relative to workdir."""
  tfds.disable_progress_bar()
  with atomic.atomic_directory(os.path.join(workdir, "dataset")) as tmp:
    builder = DistilledChat(records=records, data_dir=tmp, file_format="array_record")
    builder.download_and_prepare()
    relative = os.path.relpath(str(builder.data_dir), tmp)
    shutil.rmtree(os.path.join(tmp, "downloads"), ignore_errors=True)  # tfds makes it; nothing is downloaded
  return os.path.join("dataset", relative)
