"""What the benchmarks share: their start (arguments, logging, the config's mesh and target) and their result file.

Place in the project: `benchmarks/` measures the library's stages (speed, memory, agreement with a reference)
through its public functions; `experiments/` runs them. A benchmark calls `layerwave.runtime.configure_host()`
first, then imports this module: a sibling, found because Python puts a script's own folder on `sys.path`.
"""

from __future__ import annotations

import os
from typing import Any

from absl import app
from absl import logging
import ml_collections

from layerwave import atomic
from layerwave import sharding
from layerwave.inference import Target, load_target


def start(argv: list[str], config: ml_collections.ConfigDict) -> Target:
  """Refuses stray arguments, logs at INFO, and loads `config.model` in `config.dtype` on `config.mesh`.

  Args:
    argv: what `app.run` passes `main` (the program name, then anything absl did not parse as a flag).
    config: the benchmark's `--config`.

  Returns:
    The target, on its mesh (`target.mesh`).
  """
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.INFO)
  return load_target(config.model, dtype=config.dtype, mesh=sharding.make_mesh(config.mesh))


def write_result(workdir: str, name: str, result: Any) -> str:
  """Writes `result` as `workdir/name` (JSON, atomically), creating the folder; returns the path."""
  os.makedirs(workdir, exist_ok=True)
  return atomic.write_json(os.path.join(workdir, name), result)
