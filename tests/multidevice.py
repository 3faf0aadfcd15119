"""Runs a test script on 8 simulated CPU devices in a subprocess and returns the JSON it writes.

XLA fixes the device count when jax starts, so a multi-device check runs in a fresh interpreter. The
script runs after a prelude that puts the repository on `sys.path` (so it can import `tests.*` helpers), sets
the same matmul precision as tests/conftest.py and checks that 8 devices exist; it finds its arguments in
`ARGS` (strings) and writes its result with `write_result(obj)`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PRELUDE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import layerwave
import jax
jax.config.update("jax_default_matmul_precision", "highest")
assert len(jax.devices()) == 8, jax.devices()
OUT, ARGS = sys.argv[2], sys.argv[3:]


def write_result(obj):
  with open(OUT, "w") as f:
    json.dump(obj, f)
"""


def run_on_eight_devices(script: str, tmp_path, *args: Any, timeout: int = 600) -> Any:
  """Runs `script` (Python source, dedented) with 8 CPU devices; returns what it passed to `write_result`.

  Args:
    script: the body to run after the prelude.
    tmp_path: a folder for the result file.
    *args: passed to the script as `ARGS` (as strings).
    timeout: seconds.
  """
  out = os.path.join(str(tmp_path), "multidevice_result.json")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(script), REPO, out, *map(str, args)],
                 check=True, env=env, timeout=timeout)
  with open(out) as f:
    return json.load(f)
