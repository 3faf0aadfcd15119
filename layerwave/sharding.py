"""Device meshes and where arrays live on them.

The mesh is built once, from a config's `mesh` field (e.g. `(('data', -1),)` or
`(('data', -1), ('model', 2))`), and passed down; library code never calls `jax.devices()` on its own.
Batches are sharded over `'data'`; parameters are replicated, or split over `'model'` (tensor
parallelism: attention heads and the MLP's hidden units) when the mesh has that axis. Meshes use Auto axes so
XLA's partitioner places the collectives.

Legend (`layerwave.axes`): V target vocabulary, D target width.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MeshSpec = Sequence[tuple[str, int]]
DEFAULT_MESH: MeshSpec = (("data", -1),)


def maybe_initialize_distributed(enabled: bool) -> None:
  """Starts multi-host JAX (TPU pods, multi-node GPU) when asked; a no-op otherwise.

  On TPU pods and under SLURM/Open MPI, `jax.distributed.initialize()` discovers the coordinator
  itself; elsewhere set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID.
  """
  # Nothing here may touch the XLA backend (`jax.process_count()` would start it, and initialize() must come
  # first); `is_initialized` reads the distributed runtime's own state.
  if not enabled or jax.distributed.is_initialized():
    return
  # JAX reads JAX_COORDINATOR_ADDRESS itself but not the process count and id; pass them when they are set
  # (clusters JAX detects on its own need none of the three).
  kwargs = {}
  for key, name in (("num_processes", "JAX_NUM_PROCESSES"), ("process_id", "JAX_PROCESS_ID")):
    if os.environ.get(name):
      try:
        kwargs[key] = int(os.environ[name])
      except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r} is not an integer; set it to the {key.replace('_', ' ')}.")
  jax.distributed.initialize(**kwargs)


def use_compilation_cache(directory: str) -> None:
  """Keeps XLA's compiled programs in `directory` (jax's persistent cache), so that the next run of the same
  stage on the same devices reads its programs back instead of compiling them again (minutes for an 8B target
  on TPU). A no-op for an empty `directory`, or when JAX_COMPILATION_CACHE_DIR is set (that wins). The scale
  configs (configs/scale.py) set `compilation_cache`; CPU configs leave it empty."""
  if not directory or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return
  jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


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


def require_single_process(stage: str) -> None:
  """Refuses, before any work, a stage that runs in one JAX process only, started in several."""
  if jax.process_count() > 1:
    raise ValueError(f"{stage} runs in one JAX process, not {jax.process_count()}: the host drives every decode "
                     "step and would repeat it on each process. Run it without --config.distributed (one "
                     "process per machine); the analysis, extraction and draft training run multi-host.")


def check_processes_agree(config, stage: str) -> None:
  """Refuses a multi-process run whose processes were started with different configs (each would build its
  own batches and schedule, and the collectives would silently mix them)."""
  if jax.process_count() == 1:
    return
  text = config.to_json_best_effort(sort_keys=True) if hasattr(config, "to_json_best_effort") else repr(config)
  digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
  every = np.asarray(multihost_utils.process_allgather(digest))  # [processes, 32]
  differ = [p for p in range(every.shape[0]) if not np.array_equal(every[p], every[0])]
  if differ:
    raise ValueError(f"{stage}: processes {differ} were started with a config other than process 0's; give "
                     "every process the same command and flags.")


def data_position(mesh: Mesh) -> tuple[int, int]:
  """(this process's block along the mesh's 'data' axis, the number of such blocks).

  A process feeds the rows of the data-axis positions its devices hold, so processes are counted along
  'data', not by `jax.process_index()`: when the 'model' axis spans hosts, the processes of one model group
  hold the same data positions and feed the same rows (levanter's `process_mesh_position`). Batch iterators
  take these as their `process_index` / `process_count`.
  """
  if "data" not in mesh.axis_names:
    return 0, 1
  axis = mesh.axis_names.index("data")
  me = jax.process_index()
  mine = sorted({idx[axis] for idx in np.ndindex(mesh.devices.shape) if mesh.devices[idx].process_index == me})
  if not mine:
    raise ValueError(f"Process {me} holds no device of the mesh {dict(mesh.shape)}: build the mesh over "
                     "jax.devices() (every process's devices).")
  size, held = mesh.shape["data"], len(mine)
  if mine != list(range(mine[0], mine[0] + held)) or size % held or mine[0] % held:
    raise ValueError(f"Process {me} holds data positions {mine} of {size}: a process must hold one "
                     "contiguous, aligned block of the 'data' axis; order the mesh's devices by process.")
  return mine[0] // held, size // held


def global_batch(mesh: Mesh, tree):
  """This process's rows (numpy, its `data_position` block of the global batch) → global arrays sharded over
  'data' along axis 0. The one way batches reach a mesh: with a single process it is a plain `device_put`;
  across processes each contributes its own rows (`jax.make_array_from_process_local_data`, as the feature
  store's batches and big_vision's `make_fsarray_from_local_slice`), where `device_put` would take every
  process's rows for the whole, identical global value."""
  def put(x):
    x = np.asarray(x)
    return jax.make_array_from_process_local_data(batch_sharding(mesh, max(x.ndim, 1)), x)
  return jax.tree.map(put, tree)


def from_host(x, where: NamedSharding) -> jax.Array:
  """A host value every process holds whole and equal (prompts, their lengths) → a global array placed as
  `where`. Each process supplies only the shards its own devices hold (with `where` split over 'data': the
  rows of its data position), so no process sends or checks another's rows; with a single process it is a
  plain `device_put`."""
  x = np.asarray(x)
  if jax.process_count() == 1:
    return jax.device_put(x, where)
  return jax.make_array_from_callback(x.shape, where, lambda index: x[index])


def to_host(x) -> np.ndarray:
  """A global array's whole value on this host (all processes must call it: it gathers across them)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def process_sum(value: int) -> int:
  """The sum over processes of a per-process host count (every process must call it)."""
  if jax.process_count() == 1:
    return int(value)
  return int(np.sum(multihost_utils.process_allgather(np.int64(value))))


def process_max(value: float) -> float:
  """The largest over processes of a per-process host value, e.g. a call's wall seconds: a program that spans
  hosts ends when its slowest process does (every process must call it)."""
  if jax.process_count() == 1:
    return float(value)
  return float(np.max(multihost_utils.process_allgather(np.float64(value))))


def broadcast_json(value: Any) -> Any:
  """Process 0's JSON-able `value` on every process (every process must call it; the others' `value` is
  ignored)."""
  if jax.process_count() == 1:
    return value
  data = np.frombuffer(json.dumps(value).encode(), np.uint8) if jax.process_index() == 0 else np.zeros(0, np.uint8)
  size = int(multihost_utils.broadcast_one_to_all(np.int64(data.size)))
  if jax.process_index():
    data = np.zeros(size, np.uint8)
  return json.loads(np.asarray(multihost_utils.broadcast_one_to_all(data)).tobytes().decode())


def on_process_0(fn: Callable[[], Any]) -> Any:
  """`fn()` run by process 0 alone (what reads and writes a stage's workdir, so that a workdir no other host sees
  still decides for all), its JSON-able result returned on every process. An error `fn` raises is raised on every
  process (on the others as a ValueError with its message), so all stop together instead of waiting for each
  other in the next collective."""
  if jax.process_count() == 1:
    return fn()
  if jax.process_index() == 0:
    try:
      value = fn()
    except Exception as e:  # every process must leave the broadcast below, whatever went wrong
      broadcast_json({"error": f"{type(e).__name__}: {e}"})
      raise
    return broadcast_json({"value": value})["value"]
  out = broadcast_json(None)
  if "error" in out:
    raise ValueError(f"Process 0 stopped: {out['error']}")
  return out["value"]


def check_batch(mesh: Mesh, batch: int) -> None:
  """Raises a clear error when the batch cannot be split evenly over the data axis."""
  n = data_size(mesh)
  if batch % n:
    raise ValueError(f"Batch size {batch} is not divisible by the mesh's 'data' axis ({n} devices): "
                     f"pad the batch to a multiple of {n} or build a smaller mesh.")


# Parameter name (leaf module) -> which kernel axis is split over 'model'.
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc")  # split outputs (fc: the draft's fusion)
_ROW = ("o_proj", "down_proj")  # split inputs


def param_spec(path: tuple, shape: tuple[int, ...], mesh: Mesh) -> P:
  """PartitionSpec for a target parameter: replicated, or Megatron-style split over `'model'`.

  The embedding `[V, D]` and the LM head `[D, V]` are split over the vocabulary, so the logits `[.., V]` come
  out split over `'model'` too and no chip holds the whole matrix or the whole logits (MaxText's layout). A
  vocabulary the axis does not divide stays replicated.
  """
  if "model" not in mesh.shape or mesh.shape["model"] == 1:
    return P()
  n = mesh.shape["model"]
  names = [str(p) for p in path]
  module = names[-2] if len(names) >= 2 else ""
  if (names[-1] == "embedding" or names == ["embed_tokens"]) and shape[0] % n == 0:  # the draft's frozen copy too
    return P("model", None)
  if module == "lm_head" and names[-1] == "kernel" and shape[-1] % n == 0:
    return P(None, "model")
  if module in _COLUMN and shape[-1] % n == 0:
    return P(None, "model") if names[-1] == "kernel" else P("model")
  if module in _ROW and names[-1] == "kernel" and shape[0] % n == 0:
    return P("model", None)
  return P()


def fsdp_spec(shape: tuple[int, ...], mesh: Mesh) -> P:
  """PartitionSpec that splits an array over every device of the mesh (fully sharded data parallelism).

  The first axis of the largest that the device count divides is split over all the mesh's axes at once; an
  array with no such axis (norm scales, scalars) stays replicated. Used for the draft's parameters and AdamW
  moments during training: each chip keeps 1/N of them and XLA gathers a layer's weights where the step
  reads them (the ZeRO-3 layout of MaxText's `fsdp` axis).
  """
  n = math.prod(mesh.shape.values())
  if n == 1 or not shape:
    return P()
  order = sorted(range(len(shape)), key=lambda i: (-shape[i], i))
  for axis in order:
    if shape[axis] % n == 0 and shape[axis] >= n:
      spec = [None] * len(shape)
      spec[axis] = tuple(mesh.axis_names)
      return P(*spec)
  return P()


def fsdp_shardings(tree, mesh: Mesh):
  """`NamedSharding`s of `fsdp_spec` for every array (or `ShapeDtypeStruct`) leaf of `tree`."""
  return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(tuple(x.shape), mesh)), tree)


def param_shardings(state, mesh: Mesh):
  """`NamedSharding`s of `param_spec` for every leaf of an NNX state (the target's, or a draft's at inference:
  its blocks carry the target's names, so they split over 'model' the same way)."""
  return nnx.from_flat_state([
      (path, var.replace(NamedSharding(mesh, param_spec(path, tuple(var.get_value().shape), mesh))))
      for path, var in nnx.to_flat_state(state)])


def place_param(mesh: Mesh):
  """Returns a `(path, array) -> jax.Array` that puts each parameter on the mesh."""
  def place(path, arr):
    return jax.device_put(arr, NamedSharding(mesh, param_spec(path, arr.shape, mesh)))
  return place
