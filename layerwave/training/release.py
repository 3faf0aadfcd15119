"""Released drafts: an EAGLE-3 directory with a manifest, committed under `releases/`, loaded by short name.

A draft release is exactly what `layerwave.export.export_eagle3` writes (`config.json`, `model.safetensors`,
weights in bfloat16 by default) plus `manifest.json`: the layer ids, the target (model spec and fingerprint),
the data, the commands that made it, its measured held-out sim τ and evaluation table, and the SHA-256 of every
file. `layerwave.load_draft("smollm2-135m-instruct-eagle3", target)` and `--config.draft=NAME` find it under
`releases/` (or `$LAYERWAVE_RELEASES`); loading verifies every checksum and the target first, so an altered
release, or one for another target, is refused with the file or fingerprint named.

  python experiments/release_draft.py --draft=W --name=smollm2-135m-instruct-eagle3 [--heldout=H.json]
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
from typing import Any

from layerwave import atomic
from layerwave import export as export_lib
from layerwave import layer_ids
from layerwave import options as options_lib
from layerwave.data import distilled
from layerwave.data import release as answers_release
from layerwave.training import options as train_options
from layerwave.inference import Target
from layerwave.models.draft import Draft

__all__ = ["FORMAT", "ReleaseError", "releases_root", "available", "resolve", "write", "verify_for",
           "training_record", "TRAINING_FIELDS"]

FORMAT = "layerwave-draft-release"
FORMAT_VERSION = 1
MANIFEST = answers_release.MANIFEST
ReleaseError = answers_release.ReleaseError
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


def releases_root() -> str:
  """`$LAYERWAVE_RELEASES`, default the repository's `releases/` folder."""
  return os.environ.get("LAYERWAVE_RELEASES") or os.path.join(
      os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "releases")


def _manifest_format(directory: str) -> str | None:
  path = os.path.join(directory, MANIFEST)
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f).get("format")
  except (OSError, ValueError):
    return None


def is_release_dir(path: str) -> bool:
  return os.path.isdir(path) and _manifest_format(path) == FORMAT


def available() -> list[str]:
  """The names of the draft releases under `releases_root()`."""
  root = releases_root()
  if not os.path.isdir(root):
    return []
  return sorted(n for n in os.listdir(root) if is_release_dir(os.path.join(root, n)))


def resolve(name: str) -> str | None:
  """A short name (no path separator, not an existing path) → its release directory; None for anything
  else (a path is the caller's to load). Raises `ReleaseError` for a short name no release has."""
  if os.path.exists(name) or os.sep in name or "/" in name or name == "random":
    return None
  directory = os.path.join(releases_root(), name)
  if is_release_dir(directory):
    return directory
  names = available()
  raise ReleaseError(f"No draft release named {name!r} under {releases_root()}; the releases there are: "
                     f"{', '.join(names) or 'none'}. Give one of them, or a path to a draft.")


def verify_for(directory: str, target: Target) -> dict[str, Any]:
  """Checks every file against the manifest's SHA-256 and the target against the one the draft was trained
  for; returns the manifest."""
  manifest = answers_release.verify(directory, fmt=FORMAT)
  want, have = manifest["target"]["fingerprint"], distilled.target_fingerprint(target)
  if want != have:
    raise ReleaseError(f"{directory} is a draft for {manifest['target']['model']} (fingerprint {want}); the "
                       f"target given has fingerprint {have}. Load {manifest['target']['model']} as the "
                       "target.")
  return manifest


# What a release keeps of its training run's checkpoint, so that the run can continue from it on a machine
# that lost the workdir (`train.init_from`): the settings it must be continued under, where it stood.
TRAINING_FIELDS = ("step", "schedule_steps", "config_fingerprint", "settings", "feature_store", "data_position",
                   "tokens_trained", "train_seconds", "compute_dtypes")


def training_record(meta: dict[str, Any]) -> dict[str, Any]:
  """The `training` block of a release, from its run's checkpoint meta: `TRAINING_FIELDS` and the run's
  planned `num_steps` (a release before that step is interim)."""
  missing = [k for k in ("step", "schedule_steps", "config_fingerprint", "settings", "data_position")
             if k not in meta]
  if missing:
    raise ValueError(f"The checkpoint's meta lacks {missing}: it was not written by training.loop.train.")
  record = {k: meta.get(k) for k in TRAINING_FIELDS}
  # No machine's home in a release: paths under it read "~/..." (and the fingerprint is of what is recorded);
  # `train_options.same_recipe` expands them where the run continues.
  record["settings"] = train_options.home_as_tilde(record["settings"])
  record["config_fingerprint"] = options_lib.fingerprint(record["settings"])
  record["num_steps"] = ((meta.get("config") or {}).get("train") or {}).get("num_steps")
  return record


def write(draft: Draft, target: Target, out_dir: str, *, model: str, selection=None, dtype: str = "bfloat16",
          commands: list[str] | None = None, data: dict | None = None, metrics: dict | None = None,
          training: dict | None = None, overwrite: bool = False) -> dict[str, Any]:
  """Exports `draft` as a release directory, atomically (a temporary directory renamed into place).

  Args:
    draft: the trained draft (k = 3 layers: what engines load; `export_eagle3` refuses others).
    target: its target.
    out_dir: the release directory, e.g. `releases/smollm2-135m-instruct-eagle3`.
    model: the target's model spec, recorded for users (`layerwave.load_target(model)`).
    selection: the layer selection record behind the draft (a manual one when None).
    dtype: the tensors' dtype on disk.
    commands: the commands that produced the draft (data, features, training).
    data: what it was trained on (conversation count, the distilled set's fingerprint, ...).
    metrics: measured quality (held-out sim τ, the evaluation table).
    training: `training_record` of the run's checkpoint (lets `train.init_from` continue the run).
    overwrite: replace an existing release (only with a better draft).

  Returns:
    The manifest written.
  """
  name = os.path.basename(os.path.normpath(out_dir))
  if not _NAME.match(name):
    raise ValueError(f"Release name {name!r}: use lower-case letters, digits, '.', '_' and '-'.")
  out_dir = os.path.abspath(out_dir)
  if os.path.lexists(out_dir) and not overwrite:
    raise FileExistsError(f"{out_dir} exists; a release is replaced only by a better draft (overwrite=True).")
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  staging = os.path.join(parent, f".tmp-release-{name}")
  shutil.rmtree(staging, ignore_errors=True)
  export_lib.export_eagle3(draft, target, staging, selection=selection, dtype=dtype)
  c = draft.config
  files = sorted(os.listdir(staging))
  manifest = {
      "format": FORMAT, "format_version": FORMAT_VERSION, "name": name,
      "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
      "layer_ids": list(c.layer_ids), "convention": layer_ids.CONVENTION,
      "draft_vocab_size": c.draft_vocab_size, "dtype": dtype,
      "target": {"model": model, "fingerprint": distilled.target_fingerprint(target),
                 "num_layers": target.config.num_layers, "hidden_size": target.config.hidden_size},
      "data": data or {}, "metrics": metrics or {}, "commands": list(commands or []),
      **({"training": training} if training else {}),
      "sha256": {f: answers_release.sha256(os.path.join(staging, f)) for f in files},
  }
  atomic.write_json(os.path.join(staging, MANIFEST), manifest)
  if os.path.lexists(out_dir):
    shutil.rmtree(out_dir)
  os.replace(staging, out_dir)
  return manifest
