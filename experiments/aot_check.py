"""Does every stage fit the TPU slice? Compiles each for the topology from this machine (libtpu, no TPU needed).

  python experiments/aot_check.py --config=configs/llama3_8b.py:v5e8 --stages=all --json=aot_rows.json
  python experiments/aot_check.py --config=configs/llama3_8b.py:v5e8 --topology=v5e:4x4 \
      --config.mesh='(("data",2),("model",8))' --stages=train_offline,train_online
  python experiments/aot_check.py --config=configs/llama3_8b.py:v5e8 --model_config=/path/to/config.json

Prints one row per stage: per-chip argument / output / temporary bytes against the chip's HBM (fits with >= 10%
left, or by how much it does not and what to change), compile seconds, FLOPs and bytes of one chip's program,
and the roofline time with the tokens/s it implies. Every figure is compiled, not run.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
from absl import app
from absl import flags
from ml_collections import config_flags

from layerwave import aot

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (a scale variant).", lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", "", "TPU topology, e.g. v5e:2x4; default config.aot.topology.")
_STAGES = flags.DEFINE_list("stages", ["all"], f"Stages among {list(aot.STAGES)}, or all.")
_JSON = flags.DEFINE_string("json", "", "Also write the rows here (JSON).")
_MODEL_CONFIG = flags.DEFINE_string("model_config", "", "An HF config.json (or its directory) to take the target's "
                                    "shapes from; default the config's `shapes`.")
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  aot.run(_CONFIG.value, topology=_TOPOLOGY.value, stages=_STAGES.value, json_path=_JSON.value,
          model_config=_MODEL_CONFIG.value)


if __name__ == "__main__":
  app.run(main)
