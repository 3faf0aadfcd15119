"""EAGLE-3 export (layerwave.export) and import (layerwave.eagle3): exact round trip, published names, official
directories, bad inputs.

Where the pinned names and fields come from (read in the public sources, not copied):
* vLLM `vllm/model_executor/models/llama_eagle3.py`: `LlamaModel.load_weights` renames `midlayer.` →
  `layers.0.` and stacks `q/k/v_proj`, `gate/up_proj`; `Eagle3LlamaForCausalLM.load_weights` skips `t2d`,
  loads `d2t` as `draft_id_to_target_id` (int64), prefixes the rest with `model.` except `lm_head`, and
  loads `embed_tokens` only if present. Config: `draft_vocab_size`, `target_hidden_size` (fc is
  `3 * target_hidden_size → hidden_size`), `eagle_config.use_aux_hidden_state`.
* vLLM `vllm/v1/worker/gpu_model_runner.py` `_get_eagle3_aux_layers_from_config`: ids from
  `eagle_aux_hidden_state_layer_ids`, else `eagle_config["eagle_aux_hidden_state_layer_ids"]`, passed
  unchanged to `set_aux_hidden_state_layers`; `llama.py` captures before layer idx → HF hidden_states[idx].
* SGLang `python/sglang/srt/models/llama_eagle3.py`: `LlamaForCausalLMEagle3` with `model.fc`,
  `model.midlayer` (`input_layernorm`, `hidden_norm`, `self_attn.{q,k,v,o}_proj`,
  `post_attention_layernorm`, `mlp.{gate,up,down}_proj`), `model.norm`, `lm_head`; `d2t` becomes
  `hot_token_id = d2t + arange`; `t2d` is skipped. SGLang `llama.py` `set_eagle3_layers_to_capture` adds 1
  to explicit ids (block-output convention; sglang PR #25454 only when the first id is 1). Its capture, like
  vLLM's, appends `hidden_states + residual`, and the residual is None before block 0: id 0 cannot load.
* EAGLE `eagle/model/cnets.py` (the EAGLE-3 reference): `fc`, `midlayer`, `norm`, `lm_head`, buffers
  `d2t` (long) and `t2d` (bool), `target_id = draft_id + d2t[draft_id]`, embeds concatenated first.
* Published config.json (SpecForge `configs/qwen3-4b-eagle3.json`, the layout of
  yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): `architectures: ["LlamaForCausalLMEagle3"]`, `model_type: llama`,
  `num_hidden_layers: 1`, `vocab_size` = target V, `draft_vocab_size`, no layer ids (engines default to
  [2, L//2, L-3]); SpecForge-era drafts add `eagle_config: {"eagle_aux_hidden_state_layer_ids": [...],
  "use_aux_hidden_state": true}` in block-output numbering (SpecForge's default [1, L//2-1, L-4]).
* EAGLE-3.1 per-layer norms (`fc_norm`), quoted from the loaders:
  - vLLM `vllm/model_executor/models/llama_eagle3.py` (since vllm PR #42764): `use_fc_norm =
    getattr(self.config, "fc_norm", False)` builds `self.fc_norm = nn.ModuleList([RMSNorm(target_hidden_size,
    eps=self.config.rms_norm_eps) for _ in range(self.num_aux_hidden_states)])`;
    `combine_hidden_states` does `chunks = hidden_states.chunk(self.model.num_aux_hidden_states, dim=-1)`
    and `torch.cat([norm(chunk) for norm, chunk in zip(self.model.fc_norm, chunks)], dim=-1)` before
    `self.model.fc`; `load_weights` prefixes `model.`, so the file's name is `fc_norm.{i}.weight`.
    `self.norm_output = getattr(self.config, "norm_output", False)`: absent = pre-norm h fed back.
  - SGLang `python/sglang/srt/models/llama_eagle3.py`: `use_fc_norm = getattr(config, "fc_norm", None) or
    getattr(config, "use_aux_norm", False)`, `RMSNorm(self.hidden_size_in, eps=config.rms_norm_eps)` per aux
    state, legacy names `aux_norm_low/mid/high` → `fc_norm.0/1/2`; its `load_weights` skips any name it has
    no parameter for (`if param_name in params_dict`), which is why an SGLang without fc_norm ignores them.
  - SpecForge `specforge/modeling/draft/llama3_eagle.py`: `if getattr(config, "fc_norm", False):
    self.fc_norm = nn.ModuleList([LlamaRMSNorm(self.target_hidden_size, eps=config.rms_norm_eps) for _ in
    range(3)])`, applied in `project_hidden_states`; `configs/qwen3-30B-A3B-eagle3.1.json` sets
    `"fc_norm": true`; `specforge/export/to_sglang.py` writes the state-dict names unchanged.
  - speculators `src/speculators/models/eagle3/config.py` (`fc_norm`: "concat(Norm(h_a), Norm(h_b),
    Norm(h_c)) instead of the single Norm(concat(h_a, h_b, h_c)) used by norm_before_fc") and
    `convert/eagle/eagle3_converter.py` (`fc_norm=fc_norm or eagle_config.get("fc_norm", False)`).
"""

