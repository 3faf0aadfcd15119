"""A layer selection in each engine's own numbering: the lines to paste into vLLM, SGLang, SpecForge, ... .

Place in the pipeline: the way out of layerwave for a `LayerSelection` (hf_hidden_states ids,
`layerwave.layer_ids`, docs/METHOD.md §1). Every engine that trains or serves an EAGLE-3 draft names the same
tensors its own way; each entry of `ENGINES` states its rule as read from the engine's capture code (the
repository, path and commit are in its `sources`) and `tests/engine_ids_test.py` runs each rule, transcribed,
over a real model's decoder layers against our `hidden_states[id]`. Two numberings cover every engine:

* "input of block i" — vLLM, SGLang's capture loop, tpu-inference: the residual stream entering decoder
  block i is captured before the block runs. That is hf id i. Block 0 has no residual yet (the fused-norm
  engines add `hidden + residual` and fail there), so id 0 cannot be named.
* "output of block j" — SpecForge, TensorRT-LLM, TensorRT Model Optimizer: block j's output, through a
  forward hook or inside the block. That is hf id j + 1. Block L − 1's output is the pre-norm state HF does
  not return (hf id L is after the final norm), so id L cannot be named.

SGLang reads its config's ids as block outputs (adds 1) before its PR #25454, and since then only when the
first id is 1. tpu-inference's JAX Llama ignores the config altogether. `report` converts a selection for any
set of engines and refuses what an engine cannot read (when listing every engine, it marks it instead);
`experiments/select_layers.py` prints the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from layerwave import layer_ids

__all__ = ["ENGINES", "Engine", "engine_ids", "parse_engines", "report", "format_report"]

IdMap = Callable[[tuple[int, ...], int], tuple[int, ...]]


def _same(ids, num_layers):
  del num_layers
  return tuple(ids)


def _minus_one(ids, num_layers):
  del num_layers
  return tuple(i - 1 for i in ids)


def _plus_one(ids, num_layers):
  del num_layers
  return tuple(i + 1 for i in ids)


def _sglang_reads(written, num_layers):
  """SGLang >= PR #25454: `layers_to_capture` = ids + 1 when the first id is 1, else the ids as written."""
  return _plus_one(written, num_layers) if tuple(written[:1]) == (1,) else tuple(written)


def _eagle3_default(written, num_layers):
  """tpu-inference's JAX Llama: (2, L//2, L−3) before those blocks, whatever was written."""
  del written
  return _default(num_layers) or ()


def _default(num_layers: int) -> tuple[int, ...] | None:
  """EAGLE-3's (2, L//2, L−3), or None for a target too shallow to have three distinct such layers."""
  try:
    return layer_ids.eagle3_layer_ids(num_layers)
  except ValueError:
    return None


def _fmt(ids) -> str:
  return "[]" if ids is None else "[" + ", ".join(str(i) for i in ids) + "]"


@dataclasses.dataclass(frozen=True)
class Engine:
  """One consumer of layer ids.

  Attributes:
    name: the key (`--engines=NAME`).
    title: the engine as people call it.
    numbering: what its id names, in one phrase.
    write: hf ids, L → the ids to give this engine.
    reads: ids given to it, L → the hf ids it then captures (its capture rule).
    lines: written ids, hf ids, L → the lines a user pastes.
    sources: repository, path and commit of the code the rule was read from.
    honours_selection: False where the engine captures its default whatever it is given.
    exact_k: the number of layers it accepts, where it checks one.
  """

  name: str
  title: str
  numbering: str
  write: IdMap
  reads: IdMap
  lines: Callable[[tuple[int, ...], tuple[int, ...], int], list[str]]
  sources: tuple[str, ...]
  honours_selection: bool = True
  exact_k: int | None = None


def _vllm_lines(w, ids, num_layers):
  del ids, num_layers
  return [f'"eagle_aux_hidden_state_layer_ids": {_fmt(w)}   # EAGLE-3 draft config.json, top level',
          "vllm serve TARGET --speculative-config "
          "'{\"method\": \"eagle3\", \"model\": \"DRAFT_DIR\", \"num_speculative_tokens\": 3}'"]


