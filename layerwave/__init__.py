"""layerwave: which target layers should a speculative-decoding draft read?

Public API (the pipeline in order):
  load_target(spec, dtype)          the target LLM (HF directory, GGUF, short name, hub id)
  generate(target, prompt_ids, ...) autoregressive decoding, the speedup baseline
  load_draft(path, target)          a trained EAGLE-3 draft (training workdir or EAGLE-3 HF directory)
  export_eagle3(draft, target, dir) the draft as an EAGLE-3 Hugging Face directory (vLLM, SGLang)
  load_eagle3(dir, target)          an EAGLE-3 Hugging Face directory (ours or a published draft)

Importing layerwave sets OPENBLAS_NUM_THREADS=1, and with simulated CPU devices (`XLA_FLAGS=
--xla_force_host_platform_device_count=N`) PJRT_NPROC=4N, unless they are already set (below); launchers and
the tests import it before numpy and jax for that reason.
"""

import os

# XLA:CPU's eigvalsh (the analysis' matrix entropy) runs on scipy's OpenBLAS, whose per-core spinning threads
# slow it many times over when the cores are shared (CI runners, parallel jobs; BENCHMARKS.md, "Layer
# statistics"); one thread is as fast on an idle machine. OpenBLAS reads the variable when it loads, so it is
# set before anything here imports numpy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def _simulated_devices(flags: str) -> int:
  for flag in flags.split():
    if flag.startswith("--xla_force_host_platform_device_count="):
      try:
        return int(flag.split("=", 1)[1])
      except ValueError:
        return 0
  return 0


# With N simulated CPU devices XLA sizes its thread pools max(cores, N): when all N devices enter jaxlib's
# batched eigvalsh (the analysis' matrix entropy) together, each splits its batch into tasks on that pool and
# waits, no thread is left to run them, and the process hangs (tests/multidevice.py). Four threads per device
# leave room; XLA reads PJRT_NPROC when its backend starts, so it is set before anything here imports jax.
if _simulated_devices(os.environ.get("XLA_FLAGS", "")) > 1:
  os.environ.setdefault("PJRT_NPROC", str(4 * _simulated_devices(os.environ["XLA_FLAGS"])))

# pylint: disable=g-import-not-at-top,wrong-import-position
from layerwave.eagle3 import load_eagle3
from layerwave.export import export_eagle3
from layerwave.generate import generate
from layerwave import continuous  # noqa: E402  # layerwave.continuous.Engine
from layerwave.inference import Target, load_target
from layerwave.models.config import ModelConfig
from layerwave.models.kv_cache import KVCache
from layerwave.models.target import TargetOutput
from layerwave.sampling import SamplingParams
from layerwave import speculative  # layerwave.speculative.generate

__all__ = ["KVCache", "ModelConfig", "SamplingParams", "Target", "TargetOutput", "export_eagle3",
           "generate", "load_draft", "load_eagle3",
           "load_target"]

# Entry points whose modules import heavy dependencies (orbax through the checkpoints), loaded on first use so
# that `import layerwave` stays light: {name: module}.
_LAZY = {"load_draft": "layerwave.training.restore"}


def __getattr__(name: str):
  if name in _LAZY:
    import importlib  # pylint: disable=g-import-not-at-top
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'layerwave' has no attribute {name!r}")
