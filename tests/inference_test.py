"""layerwave.inference: the Target's calls on a tiny random NNX target, prompt padding, dtypes, the cache."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layerwave import inference
from layerwave import sharding
from layerwave.models.config import ModelConfig
from layerwave.models.kv_cache import causal_mask
from layerwave.models.target import Transformer

CONFIG = ModelConfig(model_type="llama", vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=4, max_position_embeddings=64, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def target():
  graphdef, params = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
  return inference.Target(config=CONFIG, graphdef=graphdef, params=params, tokenizer=None,
                          mesh=sharding.make_mesh())


def test_positions_count_real_tokens_for_left_and_right_padding():
  mask = jnp.array([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(inference.positions_from_mask(mask),
                                [[0, 1, 2, 2, 2], [0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])


def test_padding_changes_nothing_at_real_positions(target):
  ids = np.array([[5, 9, 13, 7]])
  plain = target.forward(ids, return_hidden_states=True)
  left = target.forward(np.array([[0, 0, 5, 9, 13, 7]]), np.array([[0, 0, 1, 1, 1, 1]]),
                        return_hidden_states=True)
  right = target.forward(np.array([[5, 9, 13, 7, 0, 0]]), np.array([[1, 1, 1, 1, 0, 0]]))
  assert plain.logits.shape == (1, 4, 40) and plain.hidden_states.shape == (3, 1, 4, 16)
  np.testing.assert_allclose(left.logits[:, 2:], plain.logits, atol=1e-5)
  np.testing.assert_allclose(left.hidden_states[:, :, 2:], plain.hidden_states, atol=1e-5)
  np.testing.assert_allclose(right.logits[:, :4], plain.logits, atol=1e-5)


def test_cached_forward_in_two_chunks_equals_one_forward(target):
  ids = jnp.array([[3, 8, 1, 12, 30, 4, 9]])
  full = inference.forward_fn(target.graphdef, target.params, ids, jnp.ones_like(ids))
  cache = inference.new_cache(CONFIG, 1, 16, jnp.float32, target.mesh)
  lengths = jnp.zeros((1,), jnp.int32)
  logits = []
  for chunk in (ids[:, :4], ids[:, 4:]):
    t = chunk.shape[1]
    out = inference.cached_forward(target.graphdef, target.params, chunk, lengths[:, None] + jnp.arange(t),
                                   causal_mask(jnp.ones_like(chunk)), cache, lengths)
    cache, lengths = out.cache, lengths + t
    logits.append(out.logits)
  np.testing.assert_allclose(jnp.concatenate(logits, axis=1), full.logits, atol=1e-5)


def test_new_cache_shape_dtype_and_placement(target):
  cache = jax.jit(lambda: inference.new_cache(CONFIG, 2, 8, jnp.bfloat16, target.mesh))()
  assert len(cache.keys) == len(cache.values) == CONFIG.num_layers
  assert cache.keys[0].shape == (2, 8, 2, 4) and cache.keys[0].dtype == jnp.bfloat16 and cache.slots == 8
  assert cache.keys[0].sharding.is_equivalent_to(sharding.batch_sharding(target.mesh, 4), 4)


@pytest.mark.parametrize("chunk", [1, 5, 21, 100])
def test_over_positions_equals_the_function_on_all_positions(target, chunk):
  """Blocks of any size (a remainder, exact, all, more than all) give `fn` of every position, pytree leaves
  with trailing axes reshaped to [B, T, ...]; the LM head's argmax bit for bit."""
  h = jax.random.normal(jax.random.key(0), (3, 7, 16))
  model = target.model
  fn = lambda x: {"top1": jnp.argmax(model.logits(x), -1), "two": jnp.stack([x.sum(-1), x.max(-1)], -1)}  # noqa: E731
  got = inference.over_positions(h, fn, chunk)
  full = fn(h.reshape(21, 16))
  np.testing.assert_array_equal(got["top1"], np.asarray(full["top1"]).reshape(3, 7))
  np.testing.assert_allclose(got["two"], np.asarray(full["two"]).reshape(3, 7, 2), rtol=1e-6)
  assert got["two"].shape == (3, 7, 2)