import json
import logging
import os
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import layerwave
from layerwave import checkpoint as ckpt_lib
from layerwave import eagle3
from layerwave import export
from layerwave import layer_ids
from layerwave.models import gates
from layerwave.models.draft import Draft, DraftConfig
from layerwave.models.kv_cache import KVCache
from layerwave.training import restore
from layerwave.training import step as step_lib
from tests.models import hf_reference

L, D, V, V_D = 8, 32, 97, 50
IDS = (2, 3, 6)  # not EAGLE-3's (2, 4, 5): the explicit-ids path is what is tested

# Published tensor names with HF `[out, in]` shapes for D = d = 32, H = 4, K = 2, head 8, MLP 48.
PUBLISHED_SHAPES = {
    "fc.weight": (D, 3 * D),
    "midlayer.input_layernorm.weight": (D,),
    "midlayer.hidden_norm.weight": (D,),
    "midlayer.self_attn.q_proj.weight": (32, 2 * D),
    "midlayer.self_attn.k_proj.weight": (16, 2 * D),
    "midlayer.self_attn.v_proj.weight": (16, 2 * D),
    "midlayer.self_attn.o_proj.weight": (D, 32),
    "midlayer.post_attention_layernorm.weight": (D,),
    "midlayer.mlp.gate_proj.weight": (48, D),
    "midlayer.mlp.up_proj.weight": (48, D),
    "midlayer.mlp.down_proj.weight": (D, 48),
    "norm.weight": (D,),
    "lm_head.weight": (V_D, D),
    "d2t": (V_D,),
    "t2d": (V,),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("llama8"))
  hf_reference.save_hf_model_with(directory, num_hidden_layers=L, tie_word_embeddings=False)
  return layerwave.load_target(directory)


def _vocab_ids(seed=0):
  return np.sort(np.random.default_rng(seed).choice(V, V_D, replace=False))


def _draft(target, ids=IDS, **kw):
  cfg = DraftConfig.from_target(target.config, ids, draft_vocab_size=V_D, **kw)
  draft = Draft(cfg, embedding=target.params["embed_tokens"]["embedding"][...], rngs=nnx.Rngs(0))
  vocab = _vocab_ids()
  draft.d2t[...] = jnp.asarray(vocab - np.arange(V_D), jnp.int32)
  draft.t2d[...] = jnp.zeros(V, bool).at[vocab].set(True)
  for norm in (draft.midlayer.input_layernorm, draft.midlayer.hidden_norm, draft.norm,
               draft.midlayer.post_attention_layernorm):  # non-trivial scales
    norm.scale[...] = 1 + 0.1 * jnp.arange(D, dtype=jnp.float32) / D
  return draft


def _logits(draft, target, tokens):
  feats = target.forward(tokens, return_hidden_states=True).hidden_states
  g = draft.fuse(feats[jnp.asarray(draft.config.layer_ids)])
  b, t = tokens.shape
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  next_tokens = jnp.asarray(np.roll(tokens, -1, axis=1))  # x_{t+1} (wrapping is fine for a comparison)
  _, logits, _ = draft(g, next_tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), mask,
                       KVCache.zeros(draft.config.model, b, t), jnp.zeros(b, jnp.int32))
  return np.asarray(logits)


def _state(draft):
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(draft))}


def test_round_trip_is_exact_and_logits_identical(target, tmp_path):
  draft = _draft(target)
  record = layer_ids.LayerSelection(ids=IDS, num_layers=L, hidden_size=D, strategy="greedy", lam=0.5)
  out = export.export_eagle3(draft, target, str(tmp_path / "eagle3"), selection=record)
  back = layerwave.load_draft(out, target)  # the hook: a config.json with an EAGLE-3 architecture
  assert back.config == draft.config
  a, b = _state(draft), _state(back)
  assert a.keys() == b.keys()
  for path in a:
    assert a[path].dtype == b[path].dtype, path
    np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))
  tokens = np.random.default_rng(1).integers(0, V, (2, 7))
  np.testing.assert_array_equal(_logits(draft, target, tokens), _logits(back, target, tokens))
  with open(os.path.join(out, "config.json")) as f:
    lw = json.load(f)["layerwave"]
  assert layer_ids.LayerSelection.from_dict(lw["selection"]) == record
  assert lw["block_output_layer_ids"] == [1, 2, 5]  # SpecForge / TensorRT-LLM numbering
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]  # nothing half-written left


