"""Runs a test script on 8 simulated CPU devices in a subprocess and returns the JSON it writes.

XLA fixes the device count when jax starts, so a multi-device check runs in a fresh interpreter. The
script runs after a prelude that puts the repository on `sys.path` (so it can import `tests.*` helpers), sets
the same matmul precision as tests/conftest.py and checks that 8 devices exist; it finds its arguments in
`ARGS` (strings) and writes its result with `write_result(obj)`. The subprocess inherits tests/conftest.py's
persistent compilation cache through the environment.

Thread pools: XLA:CPU sizes its intra-op pool at max(cores, devices), so 8 simulated devices on 2 cores get 8
threads, and each device runs its program's thunks on them. jaxlib's batched LAPACK kernels (the analysis'
`eigvalsh`) split a batch into tasks on that same pool and block until they finish; when all 8 devices reach such
a kernel together, all 8 threads wait for tasks that no thread is left to run, and the process hangs with no
timeout (no collective is involved, so XLA's rendezvous watchdog never fires). That is how
tests/analysis/collect_test.py::test_eight_devices_match_one once hung for its whole 600 s under load; run in a
loop, the analysis' finalize program hung every time in under 200 calls. `PJRT_NPROC` (read by XLA's
`DefaultThreadPoolSize`) gives the pools 4 threads per device, so the waiting callers (one per device and LAPACK
call running at once) can never take every thread; the same loop then ran 3 × 200 calls in 6-8 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_DEVICES = 8

_PRELUDE = """
import faulthandler, json, sys
sys.path.insert(0, sys.argv[1])
faulthandler.dump_traceback_later(float(sys.argv[3]), exit=True)  # a hang fails with its stacks, before the kill
from layerwave import runtime
runtime.configure_host()  # before jax loads: PJRT_NPROC (set by `environment()` too, for a caller's own runs)
import layerwave
import jax
jax.config.update("jax_default_matmul_precision", "highest")
assert len(jax.devices()) == 8, jax.devices()
OUT, ARGS = sys.argv[2], sys.argv[4:]


def write_result(obj):
  with open(OUT, "w") as f:
    json.dump(obj, f)
"""


def environment() -> dict:
  """The subprocess' environment: 8 CPU devices, and thread pools larger than the device count (above)."""
  return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={NUM_DEVICES}",
              JAX_PLATFORMS="cpu", PJRT_NPROC=str(4 * NUM_DEVICES))


def run_on_eight_devices(script: str, tmp_path, *args: Any, timeout: int = 600) -> Any:
  """Runs `script` (Python source, dedented) with 8 CPU devices; returns what it passed to `write_result`.

  Args:
    script: the body to run after the prelude.
    tmp_path: a folder for the result file.
    *args: passed to the script as `ARGS` (as strings).
    timeout: seconds; 30 s before it, the script prints every thread's Python stack and exits.
  """
  out = os.path.join(str(tmp_path), "multidevice_result.json")
  subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(script), REPO, out, str(max(timeout - 30, 1)),
                  *map(str, args)], check=True, env=environment(), timeout=timeout)
  with open(out) as f:
    return json.load(f)
