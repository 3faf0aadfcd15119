"""Parity of the Flax target with Hugging Face's PyTorch models, cached decoding, configs and bad inputs."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import layerwave
from layerwave import inference
from layerwave.generate import generate
from layerwave.models.config import ModelConfig
from layerwave.models.kv_cache import KVCache, causal_mask

from tests.models import hf_reference

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module", params=sorted(hf_reference.FAMILIES))
def family(request, tmp_path_factory):
  directory = str(tmp_path_factory.mktemp(request.param))
  model = hf_reference.save_hf_model(request.param, directory)
  return request.param, model, layerwave.load_target(directory)


def _batch(vocab, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, vocab, size=(2, 11))
  mask = np.ones_like(ids)
  mask[1, 7:] = 0  # a right-padded row
  return ids, mask


def test_hidden_states_and_logits_match_pytorch(family):
  name, hf_model, target = family
  ids, mask = _batch(target.config.vocab_size)
  with torch.no_grad():
    ref = hf_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                   output_hidden_states=True)
  out = target.forward(ids, mask, return_hidden_states=True)
  L = target.config.num_layers
  assert out.hidden_states.shape == (L + 1, 2, 11, target.config.hidden_size)
  assert len(ref.hidden_states) == L + 1
  real = mask.astype(bool)
  for i in range(L + 1):
    np.testing.assert_allclose(np.asarray(out.hidden_states[i])[real],
                               ref.hidden_states[i].numpy()[real], atol=1e-4, rtol=1e-4,
                               err_msg=f"{name}: hidden state {i}")
  np.testing.assert_allclose(np.asarray(out.logits)[real], ref.logits.numpy()[real], atol=1e-4,
                             rtol=1e-4, err_msg=f"{name}: logits")


def test_the_memory_efficient_attention_kernel_matches_pytorch_too(family):
  """`with_attention("chunked")`: the forward without [T, T] scores (what TPU's splash and GPU's cuDNN replace
  too) equals HF's model at real positions, every family (Gemma's sliding window included)."""
  name, hf_model, target = family
  chunked = inference.with_attention(target, "chunked")
  assert nnx_attention(chunked) == "chunked" and nnx_attention(target) == "xla"  # auto on CPU: today's path
  ids, mask = _batch(target.config.vocab_size, seed=3)
  with torch.no_grad():
    ref = hf_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), output_hidden_states=True)
  out = chunked.forward(ids, mask, return_hidden_states=True)
  real = mask.astype(bool)
  for i in range(target.config.num_layers + 1):
    np.testing.assert_allclose(np.asarray(out.hidden_states[i])[real], ref.hidden_states[i].numpy()[real],
                               atol=1e-4, rtol=1e-4, err_msg=f"{name}: hidden state {i}")
  np.testing.assert_allclose(np.asarray(out.logits)[real], ref.logits.numpy()[real], atol=1e-4, rtol=1e-4)
  with pytest.raises(ValueError, match="Unknown attention kernel 'flash'"):
    inference.with_attention(target, "flash")


def test_a_prefill_through_the_kernel_fills_the_cache_the_dense_prefill_fills(family):
  """A prefill into an empty cache given `valid` runs its attention through the target's kernel ("chunked"
  here; splash and cuDNN on accelerators): the same states and cache as the dense prefill over the whole cache,
  and greedy decoding after it (static batch and continuous batching) the same tokens."""
  name, _, target = family
  chunked = inference.with_attention(target, "chunked")
  ids, valid = _batch(target.config.vocab_size, seed=5)
  b, t = ids.shape
  pos = np.broadcast_to(np.arange(t), (b, t))
  outs = [inference.cached_forward(m.graphdef, m.params, ids, pos, causal_mask(jnp.asarray(valid)),
                                   KVCache.zeros(target.config, b, 32), jnp.zeros(b, jnp.int32),
                                   return_hidden_states=True, valid=jnp.asarray(valid))
          for m in (target, chunked)]
  real = valid.astype(bool)
  np.testing.assert_allclose(np.asarray(outs[1].hidden_states)[:, real], np.asarray(outs[0].hidden_states)[:, real],
                             atol=1e-5, rtol=1e-5, err_msg=name)
  for dense, kernel in zip(outs[0].cache.keys + outs[0].cache.values, outs[1].cache.keys + outs[1].cache.values):
    np.testing.assert_allclose(np.asarray(kernel)[:, :t][real], np.asarray(dense)[:, :t][real], atol=1e-5,
                               rtol=1e-5, err_msg=name)
  prompts = [ids[0].tolist(), ids[1, :7].tolist()]
  for slots in (0, 1):
    assert (generate(chunked, prompts, 6, ignore_eos=True, slots=slots)
            == generate(target, prompts, 6, ignore_eos=True, slots=slots)), (name, slots)


def nnx_attention(target):
  return inference.nnx.merge(target.graphdef, target.params).attention_impl


def test_cached_decoding_equals_full_forward(family):
  """Prefill part of a ragged batch, then feed the rest one token and three tokens at a time."""
  _, _, target = family
  ids, _ = _batch(target.config.vocab_size, seed=1)
  full = target.forward(ids, return_hidden_states=True)
  c = target.config
  b, t = ids.shape
  cache = KVCache.zeros(c, b, 32)
  lengths = np.array([4, 6], np.int32)  # ragged prefixes
  width = 6
  valid = (np.arange(width)[None] < lengths[:, None]).astype(np.int32)
  pos = np.broadcast_to(np.arange(width), (b, width))
  out = inference.cached_forward(target.graphdef, target.params, ids[:, :width], pos,
                                 causal_mask(jnp.asarray(valid)), cache, jnp.zeros(b, jnp.int32))
  cache = out.cache
  lengths = jnp.asarray(lengths)
  logits, hidden = [], []
  for step in (1, 3, 1):  # single tokens and a 3-token causal chain
    idx = np.asarray(lengths)[:, None] + np.arange(step)[None]
    toks = np.take_along_axis(ids, idx, axis=1)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((step, step), bool)), (b, step, step))
    o = inference.cached_forward(target.graphdef, target.params, toks, jnp.asarray(idx), mask, cache,
                                 lengths, return_hidden_states=True)
    for r in range(b):
      for j in range(step):
        np.testing.assert_allclose(o.logits[r, j], full.logits[r, idx[r, j]], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(o.hidden_states[:, r, j], full.hidden_states[:, r, idx[r, j]],
                                   atol=1e-4, rtol=1e-4)
    cache, lengths = o.cache, lengths + step


def test_tree_mask_verification_matches_branch_forwards(family):
  """Two branches verified in one call under a tree mask equal each branch's own forward."""
  _, _, target = family
  c = target.config
  prefix = np.array([[5, 9, 13, 17]])
  a, b_ = [21, 22], [31, 32]
  full_a = target.forward(np.concatenate([prefix, [a]], 1)).logits
  full_b = target.forward(np.concatenate([prefix, [b_]], 1)).logits
  cache = KVCache.zeros(c, 1, 16)
  pos = np.arange(4)[None]
  out = inference.cached_forward(target.graphdef, target.params, prefix, pos,
                                 causal_mask(jnp.ones((1, 4), jnp.int32)), cache,
                                 jnp.zeros(1, jnp.int32))
  # Nodes: a0, a1 (child of a0), b0, b1 (child of b0); positions by depth.
  toks = np.array([[a[0], a[1], b_[0], b_[1]]])
  tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], bool)[None]
  o = inference.cached_forward(target.graphdef, target.params, toks, np.array([[4, 5, 4, 5]]),
                               jnp.asarray(tree), out.cache, jnp.array([4]))
  np.testing.assert_allclose(o.logits[0, :2], full_a[0, 4:], atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(o.logits[0, 2:], full_b[0, 4:], atol=1e-4, rtol=1e-4)


def test_bfloat16_runs_close_to_float32(tmp_path):
  hf_reference.save_hf_model("llama", str(tmp_path))
  f32 = layerwave.load_target(str(tmp_path))
  bf16 = layerwave.load_target(str(tmp_path), dtype="bfloat16")
  ids, mask = _batch(f32.config.vocab_size)
  a = np.asarray(f32.forward(ids, mask).logits)
  b = np.asarray(bf16.forward(ids, mask).logits)
  assert jax.tree.leaves(bf16.params)[0].dtype == jnp.bfloat16
  assert np.abs(a - b).max() < 0.1 * np.abs(a).max()


def test_config_reads_both_rope_formats():
  common = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2)
  scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=16)
  old = ModelConfig.from_hf({**common, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3",
                                                                            **scaling}})
  new = ModelConfig.from_hf({**common, "rope_parameters": {"rope_type": "llama3",
                                                            "rope_theta": 5e5, **scaling}})
  legacy = ModelConfig.from_hf({**common, "rope_theta": 5e5, "rope_scaling": {"type": "llama3",
                                                                               **scaling}})
  assert old == new == legacy
  assert old.rope_theta == 5e5 and old.rope_scaling_dict["factor"] == 8.0
  assert old.head_dim == 4 and old.num_kv_heads == 2