def _sglang_lines(w, ids, num_layers):
  del ids, num_layers
  return [f'"eagle_config": {{"eagle_aux_hidden_state_layer_ids": {_fmt(w)}}}   # EAGLE-3 draft config.json',
          "python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 "
          "--speculative-draft-model-path DRAFT_DIR"]


def _specforge_lines(w, ids, num_layers):
  del ids, num_layers
  return [f"model.aux_hidden_state_layer_ids: {_fmt(w)}   # recipe YAML (specforge train --config RECIPE.yaml)",
          f'"eagle_config": {{"eagle_aux_hidden_state_layer_ids": {_fmt(w)}}}   # or the draft config.json']


def _speculators_lines(w, ids, num_layers):
  del ids, num_layers
  flag = "--target-layer-ids " + " ".join(str(i) for i in w)
  return [f"python scripts/launch_vllm.py TARGET {flag} -- ...   # appends L itself (--include-last-layer)",
          f"python scripts/train.py ... {flag}"]


def _trtllm_lines(w, ids, num_layers):
  del ids, num_layers
  return [f"EagleDecodingConfig(..., eagle3_layers_to_capture={{{', '.join(str(i) for i in w)}}})",
          f"speculative_config: {{eagle3_layers_to_capture: {_fmt(w)}, ...}}   # trtllm-serve "
          "--extra_llm_api_options YAML"]


def _modelopt_lines(w, ids, num_layers):
  lines = [f'{{"eagle_aux_hidden_state_layer_ids": {_fmt(w)}, "use_aux_hidden_state": true}}   # eagle_config.json '
           "for examples/speculative_decoding/main.py --eagle_config"]
  if tuple(ids) != _default(num_layers):
    lines.append(f"# offline data: compute_hidden_states_hf.py takes outputs.hidden_states[2, L//2, L-3] whatever "
                 f"the config; set its selected_layer_indices to the hf ids {_fmt(ids)}")
  return lines


def _tpu_lines(w, ids, num_layers):
  default = _default(num_layers)
  if tuple(ids) == default:
    return [f"# nothing to set: the JAX Llama captures (2, L//2, L-3) = {_fmt(default)}, this selection",
            "vllm serve TARGET --speculative-config "
            "'{\"method\": \"eagle3\", \"model\": \"DRAFT_DIR\", \"num_speculative_tokens\": 3}'"]
  return [f"# the JAX Llama captures {_fmt(default)}, NOT {_fmt(ids)}: run the target on vLLM's PyTorch path, "
          "which reads the draft config",
          f'"eagle_aux_hidden_state_layer_ids": {_fmt(ids)}   # EAGLE-3 draft config.json, top level',
          "MODEL_IMPL_TYPE=vllm vllm serve TARGET --speculative-config "
          "'{\"method\": \"eagle3\", \"model\": \"DRAFT_DIR\", \"num_speculative_tokens\": 3}'"]


