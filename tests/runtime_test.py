"""layerwave.runtime and the package root: `import layerwave` changes no environment variable and loads neither
numpy nor jax; `runtime.configure_host()` sets the thread variables, keeping a value already set."""

import json
import os
import subprocess
import sys

import pytest

from layerwave import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIABLES = ("OPENBLAS_NUM_THREADS", "PJRT_NPROC", "XLA_FLAGS")


def _python(code: str, **env: str) -> str:
  """Runs `code` in a fresh interpreter, the thread variables unset unless given; its last line of output."""
  environ = {k: v for k, v in os.environ.items() if k not in VARIABLES}
  environ.update(env, PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                       env=environ, timeout=300)
  return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("flags", ["", "--xla_force_host_platform_device_count=8"])
def test_import_layerwave_leaves_the_environment_and_numpy_alone(flags):
  code = ("import os, sys, json\nbefore = dict(os.environ)\nimport layerwave\n"
          "from layerwave import runtime\n"
          "print(json.dumps([dict(os.environ) == before, sorted(m for m in ('numpy', 'jax') if m in sys.modules)]))")
  unchanged, loaded = json.loads(_python(code, **({"XLA_FLAGS": flags} if flags else {})))
  assert unchanged and loaded == []


@pytest.mark.parametrize("flags,preset,expected", [
    ("--xla_force_host_platform_device_count=8", None, "32"),  # 4 threads per simulated device
    ("--xla_force_host_platform_device_count=8", "5", "5"),  # the user's value stays
    ("", None, "unset"),  # real devices: XLA's own pool size
])
def test_configure_host_sizes_the_thread_pools_of_simulated_devices(flags, preset, expected):
  env = ({"XLA_FLAGS": flags} if flags else {}) | ({"PJRT_NPROC": preset} if preset else {})
  code = ("import os\nfrom layerwave import runtime\nruntime.configure_host()\n"
          "print(os.environ.get('PJRT_NPROC', 'unset'))")
  assert _python(code, **env) == expected


@pytest.mark.parametrize("preset,expected", [(None, "1"), ("4", "4")])
def test_configure_host_gives_openblas_one_thread_unless_set(preset, expected):
  code = "import os\nfrom layerwave import runtime\nruntime.configure_host()\nprint(os.environ['OPENBLAS_NUM_THREADS'])"
  assert _python(code, **({"OPENBLAS_NUM_THREADS": preset} if preset else {})) == expected


def test_configure_host_returns_what_it_set_in_the_mapping_given():
  environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "OPENBLAS_NUM_THREADS": "2"}
  assert runtime.configure_host(environ) == {"PJRT_NPROC": "16"}
  assert environ["OPENBLAS_NUM_THREADS"] == "2"
  assert runtime.configure_host(environ) == {}


@pytest.mark.parametrize("flags,expected", [
    ("--xla_force_host_platform_device_count=8", 8), ("--foo=1 --xla_force_host_platform_device_count=2", 2),
    ("--xla_force_host_platform_device_count=x", 0), ("", 0)])
def test_simulated_devices_reads_the_flag(flags, expected):
  assert runtime.simulated_devices(flags) == expected


def test_public_names_load_on_use_and_all_lists_them():
  code = ("import json, layerwave\nfrom layerwave import continuous, generate\n"
          "print(json.dumps([layerwave.__all__, callable(layerwave.generate), generate is layerwave.generate, "
          "callable(layerwave.speculative.generate), continuous.__name__, "
          "all(getattr(layerwave, n) is not None for n in layerwave.__all__)]))")
  names, generate_is_function, same, speculative_ok, continuous_name, all_resolve = json.loads(_python(code))
  assert {"speculative", "continuous", "generate", "load_target", "load_draft"} <= set(names)
  assert generate_is_function and same and speculative_ok and all_resolve
  assert continuous_name == "layerwave.continuous"
