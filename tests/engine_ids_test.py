"""layerwave.engine_ids against the engines' own capture code.

Each engine's capture rule is transcribed below from its repository (the file and commit in the comment) as a
loop over a real model's decoder layers: the project's Flax Transformer loaded from a tiny Hugging Face Llama
(8 blocks, so EAGLE-3's (2, L//2, L-3) is (2, 4, 5)), or for the hook-based engines the Hugging Face PyTorch
model itself. The ids `engine_ids` gives an engine must make that loop capture exactly our
`hidden_states[id]` for the selection; the same loop fed the ids in another engine's numbering must not.
"""

import numpy as np
import pytest

import jax.numpy as jnp

from layerwave import engine_ids
from layerwave import layer_ids
from layerwave.inference import load_target
from layerwave.models import kv_cache
from layerwave.models import layers as layers_lib

L = 8
SELECTIONS = [(2, 4, 5), (1, 3, 7), (3, 5, 6), (2, 6)]  # the default, one starting at 1, two others


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """(the HF PyTorch model, our Flax model, tokens [B, T], our hidden_states [L+1, B, T, D] as numpy)."""
  hf_reference = pytest.importorskip("tests.models.hf_reference")
  directory = str(tmp_path_factory.mktemp("tiny_llama"))
  hf_model = hf_reference.save_hf_model_with(directory, num_hidden_layers=L)
  target = load_target(directory)
  tokens = np.random.default_rng(0).integers(3, target.config.vocab_size, size=(2, 7))
  hidden = np.asarray(target.forward(tokens, return_hidden_states=True).hidden_states)
  assert hidden.shape[0] == L + 1
  return hf_model, target.model, tokens, hidden


def _context(model, tokens):
  """What every decoder layer takes besides its input: RoPE positions and frequencies, the causal mask."""
  c = model.config
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  inv_freq = jnp.asarray(layers_lib.rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling_dict), jnp.float32)
  return positions, inv_freq, kv_cache.causal_mask(jnp.ones((b, t), bool))


def _fused_layer(layer, hidden, residual, ctx):
  """One Llama block run as vLLM, SGLang and TensorRT-LLM run it: the residual add fused into the next norm
  (`norm(x, residual)` returns (norm(x + residual), x + residual)); returns (MLP output, residual before it)."""
  positions, inv_freq, mask = ctx
  if residual is None:
    residual = hidden
    hidden = layer.input_layernorm(hidden)
  else:
    residual = hidden + residual
    hidden = layer.input_layernorm(residual)
  hidden, _ = layer.self_attn(hidden, positions, inv_freq, mask, None, None)
  residual = hidden + residual
  hidden = layer.mlp(layer.post_attention_layernorm(residual))
  return hidden, residual


def vllm_capture(model, tokens, aux_hidden_state_layers):
  # vllm-project/vllm vllm/model_executor/models/llama.py @ e06c9ba2a6ea, LlamaModel.forward:
  #   for idx, layer in enumerate(islice(self.layers, start, end)):
  #     if idx in self.aux_hidden_state_layers: aux_hidden_states.append(hidden_states + residual)
  #     hidden_states, residual = layer(positions, hidden_states, residual)
  # and eagle3_utils.get_eagle3_aux_layers_from_config passes the config's ids through unchanged.
  ctx = _context(model, tokens)
  hidden, residual, aux = model.embed(jnp.asarray(tokens)), None, []
  for idx, layer in enumerate(model.layers):
    if idx in aux_hidden_state_layers:
      aux.append(hidden + residual)  # residual is None before block 0: a TypeError, as in vLLM
    hidden, residual = _fused_layer(layer, hidden, residual, ctx)
  return aux


def sglang_layers_to_capture(layer_ids_written, pr25454: bool):
  # sgl-project/sglang python/sglang/srt/models/llama.py @ bf7a0e237e8d, set_eagle3_layers_to_capture:
  #   self.model.layers_to_capture = [val + 1 for val in layer_ids]
  # and since PR #25454 the + 1 only when layer_ids[0] == 1, the ids as written otherwise.
  if not pr25454 or list(layer_ids_written[:1]) == [1]:
    return [v + 1 for v in layer_ids_written]
  return list(layer_ids_written)


