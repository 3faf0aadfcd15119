"""Export a trained draft as an EAGLE-3 Hugging Face directory (for vLLM / SGLang).

  python experiments/export_draft.py --draft=W --out=out/my-eagle3
  python experiments/export_draft.py --draft=W --out=out/my-eagle3 --overwrite --dtype=bfloat16

Loads the target recorded in W's checkpoint (or --model), then the draft, and writes config.json +
model.safetensors (layerwave/training/restore.py loads the draft; see layerwave/eagle3.py for the layer-id convention each engine reads; config.json's
`layerwave.engine_note` says which layers each engine version feeds this draft). Serve it with e.g.
  vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "out/my-eagle3", ...}'
Engines run the draft in the target's dtype: for a bfloat16 serving target export --dtype=bfloat16.
Refused unless asked for: layer ids starting at 1 (--allow_first_id_1: SGLang >= PR #25454 shifts them,
vLLM does not) and k != 3 layers (--allow_nonstandard_k: only layerwave loads it). Id 0 is always refused.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import json
import os

from absl import app
from absl import flags

from layerwave.training import restore

_DRAFT = flags.DEFINE_string("draft", None, "Training workdir of the draft.", required=True)
_OUT = flags.DEFINE_string("out", None, "Directory to create.", required=True)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --out directory.")
_MODEL = flags.DEFINE_string("model", None, "Target model (default: the one the draft recorded).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"],
                           "Tensor dtype on disk, recorded in config.json (torch_dtype, dtype). Engines "
                           "run the draft in the target's dtype: bfloat16 for a bfloat16 serving target; "
                           "float32 round-trips exactly.")
_EMBED = flags.DEFINE_bool("include_embedding", False,
                           "Also write embed_tokens.weight (engines share the target's when absent).")
_FIRST_ID_1 = flags.DEFINE_bool(
    "allow_first_id_1", False,
    "Export layer ids starting at 1 (read as written by vLLM, shifted by one by SGLang >= PR #25454); "
    "config.json's layerwave.engine_note and a log line say what each engine reads.")
_NONSTANDARD_K = flags.DEFINE_bool(
    "allow_nonstandard_k", False,
    "Export a draft reading k != 3 layers (vLLM and SGLang cannot load it; layerwave can).")


def main(argv):
  del argv
  out = restore.export_workdir(_DRAFT.value, _OUT.value, model=_MODEL.value, step=_STEP.value,
                               overwrite=_OVERWRITE.value, dtype=_DTYPE.value,
                               include_embedding=_EMBED.value, allow_first_id_1=_FIRST_ID_1.value,
                               allow_nonstandard_k=_NONSTANDARD_K.value)
  with open(os.path.join(out, "config.json")) as f:
    print(json.load(f)["layerwave"]["engine_note"])  # which layers each engine version will feed it
  print(out)


if __name__ == "__main__":
  app.run(main)
