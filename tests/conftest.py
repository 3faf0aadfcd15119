"""Shared pytest set-up: CPU JAX with float32 matmuls at full precision for parity tests, and a tiny target.

`tiny_chat_target_dir`: a random 8-layer Llama (D = 32) that speaks SmolLM2's tokenizer and chat template, so
the real data pipeline, the analysis, training and comparison stages run on it in seconds. Eight layers, so
EAGLE-3's rule (2, L//2, L-3) gives distinct ids: (2, 4, 5).
"""

import os
import shutil

from layerwave import runtime

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

import jax  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

from layerwave.models import hub  # pylint: disable=g-import-not-at-top

jax.config.update("jax_default_matmul_precision", "highest")
# The tests run on the CPU. The test extra installs libtpu (for the ahead-of-time TPU compiles of tests/aot), and
# with it installed every jax process would also try to start a TPU backend that this machine does not have.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])

# A persistent compilation cache outside the repository ($LAYERWAVE_CACHE/jax-compilation, default
# ~/.cache/layerwave/jax-compilation), for this process and, through the environment, for every process the
# tests start (tests/multidevice.py, tests/multihost.py, the launchers): most of a test's time on XLA:CPU is
# compiling small programs, and a second run reads them back (tests/analysis: 113 s of CPU without the cache,
# 41 s with it warm). Every program is kept: the default keeps only those that took over a second to compile,
# which on CPU is almost none. Keys hold the jax version, the XLA flags and the device assignment, so an
# entry never serves another set-up; an unreadable entry (a writer killed mid-write) is reported and
# recompiled. Delete the folder to reclaim its space (~70 MB after a full run). A variable set beforehand wins.
COMPILATION_CACHE_ENV = {
    "JAX_COMPILATION_CACHE_DIR": os.path.join(hub.cache_root(), "jax-compilation"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
}
for _name, _value in COMPILATION_CACHE_ENV.items():
  os.environ.setdefault(_name, _value)
# jax read the environment when it was imported (above, through layerwave), before these were set.
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                  int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
  """Drops JAX's compiled programs after each test module.

  One pytest process compiles thousands of XLA CPU programs; each holds memory mappings for its code, and past
  the kernel's `vm.max_map_count` (65,530 here) the next compilation segfaults inside XLA (seen in the full run,
  never in a module alone). Kept across modules, they grow fast: tests/speculative (without the tuner),
  generate, inference and models/draft reached 24,867 mappings and 4.2 GB resident in 9 modules, against at
  most 10,440 and 2.4 GB cleared per module. Clearing costs nothing measurable: a program a later module needs
  again comes back from the persistent cache above (written when it was first compiled, so on a first run too);
  tests/speculative's acceptance, decode, verify and tree modules took 92 s of CPU cleared and 93 s kept, so
  clearing less often (say, only past a mapping count) would save no time and would let memory grow.
  """
  yield
  jax.clear_caches()


@pytest.fixture(scope="session")
def tiny_chat_target_dir(tmp_path_factory):
  hf_reference = pytest.importorskip("tests.models.hf_reference")  # needs torch
  directory = str(tmp_path_factory.mktemp("tiny_chat_target"))
  smol = hub.resolve("smollm2-135m-instruct")
  hf_reference.save_hf_model_with(directory, vocab_size=49152, num_hidden_layers=8,
                                  eos_token_id=2, bos_token_id=1, pad_token_id=2)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(smol, name), os.path.join(directory, name))
  return directory
