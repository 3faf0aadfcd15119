"""Qwen3-8B as the target, on a TPU v5e-8: every stage sized for the slice (compile-check with aot_check).

  python experiments/aot_check.py --config=configs/qwen3_8b.py:v5e8 --stages=all   # compiled here, not run

L = 36, so EAGLE-3's rule gives [2, 18, 33]. Its vocabulary (151,936) splits over the 8 chips like Llama's.
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location("configs.scale", os.path.join(os.path.dirname(__file__), "scale.py"))
scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale)

TOPOLOGIES = {"v5e8": "v5e:2x4"}


def get_config(arg=None):
  arg = arg or "v5e8"
  if arg not in TOPOLOGIES:
    raise ValueError(f"Unknown variant {arg!r} of configs/qwen3_8b.py: use one of {sorted(TOPOLOGIES)}.")
  c = scale.scale_config(model="Qwen/Qwen3-8B", shapes="shapes/qwen3-8b", mesh=(("data", 1), ("model", 8)),
                         max_length=2048, analysis_batch=8, train_batch=16, features_batch=8, slots=64,
                         prompt_len=2048)
  c.aot.topology = TOPOLOGIES[arg]
  return c
