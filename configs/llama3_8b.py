"""Llama-3.1-8B-Instruct as the target, on a TPU v5e-8: every stage sized for the slice.

  python experiments/aot_check.py --config=configs/llama3_8b.py:v5e8 --stages=all   # compiled here, not run
  python experiments/analyze.py --config=configs/llama3_8b.py:v5e8 --workdir=W       # on the v5e-8
  python experiments/train_draft.py --config=configs/llama3_8b.py:v5e8 --workdir=W --config.layers=2,16,29

L = 32, so EAGLE-3's rule gives [2, 16, 29]. `:smoke` is a tiny Llama-shaped target on a v5e-4 (`v5e:2x2`), what
the test suite compiles through `aot_check` in seconds.
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location("configs.scale", os.path.join(os.path.dirname(__file__), "scale.py"))
scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale)

TOPOLOGIES = {"v5e8": "v5e:2x4", "smoke": "v5e:2x2"}


def get_config(arg=None):
  arg = arg or "v5e8"
  if arg == "v5e8":
    c = scale.scale_config(model="meta-llama/Llama-3.1-8B-Instruct", shapes="shapes/llama-3.1-8b",
                           mesh=(("data", 1), ("model", 8)), max_length=2048, analysis_batch=8, train_batch=16,
                           features_batch=8, slots=64, prompt_len=2048)
  elif arg == "smoke":
    c = scale.scale_config(model="", shapes="shapes/tiny-llama", mesh=(("data", 2), ("model", 2)), max_length=256,
                           analysis_batch=4, train_batch=4, features_batch=4, slots=8, prompt_len=128, new_tokens=32,
                           decode_batches=(1, 4))
    c.draft_model.vocab_size = 512
    c.train.ttt_steps = 3
  else:
    raise ValueError(f"Unknown variant {arg!r} of configs/llama3_8b.py: use one of {sorted(TOPOLOGIES)}.")
  c.aot.topology = TOPOLOGIES[arg]
  return c
