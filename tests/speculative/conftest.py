"""Fixtures for the speculative tests: tiny random targets and drafts for them, built once per session.

* `llama`: the tiny Hugging Face-style Llama of `tests/models/hf_reference.py` (V = 97, L = 3), loaded
  through `layerwave.load_target`, with an untrained draft and a draft overfit to its greedy continuations
  of `PROMPTS` (a stand-in for a trained draft: it accepts often, so long accepted paths are exercised).
* `gemma`: the tiny Gemma 3 of the same module (window 4, local and global blocks), with a draft overfit the
  same way: decoding runs far past the window, through verification of chains and trees.
* `tiny_vocab`: an 8-token target built directly in NNX, for distribution tests with exact probabilities.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import layerwave
from layerwave import sharding
from layerwave.inference import Target
from layerwave.models.config import ModelConfig
from layerwave.models.draft import Draft, DraftConfig
from layerwave.models.kv_cache import KVCache, causal_mask
from layerwave.models.target import Transformer

PROMPTS = [[5, 17, 33, 8, 41], [12, 9], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74,
                                          75, 76, 77], [40, 2, 7]]


def make_draft(target: Target, layer_ids, seed: int = 0) -> Draft:
  config = DraftConfig.from_target(target.config, layer_ids,
                                   draft_vocab_size=target.config.vocab_size)
  return Draft(config, embedding=target.params["embed_tokens"]["embedding"][...],
               rngs=nnx.Rngs(seed))


def overfit_draft(target: Target, draft: Draft, sequences, steps: int = 300) -> Draft:
  """Trains the draft (first draft step only) to predict x_{t+2} from the target's features at t."""
  width = max(len(s) for s in sequences)
  tokens = np.zeros((len(sequences), width), np.int32)
  valid = np.zeros_like(tokens)
  for i, s in enumerate(sequences):
    tokens[i, :len(s)], valid[i, :len(s)] = s, 1
  feats = target.forward(tokens, valid, return_hidden_states=True).hidden_states
  feats = feats[np.asarray(draft.config.layer_ids)][:, :, :-1]  # [k, B, T-1, D]
  inputs, labels = tokens[:, 1:], np.pad(tokens[:, 2:], ((0, 0), (0, 1)))
  weight = np.pad(valid[:, 2:], ((0, 0), (0, 1))).astype(np.float32)
  b, t = inputs.shape
  mask = causal_mask(jnp.asarray(valid[:, 1:]))
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  graphdef, params, rest = nnx.split(draft, nnx.Param, ...)
  tx = optax.adam(1e-2)

  def loss_fn(p):
    d = nnx.merge(graphdef, p, rest)
    cache = KVCache.zeros(d.config.model, b, t)
    _, logits, _ = d(d.fuse(feats), inputs, positions, mask, cache, jnp.zeros((b,), jnp.int32))
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(ce * weight) / jnp.sum(weight)

  @jax.jit
  def train(p):
    def step(carry, _):
      p, s = carry
      grads = jax.grad(loss_fn)(p)
      updates, s = tx.update(grads, s, p)
      return (optax.apply_updates(p, updates), s), None
    return jax.lax.scan(step, (p, tx.init(p)), None, length=steps)[0][0]

  return nnx.merge(graphdef, train(params), rest)


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
  hf_reference = pytest.importorskip("tests.models.hf_reference")
  directory = str(tmp_path_factory.mktemp("llama"))
  hf_reference.save_hf_model("llama", directory, seed=3)
  target = layerwave.load_target(directory)
  untrained = make_draft(target, (1, 2, 3))
  continuations = layerwave.generate(target, PROMPTS, 40, ignore_eos=True)
  trained = overfit_draft(target, make_draft(target, (1, 2, 3), seed=1),
                          [p + c for p, c in zip(PROMPTS, continuations)])
  return target, untrained, trained


@pytest.fixture(scope="session")
def gemma(tmp_path_factory):
  hf_reference = pytest.importorskip("tests.models.hf_reference")
  directory = str(tmp_path_factory.mktemp("gemma3"))
  hf_reference.save_hf_model("gemma3", directory, seed=3)
  target = layerwave.load_target(directory)
  continuations = layerwave.generate(target, PROMPTS, 40, ignore_eos=True)
  trained = overfit_draft(target, make_draft(target, (1, 2, 3), seed=1),
                          [p + c for p, c in zip(PROMPTS, continuations)])
  return target, trained


@pytest.fixture(scope="session")
def tiny_vocab():
  config = ModelConfig(model_type="llama", vocab_size=8, hidden_size=16, intermediate_size=32,
                       num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                       max_position_embeddings=64)
  graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(7)))
  target = Target(config=config, graphdef=graphdef, params=params, tokenizer=None,
                  mesh=sharding.make_mesh())
  return target, make_draft(target, (0, 1, 2), seed=2)
