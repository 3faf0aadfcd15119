"""Ahead-of-time checks: every stage compiled for a TPU topology from a machine without one (see `check`)."""

from __future__ import annotations

import json
import os

import jax

from layerwave.aot.compiled import HEADER, Row, check, format_row, write_json
from layerwave.aot.chips import CHIPS, Chip, parse_topology, topology_devices
from layerwave.aot.stages import STAGES
from layerwave.models.config import ModelConfig

__all__ = ["CHIPS", "Chip", "HEADER", "Row", "STAGES", "check", "format_row", "model_shapes", "parse_topology",
           "run", "topology_devices"]


def model_shapes(path: str) -> ModelConfig:
  """The target's shapes from an HF `config.json` (the file, or the directory holding it); no weights read.

  Raises:
    FileNotFoundError: no config.json there.
    ValueError: an architecture layerwave's target does not support (`ModelConfig.from_hf` names it).
  """
  file = os.path.join(path, "config.json") if os.path.isdir(path) else path
  if not os.path.isfile(file):
    raise FileNotFoundError(f"No config.json at {path}: give --model_config=DIR_OR_FILE (the shapes shipped under "
                            "configs/shapes/, or a checkpoint's own config.json).")
  with open(file) as f:
    try:
      return ModelConfig.from_hf(json.load(f))
    except json.JSONDecodeError as e:
      raise ValueError(f"{file} is not valid JSON ({e}).") from e


def run(config, *, topology: str = "", stages=("all",), json_path: str = "", model_config: str = "", log=print):
  """The `aot_check` launcher's adapter: shapes from `model_config` (else the config's `shapes`, else a local
  checkpoint directory `model`), the topology from the flag (else `config.aot.topology`), a table on `log`,
  and the rows written to `json_path` when given. Returns `check`'s dict."""
  # Compile seconds are a finding here: never read a program back from the persistent cache.
  jax.config.update("jax_enable_compilation_cache", False)
  source = model_config or config.get("shapes") or config.model
  model = model_shapes(source)
  topology = topology or config.get("aot", {}).get("topology", "")
  if not topology:
    raise ValueError("No topology: pass --topology=v5e:2x4 (or set config.aot.topology).")
  log(f"{source}: L {model.num_layers}, D {model.hidden_size}, V {model.vocab_size}; {topology}, mesh "
      f"{dict(config.mesh)}, {config.dtype}. Compiled for the topology here, not run.")
  log(HEADER)
  result = check(config, model, topology, tuple(stages), log=log)
  result["shapes"] = source
  if json_path:
    write_json(result, json_path)
  return result
