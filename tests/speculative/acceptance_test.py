"""What the speculative loop accepts == what the draft was trained to predict, computed independently.

The loop runs the draft against a KV cache it fills itself (prefill, chain, commit of accepted tokens);
training runs the same draft as the unrolled training-time test (TTT) over whole sequences with no cache.
At T = 0 every token the loop emits is the target's greedy token, so along the target's greedy continuation
the two must agree exactly, iteration by iteration:

* chain: with committed length n, the loop accepts m = the number of leading steps j < K at which the TTT
  prediction at position n - 1 (step j predicts x_{n+1+j}) equals the greedy token;
* tree: the accepted path's length is the depth of the deepest node of the tree the draft builds whose whole
  root path matches the greedy tokens, with the draft state rebuilt from scratch (one cached pass over the
  prefix, plain target features) rather than carried through the loop.

Any defect in how the loop feeds or caches the draft (an integer KV cache, a feature off by one position, a
commit of the wrong entries) changes these counts; greedy equality with plain decoding never sees it, since
the target decides every emitted token.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import layerwave
from layerwave import sharding
from layerwave.generate import compute_dtype
from layerwave.models.draft import Draft, DraftConfig
from layerwave.models.kv_cache import KVCache, causal_mask
from layerwave.speculative import acceptance
from layerwave.speculative import tree as tree_lib
from layerwave.training import step as step_lib

from tests.speculative.conftest import PROMPTS

K = 3  # chain length; the draft is trained with K + 1 TTT steps
TREE = dict(method="tree", tree_depth=4, tree_top_k=3, tree_tokens=12)
MAX_NEW = 40


def ttt_trained_draft(target, sequences, steps=300, ttt_steps=K + 1, seed=4) -> Draft:
  """A draft trained by layerwave's own jitted train step (TTT loss) on `sequences`."""
  config = DraftConfig.from_target(target.config, (1, 2, 3), draft_vocab_size=64)
  draft = Draft(config, embedding=target.params["embed_tokens"]["embedding"][...],
                rngs=nnx.Rngs(seed))
  # The 64-token draft vocabulary: the most frequent targets, so some target tokens are out of it.
  counts = np.bincount(np.concatenate([s[1:] for s in sequences]), minlength=config.target_vocab_size)
  ids = np.sort(np.argsort(-counts, kind="stable")[:64])
  draft.d2t[...] = jnp.asarray(ids - np.arange(64), jnp.int32)
  draft.t2d[...] = jnp.zeros(config.target_vocab_size, bool).at[ids].set(True)
  width = max(len(s) for s in sequences)
  batch = {"input_ids": np.zeros((len(sequences), width), np.int32),
           "attention_mask": np.zeros((len(sequences), width), np.int32)}
  for i, s in enumerate(sequences):
    batch["input_ids"][i, :len(s)], batch["attention_mask"][i, :len(s)] = s, 1
  batch["assistant_mask"] = batch["attention_mask"]
  graphdef, params, vocab, embed = step_lib.split_draft(draft)
  optimizer = step_lib.OptimizerSettings(3e-3, 10, steps)
  rep = sharding.replicated(target.mesh)
  state = jax.device_put(step_lib.init_state(params, optimizer), rep)
  batch = jax.device_put(batch, sharding.batch_sharding(target.mesh))
  for _ in range(steps):
    state, _ = step_lib.train_step(state, vocab, embed, target.params, batch, program=step_lib.StepProgram(
        graphdef, step_lib.LossSettings(steps=ttt_steps, decay=0.8, assistant_only=True), optimizer=optimizer,
        target_graphdef=target.graphdef))
  return nnx.merge(graphdef, state.params, vocab, embed)


@pytest.fixture(scope="module")
def setting(llama):
  target = llama[0]
  rng = np.random.default_rng(0)
  # Train on the greedy continuations of half the prompts; evaluate on those and on unseen ones, so
  # that acceptance lengths vary from 0 to K.
  extra = [list(rng.integers(3, 97, n)) for n in (4, 9, 6, 11)]
  prompts = PROMPTS + [[int(t) for t in p] for p in extra]
  continuations = layerwave.generate(target, prompts, MAX_NEW + 2 * K + 2, ignore_eos=True)
  sequences = [np.asarray(p + c, np.int32) for p, c in zip(prompts, continuations)]
  draft = ttt_trained_draft(target, sequences[::2])
  return target, draft, prompts, sequences


