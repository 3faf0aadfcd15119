"""What a draft trains from: a source opens and checks its data, then, bound to the run's draft, gives
`training.loop.train` its training batches, its train function and its held-out evaluation.

`OnlineSource`: the chat dataset (tfds array_record); the target runs inside each step (`step.train_step`) to
compute the selected layers' hidden states. `StoreSource`: a feature store (`layerwave.training.features`,
written by experiments/extract_features.py), with the train splits of `train.extra_features` beside its own and
the held-out split of `train.eval_features` in place of its own; the step runs no target
(`step.train_step_offline`) and reads the target's LM-head rows of the draft vocabulary. A store that cannot
stand in for the target here (another target, tokenizer, missing layer, other data) is refused when it is
opened, before training. With the same seed both sources visit the same sequences in the same order.

Legend (`layerwave.axes`): D target width, V target vocabulary, V_d draft vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from layerwave import data as data_lib
from layerwave import layer_ids
from layerwave import sharding
from layerwave.data.options import DataOptions
from layerwave.inference import Target, compute_dtype, target_fingerprint, with_dtype
from layerwave.training import features as features_lib
from layerwave.training import step as step_lib
from layerwave.training.options import TrainOptions


def dtype_name(target: Target) -> str:
  """The target's compute dtype by name ("float32", "bfloat16")."""
  return str(jnp.dtype(compute_dtype(target.graphdef, target.params)))


def target_head(target: Target) -> jax.Array:
  """The target's LM head as `[D, V]` (the transposed embedding when tied)."""
  tp = target.params
  return (tp["embed_tokens"]["embedding"][...].T if target.config.tie_word_embeddings
          else tp["lm_head"]["kernel"][...])


def place(tree, shardings):
  """`tree` on the devices as `shardings` say, from this process."""
  if jax.process_count() > 1:
    # Across processes, device_put of a process-local jax.Array can build an array whose shards are not one
    # per device (orbax cannot save it); the same value from host memory places cleanly on every process.
    tree = jax.tree.map(np.asarray, tree)
  return jax.device_put(tree, shardings)


def replicate(tree, mesh):
  """`tree` whole on every device of `mesh`."""
  return place(tree, sharding.replicated(mesh))


def load_data(data: DataOptions, target: Target):
  """Builds (or reuses) the chat dataset; returns (ChatDataset, train source, held-out source)."""
  if data.max_length > target.config.max_position_embeddings:
    raise ValueError(f"data.max_length={data.max_length} exceeds the target's max_position_embeddings "
                     f"({target.config.max_position_embeddings}).")
  dataset = data.build(target.tokenizer)
  if not dataset.num_examples.get("train"):
    raise ValueError("No training example left after filtering (every conversation was dropped); "
                     "raise data.max_length or use more records.")
  heldout = dataset.source("heldout") if dataset.num_examples.get("heldout") else None
  return dataset, dataset.source("train"), heldout


def load_store(path: str, data: DataOptions, target: Target, record: layer_ids.LayerSelection,
               own_data: bool = False):
  """Opens and checks a feature store for this run; returns (store, train split or None, held-out split or None)
  (a store of only a held-out split serves `train.eval_features`).

  Args:
    path, data, target, record: the store and what this run trains.
    own_data: accept the store's own data (`train.eval_features`: a held-out split of other text); the target,
      tokenizer, layers and sequence length are checked all the same.

  Raises:
    features.StoreError: the store cannot stand in for the target here (see `features.check_for_training`).
  """
  store = features_lib.open_store(path)
  data_dict = data.record()
  if own_data:
    data_dict = {**store.header.get("data", {}), "max_length": data.max_length}
  features_lib.check_for_training(
      store, target_config=target.config, target_dtype=dtype_name(target),
      target_fingerprint=target_fingerprint(target),
      tokenizer_fingerprint=data_lib.tokenizer_fingerprint(target.tokenizer), layer_ids=record.ids,
      data=data_dict)
  heldout = store.split("heldout", data.max_length) if store.counts("heldout")[0] else None
  train = store.split("train", data.max_length) if store.counts("train")[0] else None
  return store, train, heldout


def load_extra_store(path: str, store, data: DataOptions, target: Target, record: layer_ids.LayerSelection):
  """Opens one of `train.extra_features`: checked as `train.eval_features` is (its own data; the target,
  tokenizer, layers and length as this run's), and against `store`, the run's own: the same layer slots, and
  the same train / held-out split of conversations (`data.heldout_fraction`, `data.split_seed`), so that its
  train split holds none of the conversations `store` holds out. Returns (store, its train split).

  Raises:
    features.StoreError: it cannot be trained from beside `store`; the message says what to extract.
  """
  extra, train, _ = load_store(path, data, target, record, own_data=True)
  if train is None:
    raise features_lib.StoreError(f"train.extra_features: {path} has no 'train' sequences; extract it with "
                                  "--config.features.splits=train (or train,heldout).")
  theirs = extra.header.get("data", {})
  for key in ("heldout_fraction", "split_seed"):
    if theirs.get(key) != getattr(data, key):
      raise features_lib.StoreError(
          f"train.extra_features: {path} split its conversations with data.{key}={theirs.get(key)}, this run "
          f"with {getattr(data, key)}: its train split could hold conversations this run holds out. Extract it "
          f"again with --config.data.{key}={getattr(data, key)}.")
  if extra.layer_slots(record.ids) != store.layer_slots(record.ids):
    raise features_lib.StoreError(
        f"train.extra_features: {path} stores the depths {extra.header.get('stored_depths')}, "
        f"{store.path} {store.header.get('stored_depths')}: stores trained from together must lay out the "
        f"layers {list(record.ids)} alike. Extract it with --config.features.depths as {store.path} was.")
  return extra, train