def test_old_style_config_json_loads_and_matches(tmp_path):
  """A checkpoint written with rope_theta + rope_scaling (pre-transformers-5) gives the same logits."""
  hf_model = hf_reference.save_hf_model("llama3_rope", str(tmp_path))
  with open(tmp_path / "config.json") as f:
    cfg = json.load(f)
  params = cfg.pop("rope_parameters")
  cfg["rope_theta"] = params.pop("rope_theta")
  cfg["rope_scaling"] = params
  with open(tmp_path / "config.json", "w") as f:
    json.dump(cfg, f)
  target = layerwave.load_target(str(tmp_path))
  assert target.config.rope_scaling_dict["rope_type"] == "llama3"
  ids, mask = _batch(target.config.vocab_size)
  with torch.no_grad():
    ref = hf_model(input_ids=torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(target.forward(ids).logits, ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------
# Bad inputs: one clear error each.

def test_missing_path():
  with pytest.raises(FileNotFoundError, match="not found"):
    layerwave.load_target("./no/such/checkpoint")


def test_directory_without_config(tmp_path):
  with pytest.raises(FileNotFoundError, match="without config.json"):
    layerwave.load_target(str(tmp_path))


def test_unsupported_model_type(tmp_path):
  hf_reference.save_hf_model("llama", str(tmp_path))
  cfg = json.loads((tmp_path / "config.json").read_text())
  cfg["model_type"] = "gpt2"
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match="Unsupported model_type 'gpt2'"):
    layerwave.load_target(str(tmp_path))


def test_sliding_window_and_moe_are_refused():
  base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
              num_attention_heads=2, max_position_embeddings=4096)
  with pytest.raises(ValueError, match="sliding-window"):
    ModelConfig.from_hf({**base, "model_type": "mistral", "sliding_window": 1024})
  with pytest.raises(ValueError, match="mixture-of-experts"):
    ModelConfig.from_hf({**base, "model_type": "llama", "num_local_experts": 8})