def test_chain_acceptance_equals_teacher_forced_prediction(setting):
  target, draft, prompts, sequences = setting
  out, metrics = layerwave.speculative.generate(target, draft, prompts, MAX_NEW, ignore_eos=True,
                                                method="chain", num_draft_tokens=K)
  predictions = acceptance.teacher_forced_predictions(target, draft, sequences, K)
  all_m = []
  for prompt, sequence, got, accepted, preds in zip(prompts, sequences, out, metrics["accept_lengths"],
                                                    predictions):
    assert got == list(sequence[len(prompt):len(prompt) + MAX_NEW])
    assert accepted == acceptance.predicted_chain_acceptance(preds, sequence, len(prompt), K, MAX_NEW)
    all_m += accepted
  # The check means something only if acceptance varies.
  assert min(all_m) == 0 and max(all_m) == K, np.bincount(all_m)


def test_tau_estimates_count_leading_matches():
  sequence = np.arange(20)
  preds = np.stack([sequence[2:], sequence[3:].tolist() + [-1], np.full(18, -1)])  # j: predicts t+2+j
  preds[0, 7] = -1  # at n = 8 the first draft misses
  est = acceptance.tau_estimates(preds, sequence, 5, 3, 8)
  # starts n = 5..11; m(n) = 2 except m(8) = 0.
  assert est["starts"] == 7
  assert est["positional_tau"] == (6 * 3 + 1) / 7
  np.testing.assert_allclose(est["acc"], [6 / 7, 1.0, 0.0])
  assert est["marginal_tau"] == 1 + 6 / 7 + 6 / 7
  assert acceptance.predicted_chain_acceptance(preds, sequence, 5, 3, 8) == [2, 0, 2]
  with pytest.raises(ValueError, match="longer greedy continuation"):
    acceptance.leading_matches(preds, sequence, 18, 3)


def draft_states(target, draft, sequence):
  """The draft run over a whole sequence in one cached pass: h `[T, d]` and the filled cache.

  At committed length n the loop's draft holds positions 0..n-1 of this (causal) pass: slots >= n are
  overwritten or masked when the tree is drafted with lengths = n.
  """
  t = len(sequence) - 1
  tokens = jnp.asarray(sequence)[None]
  feats = target.forward(tokens[:, :t], jnp.ones((1, t), jnp.int32),
                         return_hidden_states=True).hidden_states[np.asarray(draft.config.layer_ids)]
  cache = KVCache.zeros(draft.config.model, 1, t + 64)
  h, _, cache = draft(draft.fuse(feats), tokens[:, 1:], jnp.arange(t)[None],
                      causal_mask(jnp.ones((1, t), jnp.int32)), cache, jnp.zeros((1,), jnp.int32))
  return h[0], cache


@nnx.jit
def _tree_at(draft, h, cache, sequence, n):
  budget = tree_lib.TreeBudget(TREE["tree_depth"], TREE["tree_top_k"], TREE["tree_tokens"])
  return tree_lib.dynamic_tree(draft, sequence[n][None], h[n - 1][None], n[None], cache, budget)


def deepest_match(tree, sequence, n) -> int:
  """Depth of the deepest node whose root path equals the greedy tokens (plain numpy)."""
  ok = np.zeros(len(tree.tokens), bool)
  ok[0] = True
  for i in range(1, len(tree.tokens)):  # parents come before children
    d = tree.depths[i]
    ok[i] = ok[tree.parents[i]] and tree.tokens[i] == sequence[n + d]
  return int(tree.depths[ok].max())


def test_tree_acceptance_equals_deepest_matching_path(setting):
  target, draft, prompts, sequences = setting
  out, metrics = layerwave.speculative.generate(target, draft, prompts, MAX_NEW, ignore_eos=True,
                                                **TREE)
  all_m = []
  for prompt, sequence, got, accepted in zip(prompts, sequences, out, metrics["accept_lengths"]):
    assert got == list(sequence[len(prompt):len(prompt) + MAX_NEW])
    h, cache = draft_states(target, draft, sequence)
    n = len(prompt)
    for m in accepted:
      tree = jax.tree.map(lambda x: np.asarray(x)[0],
                          _tree_at(draft, h, cache, jnp.asarray(sequence), jnp.asarray(n)))
      assert m == deepest_match(tree, sequence, n), n
      n += m + 1
    all_m += accepted
  assert len(set(all_m)) >= 3, np.bincount(all_m)  # acceptance varies: the check means something


def test_caches_take_the_models_compute_dtype(llama):
  """The cache dtype comes from the model, never from a parameter leaf (`d2t` is int32)."""
  target, draft = llama[0], llama[2]
  graphdef, params = nnx.split(draft)
  assert jax.tree.leaves(params)[0].dtype == jnp.int32  # what sized the cache before
  assert nnx.merge(graphdef, params).compute_dtype == jnp.float32
  assert compute_dtype(target.graphdef, target.params) == jnp.float32
  with pytest.raises(TypeError, match="floating dtype"):
    KVCache.zeros(draft.config.model, 1, 8, jnp.int32)