def test_published_key_names_and_config_fields(target, tmp_path):
  out = export.export_eagle3(_draft(target), target, str(tmp_path / "e"))
  tensors = load_file(os.path.join(out, "model.safetensors"))
  assert {k: v.shape for k, v in tensors.items()} == PUBLISHED_SHAPES  # no embed_tokens by default
  assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == np.bool_
  np.testing.assert_array_equal(np.arange(V_D) + tensors["d2t"], _vocab_ids())
  with open(os.path.join(out, "config.json")) as f:
    cfg = json.load(f)
  assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]  # SGLang class; vLLM registry entry
  assert cfg["model_type"] == "llama"
  assert cfg["num_hidden_layers"] == 1  # vLLM builds layers.0 from midlayer; SGLang one midlayer
  assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (V, V_D, D)
  assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
          cfg["num_key_value_heads"], cfg["head_dim"]) == (D, 48, 4, 2, 8)
  assert cfg["tie_word_embeddings"] is False  # SGLang ties lm_head to the embedding otherwise
  for key in ("rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings"):
    assert key in cfg
  # HF hidden-state ids = vLLM's reading (captured before block i), at both places vLLM looks.
  assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": list(IDS),
                                 "use_aux_hidden_state": True}
  assert cfg["eagle_aux_hidden_state_layer_ids"] == list(IDS)
  assert cfg["torch_dtype"] == cfg["dtype"] == "float32"  # transformers < 4.56 / >= 4.56 spellings
  # Before #25454 SGLang adds 1 to every id; since, only to lists starting at 1; vLLM never.
  assert cfg["layerwave"]["engine_layer_ids"] == {"vllm": [2, 3, 6], "sglang": [2, 3, 6],
                                                  "sglang_before_pr25454": [3, 4, 7]}
  assert "SGLang before PR #25454 reads layers [3, 4, 7], NOT the trained" in cfg["layerwave"]["engine_note"]
  with_embed = export.export_eagle3(_draft(target), target, str(tmp_path / "emb"),
                                    include_embedding=True)
  assert load_file(os.path.join(with_embed, "model.safetensors"))["embed_tokens.weight"].shape == (V, D)
  layerwave.load_eagle3(with_embed, target)


def _rms(x, w, eps):
  return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def _official_dir(path, eagle_config=None, drop=(), dtype=ml_dtypes.bfloat16):
  """An EAGLE-3 directory written as published drafts write it (bf16 tensors, int64 d2t, no layerwave)."""
  rng = np.random.default_rng(3)
  tensors = {k: (rng.normal(size=s) * (0.3 if len(s) == 2 else 0.1) + (len(s) == 1)).astype(dtype)
             for k, s in PUBLISHED_SHAPES.items() if k not in ("d2t", "t2d")}
  vocab = _vocab_ids(5)
  tensors["d2t"] = (vocab - np.arange(V_D)).astype(np.int64)
  tensors["t2d"] = np.isin(np.arange(V), vocab)
  for k in drop:
    del tensors[k]
  config = {"architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False,
            "bos_token_id": 1, "eos_token_id": 2, "head_dim": 8, "hidden_act": "silu",
            "hidden_size": D, "initializer_range": 0.02, "intermediate_size": 48,
            "max_position_embeddings": 256, "model_type": "llama", "num_attention_heads": 4,
            "num_hidden_layers": 1, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
            "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": V, "draft_vocab_size": V_D}
  if eagle_config is not None:
    config["eagle_config"] = eagle_config
  os.makedirs(path)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  return {k: np.asarray(v, np.float32) if v.dtype == dtype else v for k, v in tensors.items()}


def test_official_directory_loads_and_runs(target, tmp_path):
  w = _official_dir(str(tmp_path / "official"))
  draft = layerwave.load_draft(str(tmp_path / "official"), target)
  assert draft.config.layer_ids == layer_ids.eagle3_layer_ids(L) == (2, 4, 5)  # no ids: engines' default
  np.testing.assert_array_equal(draft.draft_token_ids(), _vocab_ids(5))
  # One position: attention over a single key returns its value, so the EAGLE-3 midlayer reduces to
  # plain numpy on the published tensors — embeds first, hidden_norm on g, residual on the un-normed g.
  token = 11
  feats = np.asarray(target.forward(np.array([[token]]), return_hidden_states=True).hidden_states)
  h_in = np.concatenate([feats[i, 0, 0] for i in (2, 4, 5)])
  emb = np.asarray(target.params["embed_tokens"]["embedding"][...])[token]
  g = w["fc.weight"] @ h_in
  u = np.concatenate([_rms(emb, w["midlayer.input_layernorm.weight"], 1e-5),
                      _rms(g, w["midlayer.hidden_norm.weight"], 1e-5)])
  v = (w["midlayer.self_attn.v_proj.weight"] @ u).reshape(2, 8)
  attn = np.repeat(v, 2, axis=0).reshape(-1)  # 4 query heads share 2 kv heads
  a = g + w["midlayer.self_attn.o_proj.weight"] @ attn
  x = _rms(a, w["midlayer.post_attention_layernorm.weight"], 1e-5)
  gate = w["midlayer.mlp.gate_proj.weight"] @ x
  h = a + w["midlayer.mlp.down_proj.weight"] @ (gate / (1 + np.exp(-gate))
                                                * (w["midlayer.mlp.up_proj.weight"] @ x))
  want = w["lm_head.weight"] @ _rms(h, w["norm.weight"], 1e-5)
  got_h, got, _ = draft(jnp.asarray(g)[None, None], jnp.array([[token]]), jnp.zeros((1, 1), jnp.int32),
                        jnp.ones((1, 1, 1), bool), KVCache.zeros(draft.config.model, 1, 4),
                        jnp.zeros(1, jnp.int32))
  np.testing.assert_allclose(np.asarray(got_h)[0, 0], h, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(got)[0, 0], want, rtol=1e-4, atol=1e-4)
  tokens = np.random.default_rng(2).integers(0, V, (1, 5))
  assert np.isfinite(_logits(draft, target, tokens)).all()


