"""Draft training, end to end: `train(target, layers, recipe, workdir)` over typed objects (`layerwave.compare`
calls it for every cell with the target it holds), and `run(config, workdir)`, its adapter for
experiments/train_draft.py and notebooks.

target + LayerSelection → ShareGPT chat dataset (tfds array_record) → draft vocabulary → online
data-parallel TTT training with periodic held-out evaluation → orbax checkpoints in `workdir/checkpoints`
(params, optimizer state, step, data position, vocabulary, selection record, draft config). Rerunning with
the same workdir resumes exactly where the last checkpoint left off; a different config is refused.

Offline (`train.features=DIR`): the same loop reads a feature store (`layerwave.training.features`, written
by experiments/extract_features.py) instead of the chat dataset, and the step runs no target
(`step.train_step_offline`); the target is still loaded, for its embedding, its LM-head rows of the draft
vocabulary and the store's checks (another target, tokenizer, missing layer, other data: refused before
training). The vocabulary is counted from the store's tokens and the held-out evaluation reads its heldout
split. The run lasts `train.num_steps` steps whichever path: the stream repeats the store's train split in
freshly shuffled epochs as often as that takes (the log names the number of epochs), so E epochs are
`num_steps = E * steps_per_epoch`. With the same seed the offline stream visits the same sequences in the same
order as the online one over the dataset the store was extracted from.

Legend (`layerwave.axes`): D target width, V target vocabulary, V_d draft vocabulary.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from layerwave import checkpoint as ckpt_lib
from layerwave import data as data_lib
from layerwave import layer_ids
from layerwave import metrics as metrics_lib
from layerwave import options as options_lib
from layerwave import sharding
from layerwave.analysis import report as report_lib
from layerwave.data.options import DataOptions
from layerwave.inference import Target, compute_dtype, load_target, target_fingerprint, with_dtype
from layerwave.models.draft import Draft, DraftConfig
from layerwave.training import features as features_lib
from layerwave.training import losses
from layerwave.training import options as train_options
from layerwave.training import restore
from layerwave.training import step as step_lib
from layerwave.training import vocab as vocab_lib
from layerwave.training.options import DraftModelOptions, Recipe, TrainOptions
def resolve_selection(config, target: Target) -> layer_ids.LayerSelection:
  """The layers to train on: `config.layers` ids, or (when it is empty) a strategy from `config.selection.path`."""
  c = target.config
  ids = layer_ids.parse_layer_ids(config.layers)
  if ids:
    record = layer_ids.LayerSelection(ids=ids, num_layers=c.num_layers,
                                      hidden_size=c.hidden_size, strategy="manual")
    record.validate_for(c.num_layers, c.hidden_size)
    return record
  if not config.selection.path or not config.selection.strategy:
    raise ValueError("Give the draft's layers: --config.layers=2,15,27, or --config.selection.path="
                     "W/selection.json with --config.selection.strategy=NAME.")
  return report_lib.read_selection(config.selection.path, config.selection.strategy, c.num_layers,
                                   c.hidden_size)


def fingerprint_settings(target: Target, recipe: Recipe, ids: Sequence[int]) -> dict[str, Any]:
  """Every setting that fixes what a training run computes.

  The target (the name it was loaded by and its compute dtype), the layer ids trained on and the recipe
  (`Recipe.fingerprint_settings`: less the run length, logging and evaluation, less `train.features`, which
  enters by the store's own fingerprint). Not the mesh: the global batch fixes the computation, so a run
  resumes on another number of devices.
  """
  return {"model": target.spec or target.path, "dtype": _dtype_name(target),
          "layers": [int(i) for i in ids], **recipe.fingerprint_settings()}


def config_fingerprint(target: Target, recipe: Recipe, ids: Sequence[int]) -> str:
  """The hash of `fingerprint_settings`, recorded in every checkpoint: a resume under another is refused."""
  return options_lib.fingerprint(fingerprint_settings(target, recipe, ids))


def _dtype_name(target: Target) -> str:
  return str(jnp.dtype(compute_dtype(target.graphdef, target.params)))


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
               target_dtype: str, own_data: bool = False):
  """Opens and checks a feature store for this run; returns (store, train split or None, held-out split or None)
  (a store of only a held-out split serves `train.eval_features`).

  Args:
    path, data, target, record, target_dtype: the store and what this run trains.
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
      store, target_config=target.config, target_dtype=target_dtype,
      target_fingerprint=target_fingerprint(target),
      tokenizer_fingerprint=data_lib.tokenizer_fingerprint(target.tokenizer), layer_ids=record.ids,
      data=data_dict)
  heldout = store.split("heldout", data.max_length) if store.counts("heldout")[0] else None
  train = store.split("train", data.max_length) if store.counts("train")[0] else None
  return store, train, heldout