@pytest.mark.parametrize("edit,match", [
    ("drop", r"missing tensors: \['model.layers.0.mlp.up_proj.weight'\]"),
    ("extra", r"unexpected tensors: \['model.layers.9.foo.weight'\]"),
    ("shape", r"model.norm.weight has shape \(31,\), expected \(32,\)"),
])
def test_safetensors_mismatch_names_the_tensor(tmp_path, edit, match):
  from safetensors.numpy import load_file, save_file
  hf_reference.save_hf_model("llama", str(tmp_path))
  path = str(tmp_path / "model.safetensors")
  tensors = load_file(path)
  if edit == "drop":
    del tensors["model.layers.0.mlp.up_proj.weight"]
  elif edit == "extra":
    tensors["model.layers.9.foo.weight"] = np.zeros(3, np.float32)
  else:
    tensors["model.norm.weight"] = np.zeros(31, np.float32)
  save_file(tensors, path)
  with pytest.raises(ValueError, match=match):
    layerwave.load_target(str(tmp_path))


def test_unknown_dtype(tmp_path):
  with pytest.raises(ValueError, match="Unknown dtype 'float8'"):
    layerwave.load_target(str(tmp_path), dtype="float8")


def test_forward_rejects_bad_batches(tmp_path):
  hf_reference.save_hf_model("llama", str(tmp_path))
  target = layerwave.load_target(str(tmp_path))
  with pytest.raises(ValueError, match="non-empty"):
    target.forward(np.zeros((1, 0), np.int32))
  with pytest.raises(ValueError, match="Token ids must lie in"):
    target.forward(np.array([[1, 2, 500]]))


# ---------------------------------------------------------------------------------------------------
# Gemma 3: the sliding window in isolation, the configs it refuses, fingerprints of the other families.

def test_window_mask_reads_keys_by_position():
  """Cache-free and cached forms agree with a direct rule over the keys' positions (tree nodes included)."""
  from layerwave.models import kv_cache
  positions = np.array([[0, 1, 2, 3, 4, 5], [3, 4, 5, 5, 6, 6]])
  got = np.asarray(kv_cache.window_mask(jnp.asarray(positions), 3))
  np.testing.assert_array_equal(got, (positions[:, :, None] - positions[:, None, :]) < 3)
  # Against 16 slots: row 0 has 2 committed tokens, row 1 has 3 (slot s holds position s); the new tokens
  # (a chain in row 0, two branches in row 1) follow at slots lengths + i, their positions not their slots.
  lengths = np.array([2, 3])
  new_pos = positions + lengths[:, None]
  got = np.asarray(kv_cache.window_mask(jnp.asarray(new_pos), 3, jnp.asarray(lengths), 16))
  for b in range(2):
    key_pos = list(range(lengths[b])) + list(new_pos[b])
    want = (new_pos[b][:, None] - np.array(key_pos)[None, :]) < 3
    np.testing.assert_array_equal(got[b, :, :len(key_pos)], want)


