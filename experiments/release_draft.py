"""Release a trained draft under releases/: an EAGLE-3 directory (bf16) with a manifest, loadable by name.

  python experiments/release_draft.py --draft=R/draft --name=smollm2-135m-instruct-eagle3 \
      --data=R/distilled/manifest.json --heldout=R/features --metrics=R/eval/batch1/bench_speculative.json \
      --commands="make campaign-distill" --commands="make campaign-train"

Loads the target the draft's checkpoint recorded, exports the draft (`layerwave.export.export_eagle3`, weights
in --dtype) and writes manifest.json (layer ids, target fingerprint, data, commands, held-out sim τ, the
results of each --metrics file keyed by its folder's name, SHA-256 of every file); see
`layerwave/training/release.py`. The held-out sim τ is that of the released weights on the whole heldout split
of --heldout (the run's store), else the workdir's last periodic evaluation (a few batches). Then
`layerwave.load_draft(NAME, target)` and `--config.draft=NAME` load it. A release is replaced only with
--overwrite and a held-out sim τ at least the release's. The manifest's `training` block (the run's settings,
step and data position) lets `--config.train.init_from=NAME` continue an unfinished run on a machine that lost
its workdir; `metrics.interim` says whether the run had reached its `train.num_steps`.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import json
import os
import tempfile

from absl import app
from absl import flags

from layerwave import checkpoint as ckpt_lib
from layerwave import eagle3
from layerwave import export as export_lib
from layerwave import layer_ids
from layerwave.inference import load_target
from layerwave.training import curves
from layerwave.training import features
from layerwave.training import loop
from layerwave.training import release
from layerwave.training import restore

_DRAFT = flags.DEFINE_string("draft", None, "Training workdir of the draft.", required=True)
_NAME = flags.DEFINE_string("name", None, "Release name (a folder under releases/).", required=True)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "Tensor dtype on disk.")
_DATA = flags.DEFINE_string("data", None, "The distilled workdir's manifest.json (its fingerprint and counts).")
_METRICS = flags.DEFINE_multi_string(
    "metrics", [], "A bench_speculative.json (or any JSON of measured results); repeat for several. Each is kept "
    "under its folder's name (eval/batch1/bench_speculative.json: 'batch1'), without its config.")
_COMMANDS = flags.DEFINE_multi_string("commands", [], "The commands that produced the draft.")
_HELDOUT = flags.DEFINE_string(
    "heldout", None, "A feature store (the run's own): the draft as released (its --dtype weights loaded back) is "
    "evaluated on this store's whole heldout split, and that simulated τ becomes the manifest's heldout_sim_tau "
    "(else the run's last periodic evaluation, which reads train.eval_batches batches).")
_HELDOUT_STEPS = flags.DEFINE_integer("heldout_steps", 5, "Draft depth of the --heldout evaluation.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing release (only with a better draft).")


def main(argv):
  del argv
  ckpt = ckpt_lib.Checkpointer(restore.checkpoint_dir(_DRAFT.value))
  try:
    meta = ckpt.read_meta()
  finally:
    ckpt.close()
  model = (meta.get("config") or {}).get("model")
  if not model:
    raise ValueError(f"{_DRAFT.value} does not record its target model.")
  target = load_target(model)
  draft = restore.load_draft(_DRAFT.value, target)
  points = curves.read_curve(_DRAFT.value)
  metrics = {"heldout_sim_tau": points[-1].sim_tau if points else None, "step": meta.get("step"),
             "tokens_trained": meta.get("tokens_trained")}
  if points:
    metrics["last_evaluation"] = {"step": points[-1].step, "sim_tau": points[-1].sim_tau}
  if _HELDOUT.value:
    metrics["heldout"] = _evaluate_released(draft, target, meta, _HELDOUT.value, _HELDOUT_STEPS.value)
    metrics["heldout_sim_tau"] = metrics["heldout"]["sim_tau"]
  evaluation = {}
  for path in _METRICS.value:
    name = os.path.basename(os.path.dirname(os.path.abspath(path)))
    if name in evaluation:
      raise app.UsageError(f"--metrics: two files in folders named {name!r}; give each its own folder.")
    with open(path, encoding="utf-8") as f:
      measured = json.load(f)
    evaluation[name] = {k: v for k, v in measured.items() if k != "config"} if isinstance(measured, dict) else measured
  if evaluation:
    metrics["evaluation"] = evaluation
  data = {"selection": meta.get("selection"), "dataset": meta.get("dataset")}
  if _DATA.value:
    with open(_DATA.value, encoding="utf-8") as f:
      distilled = json.load(f)
    data["distilled"] = {k: distilled.get(k) for k in ("dataset", "fingerprint", "output", "prompts")}
  out = os.path.join(release.releases_root(), _NAME.value)
  training = release.training_record(meta)
  metrics["interim"] = bool(training["num_steps"] and training["step"] < training["num_steps"])
  if _OVERWRITE.value and release.is_release_dir(out):
    with open(os.path.join(out, release.MANIFEST), encoding="utf-8") as f:
      old_metrics = json.load(f).get("metrics") or {}
    old, new = _comparable(old_metrics, metrics)
    if old is not None and (new is None or new < old):
      raise app.UsageError(f"{out} holds a draft of held-out sim τ {old:.4f}; this one's is {new} (measured "
                           "the same way): a release is replaced only with a better draft.")
  manifest = release.write(draft, target, out, model=model,
                           selection=layer_ids.LayerSelection.from_dict(meta["selection"]),
                           dtype=_DTYPE.value, commands=_COMMANDS.value, data=data, metrics=metrics,
                           training=training, overwrite=_OVERWRITE.value)
  print(json.dumps({"release": out, "layer_ids": manifest["layer_ids"], "files": manifest["sha256"]}, indent=1))


def _evaluate_released(draft, target, meta, store: str, steps: int) -> dict:
  """The draft exactly as released (exported in --dtype and loaded back) on `store`'s whole heldout split."""
  with tempfile.TemporaryDirectory() as tmp:
    # Engines' id checks belong to the release itself (release.write); this copy only reads the weights back.
    path = export_lib.export_eagle3(draft, target, os.path.join(tmp, "draft"), dtype=_DTYPE.value,
                                    allow_first_id_1=True, allow_nonstandard_k=True)
    released = eagle3.load_eagle3(path, target)
  train = (meta.get("config") or {}).get("train") or {}
  # The run's length buckets: a pass over every held-out sequence, with little padding computed.
  m = loop.evaluate_on_store(released, target, store, steps=steps, batch_size=int(train.get("batch_size", 8)),
                             decay=float(train.get("decay", 0.8)),
                             assistant_only=bool(train.get("assistant_only", True)),
                             widths=tuple(int(w) for w in train.get("bucket_widths") or ()))
  return {"store": features.open_store(store).fingerprint, "split": "heldout (whole)", "steps": steps,
          "dtype": _DTYPE.value, "sim_tau": float(m["sim_tau"]), "acc_j": [float(a) for a in m["acc_j"]],
          "positions": int(m["predicted_positions"])}


def _comparable(old: dict, new: dict) -> tuple[float | None, float | None]:
  """The two releases' held-out sim τ measured alike: on the same store's whole heldout split at the same depth
  when both were, else their `heldout_sim_tau` as recorded."""
  a, b = old.get("heldout"), new.get("heldout")
  if a and b and (a["store"], a["steps"]) == (b["store"], b["steps"]):
    return a["sim_tau"], b["sim_tau"]
  return old.get("heldout_sim_tau"), new.get("heldout_sim_tau")


if __name__ == "__main__":
  app.run(main)