def free_compiled() -> None:
  """Frees what the runs so far compiled, for a process that trains one run after another (a comparison's cells,
  a recipe sweep). Every run traces its own step and evaluation functions; kept in JAX's caches, their machine
  code stayed mapped, and a `:paper` sweep in one process reached the kernel's limit on memory maps
  (vm.max_map_count, 65,530 by default) after ~8 cells and crashed in LLVM ("Cannot allocate memory", then a
  segmentation fault)."""
  jax.clear_caches()
  gc.collect()


def load_extra_store(path: str, store, data: DataOptions, target: Target, record: layer_ids.LayerSelection,
                     target_dtype: str):
  """Opens one of `train.extra_features`: checked as `train.eval_features` is (its own data; the target,
  tokenizer, layers and length as this run's), and against `store`, the run's own: the same layer slots, and
  the same train / held-out split of conversations (`data.heldout_fraction`, `data.split_seed`), so that its
  train split holds none of the conversations `store` holds out. Returns (store, its train split).

  Raises:
    features.StoreError: it cannot be trained from beside `store`; the message says what to extract.
  """
  extra, train, _ = load_store(path, data, target, record, target_dtype, own_data=True)
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


def target_head(target: Target) -> jax.Array:
  """The target's LM head as `[D, V]` (the transposed embedding when tied)."""
  tp = target.params
  return (tp["embed_tokens"]["embedding"][...].T if target.config.tie_word_embeddings
          else tp["lm_head"]["kernel"][...])


def new_draft(model: DraftModelOptions, train: TrainOptions, seed: int, target: Target,
              record: layer_ids.LayerSelection, train_source) -> Draft:
  """A freshly initialised draft with its vocabulary counted from the training targets."""
  v_d = min(model.vocab_size, target.config.vocab_size)
  dcfg = DraftConfig.from_target(target.config, record.ids, draft_vocab_size=v_d, num_layers=model.num_layers,
                                 fc_norm=model.fc_norm, gates=model.gate_config)
  limit = train.vocab_examples or len(train_source)
  idx = range(min(limit, len(train_source)))
  counts = vocab_lib.count_tokens((train_source[i] for i in idx), target.config.vocab_size,
                                  assistant_only=train.assistant_only)
  d2t, t2d = vocab_lib.build_vocab(counts, v_d)
  coverage = counts[t2d].sum() / max(counts.sum(), 1)
  logging.info("Draft vocabulary: %d tokens cover %.2f%% of %d training-target tokens.", v_d,
               100 * coverage, counts.sum())
  embedding = target.params["embed_tokens"]["embedding"][...]
  draft = Draft(dcfg, embedding=embedding, dtype=jnp.float32, rngs=nnx.Rngs(seed))
  draft.d2t[...] = jnp.asarray(d2t)
  draft.t2d[...] = jnp.asarray(t2d)
  if model.init_from_target:
    init_head_from_target(draft, target)
  return draft


def init_head_from_target(draft: Draft, target: Target) -> None:
  """Starts the draft's final norm and LM head from the target's (rows of the draft vocabulary).

  The draft then begins by reading its feature h as the target reads its last hidden state, so a short
  CPU budget goes into learning h rather than an LM head from scratch. Needs d == D.
  """
  if draft.config.model.hidden_size != target.config.hidden_size:
    raise ValueError("draft_model.init_from_target needs the draft width to equal the target's.")
  tp = target.params
  head = target_head(target)  # [D, V]
  draft.lm_head.kernel[...] = jnp.take(head, draft.draft_token_ids(), axis=1).astype(
      draft.lm_head.kernel.dtype)
  draft.norm.scale[...] = tp["norm"]["scale"][...].astype(draft.norm.scale.dtype)


