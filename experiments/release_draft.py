"""Release a trained draft under releases/: an EAGLE-3 directory (bf16) with a manifest, loadable by name.

  python experiments/release_draft.py --draft=out/campaign/draft --name=smollm2-135m-instruct-eagle3 \
      --data=out/campaign/distilled/manifest.json --metrics=out/campaign/eval/batch1/bench_speculative.json \
      --commands="make campaign-distill" --commands="make campaign-train"

Loads the target the draft's checkpoint recorded, exports the draft (`layerwave.export.export_eagle3`, weights
in --dtype) and writes manifest.json (layer ids, target fingerprint, data, commands, held-out sim τ from the
workdir's last evaluation plus the results of each --metrics file, keyed by its folder's name, SHA-256 of every file); see `layerwave/training/release.py`. Then
`layerwave.load_draft(NAME, target)` and `--config.draft=NAME` load it. A release is replaced only with
--overwrite and a held-out sim τ at least the release's. The manifest's `training` block (the run's settings,
step and data position) lets `--config.train.init_from=NAME` continue an unfinished run on a machine that lost
its workdir; `metrics.interim` says whether the run had reached its `train.num_steps`.
"""

import json
import os

from absl import app
from absl import flags

from layerwave import checkpoint as ckpt_lib
from layerwave import layer_ids
from layerwave.inference import load_target
from layerwave.training import curves
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
      old = (json.load(f).get("metrics") or {}).get("heldout_sim_tau")
    if old is not None and (metrics["heldout_sim_tau"] is None or metrics["heldout_sim_tau"] < old):
      raise app.UsageError(f"{out} holds a draft of held-out sim τ {old:.4f}; this one's is "
                           f"{metrics['heldout_sim_tau']}: a release is replaced only with a better draft.")
  manifest = release.write(draft, target, out, model=model,
                           selection=layer_ids.LayerSelection.from_dict(meta["selection"]),
                           dtype=_DTYPE.value, commands=_COMMANDS.value, data=data, metrics=metrics,
                           training=training, overwrite=_OVERWRITE.value)
  print(json.dumps({"release": out, "layer_ids": manifest["layer_ids"], "files": manifest["sha256"]}, indent=1))


if __name__ == "__main__":
  app.run(main)
