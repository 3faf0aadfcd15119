"""Trained drafts back from disk: workdir resolution, the train-state restore, `load_draft`, `export_workdir`.

Place in the pipeline: between draft training and everything that reads a trained draft. The training loop
resumes through `restore_state`; speculation, the comparison and `layerwave.load_draft` load a draft through
`load_draft` (EAGLE-3 directories through `layerwave.eagle3`); the EAGLE-3 export of a workdir
(`export_workdir`) loads its draft here and hands it to `layerwave.export`. Both know the Hugging Face format
and nothing about checkpoints, so the imports run one way: `eagle3`, `export` ← `training.restore` ←
`training.loop`.

The restore target is built once (`abstract_state`): the `TrainState` and vocabulary shapes of a draft,
carrying the shardings training uses on the current mesh, as orbax restores into them.
"""

from __future__ import annotations

import os

import jax
from flax import nnx

from layerwave import checkpoint as ckpt_lib
from layerwave import eagle3
from layerwave import export as export_lib
from layerwave import layer_ids
from layerwave import options as options_lib
from layerwave import sharding
from layerwave.inference import Target, load_target
from layerwave.models.draft import Draft, DraftConfig
from layerwave.training import options as train_options
from layerwave.training import release as release_lib
from layerwave.training import step as step_lib

__all__ = ["abstract_state", "checkpoint_dir", "continue_from_release", "export_workdir", "load_draft",
           "restore_state"]

# The optimizer state's structure does not depend on the hyperparameters' values: restoring a draft for
# inference needs only that structure.
_STRUCTURE_ONLY = step_lib.OptimizerSettings(1e-4, 1, 2)


def checkpoint_dir(path: str) -> str:
  """A training workdir's `checkpoints/` directory (or `path` itself if it is one).

  Raises:
    FileNotFoundError: `path` is neither.
  """
  directory = os.path.join(path, "checkpoints") if os.path.isdir(
      os.path.join(path, "checkpoints")) else path
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"No draft at {path}: expected a training workdir with checkpoints/.")
  return directory


def abstract_state(params, vocab, mesh, optimizer: step_lib.OptimizerSettings = _STRUCTURE_ONLY):
  """(TrainState, vocabulary) as `jax.ShapeDtypeStruct`s on `mesh`: the restore target. The state is split as
  training places it (`step.state_shardings`), the vocabulary tables replicated."""
  rep = sharding.replicated(mesh)
  state = jax.eval_shape(lambda p: step_lib.init_state(p, optimizer), params)
  placed = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
  return (jax.tree.map(placed, state, step_lib.state_shardings(state, mesh)),
          jax.tree.map(lambda x: placed(x, rep), vocab))


def restore_state(ckpt: ckpt_lib.Checkpointer, params, vocab, mesh, step: int | None = None,
                  optimizer: step_lib.OptimizerSettings = _STRUCTURE_ONLY):
  """Restores `(TrainState, vocabulary, meta)` of `step` (default the latest) onto `mesh`, replicated."""
  state, vocab = abstract_state(params, vocab, mesh, optimizer)
  return ckpt.restore(state, vocab, step)


def abstract_draft(config: DraftConfig) -> Draft:
  """The draft's structure (no weights): what the restored arrays are merged into."""
  return nnx.eval_shape(lambda: Draft(config, rngs=nnx.Rngs(0)))


def load_draft(path: str, target: Target, step: int | None = None) -> Draft:
  """Loads a trained draft for `target`.

  Args:
    path: a training workdir (its latest checkpoint, or `step`) or its `checkpoints` directory; or an
      EAGLE-3 Hugging Face directory (`layerwave.export_eagle3`'s output or a published draft); or the short
      name of a release under `releases/` (`layerwave.training.release`), verified before it loads.
    target: the target the draft was trained for (its embedding is shared, its shape is checked).
    step: a specific checkpoint step; default the latest (workdirs only).

  Returns:
    The `Draft` (NNX module), ready for `layerwave.speculative.generate`.

  Raises:
    FileNotFoundError: no checkpoint under `path`.
    ValueError: the draft was trained for another target (L, D, V) or its layer ids do not fit it.
  """
  released = release_lib.resolve(path)  # a short name: releases/<name>
  if released is not None or release_lib.is_release_dir(path):
    path = released or path
    release_lib.verify_for(path, target)  # checksums and target, before anything loads
  if eagle3.is_eagle3_dir(path):
    if step is not None:
      raise ValueError(f"{path} is an EAGLE-3 directory (one set of weights); step={step} applies only "
                       "to training workdirs.")
    return eagle3.load_eagle3(path, target)
  ckpt = ckpt_lib.Checkpointer(checkpoint_dir(path))
  try:
    meta = ckpt.read_meta(step)
    dcfg = DraftConfig.from_dict(meta["draft_config"])
    dcfg.check_target(target.config)
    layer_ids.LayerSelection.from_dict(meta["selection"]).validate_for(
        target.config.num_layers, target.config.hidden_size)
    graphdef, params, vocab, frozen = step_lib.split_draft(abstract_draft(dcfg))
    state, vocab, _ = restore_state(ckpt, params, vocab, target.mesh, step)
  finally:
    ckpt.close()
  embedding = target.params["embed_tokens"]["embedding"][...]
  return nnx.merge(graphdef, state.params, vocab, jax.tree.map(lambda _: embedding, frozen))


