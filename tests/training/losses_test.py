"""The TTT loss's accuracy counts an out-of-vocabulary target as a miss (checked against plain numpy); its
targets from the full logits (online) equal those recomputed from h_L, the head rows and the argmax (offline)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layerwave.models.config import ModelConfig
from layerwave.models.draft import Draft, DraftConfig
from layerwave.models.kv_cache import causal_mask
from layerwave.models.target import Transformer
from layerwave.training import losses

CONFIG = ModelConfig(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48,
                     num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                     max_position_embeddings=128)
STEPS = 3


def setup(v_d=12, b=3, t=20, seed=0):
  target = Transformer(CONFIG, rngs=nnx.Rngs(seed))
  draft = Draft(DraftConfig.from_target(CONFIG, (1, 2), draft_vocab_size=v_d),
                embedding=target.embed_tokens.embedding[...], rngs=nnx.Rngs(seed + 1))
  rng = np.random.default_rng(seed)
  ids = np.sort(rng.choice(CONFIG.vocab_size, v_d, replace=False))
  draft.d2t[...] = jnp.asarray(ids - np.arange(v_d), jnp.int32)
  draft.t2d[...] = jnp.zeros(CONFIG.vocab_size, bool).at[ids].set(True)
  tokens = rng.integers(0, CONFIG.vocab_size, (b, t)).astype(np.int32)
  attn = np.ones((b, t), np.int32)
  attn[1, 14:] = 0
  loss_mask = attn.copy()
  loss_mask[2, :6] = 0
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  out = target(jnp.asarray(tokens), positions, causal_mask(jnp.asarray(attn)),
               return_hidden_states=True, hidden_layers=(1, 2))
  # Sharpen the target so that its argmax is inside the draft vocabulary at some positions only.
  logits = out.logits * 40.0
  return draft, out.hidden_states, logits, tokens, attn, loss_mask


def draft_argmax(draft, features, tokens, attn):
  """`[N, B, T]` target ids of the draft's top-1 at TTT step j, run step by step outside the loss."""
  t = tokens.shape[1]
  padded = np.pad(tokens, ((0, 0), (0, STEPS + 1)))
  positions = jnp.broadcast_to(jnp.arange(t), tokens.shape)
  diag = draft.ttt_init(tokens.shape[0], t, STEPS)
  h, base, out = draft.fuse(features), None, []
  for j in range(STEPS):
    h, logits, new_base, diag = draft.ttt_step(h, jnp.asarray(padded[:, j + 1:j + 1 + t]),
                                               positions + j, jnp.asarray(j), base, diag,
                                               jnp.asarray(attn))
    base = new_base if base is None else base
    out.append(np.asarray(draft.draft_to_target(jnp.argmax(logits, -1))))
  return np.stack(out)


def test_accuracy_counts_out_of_vocabulary_targets_as_misses():
  draft, features, logits, tokens, attn, loss_mask = setup()
  _, m = losses.ttt_loss(draft, features, *losses.target_targets(logits, draft), jnp.asarray(tokens),
                         jnp.asarray(attn), jnp.asarray(loss_mask), steps=STEPS)
  pred = draft_argmax(draft, features, tokens, attn)
  full_argmax = np.argmax(np.asarray(logits, np.float64), -1)  # [B, T]
  in_vocab = np.asarray(draft.t2d[...])[full_argmax]
  predictable = (loss_mask * attn).astype(bool)
  b, t = tokens.shape
  for j in range(STEPS):
    hits = counted = inv = 0
    for row in range(b):
      for pos in range(t - j - 2):
        if not predictable[row, pos + j + 2]:
          continue
        target_token = full_argmax[row, pos + j + 1]  # the target's top-1 for x_{t+2+j}
        counted += 1
        inv += in_vocab[row, pos + j + 1]
        hits += pred[j, row, pos] == target_token
    assert 0 < inv < counted  # both kinds of position occur
    np.testing.assert_allclose(float(m["acc_j"][j]), hits / counted, rtol=1e-6)
    np.testing.assert_allclose(float(m["acc_in_vocab_j"][j]), hits / inv, rtol=1e-6)
    assert float(m["tokens_j"][j]) == counted and float(m["in_vocab_j"][j]) == inv


def test_simulated_tau_is_one_plus_the_sum_of_cumulative_products():
  acc = np.array([0.6, 0.5, 0.25])
  np.testing.assert_allclose(float(losses.simulated_tau(jnp.asarray(acc))), 1 + 0.6 + 0.3 + 0.075,
                             rtol=1e-6)


def test_full_vocabulary_draft_has_equal_accuracies():
  draft, features, logits, tokens, attn, loss_mask = setup(v_d=CONFIG.vocab_size)
  draft.d2t[...] = jnp.zeros(CONFIG.vocab_size, jnp.int32)
  draft.t2d[...] = jnp.ones(CONFIG.vocab_size, bool)
  _, m = losses.ttt_loss(draft, features, *losses.target_targets(logits, draft), jnp.asarray(tokens),
                         jnp.asarray(attn), jnp.asarray(loss_mask), steps=STEPS)
  np.testing.assert_array_equal(np.asarray(m["acc_j"]), np.asarray(m["acc_in_vocab_j"]))
  jax.block_until_ready(m)


def test_offline_targets_equal_the_targets_of_the_full_logits():
  target = Transformer(CONFIG, rngs=nnx.Rngs(3))
  draft, *_ = setup()
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (2, 9)), jnp.int32)
  out = target(tokens, jnp.broadcast_to(jnp.arange(9), (2, 9)), causal_mask(jnp.ones((2, 9), jnp.int32)))
  online = losses.target_targets(out.logits, draft)
  head = target.embed_tokens.embedding[...].T if CONFIG.tie_word_embeddings else target.lm_head.kernel[...]
  rows = jnp.take(head, draft.draft_token_ids(), axis=1)  # [D, V_d]
  offline = losses.offline_targets(out.last_hidden, rows, jnp.argmax(out.logits, -1), draft)
  np.testing.assert_allclose(np.asarray(offline[0]), np.asarray(online[0]), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(offline[1]), np.asarray(online[1]))
  assert 0 < int(online[1].sum()) < online[1].size  # both in- and out-of-vocabulary argmaxes occur
  # The online step's path: the same targets from h_L alone, the argmax 4 positions at a time.
  computed = losses.online_targets(target, out.last_hidden, draft, chunk=4)
  np.testing.assert_allclose(np.asarray(computed[0]), np.asarray(online[0]), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(computed[1]), np.asarray(online[1]))


def test_blocked_argmax_equals_jnp_argmax_ties_nan_and_infinities_included():
  rng = np.random.default_rng(0)
  x = np.round(rng.normal(size=(5, 7, 2500)) * 2) / 2  # V not a multiple of the block; many ties
  x[0, 0] = -np.inf
  x[1, 2, [7, 1900]] = np.nan
  x[2, 3, 2499] = np.inf
  for block in (1024, 100, 7):
    np.testing.assert_array_equal(np.asarray(losses.argmax(jnp.asarray(x), block)), np.argmax(x, -1))
  np.testing.assert_array_equal(np.asarray(jax.jit(losses.argmax)(jnp.asarray(x))), np.asarray(jnp.argmax(x, -1)))