def test_official_block_output_ids_need_the_convention(target, tmp_path):
  # A SpecForge-style draft for SGLang: eagle_config ids count block outputs (hf id - 1). A list starting at
  # 1 is where the engines disagree (vLLM: hf ids; SGLang: block outputs), so it is never guessed.
  _official_dir(str(tmp_path / "sf"), {"eagle_aux_hidden_state_layer_ids": [1, 3, 5],
                                       "use_aux_hidden_state": True})
  with pytest.raises(ValueError, match=r"start at 1, which the engines read differently.*"
                                       r"layers \[2, 4, 6\].*id_convention='block_outputs'"):
    layerwave.load_eagle3(str(tmp_path / "sf"), target)
  assert layerwave.load_eagle3(str(tmp_path / "sf"), target,
                               id_convention="hf_hidden_states").config.layer_ids == (1, 3, 5)  # vLLM
  assert layerwave.load_eagle3(str(tmp_path / "sf"), target,
                               id_convention="block_outputs").config.layer_ids == (2, 4, 6)
  with pytest.raises(ValueError, match="Unknown id_convention"):
    layerwave.load_eagle3(str(tmp_path / "sf"), target, id_convention="sglang")
  # Id 0: vLLM and new SGLang cannot capture it, old SGLang reads block outputs: refused as ambiguous too.
  _edit_config(str(tmp_path / "sf"), lambda c: c["eagle_config"].update(
      eagle_aux_hidden_state_layer_ids=[0, 3, 5]))
  with pytest.raises(ValueError, match="cannot capture id 0.*id_convention"):
    layerwave.load_eagle3(str(tmp_path / "sf"), target)
  assert layerwave.load_eagle3(str(tmp_path / "sf"), target,
                               id_convention="block_outputs").config.layer_ids == (1, 4, 6)
  # First id >= 2: vLLM and SGLang >= #25454 both read hf ids, and so does load_eagle3.
  _edit_config(str(tmp_path / "sf"), lambda c: c["eagle_config"].update(
      eagle_aux_hidden_state_layer_ids=[2, 3, 5]))
  assert layerwave.load_eagle3(str(tmp_path / "sf"), target).config.layer_ids == (2, 3, 5)


def test_export_refuses_an_existing_directory_unless_overwrite(target, tmp_path):
  out = tmp_path / "e"
  out.mkdir()
  (out / "keep.txt").write_text("x")
  with pytest.raises(FileExistsError, match="overwrite=True"):
    export.export_eagle3(_draft(target), target, str(out))
  assert os.listdir(out) == ["keep.txt"]
  export.export_eagle3(_draft(target), target, str(out), overwrite=True)
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_export_refuses_what_engines_cannot_load(target, tmp_path):
  with pytest.raises(ValueError, match="decoder layers"):
    export.export_eagle3(_draft(target, num_layers=2), target, str(tmp_path / "a"))
  with pytest.raises(ValueError, match="learned gate"):
    export.export_eagle3(_draft(target, fc_norm=True, gates=gates.GateConfig("softmax", k=2)), target,
                         str(tmp_path / "b"))
  with pytest.raises(ValueError, match="final-norm output"):
    export.export_eagle3(_draft(target, ids=(2, 4, L)), target, str(tmp_path / "c"))
  record = layer_ids.LayerSelection(ids=(2, 4, 5), num_layers=L, hidden_size=D)
  with pytest.raises(ValueError, match="differ from the draft's"):
    export.export_eagle3(_draft(target), target, str(tmp_path / "d"), selection=record)
  assert not os.listdir(tmp_path)


def test_export_refuses_layer_id_0(target, tmp_path):
  # Both engines capture hidden_states + residual before block i; before block 0 there is no residual.
  overrides = {"allow_first_id_1": True, "allow_nonstandard_k": True}
  for ids, kw in (((0, 3, 6), {}), ((0, 3, 6), overrides), ((0, 6), overrides)):  # no override exports it
    with pytest.raises(ValueError, match="no residual before block 0.*older SGLang silently reads id 1"):
      export.export_eagle3(_draft(target, ids=ids), target, str(tmp_path / "a"), **kw)
  assert not os.listdir(tmp_path)


