"""The paper's experiment: drafts on different layer sets, same budget and seeds, compared by τ.

  # the README's main job (`make demo`): analysis → selection → two drafts → speculation
  python experiments/compare_layers.py --config=configs/smollm2_135m.py:demo --workdir=out/demo
  # the sweep of RESULTS.md (needs an analysis workdir; see RESULTS.md for the budget and timing)
  python experiments/compare_layers.py --config=configs/smollm2_135m.py:compare \\
      --config.compare.analysis=out/analysis --workdir=out/compare

Runs `layerwave.compare.run`: layer sets from the analysis (strategies, ablations, λ sweep, random sets),
one draft per (set, seed) trained with `config.train`, speculative decoding on held-out MT-bench /
HumanEval / GSM8K prompts, then W/results.md, W/results.json and W/plots/compare.png. Rerunning with the
same --workdir skips finished cells; a workdir from a different config is refused.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from layerwave import compare

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
