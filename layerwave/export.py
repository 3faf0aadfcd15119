"""Export a trained draft as an EAGLE-3 Hugging Face directory that vLLM and SGLang load.

Place in the pipeline: the last step after training. `export_eagle3` writes `config.json` +
`model.safetensors` in the layout published EAGLE-3 drafts use (`LlamaForCausalLMEagle3`; `layerwave.eagle3`
describes the format and how each engine reads its layer ids, and reads such a directory back).

The exported file carries HF ids (= vLLM's reading, and SGLang ≥ #25454's reading unless the first id is
1), in both places vLLM looks (`eagle_aux_hidden_state_layer_ids` and `eagle_config.…`), plus a `layerwave`
block with the `LayerSelection` record, the same ids in block-output numbering for SpecForge /
TensorRT-LLM readers, and `engine_layer_ids` / `engine_note`: the layers each engine version will feed.

Refused at export (clear errors, not silently approximated): layer id 0 (no residual exists before
block 0 to capture); a first id of 1 (SGLang ≥ #25454 would shift every id) unless `allow_first_id_1`;
k ≠ 3 (a shape error in both engines) unless `allow_nonstandard_k`; multi-layer drafts (vLLM names extra
layers `layers.{i}`, SGLang `additional_layers.{i-1}`); gated drafts (no engine applies learned gates);
layer id L (the final-norm output, which no engine can feed).

An `fc_norm` draft is written as EAGLE-3.1 (`layerwave.eagle3` cites the loaders): top-level
`"fc_norm": true` and tensors `fc_norm.{i}.weight` `[D]`, one per selected layer in id order, which is
exactly its `Draft.fuse`. `norm_output` is left out (false in every engine: the pre-norm h feeds the next
step, as in layerwave's draft). The export is engine-agnostic, as the file is: engines that apply the norms
(vLLM since PR #42764, SGLang where it reads `fc_norm`) run the trained draft; an older SGLang silently skips
the norms. So `layerwave.fc_norm_support` in config.json, `engine_note` and a logged warning name, per
engine, whether it applies them, rather than refusing a file the current engines load.

The reading side's public names (`load_eagle3`, `is_eagle3_dir`, `read_tensors`, `engine_layer_ids`, ...)
stay importable from here.

Legend (`layerwave.axes`): D target width, V target vocabulary.
"""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np
from absl import logging
from flax import nnx

from layerwave import atomic
from layerwave import eagle3
from layerwave import layer_ids
from layerwave.eagle3 import (ARCHITECTURE, ENGINES, FC_NORM_SUPPORT, engine_layer_ids, engine_note,
                              is_eagle3_dir, load_eagle3, read_config, read_tensors)
from layerwave.inference import Target
from layerwave.models.draft import Draft, DraftConfig

__all__ = ["ARCHITECTURE", "ENGINES", "FC_NORM_SUPPORT", "draft_tensors", "eagle3_config", "engine_layer_ids",
           "engine_note", "export_eagle3", "is_eagle3_dir", "load_eagle3", "read_config", "read_tensors"]

_DISK_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


# ---------------------------------------------------------------------------------------------------
# What the engines cannot load, or would feed from the wrong layers.


def _check_exportable(config: DraftConfig) -> None:
  if config.model.num_layers != 1:
    raise ValueError(
        f"This draft has {config.model.num_layers} decoder layers; EAGLE-3 export supports one (the "
        "midlayer): vLLM names extra layers layers.{i} and SGLang additional_layers.{i-1}, so no file "
        "would load in both. Train with draft_model.num_layers=1 to export.")
  if config.gates is not None:
    raise ValueError(
        f"This draft multiplies each normalised layer by a learned gate ({config.gates.kind} gates over "
        f"{len(config.layer_ids)} layers); no EAGLE-3 or EAGLE-3.1 engine applies gates, so it cannot be "
        "exported. Its gates choose layers: train the chosen k = 3 as an ordinary draft (draft_model.gates "
        "unset, draft_model.fc_norm=True to keep the per-layer norms) and export that.")
  if config.model.hidden_size != config.target_hidden_size:
    raise ValueError(f"Draft width {config.model.hidden_size} differs from the target's "
                     f"{config.target_hidden_size}; EAGLE-3 engines feed the target's embedding (width D) "
                     "into the midlayer, so d must equal D.")
  final = [i for i in config.layer_ids if i == config.target_num_layers]
  if final:
    raise ValueError(
        f"Layer id {final[0]} (= L) is the target's final-norm output; vLLM and SGLang capture inputs of "
        f"decoder blocks (ids 0..L-1), so no engine can feed this draft. Select ids in "
        f"0..{config.target_num_layers - 1}.")