def test_export_refuses_first_id_1_unless_allowed(target, tmp_path, caplog):
  ids = (1, 3, 6)
  with pytest.raises(ValueError, match=r"first layer id is 1.*feed layers \[2, 4, 7\].*allow_first_id_1"):
    export.export_eagle3(_draft(target, ids=ids), target, str(tmp_path / "a"))
  assert not os.listdir(tmp_path)
  with caplog.at_level(logging.WARNING):
    out = export.export_eagle3(_draft(target, ids=ids), target, str(tmp_path / "b"),
                               allow_first_id_1=True)
  with open(os.path.join(out, "config.json")) as f:
    cfg = json.load(f)
  assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]  # written as trained: vLLM's reading
  want = {"vllm": [1, 3, 6], "sglang": [2, 4, 7], "sglang_before_pr25454": [2, 4, 7]}
  assert cfg["layerwave"]["engine_layer_ids"] == want
  note = cfg["layerwave"]["engine_note"]
  assert "vLLM reads layers [1, 3, 6], the trained ones" in note
  assert "SGLang with PR #25454 (merged 2026-05-16) reads layers [2, 4, 7], NOT the trained" in note
  assert note in caplog.text  # the same sentence in the log
  assert layerwave.load_eagle3(out, target).config.layer_ids == ids  # the layerwave block is exact


def test_export_refuses_k_not_3_unless_allowed(target, tmp_path, caplog):
  for ids in ((2, 6), (2, 3, 5, 6)):
    with pytest.raises(ValueError, match=f"reads {len(ids)} layers.*fc for exactly 3.*allow_nonstandard_k"):
      export.export_eagle3(_draft(target, ids=ids), target, str(tmp_path / "a"))
  assert not os.listdir(tmp_path)
  draft = _draft(target, ids=(2, 6))
  with caplog.at_level(logging.WARNING):
    out = export.export_eagle3(draft, target, str(tmp_path / "b"), allow_nonstandard_k=True)
  with open(os.path.join(out, "config.json")) as f:
    lw = json.load(f)["layerwave"]
  assert lw["engine_layer_ids"] == {"vllm": None, "sglang": None, "sglang_before_pr25454": None}
  assert "vLLM cannot load this draft" in lw["engine_note"] and lw["engine_note"] in caplog.text
  back = layerwave.load_eagle3(out, target)  # layerwave reads it
  for path, value in _state(draft).items():
    np.testing.assert_array_equal(value, _state(back)[path], err_msg=str(path))


def test_engine_layer_ids():
  # Old SGLang's shift can reach L (= 8), which no block's input is: the engine cannot run it.
  assert eagle3.engine_layer_ids([2, 4, 7], L) == {"vllm": [2, 4, 7], "sglang": [2, 4, 7],
                                                   "sglang_before_pr25454": None}
  assert eagle3.engine_layer_ids([0, 3, 6], L) == {"vllm": None, "sglang": None,
                                                   "sglang_before_pr25454": [1, 4, 7]}
  # The reading side's public names stay importable from layerwave.export (where they were defined first).
  assert export.engine_layer_ids is eagle3.engine_layer_ids and export.load_eagle3 is eagle3.load_eagle3
  assert export.read_tensors is eagle3.read_tensors and export.is_eagle3_dir is eagle3.is_eagle3_dir


def test_import_missing_tensor(target, tmp_path):
  _official_dir(str(tmp_path / "o"), drop=("midlayer.mlp.up_proj.weight",))
  with pytest.raises(ValueError, match=r"missing tensors: \['midlayer.mlp.up_proj.weight'\]"):
    layerwave.load_eagle3(str(tmp_path / "o"), target)


def _edit_config(directory, fn):
  path = os.path.join(directory, "config.json")
  with open(path) as f:
    cfg = json.load(f)
  fn(cfg)
  with open(path, "w") as f:
    json.dump(cfg, f)


def test_import_layer_ids_of_wrong_length_or_convention(target, tmp_path):
  _official_dir(str(tmp_path / "o"), {"eagle_aux_hidden_state_layer_ids": [2, 4]})
  with pytest.raises(ValueError, match="wrong length"):
    layerwave.load_eagle3(str(tmp_path / "o"), target)
  _edit_config(str(tmp_path / "o"), lambda c: c["eagle_config"].update(
      eagle_aux_hidden_state_layer_ids=[2, 4, 9]))
  with pytest.raises(ValueError, match=r"out of range for L=8"):
    layerwave.load_eagle3(str(tmp_path / "o"), target)
  # Our export whose ids were rewritten in block-output numbering (what SpecForge / old SGLang read).
  out = export.export_eagle3(_draft(target), target, str(tmp_path / "e"))
  _edit_config(out, lambda c: (c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 5]),
                               c.pop("eagle_aux_hidden_state_layer_ids")))
  with pytest.raises(ValueError, match="block-output ids"):
    layerwave.load_eagle3(out, target)
  out = export.export_eagle3(_draft(target), target, str(tmp_path / "f"))
  _edit_config(out, lambda c: c["layerwave"].update(block_output_layer_ids=[2, 3, 6]))
  with pytest.raises(ValueError, match="mixes conventions"):
    layerwave.load_eagle3(out, target)
  with pytest.raises(ValueError, match="contradicts"):
    layerwave.load_eagle3(out, target, id_convention="block_outputs")


