"""The pipeline at the scale its users run (8B-70B targets on TPU slices), and how to check it fits first.

Not a config of its own: `configs/llama3_8b.py`, `configs/qwen3_8b.py`, `configs/qwen3_32b.py` and
`configs/llama3_70b.py` build theirs with `scale_config`. Each variant is sized for one TPU slice (mesh, batch,
sequence length) and checked by compiling every stage for that slice from any machine, without a TPU:

  python experiments/aot_check.py --config=configs/llama3_8b.py:v5e8 --stages=all

The sections the launchers read are SmolLM2's (`configs/smollm2_135m.py`: data, analysis, features, train,
speculate, distill, ...); a scale variant states what differs: the target, its dtype, the mesh, and the sizes.
The `shapes` field names a directory holding the target's `config.json` (shapes only, shipped under
`configs/shapes/`): what `aot_check` compiles when the checkpoint itself is not on this machine.
"""

import importlib.util
import os

import ml_collections

HERE = os.path.dirname(os.path.abspath(__file__))


def _smollm2_config(variant=None) -> ml_collections.ConfigDict:
  """`configs/smollm2_135m.py:<variant>` (launchers load configs by path, not as a package)."""
  spec = importlib.util.spec_from_file_location("configs.smollm2_135m", os.path.join(HERE, "smollm2_135m.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)


def scale_config(*, model: str, shapes: str, mesh, max_length: int, analysis_batch: int, train_batch: int,
                 features_batch: int, slots: int, prompt_len: int, new_tokens: int = 256,
                 decode_batches=(1, 64)) -> ml_collections.ConfigDict:
  """A launcher config for one target on one slice.

  Args:
    model: what `load_target` loads (a checkpoint directory, or a hub id where a network exists).
    shapes: the target's shape-only `config.json` directory, relative to configs/.
    mesh: the mesh's axes, e.g. (("data", 1), ("model", 8)).
    max_length: T of the analysis, extraction and training sequences.
    analysis_batch, train_batch, features_batch: global batch sizes (divisible by the 'data' axis).
    slots: continuous-batching rows of the distillation.
    prompt_len, new_tokens, decode_batches: the decode stages `aot_check` compiles (generation and speculative
      decoding at each batch size, prompts of `prompt_len`, `new_tokens` new tokens).
  """
  c = _smollm2_config()
  c.model = model
  c.shapes = os.path.join(HERE, shapes)
  c.dtype = "bfloat16"
  c.compilation_cache = "~/.cache/layerwave/jax-compilation"  # an 8B stage compiles for minutes: keep them
  c.mesh = tuple(tuple(a) for a in mesh)
  c.data.max_length = max_length
  c.analysis.batch_size = analysis_batch
  c.analysis.ladder_ratio = 2.0  # 8 eigendecomposition sizes up to T 2048, not 18: the step compiles in minutes
  c.features.batch_size = features_batch
  c.train.batch_size = train_batch
  c.train.target_dtype = ""  # the target already computes in bfloat16
  c.train.remat = True  # T 2048: steps rematerialised, the draft attention in query blocks (BENCHMARKS.md)
  c.distill.slots = slots
  c.distill.batch_size = slots
  c.distill.max_prompt_tokens = prompt_len
  c.distill.max_new_tokens = 512
  c.speculate.batch_size = 1
  c.speculate.tree_depth = 6
  c.speculate.tree_top_k = 8
  c.speculate.tree_tokens = 16  # a 16-token tree
  c.aot = ml_collections.ConfigDict()
  c.aot.prompt_len = prompt_len
  c.aot.new_tokens = new_tokens
  c.aot.decode_batches = tuple(decode_batches)
  return c


def load(name: str):
  """A sibling config module by file name (as `_smollm2_config` loads SmolLM2's)."""
  spec = importlib.util.spec_from_file_location(f"configs.{name}", os.path.join(HERE, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
