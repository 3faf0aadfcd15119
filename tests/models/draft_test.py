"""The EAGLE-3 draft: shapes, the training-time-test attention pattern, cached decoding, configs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layerwave.models import layers
from layerwave.models.config import ModelConfig
from layerwave.models.draft import (Draft, DraftConfig, ttt_attend, ttt_reference_mask,
                                    validate_layer_ids)
from layerwave.models.kv_cache import KVCache

TARGET = ModelConfig("llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=6,
                     num_heads=4, num_kv_heads=2, head_dim=8)


def _draft(**kw):
  return Draft(DraftConfig.from_target(TARGET, (2, 3, 5), draft_vocab_size=50, **kw),
               rngs=nnx.Rngs(0))


def test_shapes_via_eval_shape():
  cfg = DraftConfig.from_target(TARGET, (1, 3, 5), draft_vocab_size=40, num_layers=2)
  abstract = nnx.eval_shape(lambda: Draft(cfg, rngs=nnx.Rngs(0)))
  assert abstract.fc.kernel.shape == (3 * 32, 32)
  assert abstract.midlayer.self_attn.q_proj.kernel.shape == (64, 32)  # reads 2d
  assert abstract.midlayer.self_attn.k_proj.kernel.shape == (64, 16)
  assert abstract.lm_head.kernel.shape == (32, 40)
  assert abstract.d2t.shape == (40,) and abstract.t2d.shape == (97,)
  assert len(abstract.extra_layers) == 1


def test_ttt_attention_equals_explicit_mask():
  rng = np.random.default_rng(0)
  n, b, t, h, kv, dh = 4, 2, 5, 4, 2, 8
  q = rng.normal(size=(n, b, t, h, dh)).astype(np.float32)
  k = rng.normal(size=(n, b, t, kv, dh)).astype(np.float32)
  v = rng.normal(size=(n, b, t, kv, dh)).astype(np.float32)
  mask = ttt_reference_mask(t, n)
  # Reference: plain attention over every step's keys, flattened to (step, position).
  kf = np.repeat(k.transpose(1, 0, 2, 3, 4).reshape(b, n * t, kv, dh), h // kv, axis=2)
  vf = np.repeat(v.transpose(1, 0, 2, 3, 4).reshape(b, n * t, kv, dh), h // kv, axis=2)
  causal = jnp.ones((b, t, t), bool) & jnp.tril(jnp.ones((t, t), bool))
  for j in range(n):
    got = ttt_attend(q[j], k[0], v[0], causal, k[1:], v[1:], jnp.arange(n - 1) < j)
    rows = mask[j * t:(j + 1) * t]
    s = np.einsum("bthd,bshd->bhts", q[j].astype(np.float64), kf) / np.sqrt(dh)
    s = np.where(rows[None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("bhts,bshd->bthd", p, vf)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_ttt_attention_in_query_blocks_equals_one_block():
  rng = np.random.default_rng(3)
  n, b, t, h, kv, dh = 3, 2, 16, 4, 2, 8
  q = jnp.asarray(rng.normal(size=(b, t, h, dh)), jnp.float32)
  k0, v0 = (jnp.asarray(rng.normal(size=(b, t, kv, dh)), jnp.float32) for _ in range(2))
  kd, vd = (jnp.asarray(rng.normal(size=(n - 1, b, t, kv, dh)), jnp.float32) for _ in range(2))
  valid = jnp.asarray([[1] * t, [1] * 11 + [0] * 5], bool)
  causal = jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]
  diag = jnp.arange(n - 1) < 2

  def loss(q, k0, v0, kd, vd, block):
    return jnp.sum(jnp.sin(ttt_attend(q, k0, v0, causal, kd, vd, diag, block)))

  whole = ttt_attend(q, k0, v0, causal, kd, vd, diag)
  for block in (4, 8):
    np.testing.assert_allclose(ttt_attend(q, k0, v0, causal, kd, vd, diag, block), whole, atol=1e-6)
    got = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k0, v0, kd, vd, block)
    want = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k0, v0, kd, vd, None)
    for a, w in zip(got, want):
      np.testing.assert_allclose(a, w, atol=1e-5)
  # A length the block does not divide runs as one block.
  np.testing.assert_array_equal(ttt_attend(q, k0, v0, causal, kd, vd, diag, 5), whole)


def test_ttt_step_zero_equals_cached_decoding():
  draft = _draft()
  rng = np.random.default_rng(1)
  feats = jnp.asarray(rng.normal(size=(3, 2, 6, 32)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, 97, (2, 6)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
  g = draft.fuse(feats)
  h, logits, _, _ = draft.ttt_step(g, tokens, pos, jnp.asarray(0), None, draft.ttt_init(2, 6, 3),
                                   jnp.ones((2, 6)))
  cache = KVCache.zeros(draft.config.model, 2, 8)
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((6, 6), bool)), (2, 6, 6))
  h2, logits2, _ = draft(g, tokens, pos, mask, cache, jnp.zeros(2, jnp.int32))
  np.testing.assert_allclose(h, h2, atol=1e-5)
  np.testing.assert_allclose(logits, logits2, atol=1e-4)


def test_chain_step_reads_its_own_feature_like_ttt():
  """Decoding one chained position against the cache equals TTT step 1 at that position."""
  draft = _draft()
  rng = np.random.default_rng(2)
  t = 5
  feats = jnp.asarray(rng.normal(size=(3, 1, t, 32)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, 97, (1, t + 1)), jnp.int32)
  pos = jnp.arange(t)[None]
  g = draft.fuse(feats)
  diag = draft.ttt_init(1, t, 2)
  h0, _, base, diag = draft.ttt_step(g, tokens[:, :t], pos, jnp.asarray(0), None, diag,
                                     jnp.ones((1, t)))
  h1, logits1, _, _ = draft.ttt_step(h0, tokens[:, 1:], pos + 1, jnp.asarray(1), base, diag,
                                     jnp.ones((1, t)))
  # Decode: prefix positions 0..t-1 (step 0), then position t-1's chained step at rope t.
  cache = KVCache.zeros(draft.config.model, 1, 16)
  mask = jnp.tril(jnp.ones((t, t), bool))[None]
  h_pre, _, cache = draft(g, tokens[:, :t], pos, mask, cache, jnp.zeros(1, jnp.int32))
  h_next, logits_next, _ = draft(h_pre[:, -1:], tokens[:, t:], jnp.array([[t]]),
                                 jnp.ones((1, 1, 1), bool), cache, jnp.array([t]))
  np.testing.assert_allclose(h_next[0, 0], h1[0, -1], atol=1e-5)
  np.testing.assert_allclose(logits_next[0, 0], logits1[0, -1], atol=1e-4)


def test_vocab_maps_and_token_ids():
  draft = _draft()
  ids = np.array(sorted(np.random.default_rng(0).choice(97, 50, replace=False)))
  draft.d2t[...] = jnp.asarray(ids - np.arange(50), jnp.int32)
  draft.t2d[...] = jnp.zeros(97, bool).at[ids].set(True)
  np.testing.assert_array_equal(draft.draft_token_ids(), ids)
  np.testing.assert_array_equal(draft.draft_to_target(jnp.arange(50)), ids)


def test_config_round_trip_and_errors():
  cfg = DraftConfig.from_target(
      ModelConfig("llama", 97, 32, 48, 6, 4, 2, 8, rope_scaling=(("factor", 2.0),
                                                                  ("rope_type", "linear"))),
      (2, 3), draft_vocab_size=50)
  assert DraftConfig.from_dict(cfg.to_dict()) == cfg
  with pytest.raises(ValueError, match=r"draft_vocab_size 200 must be in \[1, 97\]"):
    DraftConfig.from_target(TARGET, (1, 2), draft_vocab_size=200)
  with pytest.raises(ValueError, match="out of range"):
    validate_layer_ids((1, 7), 6)
  with pytest.raises(ValueError, match="sorted and unique"):
    validate_layer_ids((3, 3), 6)
  other = ModelConfig("llama", 97, 64, 48, 6, 4, 2, 16)
  with pytest.raises(ValueError, match="trained for a target"):
    cfg.check_target(other)


def test_draft_over_a_gemma_target_is_llama_style_and_smollm2_drafts_are_refused():
  gemma = ModelConfig.from_hf(dict(model_type="gemma3_text", vocab_size=262144, hidden_size=640,
                                   intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                                   num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                                   sliding_window=512, rope_theta=1e6, rope_local_base_freq=1e4))
  cfg = DraftConfig.from_target(gemma, (2, 9, 15), draft_vocab_size=32000)
  m = cfg.model
  assert (m.model_type, m.sliding_window, m.layer_types, m.query_pre_attn_scalar) == ("llama", None, None, None)
  assert not m.gemma and not m.qk_norm and m.rope_theta == 1e6 and m.hidden_size == 640
  assert DraftConfig.from_dict(cfg.to_dict()) == cfg
  abstract = nnx.eval_shape(lambda: Draft(cfg, rngs=nnx.Rngs(0)))
  assert abstract.fc.kernel.shape == (3 * 640, 640)
  smollm2 = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, tie_word_embeddings=True)
  smol_draft = DraftConfig.from_target(smollm2, (2, 15, 27), draft_vocab_size=8192)
  with pytest.raises(ValueError, match=r"\(L, D, V\) = \(30, 576, 49152\).*has \(18, 640, 262144\)"):
    smol_draft.check_target(gemma)
