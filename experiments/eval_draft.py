"""Held-out acceptance of trained drafts on one feature store's heldout split, side by side (no decoding).

  python experiments/eval_draft.py --config=configs/smollm2_135m.py:recipe --features=S --drafts=W1,W2 \\
      [--steps=5] [--max_batches=0]

Each draft (a training workdir or EAGLE-3 directory for the config's target) is run as training runs it, `steps`
deep, over the store's held-out sequences; prints acc_j (out-of-vocabulary targets as misses), simulated τ and
the loss per draft, so drafts trained online, offline or on other text are compared on the same text (e.g. the
target's own answers, the text it drafts at inference). `layerwave.training.loop.evaluate_on_store`.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import json

from absl import app
from absl import flags
from ml_collections import config_flags

import layerwave
from layerwave.training import loop

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
_FEATURES = flags.DEFINE_string("features", None, "Feature store whose heldout split is evaluated.")
_DRAFTS = flags.DEFINE_list("drafts", None, "Draft workdirs (or EAGLE-3 directories).")
_STEPS = flags.DEFINE_integer("steps", 5, "Draft depth K evaluated.")
_MAX_BATCHES = flags.DEFINE_integer("max_batches", 0, "Batches of train.batch_size (0 = the whole split).")
flags.mark_flags_as_required(["config", "features", "drafts"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  target = layerwave.load_target(config.model, dtype=config.dtype)
  print("| draft | layers | sim τ | acc_j | positions |")
  print("|---|---|---|---|---|")
  for path in _DRAFTS.value:
    draft = layerwave.load_draft(path, target)
    m = loop.evaluate_on_store(draft, target, _FEATURES.value, steps=_STEPS.value,
                               batch_size=int(config.train.batch_size), max_batches=_MAX_BATCHES.value)
    print(f"| {path} | {list(draft.config.layer_ids)} | {m['sim_tau']:.3f} | "
          f"{' '.join(f'{a:.3f}' for a in m['acc_j'])} | {int(m['predicted_positions'])} |", flush=True)
    print(json.dumps({"draft": path, "sim_tau": m["sim_tau"], "acc_j": [float(a) for a in m["acc_j"]],
                      "loss": float(m["loss"])}))


if __name__ == "__main__":
  app.run(main)