@dataclasses.dataclass(frozen=True)
class DraftArrays:
  """The draft as its steps read it besides the training state (`step.split_draft`).

  Attributes:
    graphdef: the draft's structure.
    vocab: its vocabulary tables (placed).
    embed: the frozen embedding: the target's own matrix, never checkpointed.
  """

  graphdef: Any
  vocab: Any
  embed: Any


@dataclasses.dataclass(frozen=True)
class Bound:
  """A source bound to a run's draft: what the loop calls.

  Attributes:
    batches: the training batches from the run's data position (`.position` is where a checkpoint resumes).
    train: `(state, batch) -> (state, metrics)`, one optimisation step.
    heldout_batches: a fresh pass over the held-out split; None without one.
    evaluate: `(state, batch) -> metrics` on a held-out batch; None without a held-out split.
  """

  batches: Any
  train: Callable
  heldout_batches: Callable[[], Iterable] | None = None
  evaluate: Callable | None = None


class Source:
  """The data a run trains from (`OnlineSource`, `StoreSource`): opened and checked, not yet bound to a draft.

  Attributes:
    name: the dataset's name (recorded in the checkpoints).
    train_split: the training sequences (the draft vocabulary is counted from them).
    heldout: the held-out sequences, or None.
    store_id: what a resumed run must read again: None online, else the fingerprints of the stores.
  """

  name: str
  train_split: Any
  heldout: Any
  store_id: str | None = None

  def __init__(self, target: Target, data: DataOptions, train: TrainOptions):
    self.target, self.data, self.train = target, data, train

  def meta(self) -> dict[str, Any]:
    """What the checkpoints record of the source beyond the run's settings."""
    return {}

  def bind(self, draft: DraftArrays, seed: int, position: data_lib.Position) -> Bound:
    """The batches from `position` (in `seed`'s order) and the steps on `draft`."""
    raise NotImplementedError

  def _iterate(self) -> dict[str, Any]:
    """The batch iterators' arguments: the global batch, this process's rows of it, every bucket divisible."""
    mesh, t = self.target.mesh, self.train
    process_index, process_count = sharding.data_position(mesh)
    return dict(batch_size=t.batch_size, seq_len=self.data.max_length,
                pad_id=int(self.target.tokenizer.pad_token_id or 0), process_index=process_index,
                process_count=process_count, row_multiple=sharding.data_size(mesh))

  def _heldout_iterate(self) -> dict[str, Any]:
    heldout_batches = dict(self._iterate(), shuffle=False, drop_remainder=False, num_epochs=1)
    t = self.train
    if self.heldout is not None and t.bucket_widths and t.eval_batches >= data_lib.BatchIterator(
        self.heldout, **heldout_batches).steps_per_epoch:
      # A pass over the whole held-out split reads it in the run's length buckets: the same positions with far
      # fewer padded ones (acc_j and sim τ are pooled over tokens, so they are unchanged; the loss, a mean of
      # per-batch means, moves a little). A partial pass keeps padded batches: buckets would bias its sample.
      heldout_batches["widths"] = t.bucket_widths
    return heldout_batches

  def _train_iterate(self, seed: int, position: data_lib.Position) -> dict[str, Any]:
    return dict(self._iterate(), seed=seed, position=position, widths=self.train.bucket_widths)


def _online_arrays(batch, mesh):
  arrays = {k: v for k, v in batch.arrays().items() if k != "example_mask"}
  return sharding.global_batch(mesh, arrays)


class OnlineSource(Source):
  """The chat dataset; the target computes the draft's features inside every step."""

  def __init__(self, target: Target, data: DataOptions, train: TrainOptions):
    super().__init__(target, data, train)
    dataset, self.train_split, self.heldout = load_data(data, target)
    self.name = dataset.name

  def bind(self, draft: DraftArrays, seed: int, position: data_lib.Position) -> Bound:
    target, t, mesh = self.target, self.train, self.target.mesh
    batches = data_lib.BatchIterator(self.train_split, **self._train_iterate(seed, position))
    # The training forward may run in bfloat16 (train.target_dtype); the held-out evaluation keeps the target
    # itself, as at inference.
    forward = with_dtype(target, t.target_dtype) if t.target_dtype else target
    program = step_lib.StepProgram(draft.graphdef, t.loss, optimizer=t.optimizer,
                                   target_graphdef=forward.graphdef, mesh=mesh)
    train = lambda state, batch: step_lib.train_step(  # noqa: E731
        state, draft.vocab, draft.embed, forward.params, _online_arrays(batch, mesh), program=program)
    if self.heldout is None:
      return Bound(batches, train)
    eval_program = step_lib.StepProgram(draft.graphdef, t.eval_loss, target_graphdef=target.graphdef)
    heldout_iterate = self._heldout_iterate()
    return Bound(batches, train, lambda: data_lib.BatchIterator(self.heldout, **heldout_iterate),
                 lambda state, batch: step_lib.eval_step(
                     state.params, draft.vocab, draft.embed, target.params, _online_arrays(batch, mesh),
                     program=eval_program))


