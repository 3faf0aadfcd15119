"""Train an EAGLE-3 draft on chosen target layers, online and data-parallel, resumable.

  python experiments/train_draft.py --config=configs/smollm2_135m.py --workdir=W --config.layers=2,15,27
  python experiments/train_draft.py --config=configs/smollm2_135m.py --workdir=W \
      --config.selection.path=A/selection.json --config.selection.strategy=greedy

Rerunning the same command resumes from the latest checkpoint in W/checkpoints.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import json

from absl import app
from absl import flags
from ml_collections import config_flags

from layerwave.training import loop

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2_135m.py", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.",
                               required=True)


def main(argv):
  del argv
  result = loop.run(_CONFIG.value, _WORKDIR.value)
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  app.run(main)
