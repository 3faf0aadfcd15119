"""Runs a test script in two real JAX processes (`jax.distributed` over 127.0.0.1), as a pod runs a launcher.

Each process has one CPU device, finds the coordinator in JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID (what `sharding.maybe_initialize_distributed` reads, so the script must call it, or a stage that
does, before anything touches the XLA backend), and gets `ARGS` (strings) and `PROCESS` (its id) after a
prelude that puts the repository on `sys.path` and sets tests/conftest.py's matmul precision. Every process
passes its result to `write_result(obj)`; the caller gets the list, one per process. `run_here` runs the
same script in the calling process as the one-process reference (the script reads DISTRIBUTED, False there,
for `config.distributed`). The processes inherit
tests/conftest.py's persistent compilation cache through the environment (only process 0 writes to it), and 30 s
before the timeout a process that is still running prints every thread's Python stack and exits, so a hang fails
with the place it hung in the assertion message. The thread pools keep XLA's default size (the core count): with
one device per process that leaves a thread beside the device's, which the 8-device runs of tests/multidevice.py
lacked (on one core jaxlib runs LAPACK batches inline, so the case does not arise).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PRELUDE = """
import faulthandler, json, os, sys
sys.path.insert(0, sys.argv[1])
faulthandler.dump_traceback_later(float(sys.argv[3]), exit=True)
from layerwave import runtime
runtime.configure_host()  # before jax loads
import jax
jax.config.update("jax_default_matmul_precision", "highest")
OUT, ARGS = sys.argv[2], sys.argv[4:]
PROCESS = int(os.environ["JAX_PROCESS_ID"])
DISTRIBUTED = True  # what a script sets config.distributed to (False when `run_here` runs it)


def write_result(obj):
  with open(OUT, "w") as f:
    json.dump(obj, f)
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_here(script: str, *args: Any) -> Any:
  """Runs `script` in this process as process 0 of 1 (no `jax.distributed`: DISTRIBUTED is False); its result.

  The one-process reference of a two-process run, without the seconds a new interpreter spends importing JAX.
  """
  results = []
  namespace = {"__name__": "__multihost_here__", "ARGS": [str(a) for a in args], "PROCESS": 0,
               "DISTRIBUTED": False, "write_result": results.append}
  exec(compile("import json, os, sys\nimport jax\n" + textwrap.dedent(script), "<multihost script>", "exec"), namespace)
  if len(results) != 1:
    raise AssertionError(f"the script called write_result {len(results)} times, not once")
  return json.loads(json.dumps(results[0]))  # as a process would have passed it


def launch(argv: list[str], num_processes: int = 2) -> list[subprocess.Popen]:
  """Starts a launcher's command line `argv` as the `num_processes` JAX processes of one distributed run (one CPU
  device each; stdout discarded, stderr piped for the failure message) and returns them running: for tests that
  stop one mid-run."""
  address = f"127.0.0.1:{_free_port()}"
  procs = []
  for i in range(num_processes):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=address, PYTHONPATH=REPO,
               JAX_NUM_PROCESSES=str(num_processes), JAX_PROCESS_ID=str(i))
    env.pop("XLA_FLAGS", None)
    procs.append(subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
  return procs


def run_in_processes(script: str, tmp_path, *args: Any, num_processes: int = 2, timeout: int = 600) -> list:
  """Runs `script` (Python source, dedented) in `num_processes` JAX processes; returns their results."""
  address = f"127.0.0.1:{_free_port()}"
  outs, procs = [], []
  for i in range(num_processes):
    outs.append(os.path.join(str(tmp_path), f"multihost_result_{i}.json"))
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=address,
               JAX_NUM_PROCESSES=str(num_processes), JAX_PROCESS_ID=str(i))
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    procs.append(subprocess.Popen([sys.executable, "-c", _PRELUDE + textwrap.dedent(script), REPO, outs[i],
                                   str(max(timeout - 30, 1)), *map(str, args)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
  finally:
    for p in procs:
      p.kill()
  for i, p in enumerate(procs):
    if p.returncode:
      raise AssertionError(f"process {i} of {num_processes} exited with {p.returncode}:\n{logs[i][-12000:]}")
  results = []
  for out in outs:
    with open(out) as f:
      results.append(json.load(f))
  return results