def continue_from_release(name: str, target: Target, *, settings: dict, feature_store: str | None,
                          schedule_steps: int) -> tuple[Draft, dict, str]:
  """The draft of an interim release and its `training` record, checked to continue this very run.

  Args:
    name: `train.init_from`: a release's short name or its directory.
    target: the run's target (checksums and target fingerprint verified).
    settings: the run's `loop.fingerprint_settings` (the release's run must have had the same).
    feature_store: the run's store fingerprint (None online); the release's run must have read the same.
    schedule_steps: the run's learning-rate schedule length (it must not change mid-run).

  Returns:
    (the draft in float32, the release's `training` record, the release directory).

  Raises:
    ValueError: not a draft release, a release with no training record, or one of another run.
  """
  directory = release_lib.resolve(name) or (name if release_lib.is_release_dir(name) else None)
  if directory is None:
    raise ValueError(f"train.init_from={name!r} is not a draft release: give a name under "
                     f"{release_lib.releases_root()} ({', '.join(release_lib.available()) or 'none there'}) or a "
                     "directory written by experiments/release_draft.py.")
  manifest = release_lib.verify_for(directory, target)
  record = manifest.get("training")
  if not record:
    raise ValueError(f"train.init_from: {directory} records no training run (a release written before "
                     "releases kept one, or by hand): it can be loaded as a draft, not continued. Unset "
                     "--config.train.init_from to start afresh.")
  want = options_lib.fingerprint(settings)
  if record["config_fingerprint"] != want and not train_options.same_recipe(record.get("settings") or {},
                                                                           settings):
    diff = options_lib.differing_fields(record.get("settings", {}), settings)
    raise ValueError(f"train.init_from: {directory} was trained with another config (fingerprint "
                     f"{record['config_fingerprint']} vs {want}; differing fields: {diff}); continue it with "
                     "the same recipe, or unset --config.train.init_from.")
  if record.get("feature_store") != feature_store:
    raise ValueError(f"train.init_from: {directory} was trained "
                     f"{'on the feature store ' + record['feature_store'] if record.get('feature_store') else 'online'}, "
                     f"this run reads {'the store ' + feature_store if feature_store else 'no store (online)'}; "
                     "extract the same store (same data, layers and dtype) or unset --config.train.init_from.")
  if int(record["schedule_steps"]) != int(schedule_steps):
    raise ValueError(f"train.init_from: {directory} ran a {record['schedule_steps']}-step learning-rate schedule; "
                     f"this run's is {schedule_steps} steps. Keep it: --config.train.num_steps="
                     f"{record['schedule_steps']} (or --config.train.schedule_steps={record['schedule_steps']}).")
  draft = eagle3.load_eagle3(directory, target, dtype="float32")
  if tuple(draft.config.layer_ids) != tuple(settings["layers"]):
    raise ValueError(f"train.init_from: {directory} reads layers {list(draft.config.layer_ids)}, this run "
                     f"{settings['layers']}.")
  return draft, record, directory


def export_workdir(workdir: str, out_dir: str, *, model: str | None = None, step: int | None = None,
                   overwrite: bool = False, dtype: str = "float32", include_embedding: bool = False,
                   allow_first_id_1: bool = False, allow_nonstandard_k: bool = False) -> str:
  """Exports the draft of a training workdir as EAGLE-3, loading the target it recorded (or `model`).

  Keyword arguments after `step` are `layerwave.export.export_eagle3`'s.

  Returns:
    `out_dir`.
  """
  ckpt = ckpt_lib.Checkpointer(checkpoint_dir(workdir))
  try:
    meta = ckpt.read_meta(step)
  finally:
    ckpt.close()
  spec = model or (meta.get("config") or {}).get("model")
  if not spec:
    raise ValueError(f"{workdir} does not record its target model; pass --model.")
  target = load_target(spec, dtype=(meta.get("config") or {}).get("dtype", "float32"))
  draft = load_draft(workdir, target, step)
  record = layer_ids.LayerSelection.from_dict(meta["selection"])
  return export_lib.export_eagle3(draft, target, out_dir, selection=record, overwrite=overwrite, dtype=dtype,
                                  include_embedding=include_embedding, allow_first_id_1=allow_first_id_1,
                                  allow_nonstandard_k=allow_nonstandard_k)
