"""Device meshes and where arrays live on them.

The mesh is built once, from a config's `mesh` field (e.g. `(('data', -1),)` or
`(('data', -1), ('model', 2))`), and passed down; library code never calls `jax.devices()` on its own.
Batches are sharded over `'data'`; parameters are replicated, or split over `'model'` (tensor
parallelism: attention heads and the MLP's hidden units) when the mesh has that axis. Meshes use Auto axes so
XLA's partitioner places the collectives.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MeshSpec = Sequence[tuple[str, int]]
DEFAULT_MESH: MeshSpec = (("data", -1),)


def maybe_initialize_distributed(enabled: bool) -> None:
  """Starts multi-host JAX (TPU pods, multi-node GPU) when asked; a no-op otherwise.

  On TPU pods and under SLURM/Open MPI, `jax.distributed.initialize()` discovers the coordinator
  itself; elsewhere set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID.
  """
  if enabled and jax.process_count() == 1:
    jax.distributed.initialize()


def make_mesh(spec: MeshSpec = DEFAULT_MESH, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds a mesh from `((axis_name, size), ...)`; one size may be -1 (all remaining devices)."""
  devices = list(jax.devices() if devices is None else devices)
  names = tuple(name for name, _ in spec)
  sizes = [int(size) for _, size in spec]
  if sizes.count(-1) > 1:
    raise ValueError(f"Mesh {spec}: at most one axis may have size -1.")
  known = math.prod(s for s in sizes if s != -1)
  if known <= 0 or len(devices) % known:
    raise ValueError(f"Mesh {spec} does not fit {len(devices)} devices: the fixed axis sizes "
                     f"multiply to {known}, which must divide the device count.")
  sizes = [len(devices) // known if s == -1 else s for s in sizes]
  if math.prod(sizes) != len(devices):
    raise ValueError(f"Mesh {spec} needs {math.prod(sizes)} devices but {len(devices)} are present.")
  grid = np.asarray(devices, dtype=object).reshape(sizes)
  return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def data_size(mesh: Mesh) -> int:
  return mesh.shape.get("data", 1)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Shards the leading (batch) axis over `'data'`."""
  return NamedSharding(mesh, P("data", *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def check_batch(mesh: Mesh, batch: int) -> None:
  """Raises a clear error when the batch cannot be split evenly over the data axis."""
  n = data_size(mesh)
  if batch % n:
    raise ValueError(f"Batch size {batch} is not divisible by the mesh's 'data' axis ({n} devices): "
                     f"pad the batch to a multiple of {n} or build a smaller mesh.")


# Parameter name (leaf module) -> which kernel axis is split over 'model'.
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split outputs
_ROW = ("o_proj", "down_proj")  # split inputs


def param_spec(path: tuple, shape: tuple[int, ...], mesh: Mesh) -> P:
  """PartitionSpec for a target parameter: replicated, or Megatron-style split over `'model'`."""
  if "model" not in mesh.shape or mesh.shape["model"] == 1:
    return P()
  n = mesh.shape["model"]
  names = [str(p) for p in path]
  module = names[-2] if len(names) >= 2 else ""
  if module in _COLUMN and shape[-1] % n == 0:
    return P(None, "model") if names[-1] == "kernel" else P("model")
  if module in _ROW and names[-1] == "kernel" and shape[0] % n == 0:
    return P("model", None)
  return P()


def place_param(mesh: Mesh):
  """Returns a `(path, array) -> jax.Array` that puts each parameter on the mesh."""
  def place(path, arr):
    return jax.device_put(arr, NamedSharding(mesh, param_spec(path, arr.shape, mesh)))
  return place