_VLLM_SOURCES = (
    "vllm-project/vllm vllm/model_executor/models/llama.py @ e06c9ba2a6ea (LlamaModel.forward: appends "
    "hidden_states + residual before layer idx when idx in aux_hidden_state_layers; default (2, L//2, L-3))",
    "vllm-project/vllm vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @ 0cfdd2e15d69 "
    "(get_eagle3_aux_layers_from_config: the draft hf_config's eagle_aux_hidden_state_layer_ids, unchanged)",
)
_SGLANG_SOURCES = (
    "sgl-project/sglang python/sglang/srt/models/llama.py @ bf7a0e237e8d (LlamaModel.forward: appends "
    "hidden_states + residual before layer i in layers_to_capture; set_eagle3_layers_to_capture: "
    "[val + 1 for val in layer_ids])",
    "sgl-project/sglang python/sglang/srt/model_executor/model_runner.py (ModelRunner: the draft's "
    "eagle_config['eagle_aux_hidden_state_layer_ids'])",
)

ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("vllm", "vLLM (the EAGLE-3 draft config's eagle_aux_hidden_state_layer_ids)",
           "input of block i (= hf id)", _same, _same, _vllm_lines, _VLLM_SOURCES),
    Engine("sglang", "SGLang with PR #25454 (+1 only when the first id is 1)",
           "input of block i (= hf id); a list starting at 1 is shifted by one", _same, _sglang_reads,
           _sglang_lines, _SGLANG_SOURCES + (
               "sgl-project/sglang pull request #25454 (merged): layers_to_capture = [v + 1] only when "
               "layer_ids[0] == 1, else the ids as written",)),
    Engine("sglang_before_pr25454", "SGLang before PR #25454 (+1 on every explicit id)",
           "output of block j (= hf id - 1)", _minus_one, _plus_one, _sglang_lines, _SGLANG_SOURCES),
    Engine("specforge", "SpecForge", "output of block j (= hf id - 1)", _minus_one, _plus_one,
           _specforge_lines, (
               "sgl-project/SpecForge specforge/algorithms/model_providers.py @ a6b6b0230009 "
               "(resolve_eagle_capture_layers: model.aux_hidden_state_layer_ids, else the draft's "
               "eagle_config ids, else [1, L//2-1, L-4]; exactly three)",
               "sgl-project/SpecForge specforge/inference/target_engine/target_capture_policy.py @ 2cece767e1dd "
               "(hf_capture: forward hook on layers[idx], its output) and "
               "specforge/modeling/target/custom_backend/llama.py (appends hidden_states after layer idx)",
               "sgl-project/SpecForge specforge/offline_capture/sglang_backend/capture.py @ a6b6b0230009 "
               "(SGLang capture: the ids go to set_eagle3_layers_to_capture, i.e. sglang_before_pr25454's rule)"),
           exact_k=3),
    Engine("speculators", "speculators (vllm-project)", "input of block i (= hf id), through vLLM",
           _same, _same, _speculators_lines, (
               "vllm-project/speculators scripts/launch_vllm.py @ c05b95b303f7 (--target-layer-ids become "
               "vLLM's eagle_aux_hidden_state_layer_ids for method extract_hidden_states, L appended)",
               "vllm-project/speculators src/speculators/models/utils.py @ c05b95b303f7 "
               "(resolve_target_layer_ids: default [2, L//2, L-3])") + _VLLM_SOURCES[:1]),
    Engine("tensorrt_llm", "TensorRT-LLM (PyTorch backend)", "output of block j (= hf id - 1)", _minus_one,
           _plus_one, _trtllm_lines, (
               "NVIDIA/TensorRT-LLM tensorrt_llm/_torch/models/modeling_llama.py @ 3a5901cd0d77 "
               "(LlamaDecoderLayer.forward: maybe_capture_hidden_states(layer_idx, hidden_states, residual) "
               "after the MLP: the block's output)",
               "NVIDIA/TensorRT-LLM tensorrt_llm/_torch/speculative/eagle3.py @ f933a608045a "
               "(Eagle3SpecMetadata: layers_to_capture default (1, L//2-1, L-4), captures hidden_states + "
               "residual)",
               "NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py (EagleDecodingConfig.eagle3_layers_to_capture)")),
    Engine("modelopt", "TensorRT Model Optimizer (EAGLE-3 training and export)",
           "output of block j (= hf id - 1)", _minus_one, _plus_one, _modelopt_lines, (
               "NVIDIA/TensorRT-Model-Optimizer modelopt/torch/speculative/plugins/transformers.py @ "
               "5a4242faf414 (forward hook on base_model.layers[layer_idx] for layer_idx in "
               "eagle_aux_hidden_state_layer_ids; default [1, L//2-1, L-4])",
               "NVIDIA/TensorRT-Model-Optimizer modelopt/torch/speculative/plugins/megatron_eagle.py @ "
               "5a4242faf414 (hook on TransformerLayer with layer_number - 1 in the ids)",
               "NVIDIA/TensorRT-Model-Optimizer examples/speculative_decoding/collect_hidden_states/"
               "compute_hidden_states_hf.py @ 5a4242faf414 (offline: hf hidden_states [2, L//2, L-3], fixed)")),
    Engine("tpu_inference", "tpu-inference (vLLM on TPU, JAX Llama)",
           "input of block i (= hf id), fixed to (2, L//2, L-3)", _same, _eagle3_default, _tpu_lines, (
               "vllm-project/tpu-inference tpu_inference/models/jax/llama3.py @ b8692ff01fa1 "
               "(LlamaModel.get_eagle3_aux_hidden_state_layers: (2, L//2, L-3) from len(self.layers); "
               "__call__ appends x before layer i; the draft config is never read)",
               "vllm-project/tpu-inference tpu_inference/models/common/model_loader.py @ b8692ff01fa1 "
               "(MODEL_IMPL_TYPE auto resolves LlamaForCausalLM to flax_nnx; 'vllm' runs vLLM's model)",
               "vllm-project/tpu-inference tpu_inference/models/vllm/vllm_model_wrapper.py @ b8692ff01fa1 "
               "(the vllm path calls vLLM's set_eagle3_aux_hidden_state_layers: the config's ids)"),
           honours_selection=False, exact_k=3),
)}


