"""Llama-3.3-70B-Instruct as the target, on a v5p slice of 8 chips over two hosts (`v5p:2x2x2`).

  python experiments/aot_check.py --config=configs/llama3_70b.py:v5p16 --stages=all   # compiled here, not run

L = 80, so EAGLE-3's rule gives [2, 40, 77]. 140 GB of bfloat16 weights split over 8 chips of 95 GiB.
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location("configs.scale", os.path.join(os.path.dirname(__file__), "scale.py"))
scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale)

TOPOLOGIES = {"v5p16": "v5p:2x2x2"}


def get_config(arg=None):
  arg = arg or "v5p16"
  if arg not in TOPOLOGIES:
    raise ValueError(f"Unknown variant {arg!r} of configs/llama3_70b.py: use one of {sorted(TOPOLOGIES)}.")
  c = scale.scale_config(model="meta-llama/Llama-3.3-70B-Instruct", shapes="shapes/llama-3.3-70b",
                         mesh=(("data", 1), ("model", 8)), max_length=2048, analysis_batch=8, train_batch=16,
                         features_batch=8, slots=64, prompt_len=2048)
  c.distributed = True  # two hosts
  c.aot.topology = TOPOLOGIES[arg]
  return c
