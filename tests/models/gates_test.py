"""Learned layer gates (layerwave.models.gates) inside the draft's fusion: every gate open is the ungated draft,
training samples are hard-concrete gates, each regulariser counts what the module docstring says, bad settings
are refused."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layerwave.models import gates
from layerwave.models.config import ModelConfig
from layerwave.models.draft import Draft, DraftConfig

TARGET = ModelConfig("llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=6,
                     num_heads=4, num_kv_heads=2, head_dim=8)
DEPTHS = (1, 2, 3, 4, 5)


def _draft(kind=None, k=2, strength=1.0, ids=DEPTHS):
  cfg = DraftConfig.from_target(TARGET, ids, draft_vocab_size=50, fc_norm=True,
                                gates=gates.GateConfig(kind, k=k, strength=strength) if kind else None)
  return Draft(cfg, rngs=nnx.Rngs(0))


def _features(seed=1):
  # Depths at very different scales, as a residual stream's are: the norms bring them to one.
  scales = jnp.array([0.5, 1.0, 4.0, 16.0, 64.0])[:, None, None, None]
  return jax.random.normal(jax.random.key(seed), (len(DEPTHS), 2, 7, 32)) * scales


@pytest.mark.parametrize("kind", gates.KINDS)
def test_every_gate_open_is_the_ungated_draft(kind):
  gated = _draft(kind)
  if kind == "hard_concrete":
    gated.gates.logits[...] = jnp.full((5,), 20.0 / gated.gates.config.lr_scale)  # clip(...) = 1 exactly
  ungated = _draft(None)  # the same seed: the gates draw no random numbers, every other parameter is equal
  np.testing.assert_array_equal(np.asarray(ungated.fc.kernel[...]), np.asarray(gated.fc.kernel[...]))
  feats = _features()
  want = np.asarray(ungated.fuse(feats))
  got = np.asarray(gated.fuse(feats))
  if kind == "softmax":  # n * softmax(0) = 1 up to one rounding
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  else:
    np.testing.assert_array_equal(got, want)


def test_a_closed_gate_removes_its_depth():
  gated = _draft("hard_concrete")
  gated.gates.logits[...] = jnp.array([20.0, -20.0, 20.0, 20.0, 20.0]) / gated.gates.config.lr_scale
  feats = _features()
  moved = feats.at[1].set(jax.random.normal(jax.random.key(9), feats[1].shape))
  np.testing.assert_array_equal(np.asarray(gated.fuse(feats)), np.asarray(gated.fuse(moved)))
  assert not np.array_equal(np.asarray(gated.fuse(feats)), np.asarray(gated.fuse(feats.at[0].multiply(2.0)
                                                                                   + feats[1])))


def test_hard_concrete_samples_in_training_and_is_deterministic_at_evaluation():
  g = gates.LayerGates(gates.GateConfig("hard_concrete", k=2), 5)
  g.logits[...] = jnp.zeros((5,))  # log α = 0: P(open) = sigmoid(β log(ζ/−γ)) ≈ 0.83
  z = np.asarray(g(4000, jnp.asarray(7)))
  assert z.shape == (5, 4000) and z.min() == 0.0 and z.max() == 1.0  # exact zeros and ones happen
  assert 0.0 < ((z > 0) & (z < 1)).mean() < 1.0
  np.testing.assert_allclose((z > 0).mean(), np.asarray(g.values(None, None))[0], atol=0.02)
  assert not np.array_equal(z, np.asarray(g(4000, jnp.asarray(8))))  # each step its own noise
  np.testing.assert_array_equal(z, np.asarray(g(4000, jnp.asarray(7))))
  np.testing.assert_allclose(np.asarray(g(3)), 0.5 * 1.2 - 0.1)  # clip(sigmoid(0) (ζ − γ) + γ)


def test_each_regulariser_counts_what_it_says():
  hc = _draft("hard_concrete", k=2, strength=0.5)
  p_open = 1 / (1 + math.exp(-(gates.INIT_LOG_ALPHA - gates.BETA * math.log(-gates.GAMMA / gates.ZETA))))
  np.testing.assert_allclose(float(hc.gate_penalty()), 0.5 * (5 * p_open - 2), rtol=1e-5)
  hc.gates.logits[...] = jnp.full((5,), -20.0 / hc.gates.config.lr_scale)  # every gate shut: nothing to push
  assert float(hc.gate_penalty()) == 0.0
  sm = _draft("softmax", k=2, strength=0.5)
  np.testing.assert_allclose(float(sm.gate_penalty()), 0.5 * (math.log(5) - math.log(2)), rtol=1e-5)
  gl = _draft("group_lasso", k=2, strength=0.5)
  norms = np.asarray(gl.gate_values())
  np.testing.assert_allclose(norms, np.linalg.norm(np.asarray(gl.fc.kernel[...]).reshape(5, 32, 32), axis=(1, 2)),
                             rtol=1e-5)
  np.testing.assert_allclose(float(gl.gate_penalty()), 0.5 * np.sort(norms)[:3].sum(), rtol=1e-5)


@pytest.mark.parametrize("kind", gates.KINDS)
def test_the_regulariser_pulls_towards_k(kind):
  draft = _draft(kind, k=2)
  if kind == "softmax":  # uniform p is the entropy's maximum, a stationary point: the loss's gradient leaves it
    draft.gates.logits[...] = jax.random.normal(jax.random.key(3), (5,)) * 0.01
  graphdef, params, rest = nnx.split(draft, nnx.Param, ...)
  grads = jax.grad(lambda p: nnx.merge(graphdef, p, rest).gate_penalty())(params)
  step = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
  after = nnx.merge(graphdef, step, rest)
  assert float(after.gate_penalty()) < float(draft.gate_penalty())


def test_bad_gate_settings_are_refused():
  with pytest.raises(ValueError, match=r"gate k=6 is larger than the 5 candidate depths.*gate_k to at most 5"):
    _draft("softmax", k=6)
  with pytest.raises(ValueError, match=r"gates must be one of \['hard_concrete', 'softmax', 'group_lasso'\]"):
    gates.GateConfig("l1")
  with pytest.raises(ValueError, match=r"gated draft normalises every depth.*fc_norm=True"):
    DraftConfig.from_target(TARGET, DEPTHS, draft_vocab_size=50, gates=gates.GateConfig("softmax"))
  with pytest.raises(ValueError, match=r"gate k must be >= 1"):
    gates.GateConfig("softmax", k=0)


def test_config_round_trip_keeps_the_gates_and_an_ungated_record_is_unchanged():
  gated = _draft("group_lasso", k=3, strength=0.02).config
  assert DraftConfig.from_dict(gated.to_dict()) == gated
  plain = DraftConfig.from_target(TARGET, (2, 3, 5), draft_vocab_size=50)
  assert "gates" not in plain.to_dict() and DraftConfig.from_dict(plain.to_dict()) == plain
