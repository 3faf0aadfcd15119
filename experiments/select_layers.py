"""Print a layer selection in every engine's own numbering: the lines to paste into each.

  python experiments/select_layers.py                        # EAGLE-3's layers of the config's target, offline
  python experiments/select_layers.py --selection=W --strategy=exhaustive   # an analysis workdir's choice
  python experiments/select_layers.py --selection=D          # a training workdir or an EAGLE-3 export
  python experiments/select_layers.py --layers=2,9,27 --engines=vllm,sglang --json=ids.json
  python experiments/select_layers.py --layers=2,9,27 --model=configs/shapes/llama-3.1-8b

Ids given here are hf_hidden_states ids (docs/METHOD.md §1). For vLLM and the EAGLE-3 config.json, SGLang
(with and before its PR #25454), SpecForge, speculators, TensorRT-LLM, Model Optimizer and tpu-inference it
prints the ids that engine needs, the config key or flag to put them in, and the engine file its numbering
was read from (layerwave/engine_ids.py). Listing every engine, one that cannot read the selection is marked;
naming it with --engines refuses. tpu-inference's JAX Llama captures EAGLE-3's default whatever it is told:
a non-default selection is refused for it unless --allow_ignored_selection.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import os

from absl import app
from absl import flags
from ml_collections import config_flags

from layerwave.analysis import select_layers

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "smollm2_135m.py"),
    "Config file: its `model`, and its `layers` or `selection.path` when no flag below names the layers.",
    lock_config=True)
_SELECTION = flags.DEFINE_string("selection", "", "A selection.json, a LayerSelection JSON, or an analysis, "
                                 "training or EAGLE-3 export directory.")
_STRATEGY = flags.DEFINE_string("strategy", "", "Which record of a file holding several (analysis strategies).")
_LAYERS = flags.DEFINE_list("layers", [], "hf_hidden_states ids, e.g. 2,15,27 (instead of --selection).")
_MODEL = flags.DEFINE_string("model", "", "The target for L (short name, checkpoint directory or config.json); "
                             "default the config's model. Checked against a loaded record when given.")
_K = flags.DEFINE_integer("k", 0, "Layers to select: re-runs an analysis strategy at this k (from the "
                          "workdir's layer_stats.json), or sets the k of EAGLE-3's rule; 0 keeps the record's.")
_ENGINES = flags.DEFINE_list("engines", [], "Engines to print (default all); naming one refuses a selection it "
                             "cannot read.")
_JSON = flags.DEFINE_string("json", "", "Also write the report here (JSON, atomically).")
_ALLOW_IGNORED = flags.DEFINE_bool("allow_ignored_selection", False,
                                   "Print tpu-inference's lines for a non-default selection (it captures the "
                                   "default anyway) instead of refusing.")
_SOURCES = flags.DEFINE_bool("sources", True, "Print the engine files each numbering was read from.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  select_layers.run(_CONFIG.value, selection=_SELECTION.value, strategy=_STRATEGY.value, layers=_LAYERS.value,
                    model=_MODEL.value, k=_K.value, engines=_ENGINES.value, json_path=_JSON.value,
                    allow_ignored_selection=_ALLOW_IGNORED.value, show_sources=_SOURCES.value)


if __name__ == "__main__":
  app.run(main)