def _place(tree, shardings):
  if jax.process_count() > 1:
    # Across processes, device_put of a process-local jax.Array can build an array whose shards are not one
    # per device (orbax cannot save it); the same value from host memory places cleanly on every process.
    tree = jax.tree.map(np.asarray, tree)
  return jax.device_put(tree, shardings)


def _replicate(tree, mesh):
  return _place(tree, sharding.replicated(mesh))


def _evaluate(batches, eval_batches: int, eval_fn) -> dict:
  """Held-out metrics pooled over at most `eval_batches` batches; `eval_fn(batch)` → a step's metrics."""
  sums, n = None, 0
  for i, batch in enumerate(batches):
    if i >= eval_batches:
      break
    m = jax.device_get(eval_fn(batch))
    sums = m if sums is None else jax.tree.map(np.add, sums, m)
    n += 1
  if not n:
    return {}
  mean = jax.tree.map(lambda x: np.asarray(x) / n, sums)
  # Accuracies pooled over tokens (not a mean of per-batch ratios), and the held-out simulated τ from them
  # (eval_step computes none per batch); out-of-vocabulary targets are misses.
  mean["acc_j"] = sums["hits_j"] / np.maximum(sums["tokens_j"], 1.0)
  mean["acc_in_vocab_j"] = sums["hits_j"] / np.maximum(sums["in_vocab_j"], 1.0)
  mean["sim_tau"] = float(losses.simulated_tau(mean["acc_j"]))
  mean["predicted_positions"] = float(sums["tokens_j"][0])  # what the accuracies pool (first depth)
  for count in ("tokens", "hits_j", "tokens_j", "in_vocab_j"):
    mean.pop(count, None)
  return mean


def evaluate_on_store(draft: Draft, target: Target, path: str, *, steps: int, batch_size: int = 8,
                      seq_len: int = 0, max_batches: int = 0, decay: float = 0.8, assistant_only: bool = True,
                      widths: tuple[int, ...] = ()) -> dict:
  """Held-out acc_j, acc_in_vocab_j, sim τ and loss of any draft for `target` on a store's heldout split.

  Compares drafts trained anywhere (online, offline, on other text) on one held-out text, `steps` deep.
  The store is checked against the target, its tokenizer and the draft's layers. `widths`: length buckets for
  a pass over the whole split (`max_batches` 0), which then computes far fewer padded positions; the
  accuracies and sim τ are pooled over tokens, so they do not depend on the batching (the loss, a mean of
  per-batch means, does a little).
  """
  if widths and max_batches:
    raise ValueError("evaluate_on_store: length buckets group the split by length, so only a pass over the "
                     "whole split (max_batches=0) reads an unbiased sample; drop `widths` or `max_batches`.")
  store = features_lib.open_store(path)
  record = layer_ids.LayerSelection(ids=tuple(draft.config.layer_ids), num_layers=target.config.num_layers,
                                    hidden_size=target.config.hidden_size, strategy="manual")
  seq_len = seq_len or store.seq_len
  data = options_lib.from_section(DataOptions, {**store.header.get("data", {}), "max_length": seq_len}, "data")
  _, _, heldout = load_store(path, data, target, record, _dtype_name(target), own_data=True)
  if heldout is None:
    raise ValueError(f"Feature store {path} has no heldout split; extract it with features.splits=train,heldout.")
  graphdef, params, vocab, embed = step_lib.split_draft(draft)
  mesh = target.mesh
  params, vocab, embed = _replicate((params, vocab, embed), mesh)
  ids = np.arange(draft.config.draft_vocab_size) + np.asarray(jax.device_get(vocab["d2t"][...]))
  head_rows = _replicate(jnp.take(target_head(target), jnp.asarray(ids), axis=1), mesh)
  batches = features_lib.FeatureBatchIterator(heldout, store.layer_slots(record.ids), batch_size=batch_size,
                                              seq_len=seq_len, pad_id=int(target.tokenizer.pad_token_id or 0),
                                              shuffle=False, drop_remainder=False, num_epochs=1, widths=widths)
  program = step_lib.StepProgram(graphdef, step_lib.LossSettings(steps, decay, assistant_only))
  return _evaluate(batches, max_batches or len(heldout), lambda b: step_lib.eval_step_offline(
      params, vocab, embed, head_rows, features_lib.device_arrays(b, mesh), program=program))