def _check_engine_ids(ids, num_layers: int, allow_first_id_1: bool, allow_nonstandard_k: bool) -> None:
  """Refuses ids that vLLM / SGLang would load from the wrong layers, or not at all."""
  ids = [int(i) for i in ids]
  if 0 in ids:
    raise ValueError(
        f"Layer id 0 (the embedding output) in {ids} cannot be exported: vLLM and SGLang capture "
        "hidden_states + residual before block i, and there is no residual before block 0, so vLLM and "
        "SGLang >= PR #25454 fail and older SGLang silently reads id 1 instead. Train on ids >= 1 "
        "(analysis.include_embeddings=False); layerwave still loads this draft from its training workdir.")
  if len(ids) != 3 and not allow_nonstandard_k:
    raise ValueError(
        f"This draft reads {len(ids)} layers {ids}; vLLM and SGLang build fc for exactly 3 (3 * "
        "target_hidden_size inputs), so loading it fails with a shape error. Pass "
        "allow_nonstandard_k=True (--allow_nonstandard_k) to export it for layerwave.load_eagle3 only.")
  if ids[0] == 1 and not allow_first_id_1:
    raise ValueError(
        f"The first layer id is 1 ({ids}): SGLang >= PR #25454 reads a list starting at 1 as block "
        f"outputs and adds 1 to every id, so it would feed layers {[i + 1 for i in ids]}, not the trained "
        "ones (vLLM reads them as written). Train on ids starting at 2 or above, or pass "
        "allow_first_id_1=True (--allow_first_id_1) to export for vLLM; config.json's layerwave."
        "engine_note then records what each engine reads.")
  if len(ids) != 3 or ids[0] == 1:
    logging.warning("Non-standard EAGLE-3 export on request: %s", engine_note(ids, num_layers))


# ---------------------------------------------------------------------------------------------------
# Writing.


def draft_tensors(draft: Draft, include_embedding: bool = False) -> dict[str, np.ndarray]:
  """The draft's tensors under published EAGLE-3 names: float32 `[out, in]`, `d2t` int64, `t2d` bool."""
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(draft)):
    name, transposed = eagle3.tensor_name(path)
    if name == "embed_tokens.weight" and not include_embedding:
      continue
    arr = np.asarray(jax.device_get(var.get_value()))
    if name == "d2t":
      arr = arr.astype(np.int64)  # published drafts store int64 (torch.long)
    elif name != "t2d":
      arr = arr.astype(np.float32)
    out[name] = np.ascontiguousarray(arr.T if transposed else arr)
  return out


def eagle3_config(draft: Draft, record: layer_ids.LayerSelection, dtype: str = "float32") -> dict:
  """config.json for an EAGLE-3 draft (fields as vLLM's / SGLang's `llama_eagle3.py` read them)."""
  c, m = draft.config, draft.config.model
  ids = [int(i) for i in c.layer_ids]
  try:
    block_ids = list(layer_ids.to_block_outputs(ids, c.target_num_layers))
  except ValueError:
    block_ids = None  # id 0 (embeddings) has no "output of block j" name
  config = {
      "architectures": [eagle3.ARCHITECTURE],
      "model_type": "llama",
      "hidden_size": m.hidden_size,
      "intermediate_size": m.intermediate_size,
      "num_attention_heads": m.num_heads,
      "num_key_value_heads": m.num_kv_heads,
      "head_dim": m.head_dim,
      "num_hidden_layers": 1,
      "hidden_act": "silu",
      "rms_norm_eps": m.rms_norm_eps,
      "rope_theta": m.rope_theta,
      "rope_scaling": m.rope_scaling_dict,
      "max_position_embeddings": m.max_position_embeddings,
      "attention_bias": False,
      "mlp_bias": False,
      "tie_word_embeddings": False,  # SGLang would otherwise use the embedding as lm_head
      "vocab_size": c.target_vocab_size,
      "draft_vocab_size": c.draft_vocab_size,
      "target_hidden_size": c.target_hidden_size,
      "bos_token_id": m.bos_token_id,
      "eos_token_id": (None if not m.eos_token_ids else m.eos_token_ids[0] if len(m.eos_token_ids) == 1
                       else list(m.eos_token_ids)),
      # The dtype on disk, under both names transformers has used (< 4.56 / >= 4.56); engines cast it
      # to the target's dtype on load.
      "torch_dtype": dtype,
      "dtype": dtype,
      # vLLM reads the top-level list first, then eagle_config's; SGLang reads eagle_config's only.
      "eagle_aux_hidden_state_layer_ids": ids,
      "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
  }
  if c.fc_norm:  # EAGLE-3.1's per-layer norms, read at the top level by every loader (see layerwave.eagle3)
    config["fc_norm"] = True
  config["layerwave"] = {
      "format_version": eagle3.FORMAT_VERSION,
      "layer_ids": ids,
      "layer_id_convention": layer_ids.CONVENTION,
      "block_output_layer_ids": block_ids,
      "engine_layer_ids": engine_layer_ids(ids, c.target_num_layers),
      "engine_note": engine_note(ids, c.target_num_layers, fc_norm=c.fc_norm),
      "target": {"num_layers": c.target_num_layers, "hidden_size": c.target_hidden_size,
                 "vocab_size": c.target_vocab_size},
      "selection": record.to_dict(),
      "draft_config": c.to_dict(),
  }
  if c.fc_norm:
    config["layerwave"]["fc_norm_support"] = dict(FC_NORM_SUPPORT)
  return config