def test_import_draft_for_another_target(target, tmp_path):
  out = export.export_eagle3(_draft(target), target, str(tmp_path / "e"))
  hf_reference.save_hf_model_with(str(tmp_path / "l6"), num_hidden_layers=6)
  target6 = layerwave.load_target(str(tmp_path / "l6"))
  with pytest.raises(ValueError, match="L=8; the given target has L=6"):
    layerwave.load_draft(out, target6)
  with pytest.raises(ValueError, match=r"trained for a target with \(L, D, V\) = \(8, 32, 97\)"):
    export.export_eagle3(_draft(target), target6, str(tmp_path / "x"))  # exported with the wrong target
  hf_reference.save_hf_model_with(str(tmp_path / "v"), num_hidden_layers=L, vocab_size=120)
  with pytest.raises(ValueError, match=r"another target: vocab_size=97 \(target has 120\)"):
    layerwave.load_draft(out, layerwave.load_target(str(tmp_path / "v")))
  # A published draft (no layerwave block) for a wider target, and one whose ids need a deeper target.
  _official_dir(str(tmp_path / "o"))
  _edit_config(str(tmp_path / "o"), lambda c: c.update(target_hidden_size=64))
  with pytest.raises(ValueError, match=r"another target: target_hidden_size=64 \(target has 32\)"):
    layerwave.load_eagle3(str(tmp_path / "o"), target)
  _edit_config(str(tmp_path / "o"), lambda c: (c.pop("target_hidden_size"), c.update(
      eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 16, 29]})))
  with pytest.raises(ValueError, match="out of range for L=8"):
    layerwave.load_eagle3(str(tmp_path / "o"), target)


def test_bfloat16_export_loads_close(target, tmp_path):
  draft = _draft(target)
  out = export.export_eagle3(draft, target, str(tmp_path / "bf"), dtype="bfloat16")
  with open(os.path.join(out, "config.json")) as f:
    cfg = json.load(f)
  assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"  # the dtype on disk, recorded
  assert load_file(os.path.join(out, "model.safetensors"))["fc.weight"].dtype == ml_dtypes.bfloat16
  back = layerwave.load_eagle3(out, target)
  np.testing.assert_allclose(back.fc.kernel[...], draft.fc.kernel[...], rtol=1e-2, atol=1e-2)
  np.testing.assert_array_equal(back.d2t[...], draft.d2t[...])


def test_export_workdir_reads_the_recorded_target(target, tmp_path):
  """The launcher's path (`training.restore.export_workdir`): a training workdir's checkpoint (written as `training.loop.run` writes it)."""
  draft = _draft(target)
  record = layer_ids.LayerSelection(ids=IDS, num_layers=L, hidden_size=D)
  _, params, vocab, _ = step_lib.split_draft(draft)
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "w" / "checkpoints"))
  ckpt.save(1, step_lib.init_state(params, step_lib.OptimizerSettings(1e-4, 1, 2)), vocab,
            {"draft_config": draft.config.to_dict(), "selection": record.to_dict(),
             "config": {"model": target.path, "dtype": "float32"}})
  ckpt.close()
  out = restore.export_workdir(str(tmp_path / "w"), str(tmp_path / "out"))
  back = layerwave.load_draft(out, target)
  for path, value in _state(draft).items():
    np.testing.assert_array_equal(value, _state(back)[path], err_msg=str(path))
  with pytest.raises(FileExistsError):
    restore.export_workdir(str(tmp_path / "w"), str(tmp_path / "out"))


def _to_torch_bin(directory):
  """Rewrites `directory`'s model.safetensors as pytorch_model.bin (torch.save), as published drafts ship."""
  import torch  # pylint: disable=g-import-not-at-top
  tensors = {}
  for name, arr in load_file(os.path.join(directory, "model.safetensors")).items():
    if arr.dtype == ml_dtypes.bfloat16:  # torch cannot take ml_dtypes arrays: move the bits
      tensors[name] = torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    else:
      tensors[name] = torch.from_numpy(arr.copy())
  torch.save(tensors, os.path.join(directory, "pytorch_model.bin"))
  os.remove(os.path.join(directory, "model.safetensors"))


def test_pytorch_model_bin_loads_as_the_safetensors_draft(target, tmp_path):
  pytest.importorskip("torch")
  import shutil  # pylint: disable=g-import-not-at-top
  export.export_eagle3(_draft(target), target, str(tmp_path / "st"))  # float32, with a layerwave block
  _official_dir(str(tmp_path / "ost"), {"eagle_aux_hidden_state_layer_ids": [2, 3, 5]})  # bfloat16
  for name in ("st", "ost"):
    shutil.copytree(str(tmp_path / name), str(tmp_path / (name + "-bin")))
    _to_torch_bin(str(tmp_path / (name + "-bin")))
    assert sorted(os.listdir(tmp_path / (name + "-bin"))) == ["config.json", "pytorch_model.bin"]
    want = layerwave.load_eagle3(str(tmp_path / name), target)
    got = layerwave.load_draft(str(tmp_path / (name + "-bin")), target)
    assert got.config == want.config
    a, b = _state(want), _state(got)
    assert a.keys() == b.keys()
    for path in a:
      assert a[path].dtype == b[path].dtype, path
      np.testing.assert_array_equal(a[path], b[path], err_msg=f"{name}: {path}")


