"""Draft training, end to end: `train(target, layers, recipe, workdir)` over typed objects (`layerwave.compare`
calls it for every cell with the target it holds), and `run(config, workdir)`, its adapter for
experiments/train_draft.py and notebooks.

target + LayerSelection → ShareGPT chat dataset (tfds array_record) → draft vocabulary → online
data-parallel TTT training with periodic held-out evaluation → orbax checkpoints in `workdir/checkpoints`
(params, optimizer state, step, data position, vocabulary, selection record, draft config). Rerunning with
the same workdir resumes exactly where the last checkpoint left off; a different config is refused.

`train` in four parts: the source opens and checks its data (`training.sources`: `OnlineSource` or
`StoreSource`); `resume_or_init` starts the draft from the workdir's latest checkpoint, a released run
(`train.init_from`) or afresh; the source, bound to that draft, gives the batches and the train and evaluation
steps; the steps run with hooks at their own cadence (`training.hooks`: metrics every `train.log_every`,
held-out evaluation every `train.eval_every`, checkpoints every `train.checkpoint_every`).

Offline (`train.features=DIR`): the same loop reads a feature store (`layerwave.training.features`, written
by experiments/extract_features.py) instead of the chat dataset, and the step runs no target
(`step.train_step_offline`); the target is still loaded, for its embedding, its LM-head rows of the draft
vocabulary and the store's checks (another target, tokenizer, missing layer, other data: refused before
training). The vocabulary is counted from the store's tokens and the held-out evaluation reads its heldout
split. The run lasts `train.num_steps` steps whichever path: the stream repeats the store's train split in
freshly shuffled epochs as often as that takes (the log names the number of epochs), so E epochs are
`num_steps = E * steps_per_epoch`. With the same seed the offline stream visits the same sequences in the same
order as the online one over the dataset the store was extracted from.

Legend (`layerwave.axes`): D target width, V target vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
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
from layerwave.inference import Target, load_target
from layerwave.models.draft import Draft, DraftConfig
from layerwave.training import features as features_lib
from layerwave.training import hooks as hooks_lib
from layerwave.training import options as train_options
from layerwave.training import restore
from layerwave.training import sources
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
  return {"model": target.spec or target.path, "dtype": sources.dtype_name(target),
          "layers": [int(i) for i in ids], **recipe.fingerprint_settings()}


def config_fingerprint(target: Target, recipe: Recipe, ids: Sequence[int]) -> str:
  """The hash of `fingerprint_settings`, recorded in every checkpoint: a resume under another is refused."""
  return options_lib.fingerprint(fingerprint_settings(target, recipe, ids))


def free_compiled() -> None:
  """Frees what the runs so far compiled, for a process that trains one run after another (a comparison's cells,
  a recipe sweep). Every run traces its own step and evaluation functions; kept in JAX's caches, their machine
  code stayed mapped, and a `:paper` sweep in one process reached the kernel's limit on memory maps
  (vm.max_map_count, 65,530 by default) after ~8 cells and crashed in LLVM ("Cannot allocate memory", then a
  segmentation fault)."""
  jax.clear_caches()
  gc.collect()


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
  head = sources.target_head(target)  # [D, V]
  draft.lm_head.kernel[...] = jnp.take(head, draft.draft_token_ids(), axis=1).astype(
      draft.lm_head.kernel.dtype)
  draft.norm.scale[...] = tp["norm"]["scale"][...].astype(draft.norm.scale.dtype)


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
  _, _, heldout = sources.load_store(path, data, target, record, own_data=True)
  if heldout is None:
    raise ValueError(f"Feature store {path} has no heldout split; extract it with features.splits=train,heldout.")
  graphdef, params, vocab, embed = step_lib.split_draft(draft)
  mesh = target.mesh
  params, vocab, embed = sources.replicate((params, vocab, embed), mesh)
  ids = np.arange(draft.config.draft_vocab_size) + np.asarray(jax.device_get(vocab["d2t"][...]))
  head_rows = sources.replicate(jnp.take(sources.target_head(target), jnp.asarray(ids), axis=1), mesh)
  batches = features_lib.FeatureBatchIterator(heldout, store.layer_slots(record.ids), batch_size=batch_size,
                                              seq_len=seq_len, pad_id=int(target.tokenizer.pad_token_id or 0),
                                              shuffle=False, drop_remainder=False, num_epochs=1, widths=widths)
  program = step_lib.StepProgram(graphdef, step_lib.LossSettings(steps, decay, assistant_only))
  return hooks_lib.evaluate(batches, max_batches or len(heldout), lambda b: step_lib.eval_step_offline(
      params, vocab, embed, head_rows, features_lib.device_arrays(b, mesh), program=program))


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


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """What a run trains, and where: the target, the layers, the recipe and the workdir, with the settings that
  fix its computation (`fingerprint_settings`)."""

  target: Target
  record: layer_ids.LayerSelection
  recipe: Recipe
  workdir: str

  @functools.cached_property
  def settings(self) -> dict[str, Any]:
    return fingerprint_settings(self.target, self.recipe, self.record.ids)


@dataclasses.dataclass(frozen=True)
class Start:
  """Where a run begins (`resume_or_init`).

  Attributes:
    draft_config: the draft's shape and layers.
    arrays: its graphdef, vocabulary tables (placed) and frozen embedding.
    state: the training state, placed (`step.state_shardings`).
    position: the data position the batches start from.
    before: the record of the checkpoint resumed or of the release continued; None for a fresh start.
    continued_from: {"release", "step"} when the run goes on from a released run (now or before a resume).
    continuing: it continues a release now (its first checkpoint is the start).
  """

  draft_config: DraftConfig
  arrays: sources.DraftArrays
  state: step_lib.TrainState
  position: data_lib.Position
  before: dict | None = None
  continued_from: dict | None = None
  continuing: bool = False


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
  t = recipe.train
  if target.tokenizer is None:
    raise ValueError(f"The target {target.spec or target.path} has no tokenizer; training data cannot be "
                     "tokenised.")
  record.validate_for(target.config.num_layers, target.config.hidden_size)
  sharding.check_batch(target.mesh, t.batch_size)
  source = sources.open_source(target, record, recipe.data, t)
  run = RunSpec(target, record, recipe, workdir)
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"))
  start = resume_or_init(run, source, ckpt)
  bound = source.bind(start.arrays, recipe.seed, start.position)
  for width in bound.batches.widths:
    sharding.check_batch(target.mesh, bound.batches.rows(width))
  if bound.batches.widths:
    logging.info("Length buckets: %s.", ", ".join(f"[{bound.batches.rows(w)}, {w}]" for w in bound.batches.widths))
  writer = metrics_lib.MetricWriter(workdir)
  start_step = int(start.state.step)
  before = start.before or {}  # real tokens and seconds of training over the whole run, carried (the curves)
  progress = hooks_lib.Progress(start_step, t.stop_step(start_step), tokens=int(before.get("tokens_trained") or 0),
                                seconds=float(before.get("train_seconds") or 0.0))
  checkpoints = hooks_lib.Checkpoints(ckpt, start.arrays.vocab, _run_meta(run, source, start),
                                      lambda: bound.batches.position)
  hooks = hooks_lib.Hooks()
  hooks.add(hooks_lib.log_metrics(writer, t.num_steps), every=t.log_every)
  evaluation = None
  if bound.evaluate is not None:  # every eval_every steps and at the run's end (not at an early stop)
    evaluation = hooks_lib.Evaluation(bound.heldout_batches, t.eval_batches, bound.evaluate, writer)
    hooks.add(evaluation, every=t.eval_every, at_stop=progress.stop == t.num_steps)
  hooks.add(checkpoints, every=t.checkpoint_every)
  if start.continuing:  # the workdir holds the draft from the start, even when the released run had ended
    checkpoints.save(start_step, start.state, progress)
  state = hooks_lib.run_steps(start.state, bound, hooks, progress)
  writer.close()
  ckpt.close()
  result = {"step": int(jax.device_get(state.step)), "layers": list(record.ids), "tokens_per_s": progress.rate()}
  last = evaluation.last if evaluation is not None else {}
  if last:
    result.update({"heldout_acc": [float(a) for a in last["acc_j"]],
                   "heldout_acc_in_vocab": [float(a) for a in last["acc_in_vocab_j"]],
                   "heldout_sim_tau": float(last["sim_tau"]), "heldout_loss": float(last["loss"]),
                   "heldout_positions": int(last["predicted_positions"])})
  return result


def resume_or_init(run: RunSpec, source: sources.Source, ckpt: ckpt_lib.Checkpointer) -> Start:
  """The run's start: its latest checkpoint in the workdir (checked: the same settings, source and schedule),
  else the released run `train.init_from` names (its step, data position and weights, fresh AdamW moments),
  else a fresh draft (its vocabulary counted from the source's training split)."""
  target, t, mesh = run.target, run.recipe.train, run.target.mesh
  latest = ckpt.latest_step()
  continued = None
  if latest is not None:
    recorded = ckpt.read_meta(latest)
    _check_resume(run, source, recorded)
    draft = restore.abstract_draft(DraftConfig.from_dict(recorded["draft_config"]))
  elif t.init_from:
    draft, continued, released = restore.continue_from_release(
        t.init_from, target, settings=run.settings, feature_store=source.store_id, schedule_steps=t.schedule_length)
  else:
    draft = new_draft(run.recipe.draft_model, t, run.recipe.seed, target, run.record, source.train_split)
  graphdef, params, vocab, frozen = step_lib.split_draft(draft)
  # The frozen embedding is the target's own matrix (never checkpointed).
  target_embedding = target.params["embed_tokens"]["embedding"][...]
  embed = jax.tree.map(lambda _: target_embedding, frozen)
  if latest is not None:
    state, vocab, meta = restore.restore_state(ckpt, params, vocab, mesh, latest, t.optimizer)
    position = data_lib.Position.from_dict(meta["data_position"])
    logging.info("Resumed from step %d (data position %s).", int(state.step), position)
    return Start(draft.config, sources.DraftArrays(graphdef, vocab, embed), state, position, before=meta,
                 continued_from=meta.get("continued_from") or None)
  state = step_lib.init_state(params, t.optimizer)
  position = data_lib.Position()
  if continued is not None:
    state = step_lib.continue_state(state, int(continued["step"]))
    position = data_lib.Position.from_dict(continued["data_position"])
    logging.warning("No checkpoint in %s: continuing the run released as %s from its step %d (data position "
                    "%s), its bfloat16-rounded weights in float32 and fresh AdamW moments.", run.workdir, released,
                    int(continued["step"]), position)
  state = sources.place(state, step_lib.state_shardings(state, mesh))  # split over every device (FSDP)
  vocab = sources.replicate(vocab, mesh)
  if continued is None:
    return Start(draft.config, sources.DraftArrays(graphdef, vocab, embed), state, position)
  return Start(draft.config, sources.DraftArrays(graphdef, vocab, embed), state, position, before=continued,
               continued_from={"release": released, "step": int(continued["step"])}, continuing=True)


def _check_resume(run: RunSpec, source: sources.Source, meta: dict) -> None:
  """Refuses a checkpoint written under other settings, from another source or with another schedule."""
  settings, t, workdir = run.settings, run.recipe.train, run.workdir
  fingerprint = options_lib.fingerprint(settings)
  if meta["config_fingerprint"] != fingerprint and not (
      "settings" in meta and train_options.same_recipe(meta["settings"], settings)):
    diff = options_lib.differing_fields(meta.get("settings", {}), settings)
    raise ValueError(f"{workdir} holds a run with a different config (fingerprint "
                     f"{meta['config_fingerprint']} vs {fingerprint}; differing fields: {diff}); resume with "
                     "the same config or use a new --workdir.")
  if meta.get("feature_store") != source.store_id:
    raise ValueError(f"{workdir} holds a run trained {_source_name(meta.get('feature_store'))}, but this run "
                     f"reads {_source_name(source.store_id)}; resume with the same train.features or use a new "
                     "--workdir.")
  started = int(meta["schedule_steps"])
  if started != t.schedule_length:
    raise ValueError(f"{workdir} started with a {started}-step learning-rate schedule; this run's is "
                     f"{t.schedule_length} steps (train.num_steps={t.num_steps}, train.schedule_steps="
                     f"{t.schedule_steps}), which would change the schedule mid-run. To train on past its end "
                     f"keep it: --config.train.schedule_steps={started}; or use a new --workdir.")


def _run_meta(run: RunSpec, source: sources.Source, start: Start) -> dict[str, Any]:
  """What every checkpoint of the run records besides its step, data position and counters."""
  target, record, recipe, t = run.target, run.record, run.recipe, run.recipe.train
  settings = run.settings
  dtype = sources.dtype_name(target)
  meta = {"config_fingerprint": options_lib.fingerprint(settings), "settings": settings,
          "schedule_steps": t.schedule_length, "draft_config": start.draft_config.to_dict(),
          "selection": record.to_dict(), "dataset": source.name,
          # What restore.load_draft and release_draft read to load the target and name the run.
          "config": {"model": target.spec or target.path, "dtype": dtype, "layers": list(record.ids),
                     **recipe.to_dict()}}
  # The run's precision history: a resumed (or continued) run may switch train.compute_dtype.
  before = start.before
  if before is None:
    meta["compute_dtypes"] = [[0, t.compute_dtype]]
  else:
    was = ((before.get("settings") or {}).get("train") or {}).get("compute_dtype", "float32")
    meta["compute_dtypes"] = train_options.precision_history(before.get("compute_dtypes"), was,
                                                             int(before["step"]), t.compute_dtype)
    if meta["compute_dtypes"][-1][1] != was:
      logging.warning("The run goes on from step %d with train.compute_dtype=%s (it ran in %s so far); its "
                      "checkpoints record the history %s.", int(before["step"]), t.compute_dtype, was,
                      meta["compute_dtypes"])
  if start.continued_from:
    meta["continued_from"] = start.continued_from
  return {**meta, **source.meta()}


def _source_name(store_id: str | None) -> str:
  return f"from the feature store {store_id}" if store_id else "online (no feature store)"