def export_eagle3(draft: Draft, target: Target, out_dir: str, *,
                  selection: layer_ids.LayerSelection | None = None, overwrite: bool = False,
                  dtype: str = "float32", include_embedding: bool = False,
                  allow_first_id_1: bool = False, allow_nonstandard_k: bool = False) -> str:
  """Writes `draft` as an EAGLE-3 Hugging Face directory, atomically.

  Args:
    draft: a trained single-layer draft for `target`; an `fc_norm` draft is written as EAGLE-3.1 (see
      the module docstring for which engine versions apply its norms).
    target: the target it reads (checked: L, D, V).
    out_dir: the directory to create.
    selection: the `LayerSelection` record behind the draft's ids (a `manual` record when None).
    overwrite: replace an existing `out_dir`.
    dtype: tensor dtype on disk, recorded as config.json's `torch_dtype` and `dtype`: 'float32' (exact
      round trip), 'bfloat16' (for a bfloat16 serving target: engines run the draft in the target's
      dtype, so this is what they compute with, in half the bytes) or 'float16'.
    include_embedding: also write `embed_tokens.weight` (vLLM shares the target's when absent).
    allow_first_id_1: export ids starting at 1, which SGLang >= PR #25454 shifts by one (vLLM does not);
      the config's `layerwave.engine_note` and a log line say what each engine reads.
    allow_nonstandard_k: export a draft reading k != 3 layers, which only layerwave loads.

  Returns:
    `out_dir`.

  Raises:
    FileExistsError: `out_dir` exists and `overwrite` is False.
    ValueError: a draft that EAGLE-3 engines cannot load or would feed from the wrong layers (unless
      allowed above), or one made for another target / selection.
  """
  if dtype not in _DISK_DTYPES:
    raise ValueError(f"Unknown export dtype {dtype!r}; choose one of {sorted(_DISK_DTYPES)}.")
  c = draft.config
  c.check_target(target.config)
  _check_exportable(c)
  if selection is None:
    selection = layer_ids.LayerSelection(ids=c.layer_ids, num_layers=c.target_num_layers,
                                         hidden_size=c.target_hidden_size)
  selection.validate_for(target.config.num_layers, target.config.hidden_size)
  if tuple(selection.ids) != tuple(c.layer_ids):
    raise ValueError(f"The selection record's ids {list(selection.ids)} differ from the draft's "
                     f"{list(c.layer_ids)}.")
  _check_engine_ids(c.layer_ids, c.target_num_layers, allow_first_id_1, allow_nonstandard_k)
  if c.fc_norm:
    logging.warning("Exporting an EAGLE-3.1 draft (fc_norm: per-layer norms before fc). vLLM %s; SGLang %s.",
                    FC_NORM_SUPPORT["vllm"], FC_NORM_SUPPORT["sglang"])
  out_dir = os.path.abspath(os.fspath(out_dir))
  if os.path.lexists(out_dir) and not overwrite:
    raise FileExistsError(f"{out_dir} already exists; choose a new directory or pass overwrite=True "
                          "(--overwrite).")
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  tensors = draft_tensors(draft, include_embedding)
  on_disk = _DISK_DTYPES[dtype]
  tensors = {k: (v.astype(on_disk) if v.dtype == np.float32 else v) for k, v in tensors.items()}
  with atomic.atomic_directory(out_dir, prefix=".tmp-eagle3-") as tmp:
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(eagle3_config(draft, selection, dtype), f, indent=2)
    save_file(tensors, os.path.join(tmp, eagle3.WEIGHTS), metadata={"format": "pt"})
  return out_dir