def test_gemma_deep_tree_verification_honours_the_window(tmp_path):
  """Two branches of 6 nodes (window 4): a node reads only its own ancestors within the window, by position."""
  hf_reference.save_hf_model("gemma3", str(tmp_path))
  target = layerwave.load_target(str(tmp_path))
  prefix = np.array([[5, 9, 13, 17, 19]])
  a, b_ = [21, 22, 23, 24, 25, 26], [31, 32, 33, 34, 35, 36]
  full_a = target.forward(np.concatenate([prefix, [a]], 1)).logits
  full_b = target.forward(np.concatenate([prefix, [b_]], 1)).logits
  cache = KVCache.zeros(target.config, 1, 24)
  out = inference.cached_forward(target.graphdef, target.params, prefix, np.arange(5)[None],
                                 causal_mask(jnp.ones((1, 5), jnp.int32)), cache, jnp.zeros(1, jnp.int32))
  chain = np.tril(np.ones((6, 6), bool))
  tree = np.zeros((12, 12), bool)
  tree[:6, :6] = tree[6:, 6:] = chain
  pos = np.concatenate([np.arange(5, 11), np.arange(5, 11)])[None]
  o = inference.cached_forward(target.graphdef, target.params, np.array([a + b_]), pos,
                               jnp.asarray(tree[None]), out.cache, jnp.array([5]))
  np.testing.assert_allclose(o.logits[0, :6], full_a[0, 5:], atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(o.logits[0, 6:], full_b[0, 5:], atol=1e-4, rtol=1e-4)


GEMMA = dict(model_type="gemma3_text", vocab_size=10, hidden_size=8, intermediate_size=16,
             num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
             max_position_embeddings=64, sliding_window=8)


def test_gemma_config_defaults_follow_the_sliding_window_pattern():
  c = ModelConfig.from_hf({**GEMMA, "rope_theta": 1e6, "rope_local_base_freq": 1e4})
  assert c.gemma and c.qk_norm and c.tie_word_embeddings is False
  assert [c.is_sliding(i) for i in range(6)] == [True] * 5 + [False]
  assert (c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar) == (1e6, 1e4, 4.0)
  assert c.final_logit_softcapping is None and c.sliding_window == 8


@pytest.mark.parametrize("model_type,match", [
    ("gemma", "Unsupported model_type 'gemma': Gemma 1"),
    ("gemma2", "Unsupported model_type 'gemma2': Gemma 2"),
    ("gemma3", "Gemma 3 multimodal checkpoint"),
    ("gemma3n", "Gemma 3n"),
])
def test_other_gemma_families_are_refused_by_name(model_type, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_hf({**GEMMA, "model_type": model_type})


def test_gemma3_multimodal_checkpoint_directory_is_refused(tmp_path):
  transformers = pytest.importorskip("transformers")
  config = transformers.Gemma3Config(text_config={**GEMMA, "model_type": "gemma3_text"},
                                     vision_config=dict(hidden_size=8, intermediate_size=16,
                                                        num_hidden_layers=1, num_attention_heads=2))
  config.save_pretrained(str(tmp_path))
  with pytest.raises(ValueError, match="Gemma 3 multimodal checkpoint"):
    layerwave.load_target(str(tmp_path))


@pytest.mark.parametrize("edit,match", [
    (dict(sliding_window=65), r"sliding_window 65 is longer than .* \(max_position_embeddings 64\)"),
    (dict(sliding_window=None), "has sliding layers but sliding_window=None"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(hidden_activation="relu"), "GELU with the tanh approximation"),
    (dict(layer_types=["sliding_attention"] * 5), "layer_types must name 6 blocks"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
])
def test_gemma_configs_the_target_cannot_honour_are_refused(edit, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_hf({**GEMMA, **edit})


def test_llama_identity_has_only_the_llama_fields():
  """Fingerprints of existing (Llama-family) targets, stores and distilled sets do not move with Gemma."""
  llama = ModelConfig("llama", 97, 32, 48, 6, 4, 2, 8)
  assert set(llama.identity()) == {
      "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
      "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
      "tie_word_embeddings", "attention_bias", "qk_norm", "bos_token_id", "eos_token_ids"}
  gemma = ModelConfig.from_hf(GEMMA)
  assert {"sliding_window", "layer_types", "rope_local_theta"} <= set(gemma.identity())


def test_gemma_generate_equals_transformers_generate(tmp_path):
  """Greedy decoding past the window (4) through local and global blocks, tokens as HF's generate."""
  hf_model = hf_reference.save_hf_model("gemma3", str(tmp_path), seed=2)
  target = layerwave.load_target(str(tmp_path))
  prompts = [[5, 17, 33, 8, 41, 50, 51], [12, 9]]
  ours = layerwave.generate(target, prompts, max_new_tokens=10, ignore_eos=True)
  for prompt, got in zip(prompts, ours):
    with torch.no_grad():
      ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10,
                              do_sample=False, pad_token_id=0)
    assert got == ref[0, len(prompt):].tolist()