def sglang_capture(model, tokens, layer_ids_written, pr25454: bool):
  # Same file, LlamaModel.forward: for i in range(start_layer, end_layer): if i in self.layers_to_capture:
  #   aux_hidden_states.append(hidden_states + residual); then the layer runs.
  layers_to_capture = sglang_layers_to_capture(layer_ids_written, pr25454)
  ctx = _context(model, tokens)
  hidden, residual, aux = model.embed(jnp.asarray(tokens)), None, []
  for i in range(len(model.layers)):
    if i in layers_to_capture:
      aux.append(hidden + residual)
    hidden, residual = _fused_layer(model.layers[i], hidden, residual, ctx)
  return aux


def trtllm_capture(model, tokens, eagle3_layers_to_capture):
  # NVIDIA/TensorRT-LLM tensorrt_llm/_torch/models/modeling_llama.py @ 3a5901cd0d77, LlamaDecoderLayer.forward:
  #   hidden_states = self.mlp(...); spec_metadata.maybe_capture_hidden_states(self.layer_idx, hidden_states,
  #   residual); tensorrt_llm/_torch/speculative/eagle3.py @ f933a608045a writes hidden_states + residual into
  #   slot i of sorted(layers_to_capture).
  layers_to_capture = sorted(eagle3_layers_to_capture)
  slots = [None] * len(layers_to_capture)
  ctx = _context(model, tokens)
  hidden, residual = model.embed(jnp.asarray(tokens)), None
  for layer_idx, layer in enumerate(model.layers):
    hidden, residual = _fused_layer(layer, hidden, residual, ctx)
    if layer_idx in layers_to_capture:
      slots[layers_to_capture.index(layer_idx)] = hidden + residual
  return [s for s in slots if s is not None]


def specforge_custom_capture(model, tokens, layers_to_output_hidden_states):
  # sgl-project/SpecForge specforge/modeling/target/custom_backend/llama.py @ 2cece767e1dd, LlamaModel.forward:
  #   for idx, decoder_layer in enumerate(self.layers): hidden_states = decoder_layer(hidden_states, ...)
  #     if idx in layers_to_output_hidden_states: all_hidden_states += (hidden_states,)
  positions, inv_freq, mask = _context(model, tokens)
  x, out = model.embed(jnp.asarray(tokens)), []
  for idx, layer in enumerate(model.layers):
    x, _ = layer(x, positions, inv_freq, mask, None, None)
    if idx in layers_to_output_hidden_states:
      out.append(x)
  return out


