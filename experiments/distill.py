"""Self-distilled training data: the target answers the ShareGPT prompts itself.

  python experiments/distill.py --config=configs/smollm2_135m.py --workdir=D
  python experiments/distill.py --config=configs/smollm2_135m.py:smoke --workdir=D   # 8 prompts, < 1 min
  python experiments/distill.py --config=configs/gemma3_270m.py --workdir=D   # a base model: plain-text prompts
  python experiments/train_draft.py --config=configs/smollm2_135m.py --workdir=W --config.layers=2,15,27 \
      --config.data.source=distilled:D

Writes D/dataset/ (array_record, the ShareGPT record schema), D/manifest.json (target and tokenizer
fingerprints, sampling, prompt counts, tokens, loops cut, time) and D/chunks/ (rerun the same command to
resume after an interruption).
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from layerwave.data import distill

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (the distilled dataset).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.INFO)
  distill.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