def parse_engines(names: Sequence[str] | str) -> tuple[str, ...]:
  """Engine keys from `--engines` (a list or a comma string); empty or `all` gives every engine.

  Raises:
    ValueError: an unknown name, naming the known ones.
  """
  if isinstance(names, str):
    names = names.split(",")
  names = tuple(n.strip() for n in names if n.strip())
  if not names or names == ("all",):
    return tuple(ENGINES)
  unknown = [n for n in names if n not in ENGINES]
  if unknown:
    raise ValueError(f"unknown engine {', '.join(repr(n) for n in unknown)}; known: {', '.join(ENGINES)} "
                     "(e.g. --engines=vllm,sglang, or leave it out for every engine)")
  return names


def _refusal(engine: Engine, ids: tuple[int, ...], num_layers: int) -> str | None:
  """Why `engine` cannot be given the selection `ids` at all, with the fix; None when it can."""
  if 0 in ids:
    return (f"hf id 0 (the embedding output) in {_fmt(ids)} has no name in {engine.title}: the input of block "
            "0 has no residual yet, and no block outputs the embedding. Select among 1..L-1 "
            "(analysis.include_embeddings=False).")
  if num_layers in ids:
    return (f"hf id {num_layers} (= L, the final-norm output) in {_fmt(ids)} has no name in {engine.title}: "
            f"engines capture inputs or outputs of blocks, before the final norm. Select among 1..{num_layers - 1} "
            "(analysis.include_final=False).")
  if engine.exact_k is not None and len(ids) != engine.exact_k:
    return (f"{engine.title} reads exactly {engine.exact_k} layers; this selection has k={len(ids)} "
            f"{_fmt(ids)}. Select k={engine.exact_k} (--k={engine.exact_k} or analysis.k={engine.exact_k}).")
  if engine.name == "sglang" and ids[0] == 1:
    return (f"SGLang >= PR #25454 cannot capture hf id 1 {_fmt(ids)}: a list starting at 1 is shifted to "
            f"{_fmt(i + 1 for i in ids)}, one starting at 0 captures before block 0, where there is no residual. "
            "Use SGLang before PR #25454 (engine sglang_before_pr25454) or vLLM, or select ids >= 2.")
  return None


def _ignored(engine: Engine, ids: tuple[int, ...], num_layers: int) -> str | None:
  """The warning for an engine that captures its default whatever it is given; None when it reads `ids`."""
  default = _default(num_layers)
  if engine.honours_selection or tuple(ids) == default:
    return None
  return (f"{engine.title} captures {_fmt(default)} (EAGLE-3's (2, L//2, L-3)) whatever the draft config "
          f"says, not this selection {_fmt(ids)}. Serve the target on vLLM's PyTorch path (MODEL_IMPL_TYPE=vllm, "
          "which reads eagle_aux_hidden_state_layer_ids), or select the default ids.")


