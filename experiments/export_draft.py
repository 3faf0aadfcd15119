"""Export a trained draft as an EAGLE-3 Hugging Face directory (for vLLM / SGLang).

  python experiments/export_draft.py --draft=W --out=out/my-eagle3
  python experiments/export_draft.py --draft=W --out=out/my-eagle3 --overwrite --dtype=bfloat16

Loads the target recorded in W's checkpoint (or --model), then the draft, and writes config.json +
model.safetensors (see layerwave/export.py for the layer-id convention each engine reads). Serve it with e.g.
  vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "out/my-eagle3", ...}'
"""

from absl import app
from absl import flags

from layerwave import export

_DRAFT = flags.DEFINE_string("draft", None, "Training workdir of the draft.", required=True)
_OUT = flags.DEFINE_string("out", None, "Directory to create.", required=True)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --out directory.")
_MODEL = flags.DEFINE_string("model", None, "Target model (default: the one the draft recorded).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"],
                           "Tensor dtype on disk.")
_EMBED = flags.DEFINE_bool("include_embedding", False,
                           "Also write embed_tokens.weight (engines share the target's when absent).")


def main(argv):
  del argv
  out = export.export_workdir(_DRAFT.value, _OUT.value, model=_MODEL.value, step=_STEP.value,
                              overwrite=_OVERWRITE.value, dtype=_DTYPE.value,
                              include_embedding=_EMBED.value)
  print(out)


if __name__ == "__main__":
  app.run(main)
