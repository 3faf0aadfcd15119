"""The paper's experiment: drafts on different layer sets, same budget and seeds, compared by τ.

  # the README's main job (~11 min on 2 CPU cores): analysis → selection → two drafts → speculation
  python experiments/compare_layers.py --config=configs/smollm2_135m.py:demo --workdir=out/demo
  # the sweep of RESULTS.md (needs an analysis workdir; see RESULTS.md for the budget and timing)
  python experiments/compare_layers.py --config=configs/smollm2_135m.py:compare \\
      --config.compare.analysis=out/analysis --workdir=out/compare

Runs `layerwave.compare.run`: layer sets from the analysis (strategies, ablations, λ sweep, random sets),
one draft per (set, seed) trained with `config.train`, speculative decoding on held-out MT-bench /
HumanEval / GSM8K prompts, then W/results.md, W/results.json and W/plots/compare.png. Rerunning with the
same --workdir skips finished cells; a workdir from a different config is refused.
"""

import os

# scipy's OpenBLAS (behind XLA:CPU's eigvalsh in the analysis) busy-waits with one thread per core.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from absl import app  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import logging  # pylint: disable=g-import-not-at-top,wrong-import-position
from ml_collections import config_flags  # pylint: disable=g-import-not-at-top,wrong-import-position

from layerwave import compare  # pylint: disable=g-import-not-at-top,wrong-import-position

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Results folder (resumable).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.INFO)
  compare.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
