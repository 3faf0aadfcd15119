"""Which layers should the draft read? Entropy and CKA of every target layer on chat data, then selections.

  python experiments/analyze.py --config=configs/smollm2_135m.py --workdir=W
  python experiments/analyze.py --config=configs/smollm2_135m.py:smoke --workdir=W   # < 1 min on a CPU

Writes W/layer_stats.json, W/selection.json (one LayerSelection per strategy; the draft-training stage reads
it with --config.selection.path=W/selection.json) and W/plots/*.png, and prints the summary table.
"""

import os

# scipy's OpenBLAS (behind XLA:CPU's eigvalsh) busy-waits with one thread per core; on a shared or small CPU
# that slows the batched eigendecompositions by 10-40x. One thread is as fast when the machine is idle.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from absl import app  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import logging  # pylint: disable=g-import-not-at-top,wrong-import-position
from ml_collections import config_flags  # pylint: disable=g-import-not-at-top,wrong-import-position

from layerwave.analysis import analyze  # pylint: disable=g-import-not-at-top,wrong-import-position

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