def tpu_inference_capture(model, tokens, draft_config_ids):
  # vllm-project/tpu-inference tpu_inference/models/jax/llama3.py @ b8692ff01fa1, LlamaModel:
  #   get_eagle3_aux_hidden_state_layers: num_layers = len(self.layers); return (2, num_layers // 2, num_layers - 3)
  #   __call__: for i, layer in enumerate(...): if i in self.aux_hidden_state_layers: aux.append(x); layer(x)
  # The draft config's ids are never read.
  del draft_config_ids
  aux_hidden_state_layers = (2, len(model.layers) // 2, len(model.layers) - 3)
  positions, inv_freq, mask = _context(model, tokens)
  x, aux = model.embed(jnp.asarray(tokens)), []
  for i, layer in enumerate(model.layers):
    if i in aux_hidden_state_layers:
      aux.append(x)
    x, _ = layer(x, positions, inv_freq, mask, None, None)
  return aux


def hook_capture(hf_model, tokens, layer_indices):
  """Forward hooks on the Hugging Face model's decoder layers, keeping each hooked layer's output.

  SpecForge's HF backend (specforge/inference/target_engine/target_capture_policy.py @ 2cece767e1dd,
  hf_capture: layers[idx].register_forward_hook, `output[0] if isinstance(output, tuple) else output`) and
  Model Optimizer's EAGLE-3 training (modelopt/torch/speculative/plugins/transformers.py @ 5a4242faf414:
  a hook on base_model.layers[layer_idx] for layer_idx in eagle_aux_hidden_state_layer_ids).
  """
  import torch
  captured, handles = {}, []
  for idx in layer_indices:
    def hook(module, inputs, output, idx=idx):
      del module, inputs
      captured[idx] = (output[0] if isinstance(output, tuple) else output).detach().numpy()
    handles.append(hf_model.model.layers[idx].register_forward_hook(hook))
  try:
    with torch.no_grad():
      hf_model(input_ids=torch.as_tensor(tokens))
  finally:
    for h in handles:
      h.remove()
  return [captured[i] for i in sorted(captured)]


CAPTURES = {  # engine -> how its capture loop reads the ids `engine_ids` gives it
    "vllm": lambda m, t, ids: vllm_capture(m, t, ids),
    "speculators": lambda m, t, ids: vllm_capture(m, t, ids),  # --target-layer-ids reach vLLM unchanged
    "sglang": lambda m, t, ids: sglang_capture(m, t, ids, pr25454=True),
    "sglang_before_pr25454": lambda m, t, ids: sglang_capture(m, t, ids, pr25454=False),
    "tensorrt_llm": trtllm_capture,
    "specforge": specforge_custom_capture,
    "tpu_inference": tpu_inference_capture,
}


def _close(captured, hidden, ids):
  return len(captured) == len(ids) and all(
      np.allclose(np.asarray(c), hidden[i], atol=1e-5, rtol=1e-5) for c, i in zip(captured, ids))


def _accepted(name, ids):
  try:
    return engine_ids.engine_ids(name, ids, L)
  except ValueError:
    return None


@pytest.mark.parametrize("name", sorted(CAPTURES))
@pytest.mark.parametrize("ids", SELECTIONS, ids=lambda s: "-".join(map(str, s)))
def test_the_engine_captures_our_hidden_states_for_its_ids(tiny, name, ids):
  _, model, tokens, hidden = tiny
  written = _accepted(name, ids)
  refused = ((name == "sglang" and ids[0] == 1) or (name == "specforge" and len(ids) != 3)
             or (name == "tpu_inference" and ids != layer_ids.eagle3_layer_ids(L)))
  assert (written is None) == refused, (name, ids, written)
  if refused:  # the messages are checked below
    return
  assert _close(CAPTURES[name](model, tokens, written), hidden, ids), (name, ids, written)


@pytest.mark.parametrize("name", ["specforge", "modelopt"])
@pytest.mark.parametrize("ids", [(2, 4, 5), (1, 3, 7)], ids=lambda s: "-".join(map(str, s)))
def test_forward_hooks_on_the_hf_model_capture_our_hidden_states(tiny, name, ids):
  hf_model, _, tokens, hidden = tiny
  written = engine_ids.engine_ids(name, ids, L)
  assert _close(hook_capture(hf_model, tokens, written), hidden, ids)
  assert not _close(hook_capture(hf_model, tokens, ids), hidden, ids)  # hf ids as hook indices: one too deep


def test_each_numbering_is_distinguishable_on_this_model(tiny):
  """The loops can fail: the ids of the other family capture other tensors."""
  _, model, tokens, hidden = tiny
  ids = (3, 5, 6)
  assert not _close(vllm_capture(model, tokens, engine_ids.engine_ids("specforge", ids, L)), hidden, ids)
  assert not _close(trtllm_capture(model, tokens, engine_ids.engine_ids("vllm", ids, L)), hidden, ids)
  assert not _close(sglang_capture(model, tokens, list(ids), pr25454=False), hidden, ids)
  assert _close(sglang_capture(model, tokens, list(ids), pr25454=True), hidden, ids)


def test_tpu_inference_captures_the_default_whatever_it_is_told(tiny):
  _, model, tokens, hidden = tiny
  default = layer_ids.eagle3_layer_ids(L)
  assert _close(tpu_inference_capture(model, tokens, (3, 5, 6)), hidden, default)
  assert not _close(tpu_inference_capture(model, tokens, (3, 5, 6)), hidden, (3, 5, 6))
  with pytest.raises(ValueError, match=r"captures \[2, 4, 5\].*MODEL_IMPL_TYPE=vllm"):
    engine_ids.engine_ids("tpu_inference", (3, 5, 6), L)


def test_block_zero_has_no_residual_to_capture(tiny):
  """Why hf id 0 is refused for the fused-norm engines: their loop fails before block 0."""
  _, model, tokens, _ = tiny
  with pytest.raises(TypeError):
    vllm_capture(model, tokens, (0, 4, 5))
  for name in engine_ids.ENGINES:
    with pytest.raises(ValueError, match="hf id 0 .*include_embeddings=False"):
      engine_ids.engine_ids(name, (0, 4, 5), L)
    with pytest.raises(ValueError, match=f"hf id {L} .*include_final=False"):
      engine_ids.engine_ids(name, (2, 4, L), L)


def test_conversions_and_lines_for_smollm2():
  sel = layer_ids.LayerSelection(ids=(2, 15, 27), num_layers=30, strategy="eagle3")
  rep = engine_ids.report(sel)
  got = {name: e["ids"] for name, e in rep["engines"].items()}
  assert got == {"vllm": [2, 15, 27], "sglang": [2, 15, 27], "sglang_before_pr25454": [1, 14, 26],
                 "specforge": [1, 14, 26], "speculators": [2, 15, 27], "tensorrt_llm": [1, 14, 26],
                 "modelopt": [1, 14, 26], "tpu_inference": [2, 15, 27]}
  lines = {name: "\n".join(e["lines"]) for name, e in rep["engines"].items()}
  assert '"eagle_aux_hidden_state_layer_ids": [2, 15, 27]' in lines["vllm"]
  assert '"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}' in lines["sglang_before_pr25454"]
  assert "--target-layer-ids 2 15 27" in lines["speculators"]
  assert "eagle3_layers_to_capture={1, 14, 26}" in lines["tensorrt_llm"]
  assert "aux_hidden_state_layer_ids: [1, 14, 26]" in lines["specforge"]
  assert all(e["sources"] and not e["error"] for e in rep["engines"].values())
  text = engine_ids.format_report(rep)
  assert "read from: vllm-project/vllm vllm/model_executor/models/llama.py" in text


def test_sglang_with_pr25454_cannot_name_hf_id_1():
  assert engine_ids.engine_ids("sglang_before_pr25454", (1, 15, 27), 30) == (0, 14, 26)
  assert engine_ids.engine_ids("vllm", (1, 15, 27), 30) == (1, 15, 27)
  with pytest.raises(ValueError, match=r"cannot capture hf id 1.*sglang_before_pr25454"):
    engine_ids.engine_ids("sglang", (1, 15, 27), 30)


def test_bad_inputs_name_the_problem_and_the_fix():
  sel = layer_ids.LayerSelection(ids=(3, 9, 20), num_layers=30, strategy="greedy")
  with pytest.raises(ValueError, match=r"unknown engine 'vlm'; known: vllm, .*--engines=vllm,sglang"):
    engine_ids.report(sel, ["vlm"])
  with pytest.raises(ValueError, match=r"tpu_inference: .*captures \[2, 15, 27\].*--allow_ignored_selection"):
    engine_ids.report(sel, ["tpu_inference"])
  # Listing every engine marks the one that cannot read it instead of refusing.
  rep = engine_ids.report(sel)
  assert "MODEL_IMPL_TYPE=vllm" in rep["engines"]["tpu_inference"]["error"]
  assert not rep["engines"]["vllm"]["error"]
  allowed = engine_ids.report(sel, ["tpu_inference"], allow_ignored_selection=True)["engines"]["tpu_inference"]
  assert allowed["captures"] == [2, 15, 27] and "captures [2, 15, 27]" in allowed["warnings"][0]
  assert any(line.startswith("MODEL_IMPL_TYPE=vllm") for line in allowed["lines"])
  four = layer_ids.LayerSelection(ids=(3, 9, 20, 25), num_layers=30)
  with pytest.raises(ValueError, match=r"SpecForge reads exactly 3 layers; this selection has k=4.*--k=3"):
    engine_ids.report(four, ["specforge"])
  assert "k=4" in engine_ids.report(four, ["vllm"])["engines"]["vllm"]["warnings"][0]