def _online_arrays(batch, mesh):
  arrays = {k: v for k, v in batch.arrays().items() if k != "example_mask"}
  return sharding.global_batch(mesh, arrays)


def run(config, workdir: str) -> dict[str, Any]:
  """Trains (or resumes) a draft in `workdir` as `config` says; returns the final held-out metrics.

  The launcher's adapter over `train`: parses the config's sections into a `Recipe`, joins the other
  processes (`config.distributed`; every process must hold the same config), loads the target on the mesh
  and resolves the layers (`config.layers`, or a strategy of `config.selection.path`).
  """
  recipe = Recipe.from_config(config)
  metrics_lib.quiet_library_logs()
  sharding.use_compilation_cache(config.get("compilation_cache", ""))
  sharding.maybe_initialize_distributed(config.distributed)
  sharding.check_processes_agree(config, "Draft training")
  mesh = sharding.make_mesh(config.mesh)
  target = load_target(config.model, dtype=config.dtype, mesh=mesh)
  return train(target, resolve_selection(config, target), recipe, workdir)


def train(target: Target, record: layer_ids.LayerSelection, recipe: Recipe, workdir: str) -> dict[str, Any]:
  """Trains (or resumes) a draft for `target` on the layers `record` names, online or from a feature store.

  Args:
    target: the loaded target; its mesh is the training mesh (the global batch is split over 'data').
    record: the layers the draft reads (validated against the target).
    recipe: the budget, draft shape, data and seed; `recipe.train.features` set = offline from that store.
    workdir: checkpoints (`W/checkpoints`) and metrics; a run there resumes from its latest checkpoint, and
      one written under another target, recipe (less its run length) or store is refused.

  Returns:
    {"step", "layers", "tokens_per_s"} and, with a held-out split, "heldout_acc", "heldout_acc_in_vocab",
    "heldout_sim_tau", "heldout_loss", "heldout_positions".
  """
  t, model, data, seed = recipe.train, recipe.draft_model, recipe.data, recipe.seed
  if target.tokenizer is None:
    raise ValueError(f"The target {target.spec or target.path} has no tokenizer; training data cannot be "
                     "tokenised.")
  record.validate_for(target.config.num_layers, target.config.hidden_size)
  mesh = target.mesh
  dtype = _dtype_name(target)
  sharding.check_batch(mesh, t.batch_size)
  store, extras = None, []
  if t.features:
    store, train_source, heldout = load_store(t.features, data, target, record, dtype)
    if train_source is None:
      raise features_lib.StoreError(
          f"train.features={t.features} has no 'train' sequences (it holds {sorted(store.splits)}): train on a "
          "store extracted with --config.features.splits=train,heldout; a held-out-only store serves "
          "train.eval_features.")
    dataset_name = store.header["dataset"]
    if t.max_sequences:
      if t.max_sequences > len(train_source):
        raise ValueError(f"train.max_sequences={t.max_sequences} but {t.features} holds {len(train_source)} train "
                         f"sequences; set --config.train.max_sequences={len(train_source)} or fewer (0 = all).")
      train_source = train_source.head(t.max_sequences)
    extras = [load_extra_store(path, store, data, target, record, dtype) for path in t.extra_feature_dirs]
    seen = [store.fingerprint] + [e.fingerprint for e, _ in extras]
    if len(set(seen)) < len(seen):
      raise features_lib.StoreError(f"train.extra_features={t.extra_features} names a store twice (or "
                                    f"train.features' own, {t.features}); give each store once.")
    if extras:
      train_source = features_lib.JoinedSplit([train_source] + [split for _, split in extras])
      logging.info("Training split: %d sequences of %s and %s.", train_source.sizes[0], t.features, ", ".join(
          f"{n} of {e.path}" for n, (e, _) in zip(train_source.sizes[1:], extras)))
    if t.eval_features:
      _, _, heldout = load_store(t.eval_features, data, target, record, dtype, own_data=True)
      if heldout is None:
        raise ValueError(f"train.eval_features={t.eval_features} has no heldout split to evaluate on; extract "
                         "it with features.splits including heldout.")
  else:
    dataset, train_source, heldout = load_data(data, target)
    dataset_name = dataset.name
  store_id = None if store is None else "+".join([store.fingerprint] + [e.fingerprint for e, _ in extras])
  settings = fingerprint_settings(target, recipe, record.ids)
  fingerprint = options_lib.fingerprint(settings)
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"))
  optimizer = t.optimizer
  latest = ckpt.latest_step()
  meta, continued = None, None
  if latest is not None:
    meta = ckpt.read_meta(latest)
    if meta["config_fingerprint"] != fingerprint and not (
        "settings" in meta and train_options.same_recipe(meta["settings"], settings)):
      diff = options_lib.differing_fields(meta.get("settings", {}), settings)
      raise ValueError(f"{workdir} holds a run with a different config (fingerprint "
                       f"{meta['config_fingerprint']} vs {fingerprint}; differing fields: {diff}); resume with "
                       "the same config or use a new --workdir.")
    if meta.get("feature_store") != store_id:
      raise ValueError(f"{workdir} holds a run trained {_source_name(meta.get('feature_store'))}, but this run "
                       f"reads {_source_name(store_id)}; resume with the same train.features or use a new "
                       "--workdir.")
    started = int(meta["schedule_steps"])
    if started != t.schedule_length:
      raise ValueError(f"{workdir} started with a {started}-step learning-rate schedule; this run's is "
                       f"{t.schedule_length} steps (train.num_steps={t.num_steps}, train.schedule_steps="
                       f"{t.schedule_steps}), which would change the schedule mid-run. To train on past its end "
                       f"keep it: --config.train.schedule_steps={started}; or use a new --workdir.")
    draft = restore.abstract_draft(DraftConfig.from_dict(meta["draft_config"]))
  elif t.init_from:
    draft, continued, released = restore.continue_from_release(
        t.init_from, target, settings=settings, feature_store=store_id, schedule_steps=t.schedule_length)
  else:
    draft = new_draft(model, t, seed, target, record, train_source)
  graphdef, params, vocab, frozen = step_lib.split_draft(draft)
  # The frozen embedding is the target's own matrix (never checkpointed).
  target_embedding = target.params["embed_tokens"]["embedding"][...]
  embed = jax.tree.map(lambda _: target_embedding, frozen)
  if meta is None:
    state = step_lib.init_state(params, optimizer)
    position = data_lib.Position()
    if continued is not None:
      state = step_lib.continue_state(state, int(continued["step"]))
      position = data_lib.Position.from_dict(continued["data_position"])
      logging.warning("No checkpoint in %s: continuing the run released as %s from its step %d (data position "
                      "%s), its bfloat16-rounded weights in float32 and fresh AdamW moments.", workdir, released,
                      int(continued["step"]), position)
    state = _place(state, step_lib.state_shardings(state, mesh))  # split over every device (FSDP)
    vocab = _replicate(vocab, mesh)
  else:
    state, vocab, meta = restore.restore_state(ckpt, params, vocab, mesh, latest, optimizer)
    position = data_lib.Position.from_dict(meta["data_position"])
    logging.info("Resumed from step %d (data position %s).", int(state.step), position)
  # The target's embedding where the target keeps it (split over the vocabulary on a 'model' axis): the draft
  # reads rows of it, and a replicated copy would cost every chip the whole [V, D] matrix.
  base_meta = {"config_fingerprint": fingerprint, "settings": settings, "schedule_steps": t.schedule_length,
               "draft_config": draft.config.to_dict(),
               "selection": record.to_dict(), "dataset": dataset_name,
               # What restore.load_draft and release_draft read to load the target and name the run.
               "config": {"model": target.spec or target.path, "dtype": dtype, "layers": list(record.ids),
                          **recipe.to_dict()}}
  # The run's precision history: a resumed (or continued) run may switch train.compute_dtype.
  before = meta if meta is not None else continued
  if before is None:
    base_meta["compute_dtypes"] = [[0, t.compute_dtype]]
  else:
    was = ((before.get("settings") or {}).get("train") or {}).get("compute_dtype", "float32")
    base_meta["compute_dtypes"] = train_options.precision_history(before.get("compute_dtypes"), was,
                                                                  int(before["step"]), t.compute_dtype)
    if base_meta["compute_dtypes"][-1][1] != was:
      logging.warning("The run goes on from step %d with train.compute_dtype=%s (it ran in %s so far); its "
                      "checkpoints record the history %s.", int(before["step"]), t.compute_dtype, was,
                      base_meta["compute_dtypes"])
  if continued is not None:
    base_meta["continued_from"] = {"release": released, "step": int(continued["step"])}
  elif meta is not None and meta.get("continued_from"):
    base_meta["continued_from"] = meta["continued_from"]
  pad_id = int(target.tokenizer.pad_token_id or 0)
  process_index, process_count = sharding.data_position(mesh)
  iterate = dict(batch_size=t.batch_size, seq_len=data.max_length, pad_id=pad_id, process_index=process_index,
                 process_count=process_count, row_multiple=sharding.data_size(mesh))  # every bucket splits
  heldout_batches = dict(iterate, shuffle=False, drop_remainder=False, num_epochs=1)
  if heldout is not None and t.bucket_widths and t.eval_batches >= data_lib.BatchIterator(
      heldout, **heldout_batches).steps_per_epoch:
    # A pass over the whole held-out split reads it in the run's length buckets: the same positions with far
    # fewer padded ones (acc_j and sim τ are pooled over tokens, so they are unchanged; the loss, a mean of
    # per-batch means, moves a little). A partial pass keeps padded batches: buckets would bias its sample.
    heldout_batches["widths"] = t.bucket_widths
  train_iterate = dict(iterate, seed=seed, position=position, widths=t.bucket_widths)
  if store is None:
    it = data_lib.BatchIterator(train_source, **train_iterate)
    # The training forward may run in bfloat16 (train.target_dtype); the held-out evaluation below keeps the
    # target itself, as at inference.
    forward = with_dtype(target, t.target_dtype) if t.target_dtype else target
    program = step_lib.StepProgram(graphdef, t.loss, optimizer=optimizer, target_graphdef=forward.graphdef,
                                   mesh=mesh)
    train_fn = lambda state, batch: step_lib.train_step(  # noqa: E731
        state, vocab, embed, forward.params, _online_arrays(batch, mesh), program=program)
    eval_batches = lambda: data_lib.BatchIterator(heldout, **heldout_batches)  # noqa: E731
    eval_program = step_lib.StepProgram(graphdef, t.eval_loss, target_graphdef=target.graphdef)
    eval_fn = lambda state, batch: step_lib.eval_step(  # noqa: E731
        state.params, vocab, embed, target.params, _online_arrays(batch, mesh), program=eval_program)
  else:
    base_meta["feature_store"] = store_id
    base_meta["feature_store_path"] = store.path
    slots = store.layer_slots(record.ids)
    ids = np.arange(draft.config.draft_vocab_size) + np.asarray(jax.device_get(vocab["d2t"][...]))
    head_rows = _replicate(jnp.take(target_head(target), jnp.asarray(ids), axis=1), mesh)  # [D, V_d]
    it = features_lib.FeatureBatchIterator(train_source, slots, **train_iterate)
    program = step_lib.StepProgram(graphdef, t.loss, optimizer=optimizer, mesh=mesh)
    train_fn = lambda state, batch: step_lib.train_step_offline(  # noqa: E731
        state, vocab, embed, head_rows, features_lib.device_arrays(batch, mesh), program=program)
    eval_batches = lambda: features_lib.FeatureBatchIterator(heldout, slots, **heldout_batches)  # noqa: E731
    eval_program = step_lib.StepProgram(graphdef, t.eval_loss)
    eval_fn = lambda state, batch: step_lib.eval_step_offline(  # noqa: E731
        state.params, vocab, embed, head_rows, features_lib.device_arrays(batch, mesh), program=eval_program)
    logging.info("Offline training from %s: %d steps = %.2f epochs of its train split (%d sequences, %d "
                 "steps/epoch).", store.path, t.num_steps, t.num_steps / it.steps_per_epoch, len(train_source),
                 it.steps_per_epoch)
  for width in it.widths:
    sharding.check_batch(mesh, it.rows(width))
  if it.widths:
    logging.info("Length buckets: %s.", ", ".join(f"[{it.rows(w)}, {w}]" for w in it.widths))
  writer = metrics_lib.MetricWriter(workdir)
  start_step = int(state.step)
  stop = t.stop_step(start_step)
  tic, tokens_seen, last = time.perf_counter(), 0, {}
  # Real tokens and seconds of training steps over the whole run, carried across resumptions (curves).
  carried = meta if meta is not None else (continued or {})
  total_tokens = int(carried.get("tokens_trained") or 0)
  total_seconds = float(carried.get("train_seconds") or 0.0)
  if continued is not None:  # the workdir holds the draft from the start, even when the released run had ended
    ckpt.save(start_step, state, vocab, {**base_meta, "step": start_step, "data_position": it.position.to_dict(),
                                         "tokens_trained": total_tokens, "train_seconds": total_seconds})
  step = start_step
  for step in range(start_step, stop):
    step_tic = time.perf_counter()  # batch preparation counts as training time; evaluation does not
    batch = next(it)
    real_tokens = int(batch.attention_mask.sum())
    tokens_seen += real_tokens
    state, m = train_fn(state, batch)
    done = step + 1
    if done % t.log_every == 0 or done == stop or done % t.eval_every == 0 or done % t.checkpoint_every == 0:
      jax.block_until_ready(state.step)  # the clock stops when the step has run, not when it was dispatched
    total_seconds += time.perf_counter() - step_tic
    total_tokens += real_tokens
    if done % t.log_every == 0 or done == stop:
      m = jax.device_get(m)
      elapsed = time.perf_counter() - tic
      rate = tokens_seen / elapsed
      eta = (stop - done) * elapsed / max(done - start_step, 1)
      scalars = metrics_lib.flatten("train", {k: m[k] for k in ("loss", "grad_norm", "sim_tau")})
      scalars.update(metrics_lib.flatten("draft", {"acc_j": m["acc_j"]}))
      scalars["train/tokens_per_s"] = rate
      scalars["train/tokens"] = total_tokens
      scalars["train/seconds"] = total_seconds
      writer.write_scalars(done, scalars)
      logging.info("step %d/%d  loss %.3f  acc_0 %.3f  %.0f tok/s  ETA %.0fs", done,
                   t.num_steps, float(m["loss"]), float(m["acc_j"][0]), rate, eta)
    if heldout is not None and (done % t.eval_every == 0 or done == t.num_steps):
      last = _evaluate(eval_batches(), t.eval_batches, lambda b: eval_fn(state, b))
      scalars = metrics_lib.flatten("eval", {"loss": last["loss"], "sim_tau": last["sim_tau"]})
      scalars.update(metrics_lib.flatten("eval/draft", {"acc_j": last["acc_j"],
                                                        "acc_in_vocab_j": last["acc_in_vocab_j"]}))
      scalars.update({"train/tokens": total_tokens, "train/seconds": total_seconds})  # the curves' x axes
      writer.write_scalars(done, scalars)
    if done % t.checkpoint_every == 0 or done == stop:
      ckpt.save(done, state, vocab, {**base_meta, "step": done, "data_position": it.position.to_dict(),
                                     "tokens_trained": total_tokens, "train_seconds": total_seconds})
  writer.close()
  ckpt.close()
  result = {"step": int(jax.device_get(state.step)), "layers": list(record.ids),
            "tokens_per_s": tokens_seen / max(time.perf_counter() - tic, 1e-9)}
  if last:
    result.update({"heldout_acc": [float(a) for a in last["acc_j"]],
                   "heldout_acc_in_vocab": [float(a) for a in last["acc_in_vocab_j"]],
                   "heldout_sim_tau": float(last["sim_tau"]), "heldout_loss": float(last["loss"]),
                   "heldout_positions": int(last["predicted_positions"])})
  return result


def _source_name(store_id: str | None) -> str:
  return f"from the feature store {store_id}" if store_id else "online (no feature store)"
