"""Host settings a process needs before numpy and jax load: the first call of every launcher, benchmark and test.

`configure_host()` sets OPENBLAS_NUM_THREADS=1, and with simulated CPU devices (`XLA_FLAGS=
--xla_force_host_platform_device_count=N`) PJRT_NPROC=4N, unless they are already set. Both are read once, when
their library loads, so the call comes before anything imports numpy or jax (this module imports neither, and
`import layerwave` loads neither: the package's names load on first use). Importing layerwave changes nothing.
"""

from __future__ import annotations

import os
from typing import MutableMapping


def simulated_devices(flags: str) -> int:
  """N of `--xla_force_host_platform_device_count=N` in an XLA_FLAGS string (0 when absent or malformed)."""
  for flag in flags.split():
    if flag.startswith("--xla_force_host_platform_device_count="):
      try:
        return int(flag.split("=", 1)[1])
      except ValueError:
        return 0
  return 0


def configure_host(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
  """Sets the thread variables below in `environ` (default `os.environ`) where unset; returns those it set.

  Call it before numpy and jax are imported: each reads its variable once, when it loads.

  Args:
    environ: the environment to update; `os.environ` unless given (a subprocess' environment, say).

  Returns:
    {name: value} of the variables this call set (empty when all were set already).
  """
  environ = os.environ if environ is None else environ
  wanted = {
      # XLA:CPU's eigvalsh (the analysis' matrix entropy) runs on scipy's OpenBLAS, whose per-core spinning
      # threads slow it many times over when the cores are shared (CI runners, parallel jobs; BENCHMARKS.md,
      # "Layer statistics"); one thread is as fast on an idle machine.
      "OPENBLAS_NUM_THREADS": "1",
  }
  devices = simulated_devices(environ.get("XLA_FLAGS", ""))
  if devices > 1:
    # With N simulated CPU devices XLA sizes its thread pools max(cores, N): when all N devices enter jaxlib's
    # batched eigvalsh (the analysis' matrix entropy) together, each splits its batch into tasks on that pool
    # and waits, no thread is left to run them, and the process hangs (tests/multidevice.py). Four threads per
    # device leave room; XLA reads PJRT_NPROC when its backend starts.
    wanted["PJRT_NPROC"] = str(4 * devices)
  set_here = {name: value for name, value in wanted.items() if name not in environ}
  environ.update(set_here)
  return set_here
