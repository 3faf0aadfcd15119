"""layerwave: which target layers should a speculative-decoding draft read?

Public API (the pipeline in order):
  load_target(spec, dtype)          the target LLM (HF directory, GGUF, short name, hub id)
  generate(target, prompt_ids, ...) autoregressive decoding, the speedup baseline
  continuous.Engine                 continuous batching of many prompts through fixed decode rows
  load_draft(path, target)          a trained EAGLE-3 draft (training workdir or EAGLE-3 HF directory)
  speculative.generate(...)         speculative decoding with a draft
  export_eagle3(draft, target, dir) the draft as an EAGLE-3 Hugging Face directory (vLLM, SGLang)
  load_eagle3(dir, target)          an EAGLE-3 Hugging Face directory (ours or a published draft)

Every name loads on first use, so `import layerwave` imports neither jax nor numpy and changes nothing in the
environment; a launcher calls `layerwave.runtime.configure_host()` first, before numpy and jax load.
"""

import importlib
import sys
import types

# {public name: (module, attribute in it, or None for the module itself)}.
_EXPORTS = {
    "KVCache": ("layerwave.models.kv_cache", "KVCache"),
    "ModelConfig": ("layerwave.models.config", "ModelConfig"),
    "SamplingParams": ("layerwave.sampling", "SamplingParams"),
    "Target": ("layerwave.inference", "Target"),
    "TargetOutput": ("layerwave.models.target", "TargetOutput"),
    "continuous": ("layerwave.continuous", None),
    "export_eagle3": ("layerwave.export", "export_eagle3"),
    "generate": ("layerwave.generate", "generate"),
    "load_draft": ("layerwave.training.restore", "load_draft"),
    "load_eagle3": ("layerwave.eagle3", "load_eagle3"),
    "load_target": ("layerwave.inference", "load_target"),
    "speculative": ("layerwave.speculative", None),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'layerwave' has no attribute {name!r}")
  module, attribute = _EXPORTS[name]
  value = importlib.import_module(module)
  if attribute is not None:
    value = getattr(value, attribute)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
  """The package, keeping `layerwave.generate` the function when the submodule of that name loads.

  Loading a submodule sets it as an attribute of its package; `layerwave.generate` (the module, imported by
  `layerwave.continuous` and the speculative loop) would then hide `generate` (the function) from
  `__getattr__`. A public name that is not a module itself is never replaced by a submodule.
  """

  def __setattr__(self, name, value):
    if isinstance(value, types.ModuleType) and name in _EXPORTS and _EXPORTS[name][1] is not None:
      return
    super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
