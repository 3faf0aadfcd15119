"""The EAGLE-3 Hugging Face format as vLLM and SGLang read it, and `load_eagle3`, which reads one into a `Draft`.

Place in the pipeline: the boundary with the serving engines. A directory holds `config.json`
(`LlamaForCausalLMEagle3`) and `model.safetensors` with the published tensor names (`fc`, `midlayer.*`,
`norm`, `lm_head`, `d2t`, `t2d`); `layerwave.export` writes one, `load_eagle3` reads one (ours, or an
official one without our `layerwave` block) for `target`. These two modules are the only places where layer
ids change convention (docs/METHOD.md §1).

Layer-id conventions at this boundary, read from the engines' source:

* vLLM (`vllm/model_executor/models/llama.py`, `LlamaModel.forward`) appends `hidden_states + residual`
  *before* running decoder layer `idx` when `idx in aux_hidden_state_layers`, and
  `gpu_model_runner._get_eagle3_aux_layers_from_config` passes the draft config's
  `eagle_aux_hidden_state_layer_ids` (top level first, then `eagle_config.…`) through unchanged. So vLLM id
  i = the input of block i = HF `hidden_states[i]`: our `hf_hidden_states` ids, unchanged.
* SGLang (`python/sglang/srt/models/llama.py`) captures the same way (before layer i), but
  `set_eagle3_layers_to_capture` adds 1 to explicit ids (`[val + 1 for val in layer_ids]`, read from
  `eagle_config.eagle_aux_hidden_state_layer_ids` by `model_runner`), i.e. it reads them as "output of
  block j" — SpecForge's convention (its default `[1, L//2-1, L-4]`, e.g. `[1, 15, 28]` for L = 32).
  Since sglang PR #25454 it adds 1 only when the first id is 1, to accept both kinds of file; `ENGINES`
  names both SGLang versions.
* Both engines' default when a draft names no ids is `[2, L//2, L-3]` captured before those layers: HF ids.
* vLLM and SGLang both build `fc` as `3 * target_hidden_size → hidden_size`: only k = 3 drafts load there.
* Both run the draft in the target's dtype, casting the file's tensors on load.

EAGLE-3.1's per-layer norms (layerwave's `draft_model.fc_norm`), read from the engines' and trainers' source:
top-level `"fc_norm": true` builds one RMSNorm per captured layer, `fc_norm.{i}.weight` of shape
`[target_hidden_size]` with eps `rms_norm_eps`, applied to chunk i of the concatenated captures (layer-id
order) before `fc`: `fc(concat(norm_i(h_i)))`. That is layerwave's `Draft.fuse` exactly (learned scale, one
norm per layer, not one over the concatenation, which is the different `norm_before_fc`). Sources: vLLM
`vllm/model_executor/models/llama_eagle3.py` (`LlamaModel.fc_norm`, applied in
`Eagle3LlamaForCausalLM.combine_hidden_states`; vllm PR #42764), SGLang
`python/sglang/srt/models/llama_eagle3.py` (`LlamaModel.fc_norm`, also under the legacy flag `use_aux_norm`),
SpecForge `specforge/modeling/draft/llama3_eagle.py` (`project_hidden_states`; `export/to_sglang.py` writes
the names unchanged), speculators `src/speculators/models/eagle3/core.py` and
`convert/eagle/eagle3_converter.py`. EAGLE-3.1's other switch, `norm_output` (feed the post-norm h to the
next draft step), is not layerwave's draft, which feeds the pre-norm h as EAGLE-3 does: the engines' default
(`norm_output` absent = false), so an export leaves the key out and `load_eagle3` refuses `norm_output: true`.
`FC_NORM_SUPPORT` says which engine versions apply the norms; an SGLang without them loads the file and
silently skips the `fc_norm.*` tensors. TensorRT-LLM added the same `fc_norm` / `norm_output` fields in its
PR #14988 (from the PR's description; its loader was not read here).

`engine_layer_ids` / `engine_note` say which layers each engine version feeds for an id list.
`load_eagle3` reads ids as the current engines do: HF ids when the first is ≥ 2 (vLLM and SGLang ≥ #25454
agree); a list starting at 0 or 1 (where they disagree) needs `id_convention`. It reads
`model.safetensors`, or `pytorch_model.bin` through `torch.load(weights_only=True)` when torch is installed.

Legend (`layerwave.axes`): V target vocabulary, V_d draft vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl import logging
from flax import nnx

from layerwave import layer_ids
from layerwave import sharding
from layerwave.inference import Target, parse_dtype
from layerwave.models.config import ModelConfig
from layerwave.models.draft import Draft, DraftConfig, llama_style

__all__ = ["ARCHITECTURE", "ENGINES", "FC_NORM_SUPPORT", "engine_layer_ids", "engine_note", "is_eagle3_dir",
           "load_eagle3", "read_config", "read_tensors", "tensor_name"]

ARCHITECTURE = "LlamaForCausalLMEagle3"  # SGLang's class name; vLLM's registry maps it to its Eagle3 Llama
EAGLE3_ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")
FORMAT_VERSION = 1  # of config.json's `layerwave` block
WEIGHTS = "model.safetensors"
TORCH_WEIGHTS = "pytorch_model.bin"  # what published EAGLE-3 drafts ship
# Engine versions that read eagle_aux_hidden_state_layer_ids differently (see the module docstring).
ENGINES = {"vllm": "vLLM", "sglang": "SGLang with PR #25454 (merged 2026-05-16)",
           "sglang_before_pr25454": "SGLang before PR #25454"}
# Whether each engine in ENGINES applies an fc_norm draft's per-layer norms (an axis of versions of its own).
_SGLANG_FC_NORM = ("applies the per-layer norms where its llama_eagle3.py reads fc_norm; an older SGLang "
                   "loads the file and silently skips the fc_norm.* tensors (its load_weights ignores "
                   "names it has no parameter for): unnormalised features, low acceptance, no error")
FC_NORM_SUPPORT = {
    "vllm": ("applies the per-layer norms since PR #42764; an older vLLM refuses the file (no parameter "
             "for fc_norm.0.weight)"),
    "sglang": _SGLANG_FC_NORM,
    "sglang_before_pr25454": _SGLANG_FC_NORM,
}


# ---------------------------------------------------------------------------------------------------
# Names: NNX parameter path <-> published tensor name; the layers each engine feeds.


def tensor_name(path: tuple) -> tuple[str, bool]:
  """Draft state path → (EAGLE-3 tensor name, whether the array is transposed: HF stores `[out, in]`)."""
  parts = [str(p) for p in path]
  if parts == ["embed_tokens"]:
    return "embed_tokens.weight", False
  if parts in (["d2t"], ["t2d"]):
    return parts[0], False
  *prefix, leaf = parts
  if prefix[:1] == ["fc_norms"]:  # the engines' ModuleList is `fc_norm`
    prefix[0] = "fc_norm"
  return ".".join(prefix) + (".bias" if leaf == "bias" else ".weight"), leaf == "kernel"


def engine_layer_ids(ids, num_layers: int) -> dict[str, list[int] | None]:
  """The target layers (hf ids) each engine in `ENGINES` feeds a draft whose config.json carries `ids`.

  vLLM captures the input of block i for each id i; SGLang does the same after adding 1 to every id
  (before PR #25454) or only when the first id is 1 (since).

  Args:
    ids: the ids written in config.json (`eagle_aux_hidden_state_layer_ids`), sorted.
    num_layers: the target's L.

  Returns:
    Engine key → the hf ids it captures, or None where it cannot run the file (fc is built for 3
    layers; id 0 has no residual to capture; a shifted id reaches L, which no block's input is).
  """
  ids = [int(i) for i in ids]
  shifted = [i + 1 for i in ids]
  reads = {"vllm": ids, "sglang": shifted if ids[:1] == [1] else ids, "sglang_before_pr25454": shifted}
  runs = lambda r: len(r) == 3 and min(r) > 0 and max(r) < num_layers
  return {engine: (r if runs(r) else None) for engine, r in reads.items()}


def engine_note(ids, num_layers: int, fc_norm: bool = False) -> str:
  """One sentence per engine version: which layers it feeds a draft trained on hf ids `ids`.

  With `fc_norm` (an EAGLE-3.1 draft), each sentence also says whether that engine applies the norms.
  """
  ids = [int(i) for i in ids]
  parts = []
  for engine, reads in engine_layer_ids(ids, num_layers).items():
    if reads is None:
      what = "cannot load this draft"
    elif reads == ids:
      what = f"reads layers {reads}, the trained ones"
    else:
      what = f"reads layers {reads}, NOT the trained {ids}: wrong layers"
    if fc_norm and reads is not None:
      what += f", and {FC_NORM_SUPPORT[engine]}"
    parts.append(f"{ENGINES[engine]} {what}")
  return (f"Trained on hf_hidden_states ids {ids} (input of block i; L = {num_layers}). "
          + "; ".join(parts) + ".")


# ---------------------------------------------------------------------------------------------------
# Reading.


def read_config(directory: str) -> dict | None:
  """config.json of `directory` if it names an EAGLE-3 architecture, else None."""
  path = os.path.join(os.fspath(directory), "config.json")
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    try:
      config = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path} is not valid JSON: {e}") from e
  archs = config.get("architectures") or []
  return config if any(a in EAGLE3_ARCHITECTURES for a in archs) else None


def is_eagle3_dir(directory: str) -> bool:
  """True if `directory` holds a config.json with an EAGLE-3 architecture."""
  return read_config(directory) is not None


def _resolve_layer_ids(config: dict, num_layers: int, id_convention: str | None) -> tuple[int, ...]:
  """The draft's layer ids in hf_hidden_states numbering, checked against every place that names them."""
  block = config.get("layerwave")
  nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
  top = config.get("eagle_aux_hidden_state_layer_ids")
  if top and nested and list(top) != list(nested):
    raise ValueError(f"config.json names two different layer-id lists: eagle_aux_hidden_state_layer_ids "
                     f"{list(top)} and eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)}.")
  written = list(top or nested or [])
  if block is not None:
    if block.get("layer_id_convention") != layer_ids.CONVENTION:
      raise ValueError(f"The layerwave block states layer-id convention "
                       f"{block.get('layer_id_convention')!r}; only {layer_ids.CONVENTION!r} is written.")
    if id_convention not in (None, layer_ids.CONVENTION):
      raise ValueError(f"This directory was exported by layerwave with {layer_ids.CONVENTION} ids; "
                       f"id_convention={id_convention!r} contradicts it.")
    ids = tuple(int(i) for i in block["layer_ids"])
    if written and tuple(written) != ids:
      hint = ""
      if tuple(written) == tuple(i - 1 for i in ids):
        hint = " (they are its block-output ids: someone converted them for SpecForge / old SGLang)"
      raise ValueError(f"eagle_aux_hidden_state_layer_ids {written} disagree with the layerwave block's "
                       f"{layer_ids.CONVENTION} ids {list(ids)}{hint}.")
    want_block = block.get("block_output_layer_ids")
    if want_block is not None and tuple(want_block) != tuple(i - 1 for i in ids):
      raise ValueError(f"The layerwave block's block_output_layer_ids {list(want_block)} are not its "
                       f"hf ids {list(ids)} minus one: the record mixes conventions.")
    return ids
  if not written:  # both engines then capture EAGLE-3's default, before blocks (2, L//2, L-3)
    return layer_ids.eagle3_layer_ids(num_layers)
  written = [layer_ids.as_layer_id(i) for i in written]
  convention = id_convention
  if convention is None:
    if min(written) <= 1:  # the engines disagree: see engine_layer_ids
      as_block = [i + 1 for i in written]
      how = (f"vLLM as hf_hidden_states ids (input of block i: layers {written})" if min(written) else
             "vLLM and SGLang >= PR #25454 cannot capture id 0 (no residual before block 0)")
      raise ValueError(
          f"eagle_aux_hidden_state_layer_ids {written} start at {min(written)}, which the engines read "
          f"differently: {how}; SGLang as block outputs (layers {as_block}), the way SpecForge-trained "
          "drafts count. Pass id_convention='block_outputs' (a SpecForge / SGLang draft) or "
          f"id_convention='{layer_ids.CONVENTION}' (a draft made for vLLM) to load_eagle3.")
    convention = layer_ids.CONVENTION  # first id >= 2: vLLM and SGLang >= PR #25454 agree
  if convention == layer_ids.CONVENTION:
    return tuple(written)
  if convention == "block_outputs":
    return layer_ids.from_block_outputs(written, num_layers)
  raise ValueError(f"Unknown id_convention {id_convention!r}: use {layer_ids.CONVENTION!r} (vLLM) "
                   "or 'block_outputs' (SpecForge / SGLang's explicit ids).")


def _require(config: dict, keys, where: str) -> None:
  missing = [k for k in keys if config.get(k) is None]
  if missing:
    raise ValueError(f"{where} lacks required fields {missing}.")


def _draft_config(config: dict, target_config: ModelConfig, ids: tuple[int, ...]) -> DraftConfig:
  """DraftConfig from an EAGLE-3 config.json, shaped as `DraftConfig.from_target` would make it."""
  where = "EAGLE-3 config.json"
  _require(config, ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                    "vocab_size"), where)
  if int(config["num_hidden_layers"]) != 1:
    raise ValueError(f"{where} has num_hidden_layers={config['num_hidden_layers']}; layerwave reads "
                     "single-layer EAGLE-3 drafts only.")
  for flag in ("attention_bias", "mlp_bias", "norm_before_fc", "norm_before_residual"):
    if config.get(flag):
      raise ValueError(f"{where} sets {flag}=true, which layerwave's EAGLE-3 draft does not implement.")
  if config.get("norm_output"):
    raise ValueError(f"{where} sets norm_output=true: the draft feeds its post-norm h to the next step "
                     "(EAGLE-3.1's post-norm variant). layerwave's draft feeds the pre-norm h (EAGLE-3, "
                     "norm_output false), so it would draft differently; only fc_norm is implemented.")
  if config.get("use_aux_norm"):
    raise ValueError(f"{where} sets use_aux_norm=true (SGLang's older name, tensors aux_norm_low/mid/high); "
                     "rename it fc_norm=true and the tensors fc_norm.0/1/2.weight to load it.")
  fc_norm = config.get("fc_norm", False)
  if not isinstance(fc_norm, bool):
    raise ValueError(f"{where} has fc_norm={fc_norm!r}; it must be true or false.")
  lw_norm = ((config.get("layerwave") or {}).get("draft_config") or {}).get("fc_norm", fc_norm)
  if bool(lw_norm) != fc_norm:
    raise ValueError(f"{where} sets fc_norm={str(fc_norm).lower()} but its layerwave block's draft_config "
                     f"says fc_norm={lw_norm}: the engines would run a different draft than was trained.")
  if config.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{where} uses hidden_act={config['hidden_act']!r}; only 'silu' is supported.")
  if (config.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
    raise ValueError(f"{where} sets use_aux_hidden_state=false (an EAGLE-1/2-style draft without fc).")
  t = target_config
  got = {"vocab_size": int(config["vocab_size"]),
         "target_hidden_size": int(config.get("target_hidden_size") or config["hidden_size"])}
  want = {"vocab_size": t.vocab_size, "target_hidden_size": t.hidden_size}
  bad = {k: (got[k], want[k]) for k in got if got[k] != want[k]}
  if bad:
    raise ValueError("This EAGLE-3 draft was made for another target: " + ", ".join(
        f"{k}={g} (target has {w})" for k, (g, w) in bad.items()) + ".")
  lw_target = (config.get("layerwave") or {}).get("target")
  if lw_target and lw_target.get("num_layers") != t.num_layers:
    raise ValueError(f"This draft was exported for a target with L={lw_target.get('num_layers')}; the "
                     f"given target has L={t.num_layers}.")
  m = ModelConfig.from_hf({**config, "model_type": "llama"})  # rope settings in either spelling
  if m.hidden_size != t.hidden_size:
    raise ValueError(f"Draft width {m.hidden_size} differs from the target's {t.hidden_size}; layerwave's "
                     "draft reads the target's embedding, so d must equal D.")
  v_d = int(config.get("draft_vocab_size") or config["vocab_size"])
  if not 1 <= v_d <= t.vocab_size:
    raise ValueError(f"draft_vocab_size {v_d} must be in [1, {t.vocab_size}].")
  model = dataclasses.replace(
      llama_style(t), vocab_size=v_d, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
      num_layers=1, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
      rms_norm_eps=m.rms_norm_eps, rope_theta=m.rope_theta, rope_scaling=m.rope_scaling,
      max_position_embeddings=m.max_position_embeddings, tie_word_embeddings=False,
      attention_bias=False, qk_norm=False)
  # LayerSelection validates range, order and uniqueness with the convention named in its errors.
  layer_ids.LayerSelection(ids=ids, num_layers=t.num_layers, hidden_size=t.hidden_size)
  if tuple(sorted(set(ids))) != tuple(ids):
    raise ValueError(f"Layer ids {list(ids)} must be sorted and unique: fc's input chunks follow their "
                     "order.")
  return DraftConfig(layer_ids=tuple(ids), target_num_layers=t.num_layers,
                     target_hidden_size=t.hidden_size, target_vocab_size=t.vocab_size, model=model,
                     fc_norm=fc_norm)


def read_tensors(directory: str) -> dict[str, np.ndarray]:
  """The tensors of `model.safetensors` in `directory`, else of `pytorch_model.bin` (needs torch).

  Returns:
    Name → numpy array (bfloat16 as `ml_dtypes.bfloat16`, `d2t` int64 as stored).

  Raises:
    FileNotFoundError: neither file exists.
    ImportError: only `pytorch_model.bin` exists and torch is not installed.
    ValueError: `pytorch_model.bin` holds more than a dict of tensors.
  """
  path = os.path.join(directory, WEIGHTS)
  if not os.path.isfile(path):
    torch_path = os.path.join(directory, TORCH_WEIGHTS)
    if os.path.isfile(torch_path):
      return _read_torch_bin(torch_path)
    raise FileNotFoundError(f"No {WEIGHTS} or {TORCH_WEIGHTS} in {directory}.")
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  out = {}
  with safe_open(path, framework="numpy") as f:  # numpy keeps int64 d2t; bfloat16 via ml_dtypes
    for key in f.keys():
      out[key] = f.get_tensor(key)
  return out


def _import_torch(path: str):
  """torch, or an ImportError saying why `path` needs it and how to do without."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        f"{path} is a pickled PyTorch checkpoint and torch is not installed. Install it (`pip install "
        "torch`; the CPU build is enough: layerwave reads the file with torch.load(weights_only=True, "
        "map_location='cpu'), which runs no code from it), or convert the file to model.safetensors "
        "where torch is installed.") from e
  return torch


def _read_torch_bin(path: str) -> dict[str, np.ndarray]:
  """A `pytorch_model.bin` state dict as numpy arrays, loaded without running code from the file."""
  torch = _import_torch(path)
  try:
    state = torch.load(path, weights_only=True, map_location="cpu")
  except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
    # torch's message is a page of advice; what follows "WeightsUnpickler error:" names the refusal.
    _, _, tail = str(e).partition("WeightsUnpickler error:")
    reason = next((ln.strip() for ln in (tail or str(e)).splitlines() if ln.strip()), type(e).__name__)
    raise ValueError(f"{path} could not be read with torch.load(weights_only=True): "
                     f"{reason.split('. Please')[0].rstrip('.')}. It is damaged or holds more than tensors, "
                     "and layerwave does not unpickle arbitrary objects (that can run code). Convert a "
                     "trusted copy to model.safetensors.") from e
  if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
    raise ValueError(f"{path} is not a flat state dict of tensors (name → tensor), as EAGLE-3 drafts "
                     "ship it.")
  out = {}
  for name, t in state.items():
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits as ml_dtypes'
      out[name] = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
      out[name] = t.numpy()
  return out


def _vocab_tables(tensors, v_d: int, v: int) -> tuple[np.ndarray, np.ndarray]:
  """(d2t int32 [V_d], t2d bool [V]) checked against each other; identity when V_d == V and absent."""
  d2t = tensors.get("d2t")
  if d2t is None:
    d2t = np.zeros((v_d,), np.int64)
  ids = np.arange(v_d) + np.asarray(d2t, np.int64)
  if ids.min() < 0 or ids.max() >= v or np.any(np.diff(ids) <= 0):
    raise ValueError("d2t does not map the draft vocabulary to sorted, distinct target ids in "
                     f"[0, {v}) (target_id = draft_id + d2t[draft_id]).")
  derived = np.zeros((v,), bool)
  derived[ids] = True
  t2d = tensors.get("t2d")
  if t2d is not None and not np.array_equal(np.asarray(t2d, bool), derived):
    raise ValueError(f"t2d marks {int(np.asarray(t2d, bool).sum())} target tokens, which are not the "
                     f"{v_d} that d2t maps to.")
  return (ids - np.arange(v_d)).astype(np.int32), derived


def load_eagle3(directory: str, target: Target, *, id_convention: str | None = None,
                dtype: Any = "float32") -> Draft:
  """Reads an EAGLE-3 Hugging Face directory into a `Draft` for `target`.

  Args:
    directory: holds `config.json` (`LlamaForCausalLMEagle3`) and `model.safetensors`, or
      `pytorch_model.bin` (read with `torch.load(weights_only=True)`; needs torch).
    target: the target the draft reads; its embedding becomes the draft's (frozen).
    id_convention: how to read `eagle_aux_hidden_state_layer_ids` of a file without a `layerwave`
      block: 'hf_hidden_states' (vLLM's reading) or 'block_outputs' (SpecForge / SGLang's explicit ids,
      converted + 1). None (default) reads them as the current engines do: hf ids when the first is
      >= 2, and refuses a list starting at 0 or 1, where vLLM and SGLang disagree. Files exported by
      layerwave state theirs.
    dtype: parameter dtype of the returned draft.

  Returns:
    The `Draft`, parameters replicated over `target.mesh`.

  Raises:
    FileNotFoundError: no EAGLE-3 config.json / weights in `directory`.
    ImportError: the weights are a `pytorch_model.bin` and torch is not installed.
    ValueError: naming missing, unexpected or misshapen tensors, bad, inconsistent or ambiguous layer
      ids, or a draft made for another target.
  """
  directory = os.fspath(directory)
  if not os.path.isfile(os.path.join(directory, "config.json")):
    raise FileNotFoundError(f"No config.json in {directory}.")
  config = read_config(directory)
  if config is None:
    raise ValueError(f"{directory}/config.json does not name an EAGLE-3 architecture "
                     f"({list(EAGLE3_ARCHITECTURES)}).")
  t = target.config
  ids = _resolve_layer_ids(config, t.num_layers, id_convention)
  dcfg = _draft_config(config, t, ids)
  dcfg.check_target(t)
  block = config.get("layerwave")
  if block is not None:
    layer_ids.LayerSelection.from_dict(block["selection"]).validate_for(t.num_layers, t.hidden_size)
    if tuple(block["selection"]["ids"]) != ids:
      raise ValueError(f"The layerwave selection record's ids {block['selection']['ids']} differ from "
                       f"the draft's {list(ids)}.")
  tensors = read_tensors(directory)
  dtype = parse_dtype(dtype)
  abstract = nnx.eval_shape(lambda: Draft(dcfg, dtype=dtype, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  flat = nnx.to_flat_state(state)
  expected = {}
  for path, var in flat:
    name, transposed = tensor_name(path)
    expected[name] = tuple(var.shape[::-1] if transposed else var.shape)
  optional = {"embed_tokens.weight", "t2d"} | ({"d2t"} if dcfg.draft_vocab_size == t.vocab_size else set())
  fc = tensors.get("fc.weight")
  if fc is not None and fc.ndim == 2 and fc.shape[1] != expected["fc.weight"][1]:
    k_file, rem = divmod(fc.shape[1], t.hidden_size)
    raise ValueError(f"The layer-id list has {len(ids)} ids ({list(ids)}), so fc should read "
                     f"{len(ids)}*{t.hidden_size} = {expected['fc.weight'][1]} inputs, but fc.weight is "
                     f"{tuple(fc.shape)} ({k_file if rem == 0 else fc.shape[1] / t.hidden_size:g} target "
                     "layers): the id list has the wrong length.")
  missing = sorted(n for n in expected if n not in tensors and n not in optional)
  extra = sorted(n for n in tensors if n not in expected)
  problems = []
  if missing:
    problems.append(f"missing tensors: {missing}")
  if extra:
    hint = (" (EAGLE-3.1 per-layer norms, but config.json does not set fc_norm: true)"
            if any(n.startswith("fc_norm.") for n in extra) and not dcfg.fc_norm else "")
    problems.append(f"unexpected tensors: {extra[:8]}{' ...' if len(extra) > 8 else ''}{hint}")
  for name, shape in expected.items():
    if name in tensors and tuple(tensors[name].shape) != shape:
      problems.append(f"{name} has shape {tuple(tensors[name].shape)}, expected {shape}")
  if problems:
    raise ValueError(f"{directory} does not match its config.json: " + "; ".join(problems))
  d2t, t2d = _vocab_tables(tensors, dcfg.draft_vocab_size, t.vocab_size)
  embedding = target.params["embed_tokens"]["embedding"][...]
  if "embed_tokens.weight" in tensors and not np.allclose(
      np.asarray(tensors["embed_tokens.weight"], np.float32), np.asarray(embedding, np.float32),
      atol=1e-2):
    logging.warning("%s carries embed_tokens.weight that differs from the target's embedding; the "
                    "draft uses the target's (as SGLang does).", directory)
  rep = sharding.replicated(target.mesh)
  values = []
  for path, var in flat:
    name, transposed = tensor_name(path)
    if name == "d2t":
      arr = jnp.asarray(d2t)
    elif name == "t2d":
      arr = jnp.asarray(t2d)
    elif name == "embed_tokens.weight":
      arr = jnp.asarray(embedding, dtype)
    else:
      host = np.asarray(tensors[name]).astype(np.float32)
      arr = jnp.asarray(host.T if transposed else host, dtype)
    values.append((path, var.replace(jax.device_put(arr, rep))))
  return nnx.merge(graphdef, nnx.from_flat_state(values))
