"""A learned selection: a gated draft trained on every depth of a feature store, its k largest gates the layers.

  python experiments/learn_layers.py --config=configs/smollm2_135m.py:paper --workdir=W \
      --config.data.source=distilled:D --config.train.features=S --config.train.eval_features=H \
      --config.draft_model.gates=softmax --config.draft_model.fc_norm=True --config.learned.sweep=SWEEP

One gated run per seed (W/seed<s>: checkpoints, gates.json, selection.json), then W/selection.json
("learned_gates-k3", "learned_gates-k5": train them with --config.selection.path=W/selection.json
--config.selection.strategy=learned_gates-k3) and the report W/learned.md (layerwave.training.learned).
Rerunning the same command resumes an interrupted run and skips finished ones.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
from absl import app
from absl import flags
from ml_collections import config_flags

from layerwave.training import learned

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2_135m.py", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for the gated runs, selection.json and the report.",
                               required=True)


def main(argv):
  del argv
  learned.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
