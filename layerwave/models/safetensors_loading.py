"""Hugging Face safetensors → parameters on the mesh, tensor by tensor and slice by slice.

How `load_target` reads a checkpoint at any size. Each parameter is built with `jax.make_array_from_callback`
on the sharding `sharding.param_spec` gives it, and the callback reads from the file only the block of the
checkpoint tensor that one device holds, in the checkpoint's own dtype, and casts that block: no process ever
holds the whole model, in float32 or at all, and each process reads only what its devices hold. A shard file is
opened (memory-mapped) for one tensor at a time, so the file pages a read touches leave the process' memory
with that tensor; the host's peak is about the largest tensor on top of what the devices hold.

Values are those of `weights.read_safetensors` + `weights.params_from_hf` bit for bit: a block is widened to
float32 first (exact for bfloat16 and float16) and then rounded once to the parameter dtype, unless the
checkpoint already stores that dtype. Names and shapes are checked against the config by the same
`weights.check_checkpoint` before a byte of weights is read; a sharded checkpoint is also checked against its
index (every shard file present, every tensor in the file the index names).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  # pylint: disable=unused-import  # safetensors' numpy reader needs it for bfloat16
import numpy as np
from jax.sharding import Mesh, NamedSharding

from layerwave import sharding
from layerwave.models import weights
from layerwave.models.config import ModelConfig
from layerwave.models.target import Transformer

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class StoredTensor:
  """Where one checkpoint tensor lies: its file, and its shape and dtype as stored (e.g. 'BF16')."""
  file: str
  shape: tuple[int, ...]
  dtype: str


def _open(file: str):
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  return safe_open(file, framework="numpy")


def _header(file: str) -> dict[str, StoredTensor]:
  """The tensors one safetensors file holds (its header only; no weights are read)."""
  try:
    with _open(file) as f:
      out = {}
      for name in f.keys():
        view = f.get_slice(name)
        out[name] = StoredTensor(file, tuple(int(s) for s in view.get_shape()), str(view.get_dtype()))
      return out
  except Exception as e:  # safetensors raises its own SafetensorError (and OSError) on a bad file
    raise ValueError(f"Cannot read {file}: it is truncated or not a safetensors file ({e!r}). Download or "
                     "save it again.") from e


def stored_tensors(directory: str) -> dict[str, StoredTensor]:
  """Every tensor of an HF checkpoint directory: `model.safetensors`, or the shards its index names.

  Args:
    directory: an HF checkpoint directory.

  Returns:
    HF tensor name → `StoredTensor`.

  Raises:
    FileNotFoundError: no safetensors weights, or shard files the index names are absent.
    ValueError: a shard file that cannot be read, or tensors the index maps to a shard that lacks them.
  """
  single, index = os.path.join(directory, SINGLE), os.path.join(directory, INDEX)
  if os.path.exists(single):
    return _header(single)
  if not os.path.exists(index):
    raise FileNotFoundError(
        f"No weights in {directory}: expected {SINGLE} or {INDEX} (pickled pytorch_model.bin checkpoints are "
        "not read; re-save with safe_serialization=True).")
  try:
    with open(index) as f:
      weight_map: dict[str, str] = dict(json.load(f)["weight_map"])
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{index} is not a safetensors index (JSON with a 'weight_map' of tensor name → shard "
                     f"file): {e!r}. Download or save the checkpoint again.") from e
  files = sorted(set(weight_map.values()))
  absent = [name for name in files if not os.path.exists(os.path.join(directory, name))]
  if absent:
    count = sum(v in absent for v in weight_map.values())
    raise FileNotFoundError(
        f"{index} names shard files that are not in {directory}: {absent} ({count} tensors). The download or "
        f"copy is incomplete: fetch every file the index lists (all {len(files)} shards), or save the model again "
        "with save_pretrained.")
  stored: dict[str, StoredTensor] = {}
  for name in files:
    for key, tensor in _header(os.path.join(directory, name)).items():
      if weight_map.get(key, name) == name:  # the index decides when two files hold one name
        stored[key] = tensor
  lost = sorted(k for k in weight_map if k not in stored)
  if lost:
    where = [f"{k} (in {weight_map[k]})" for k in lost[:8]]
    raise ValueError(
        f"The shards of {directory} miss tensors that {INDEX} maps to them: {where}"
        f"{' ...' if len(lost) > 8 else ''}. The shards and their index disagree (a shard replaced or cut "
        "short): download the checkpoint again, or save it again with save_pretrained.")
  return stored


def _convert(block: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """A block in the checkpoint's dtype → `dtype`, as the float32 path rounds it (widen, then round once)."""
  if block.dtype == dtype:
    return block
  return block.astype(np.float32, copy=False).astype(dtype)


def _load_param(view, shape: tuple[int, ...], transposed: bool, placement: NamedSharding, dtype: np.dtype):
  """One parameter on the mesh: each device's block read from the checkpoint tensor `view`."""
  blocks: dict[tuple, np.ndarray] = {}  # devices holding the same block (replicas) share one read

  def read(index: tuple[slice, ...]) -> np.ndarray:
    key = tuple(s.indices(n) for s, n in zip(index, shape))
    if key not in blocks:
      if transposed:  # the kernel's block [i_in, i_out] is the HF block [i_out, i_in], transposed
        blocks[key] = np.ascontiguousarray(_convert(view[tuple(index[::-1])], dtype).T)
      else:
        blocks[key] = _convert(view[tuple(index)], dtype)
    return blocks[key]

  return jax.make_array_from_callback(shape, placement, read, dtype=dtype)


def load_params(config: ModelConfig, directory: str, mesh: Mesh, dtype: Any = jnp.float32) -> Transformer:
  """Builds a `Transformer` from an HF safetensors directory, each parameter placed on `mesh` as it is read.

  Args:
    config: the model's config (`ModelConfig.from_pretrained(directory)`).
    directory: the HF checkpoint directory (`model.safetensors`, or shards and their index).
    mesh: the device mesh; each parameter gets `NamedSharding(mesh, sharding.param_spec(path, shape, mesh))`.
    dtype: parameter dtype.

  Returns:
    The model with the checkpoint's weights, the same values as `weights.params_from_hf` on
    `weights.read_safetensors(directory)`.

  Raises:
    ValueError: naming every missing, unexpected or wrongly shaped tensor, or a damaged shard or index.
    FileNotFoundError: no weights, or shard files missing.
  """
  dtype = jnp.dtype(dtype)
  graphdef, flat = weights.abstract_model(config, dtype)
  stored = stored_tensors(directory)
  weights.check_checkpoint(config, flat, {k: v.shape for k, v in stored.items()})

  def value(path, var):
    name, transposed = weights.hf_name(path)
    shape = tuple(var.shape)
    placement = NamedSharding(mesh, sharding.param_spec(path, shape, mesh))
    # Opened per tensor: closing it unmaps the pages this tensor's reads touched.
    with _open(stored[name].file) as f:
      return _load_param(f.get_slice(name), shape, transposed, placement, dtype)

  return weights.merge_model(graphdef, flat, value)
