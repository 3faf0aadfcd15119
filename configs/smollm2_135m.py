"""SmolLM2-135M-Instruct: `--config=configs/smollm2_135m.py:<experiment>` names the experiment's own file.

  python experiments/analyze.py        --config=configs/smollm2_135m.py --workdir=W        # configs/smollm2/base.py
  python experiments/compare_layers.py --config=configs/smollm2_135m.py:demo --workdir=W   # configs/smollm2/demo.py

The settings live in configs/smollm2/: `base.py` (every section, each holding its options dataclass' defaults)
and one file per experiment over it (smoke, demo, compare, cpu, recipe, paper). This name stays because the
Makefile, the docs and the released artifacts' recorded commands use it; both spellings give the same config.
"""

import os

from layerwave import options

EXPERIMENTS = ("smoke", "demo", "compare", "cpu", "recipe", "paper")
HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2")


def get_config(arg: str | None = None) -> options.Config:
  if arg and arg not in EXPERIMENTS:
    raise ValueError(f"Unknown config variant {arg!r}; use one of "
                     f"{', '.join(':' + e for e in EXPERIMENTS)} or nothing.")
  c = options.config_module(os.path.join(HERE, f"{arg or 'base'}.py")).get_config()
  return c.unlock()  # configs/scale.py adds its own keys
