"""TPU chips and topologies to compile for from a machine that has none (libtpu's ahead-of-time path).

Place in the pipeline: the first half of `layerwave.aot`. `topology_devices("v5e:2x4")` returns the devices of
a TPU slice that does not exist here: libtpu (installed by `pip install "jax[tpu]"`) describes the topology,
and `jax.jit(f).lower(...).compile()` on a mesh of these devices compiles every stage for it, giving per-chip
memory and XLA's cost analysis without a TPU (MaxText's `train_compile.py` does the same). Nothing runs.

The chip constants (usable HBM, peak bf16 matmul FLOP/s, HBM bandwidth) are Google Cloud's published figures
for each generation (cloud.google.com/tpu/docs: "TPU v4", "TPU v5e", "TPU v5p", "TPU v6e (Trillium)"); usable
HBM is the chip's HBM less what the runtime keeps, as a v5e reports it (15.75 of 16 GiB).
"""

from __future__ import annotations

import dataclasses
import os
import re

from jax.experimental import topologies

GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation's constants (per chip).

  Attributes:
    name: the topology prefix ("v5e").
    hbm_bytes: HBM a program may use.
    peak_flops: bf16 matmul peak, FLOP/s.
    hbm_bandwidth: bytes/s.
    accelerator: libtpu's accelerator-type name for `chips` chips (`TPU_ACCELERATOR_TYPE`).
    cores_per_chip: TensorCores a chip counts for in that name (v4 / v5p slices count cores).
    chips_per_host: chips one host of the generation drives.
  """

  name: str
  hbm_bytes: int
  peak_flops: float
  hbm_bandwidth: float
  accelerator: str
  cores_per_chip: int = 1
  chips_per_host: int = 4

  def accelerator_type(self, chips: int) -> str:
    return f"{self.accelerator}-{chips * self.cores_per_chip}"


CHIPS = {
    "v4": Chip("v4", 32 * GiB - GiB // 4, 275e12, 1228e9, "v4", cores_per_chip=2),
    "v5e": Chip("v5e", 16 * GiB - GiB // 4, 197e12, 819e9, "v5litepod"),
    "v5p": Chip("v5p", 95 * GiB - GiB // 4, 459e12, 2765e9, "v5p", cores_per_chip=2),
    "v6e": Chip("v6e", 32 * GiB - GiB // 4, 918e12, 1640e9, "v6e"),
}

_TOPOLOGY = re.compile(r"^(v4|v5e|v5p|v6e):(\d+)x(\d+)(?:x(\d+))?$")


def parse_topology(name: str) -> tuple[Chip, tuple[int, ...]]:
  """`"v5e:2x4"` → (the chip, the grid `(2, 4)`); any other text raises naming the accepted form."""
  m = _TOPOLOGY.match(str(name).strip())
  if not m:
    raise ValueError(f"Unknown TPU topology {name!r}: give GENERATION:AxB or GENERATION:AxBxC with GENERATION one "
                     f"of {sorted(CHIPS)}, e.g. v5e:2x4 (a v5e-8), v5e:4x4, v5p:2x2x2 (8 v5p chips, two hosts), "
                     "v6e:2x4.")
  chip = CHIPS[m.group(1)]
  grid = tuple(int(g) for g in m.groups()[1:] if g is not None)
  if chip.name in ("v4", "v5p") and len(grid) != 3:
    raise ValueError(f"Topology {name!r}: {chip.name} slices are 3-D tori; give AxBxC, e.g. {chip.name}:2x2x2.")
  if chip.name in ("v5e", "v6e") and len(grid) != 2:
    raise ValueError(f"Topology {name!r}: {chip.name} slices are 2-D; give AxB, e.g. {chip.name}:2x4.")
  return chip, grid


def topology_devices(name: str) -> tuple[Chip, list]:
  """The devices of a TPU topology, for compiling ahead of time on a machine without TPUs.

  Sets libtpu's environment for a compile-only run (no metadata server, the slice's accelerator type, one
  worker name per host) unless the caller set it, then asks `jax.experimental.topologies`.

  Raises:
    ValueError: an unknown topology, or libtpu missing (names the install command).
  """
  chip, grid = parse_topology(name)
  chips = 1
  for g in grid:
    chips *= g
  hosts = max(1, chips // chip.chips_per_host)
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  # No chip is opened, so several compile-only processes may load libtpu at once (its lockfile guards chips).
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ["TPU_ACCELERATOR_TYPE"] = chip.accelerator_type(chips)
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", ",".join(["localhost"] * hosts))
  try:
    import libtpu  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    raise ValueError("Compiling for a TPU topology needs libtpu: pip install \"jax[tpu]==$(python -c 'import jax; "
                     "print(jax.__version__)')\" (the test extra of setup.py installs it).") from e
  topo = topologies.get_topology_desc(platform="tpu", topology_name=f"{chip.name}:{'x'.join(map(str, grid))}")
  devices = list(topo.devices)
  if len(devices) != chips:
    raise ValueError(f"libtpu described {len(devices)} devices for {name!r}, expected {chips}.")
  return chip, devices