def test_pad_prompts():
  tokens, lengths, n = inference.pad_prompts([[4, 5, 6], [7]], vocab_size=40, multiple=4)
  assert n == 2 and tokens.shape == (4, 16) and tokens.dtype == np.int32
  np.testing.assert_array_equal(lengths, [3, 1, 3, 3])  # filler rows repeat the first prompt
  np.testing.assert_array_equal(tokens[:, :3], [[4, 5, 6], [7, 0, 0], [4, 5, 6], [4, 5, 6]])
  assert not tokens[:, 3:].any()
  wide, _, _ = inference.pad_prompts(np.array([[1, 2]]), 40, 1, min_width=17)
  assert wide.shape == (1, 32)  # min_width, rounded up to the bucket
  with pytest.raises(ValueError, match="Prompt 1 is empty"):
    inference.pad_prompts([[1], []], 40, 1)
  with pytest.raises(ValueError, match="list of token-id lists"):
    inference.pad_prompts([1, 2], 40, 1)
  with pytest.raises(ValueError, match=r"Token ids must lie in \[0, 40\)"):
    inference.pad_prompts([[1, 40]], 40, 1)


def test_parse_dtype():
  assert inference.parse_dtype("bfloat16") is jnp.bfloat16
  assert inference.parse_dtype(np.float32) is jnp.float32 and inference.parse_dtype(jnp.float16) is jnp.float16
  for bad in ("float8", np.int32):
    with pytest.raises(ValueError, match="Unknown dtype"):
      inference.parse_dtype(bad)


def test_eos_ids_join_the_config_and_the_tokenizer(target):
  assert target.eos_token_ids == (2,)
  with_tokenizer = inference.Target(target.config, target.graphdef, target.params,
                                    types.SimpleNamespace(eos_token_id=7), target.mesh)
  assert with_tokenizer.eos_token_ids == (2, 7)
  assert isinstance(target.model, Transformer)


def test_a_checkpoint_without_tokenizer_files_loads_none(tmp_path):
  assert inference._load_tokenizer(str(tmp_path)) is None  # pylint: disable=protected-access


def test_target_fingerprint_changes_with_any_weight_and_the_dtype(target):
  same = inference.target_fingerprint(target)
  assert same == inference.target_fingerprint(dataclasses.replace(target)) and len(same) == 64
  params = jax.tree.map(lambda x: x, target.params)
  params["norm"]["scale"][...] = params["norm"]["scale"][...].at[3].add(1e-3)
  assert inference.target_fingerprint(dataclasses.replace(target, params=params)) != same
  half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), target.params)
  assert inference.target_fingerprint(dataclasses.replace(target, params=half)) != same


def test_with_dtype_equals_loading_in_that_dtype(tiny_chat_target_dir):
  f32 = inference.load_target(tiny_chat_target_dir)
  loaded = inference.load_target(tiny_chat_target_dir, dtype="bfloat16")
  cast = inference.with_dtype(f32, "bfloat16")
  assert inference.compute_dtype(cast.graphdef, cast.params) == jnp.bfloat16
  assert cast.graphdef == loaded.graphdef and cast.config is f32.config and cast.tokenizer is f32.tokenizer
  same = jax.tree.map(lambda a, b: a.dtype == b.dtype and bool(jnp.all(a == b)), cast.params, loaded.params)
  assert all(jax.tree.leaves(same))
  assert inference.target_fingerprint(cast) == inference.target_fingerprint(loaded)
  ids = np.array([[5, 9, 13, 7, 21, 3]])
  np.testing.assert_array_equal(cast.forward(ids).logits, loaded.forward(ids).logits)
  assert inference.with_dtype(f32, "float32") is f32 and inference.with_dtype(loaded, jnp.bfloat16) is loaded
  with pytest.raises(ValueError, match="Cannot cast a bfloat16 target to float32: load it in float32"):
    inference.with_dtype(loaded, "float32")
  with pytest.raises(ValueError, match="Unknown dtype"):
    inference.with_dtype(f32, "int8")