def test_pytorch_model_bin_runs_no_code(target, tmp_path):
  torch = pytest.importorskip("torch")
  directory = tmp_path / "evil"
  _official_dir(str(directory))
  os.remove(directory / "model.safetensors")
  torch.save({"fc.weight": torch.zeros(D, 3 * D), "payload": layer_ids.LayerSelection(
      ids=IDS, num_layers=L, hidden_size=D)}, str(directory / "pytorch_model.bin"))  # a pickled object
  with pytest.raises(ValueError, match=r"weights_only=True\): .*LayerSelection.*does not unpickle"):
    layerwave.load_eagle3(str(directory), target)
  os.remove(directory / "pytorch_model.bin")
  with pytest.raises(FileNotFoundError, match="No model.safetensors or pytorch_model.bin"):
    layerwave.load_eagle3(str(directory), target)


def test_pytorch_model_bin_without_torch(tmp_path):
  """torch made unimportable inside a child process only: the error says what to install and why."""
  directory = tmp_path / "bin"
  directory.mkdir()
  (directory / "pytorch_model.bin").write_bytes(b"not read")
  script = ("import sys; sys.modules['torch'] = None\n"  # only in this child: `import torch` fails
            "from layerwave import eagle3\n"
            "try:\n"
            "  eagle3.read_tensors(sys.argv[1])\n"
            "except ImportError as e:\n"
            "  print('ImportError:', e)\n")
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = subprocess.run([sys.executable, "-c", script, str(directory)], capture_output=True, text=True,
                       cwd=repo, timeout=300, check=True)
  assert "ImportError:" in run.stdout, run.stdout + run.stderr
  assert "pytorch_model.bin is a pickled PyTorch checkpoint and torch is not installed" in run.stdout
  assert "torch.load(weights_only=True" in run.stdout and "model.safetensors" in run.stdout


def test_round_trip_over_a_gemma_target(target, tmp_path):
  """A draft over a Gemma 3 target (Llama-style block on the target's embedding rows) exports and loads back
  exactly as a Llama-style block (before the fix the import inherited the target's Gemma fields), and a
  Llama target of another depth refuses it."""
  directory = str(tmp_path / "gemma3")
  hf_reference.save_hf_model("gemma3", directory, seed=3)
  gemma = layerwave.load_target(directory)
  n, d, v = gemma.config.num_layers, gemma.config.hidden_size, gemma.config.vocab_size
  ids = (1, 2, 3)
  cfg = DraftConfig.from_target(gemma.config, ids, draft_vocab_size=V_D)
  draft = Draft(cfg, embedding=gemma.params["embed_tokens"]["embedding"][...], rngs=nnx.Rngs(0))
  vocab = np.sort(np.random.default_rng(0).choice(v, V_D, replace=False))
  draft.d2t[...] = jnp.asarray(vocab - np.arange(V_D), jnp.int32)
  draft.t2d[...] = jnp.zeros(v, bool).at[vocab].set(True)
  out = export.export_eagle3(draft, gemma, str(tmp_path / "eagle3"), allow_first_id_1=True)
  with open(os.path.join(out, "config.json")) as f:
    config = json.load(f)
  assert config["target_hidden_size"] == d and config["vocab_size"] == v
  assert config["eagle_aux_hidden_state_layer_ids"] == list(ids)
  back = layerwave.load_draft(out, gemma)
  assert back.config == draft.config
  a, b = _state(draft), _state(back)
  for path in a:
    np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))
  tokens = np.random.default_rng(1).integers(0, v, (2, 9))  # longer than the window (4)
  np.testing.assert_array_equal(_logits(draft, gemma, tokens), _logits(back, gemma, tokens))
  assert back.config.model.model_type == "llama" and back.config.model.sliding_window is None
  assert (n, d, v) != (L, D, V)
  with pytest.raises(ValueError, match="exported for a target with L=4; the given target has L=8"):
    layerwave.load_draft(out, target)  # the module's Llama target (L = 8)


# ---------------------------------------------------------------------------------------------------
# EAGLE-3.1: fc_norm drafts (sources quoted in the module docstring).


def _fc_norm_draft(target):
  draft = _draft(target, fc_norm=True)
  for i, norm in enumerate(draft.fc_norms):  # a different, non-trivial learned scale per layer
    norm.scale[...] = 1 + 0.2 * (i + 1) * jnp.sin(jnp.arange(D, dtype=jnp.float32))
  return draft