class StoreSource(Source):
  """`train.features`' store (with `train.extra_features` beside it, `train.eval_features`' held-out split):
  the step reads stored features and runs no target."""

  def __init__(self, target: Target, record: layer_ids.LayerSelection, data: DataOptions, train: TrainOptions):
    super().__init__(target, data, train)
    t = train
    self.record = record
    self.store, train_split, heldout = load_store(t.features, data, target, record)
    if train_split is None:
      raise features_lib.StoreError(
          f"train.features={t.features} has no 'train' sequences (it holds {sorted(self.store.splits)}): train on "
          "a store extracted with --config.features.splits=train,heldout; a held-out-only store serves "
          "train.eval_features.")
    self.name = self.store.header["dataset"]
    if t.max_sequences:
      if t.max_sequences > len(train_split):
        raise ValueError(f"train.max_sequences={t.max_sequences} but {t.features} holds {len(train_split)} train "
                         f"sequences; set --config.train.max_sequences={len(train_split)} or fewer (0 = all).")
      train_split = train_split.head(t.max_sequences)
    extras = [load_extra_store(path, self.store, data, target, record) for path in t.extra_feature_dirs]
    seen = [self.store.fingerprint] + [e.fingerprint for e, _ in extras]
    if len(set(seen)) < len(seen):
      raise features_lib.StoreError(f"train.extra_features={t.extra_features} names a store twice (or "
                                    f"train.features' own, {t.features}); give each store once.")
    if extras:
      train_split = features_lib.JoinedSplit([train_split] + [split for _, split in extras])
      logging.info("Training split: %d sequences of %s and %s.", train_split.sizes[0], t.features, ", ".join(
          f"{n} of {e.path}" for n, (e, _) in zip(train_split.sizes[1:], extras)))
    if t.eval_features:
      _, _, heldout = load_store(t.eval_features, data, target, record, own_data=True)
      if heldout is None:
        raise ValueError(f"train.eval_features={t.eval_features} has no heldout split to evaluate on; extract "
                         "it with features.splits including heldout.")
    self.train_split, self.heldout = train_split, heldout
    self.store_id = "+".join(seen)

  def meta(self) -> dict[str, Any]:
    return {"feature_store": self.store_id, "feature_store_path": self.store.path}

  def bind(self, draft: DraftArrays, seed: int, position: data_lib.Position) -> Bound:
    t, mesh, store = self.train, self.target.mesh, self.store
    slots = store.layer_slots(self.record.ids)
    d2t = np.asarray(jax.device_get(draft.vocab["d2t"][...]))
    ids = np.arange(d2t.shape[0]) + d2t
    head_rows = replicate(jnp.take(target_head(self.target), jnp.asarray(ids), axis=1), mesh)  # [D, V_d]
    batches = features_lib.FeatureBatchIterator(self.train_split, slots, **self._train_iterate(seed, position))
    program = step_lib.StepProgram(draft.graphdef, t.loss, optimizer=t.optimizer, mesh=mesh)
    train = lambda state, batch: step_lib.train_step_offline(  # noqa: E731
        state, draft.vocab, draft.embed, head_rows, features_lib.device_arrays(batch, mesh), program=program)
    logging.info("Offline training from %s: %d steps = %.2f epochs of its train split (%d sequences, %d "
                 "steps/epoch).", store.path, t.num_steps, t.num_steps / batches.steps_per_epoch,
                 len(self.train_split), batches.steps_per_epoch)
    if self.heldout is None:
      return Bound(batches, train)
    eval_program = step_lib.StepProgram(draft.graphdef, t.eval_loss)
    heldout_iterate = self._heldout_iterate()
    return Bound(batches, train,
                 lambda: features_lib.FeatureBatchIterator(self.heldout, slots, **heldout_iterate),
                 lambda state, batch: step_lib.eval_step_offline(
                     state.params, draft.vocab, draft.embed, head_rows, features_lib.device_arrays(batch, mesh),
                     program=eval_program))


def open_source(target: Target, record: layer_ids.LayerSelection, data: DataOptions, train: TrainOptions) -> Source:
  """The run's source, opened and checked: `train.features` set = a `StoreSource`, else an `OnlineSource`."""
  if train.features:
    return StoreSource(target, record, data, train)
  return OnlineSource(target, data, train)
