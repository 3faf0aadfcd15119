"""The experiment configs under configs/, loaded as `--config=configs/<name>.py:<variant>` loads them."""

import importlib.util
import os

import ml_collections

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def load(variant: str = "smoke", name: str = "smollm2_135m") -> ml_collections.ConfigDict:
  """A fresh `get_config(variant)` of `configs/<name>.py` (unlocked: tests edit it)."""
  spec = importlib.util.spec_from_file_location(f"configs.{name}", os.path.join(CONFIGS, name + ".py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant).unlock()