def test_fc_norm_round_trip_is_exact(target, tmp_path, caplog):
  draft = _fc_norm_draft(target)
  with caplog.at_level(logging.WARNING):
    out = export.export_eagle3(draft, target, str(tmp_path / "eagle31"))
  assert "EAGLE-3.1" in caplog.text and "silently skips the fc_norm" in caplog.text
  back = layerwave.load_draft(out, target)
  assert back.config == draft.config and back.config.fc_norm
  a, b = _state(draft), _state(back)
  assert a.keys() == b.keys()
  for path in a:
    assert a[path].dtype == b[path].dtype, path
    np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))
  tokens = np.random.default_rng(1).integers(0, V, (2, 7))
  np.testing.assert_array_equal(_logits(draft, target, tokens), _logits(back, target, tokens))
  plain = _draft(target)  # the same weights without the norms draft differently: the norms travelled
  assert not np.array_equal(_logits(plain, target, tokens), _logits(back, target, tokens))


def test_fc_norm_names_are_what_the_engines_load(target, tmp_path):
  draft = _fc_norm_draft(target)
  out = export.export_eagle3(draft, target, str(tmp_path / "e"))
  tensors = load_file(os.path.join(out, "model.safetensors"))
  norms = {f"fc_norm.{i}.weight": (D,) for i in range(3)}  # vLLM / SGLang / SpecForge: one per aux layer
  assert {k: v.shape for k, v in tensors.items()} == {**PUBLISHED_SHAPES, **norms}
  with open(os.path.join(out, "config.json")) as f:
    cfg = json.load(f)
  assert cfg["fc_norm"] is True  # top level: getattr(self.config, "fc_norm", False) in every loader
  for key in ("norm_output", "norm_before_fc", "use_aux_norm"):  # absent = the engines' EAGLE-3 default
    assert key not in cfg and key not in cfg["eagle_config"]
  assert cfg["rms_norm_eps"] == draft.config.model.rms_norm_eps  # the eps the engines give fc_norm
  lw = cfg["layerwave"]
  assert lw["draft_config"]["fc_norm"] is True
  assert lw["fc_norm_support"] == eagle3.FC_NORM_SUPPORT
  assert "vLLM reads layers [2, 3, 6], the trained ones, and applies the per-layer norms since PR #42764" \
      in lw["engine_note"]
  assert "silently skips the fc_norm.* tensors" in lw["engine_note"]
  # The engines' fusion on the written tensors (numpy): chunk i of the captures, in id order, through
  # RMSNorm fc_norm.{i}.weight with rms_norm_eps, then fc. It is layerwave's Draft.fuse.
  feats = np.asarray(target.forward(np.array([[5, 9, 2]]), return_hidden_states=True).hidden_states)
  h = np.concatenate([_rms(feats[j], tensors[f"fc_norm.{i}.weight"], cfg["rms_norm_eps"])
                      for i, j in enumerate(IDS)], -1)
  want = h @ tensors["fc.weight"].T
  got = np.asarray(draft.fuse(jnp.asarray(feats[list(IDS)])))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # A plain draft's file is unchanged: no fc_norm key, tensor or support table.
  plain = export.export_eagle3(_draft(target), target, str(tmp_path / "p"))
  with open(os.path.join(plain, "config.json")) as f:
    cfg = json.load(f)
  assert "fc_norm" not in cfg and "fc_norm_support" not in cfg["layerwave"]
  assert "norms" not in cfg["layerwave"]["engine_note"]


def test_fc_norm_refusals(target, tmp_path):
  # A gated draft: its gates scale each normed layer, which no engine does.
  gated = _draft(target, fc_norm=True, gates=gates.GateConfig("softmax", k=2))
  with pytest.raises(ValueError, match=r"learned gate \(softmax gates over 3 layers\); no EAGLE-3 or "
                                       r"EAGLE-3.1 engine applies gates.*draft_model.fc_norm=True"):
    export.export_eagle3(gated, target, str(tmp_path / "g"))
  out = export.export_eagle3(_fc_norm_draft(target), target, str(tmp_path / "e"))
  # Post-norm feedback (EAGLE-3.1's norm_output) is another draft than layerwave's.
  _edit_config(out, lambda c: c.update(norm_output=True))
  with pytest.raises(ValueError, match="norm_output=true.*pre-norm h"):
    layerwave.load_eagle3(out, target)
  _edit_config(out, lambda c: (c.pop("norm_output"), c.update(fc_norm=False)))
  with pytest.raises(ValueError, match="fc_norm=false but its layerwave block's draft_config says fc_norm=True"):
    layerwave.load_eagle3(out, target)
  _edit_config(out, lambda c: (c.pop("layerwave"), c.pop("fc_norm")))  # norms on disk, no flag
  with pytest.raises(ValueError, match=r"unexpected tensors: \['fc_norm.0.weight'.*does not set fc_norm"):
    layerwave.load_eagle3(out, target)
  _edit_config(out, lambda c: c.update(use_aux_norm=True))
  with pytest.raises(ValueError, match="use_aux_norm.*rename it fc_norm=true"):
    layerwave.load_eagle3(out, target)
  _edit_config(out, lambda c: (c.pop("use_aux_norm"), c.update(fc_norm=True)))
  assert layerwave.load_eagle3(out, target).config.fc_norm  # a file without our block loads as EAGLE-3.1
