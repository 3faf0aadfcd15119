"""Extract the target's features once into a store that offline draft training reads (no target in the step).

  python experiments/extract_features.py --config=configs/smollm2_135m.py:cpu --config.layers=2,15,27 \
      --config.features.dir=F
  python experiments/train_draft.py --config=configs/smollm2_135m.py:cpu --config.layers=2,15,27 \
      --workdir=W --config.train.features=F
  python experiments/extract_features.py --config=configs/smollm2_135m.py:smoke --config.layers=2,15,27 \
      --config.features.dir=F   # seconds on a CPU

Runs the target over the chat dataset of `--config.data` (train and heldout splits) and stores, per real token,
the hidden states of `--config.features.depths` ("" = the layers of `--config.layers`, or every set in
`--config.selection.path`; "all" = 0..L), the final-norm state, the target's argmax, the ids and the assistant
mask, in bfloat16 (`--config.features.dtype=float32` for full precision). The size is printed before anything
is written; a store that would not fit is refused. Rerunning the same command resumes after the last finished
shard. Multi-host: the same command on every host with `--config.distributed=True` and F on a shared
filesystem.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import json

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from layerwave.training.features import extraction

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.INFO)
  result = extraction.run(_CONFIG.value)
  print(json.dumps({k: result[k] for k in ("tokens_computed", "seconds", "tokens_per_s", "bytes")}
                   | {"dir": _CONFIG.value.features.dir}, indent=2))


if __name__ == "__main__":
  app.run(main)