def engine_ids(name: str, ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
  """The ids to give engine `name` so that it captures the hf_hidden_states ids `ids`.

  Raises:
    ValueError: an unknown engine, or ids it cannot capture (the message says why and what to do).
  """
  engine = ENGINES[parse_engines([name])[0]]
  ids = tuple(sorted(layer_ids.as_layer_id(i) for i in ids))
  problem = _refusal(engine, ids, num_layers) or _ignored(engine, ids, num_layers)
  if problem:
    raise ValueError(problem)
  return engine.write(ids, num_layers)


def report(selection: layer_ids.LayerSelection, engines: Sequence[str] = (), *, strict: bool | None = None,
           allow_ignored_selection: bool = False) -> dict[str, Any]:
  """The selection in every engine's numbering, with the lines to paste (JSON-ready).

  Args:
    selection: the record (hf_hidden_states ids, validated against its L).
    engines: engine keys (empty: all of them).
    strict: raise when a named engine cannot read the selection; default True when `engines` names some,
      False for the listing of every engine, where such an engine carries an `error` instead of lines.
    allow_ignored_selection: give an engine that captures its default whatever it is told (tpu-inference)
      its lines with a warning, instead of refusing.

  Returns:
    {"ids", "num_layers", "convention", "strategy", "selection", "engines": {name: {...}}}.

  Raises:
    ValueError: an unknown engine name, or (strict) a selection an engine cannot read.
  """
  names = parse_engines(engines)
  strict = bool(engines) if strict is None else strict
  ids, num_layers = tuple(selection.ids), selection.num_layers
  out = {}
  for name in names:
    engine = ENGINES[name]
    entry = {"title": engine.title, "numbering": engine.numbering, "honours_selection": engine.honours_selection,
             "sources": list(engine.sources), "ids": None, "captures": None, "lines": [], "warnings": [],
             "error": None}
    problem = _refusal(engine, ids, num_layers)
    ignored = None if problem else _ignored(engine, ids, num_layers)
    if ignored and not allow_ignored_selection:
      problem, ignored = ignored + " Or pass --allow_ignored_selection to print the lines anyway.", None
    if problem:
      if strict:
        raise ValueError(f"{name}: {problem}")
      entry["error"] = problem
      out[name] = entry
      continue
    written = engine.write(ids, num_layers)
    captured = engine.reads(written, num_layers)
    if not ignored and tuple(captured) != ids:  # the rule's inverse is wrong: never ship such lines
      raise AssertionError(f"{name}: ids {_fmt(written)} capture {_fmt(captured)}, not {_fmt(ids)}")
    if ignored:
      entry["warnings"].append(ignored)
    if len(ids) != 3 and name in ("vllm", "sglang", "sglang_before_pr25454", "speculators", "tensorrt_llm"):
      entry["warnings"].append(
          f"k={len(ids)}: EAGLE-3 drafts read 3 layers; engine versions that build fc as 3 * hidden_size "
          "(vLLM's llama_eagle3.py @ 583507d13075) cannot load it (layerwave's export needs "
          "--allow_nonstandard_k).")
    if name == "specforge" and written[0] != 1:
      entry["warnings"].append(
          f"SpecForge's SGLang capture hands {_fmt(written)} to set_eagle3_layers_to_capture: an SGLang with PR "
          f"#25454 reads a list not starting at 1 as hf ids and captures {_fmt(_sglang_reads(written, num_layers))} "
          "instead. Capture with SGLang before #25454 or SpecForge's HF backend.")
    entry.update(ids=list(written), captures=list(captured), lines=engine.lines(written, ids, num_layers))
    out[name] = entry
  return {"ids": list(ids), "num_layers": num_layers, "convention": layer_ids.CONVENTION,
          "strategy": selection.strategy, "selection": selection.to_dict(), "engines": out}


def format_report(rep: dict[str, Any], show_sources: bool = True) -> str:
  """`report`'s dict as text: a header, then per engine its ids, the lines to paste and where they come from."""
  num_layers = rep["num_layers"]
  out = [f"Selection ({rep['strategy']}): hf_hidden_states ids {_fmt(rep['ids'])} of a target with "
         f"L = {num_layers} (0 = embeddings, i = output of block i-1 = input of block i, {num_layers} = final norm)."]
  for name, e in rep["engines"].items():
    out.append("")
    if e["error"]:
      out.append(f"{name} — {e['title']}: CANNOT READ THIS SELECTION. {e['error']}")
      continue
    out.append(f"{name} — {e['title']}: {_fmt(e['ids'])}  ({e['numbering']})")
    out.extend(f"  WARNING: {w}" for w in e["warnings"])
    out.extend(f"  {line}" for line in e["lines"])
    if show_sources:
      out.extend(f"  read from: {s}" for s in e["sources"])
  return "\n".join(out)
