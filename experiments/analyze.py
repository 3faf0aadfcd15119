"""Which layers should the draft read? Entropy and CKA of every target layer on chat data, then selections.

  python experiments/analyze.py --config=configs/smollm2_135m.py --workdir=W
  python experiments/analyze.py --config=configs/smollm2_135m.py:smoke --workdir=W   # < 1 min on a CPU

Writes W/layer_stats.json, W/selection.json (one LayerSelection per strategy; the draft-training stage reads
it with --config.selection.path=W/selection.json) and W/plots/*.png, and prints the summary table.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from layerwave.analysis import analyze

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.INFO)
  analyze.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
