"""Qwen3-32B as the target, on a TPU v5e-16 (`:v5e16`) or a v5p-8 (`:v5p8`, 4 chips of 95 GiB).

  python experiments/aot_check.py --config=configs/qwen3_32b.py:v5e16 --stages=all   # compiled here, not run
  python experiments/aot_check.py --config=configs/qwen3_32b.py:v5p8 --stages=all

L = 64, so EAGLE-3's rule gives [2, 32, 61]. Its 8 KV heads cap the 'model' axis at 8: on 16 chips the other
factor of 2 goes to 'data'.
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location("configs.scale", os.path.join(os.path.dirname(__file__), "scale.py"))
scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale)

TOPOLOGIES = {"v5e16": "v5e:4x4", "v5p8": "v5p:2x2x1"}


def get_config(arg=None):
  arg = arg or "v5e16"
  if arg == "v5e16":
    mesh, analysis, features = (("data", 2), ("model", 8)), 8, 8
  elif arg == "v5p8":
    mesh, analysis, features = (("data", 1), ("model", 4)), 8, 8
  else:
    raise ValueError(f"Unknown variant {arg!r} of configs/qwen3_32b.py: use one of {sorted(TOPOLOGIES)}.")
  c = scale.scale_config(model="Qwen/Qwen3-32B", shapes="shapes/qwen3-32b", mesh=mesh, max_length=2048,
                         analysis_batch=analysis, train_batch=16, features_batch=features, slots=64, prompt_len=2048)
  c.aot.topology = TOPOLOGIES[arg]
  return c
