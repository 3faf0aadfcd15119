"""Continuous batching: results independent of the schedule, rows that stop early, bounded attention, bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import layerwave
from layerwave import continuous
from layerwave.data import chat
from layerwave.inference import cached_forward
from layerwave.models import hub
from layerwave.models.kv_cache import KVCache, causal_mask

QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn leaves falling on a quiet pond.",
             "2+2?", "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name.",
             "Name a prime number.", "List three uses of a paperclip that are not holding paper together.",
             "Hi", "Translate 'good morning' into Spanish and French."]


@pytest.fixture(scope="module")
def smol():
  return layerwave.load_target(hub.resolve("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def prompts(smol):
  return [chat.encode_prompt(smol.tokenizer, [{"role": "user", "content": q}]).tolist() for q in QUESTIONS]


@pytest.fixture(scope="module")
def tiny(tiny_chat_target_dir):
  return layerwave.load_target(tiny_chat_target_dir)


# The same property on the real checkpoint; by default the tiny chat target covers it (rows that leave at EOS
# or a loop and take the next prompt: tests/data/distill_test.py's continuous tests, and the tests below).
@pytest.mark.slow
def test_real_smollm2_greedy_equals_each_prompt_alone(smol, prompts):
  assert len({len(p) for p in prompts}) > 4  # varied lengths: several prefill widths and read bounds
  alone = [layerwave.generate(smol, [p], 40)[0] for p in prompts]
  got, stats = layerwave.generate(smol, prompts, 40, slots=3, chunk_steps=8, return_stats=True)
  assert got == alone
  assert stats["finished"] == len(prompts) and stats["prefills"] > 1  # rows were refilled
  assert any(a[-1] in smol.eos_token_ids for a in alone)  # some rows ended at EOS, and their row was reused


def test_sampled_streams_depend_on_the_prompt_not_the_schedule(tiny):
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 500, size=int(n)).tolist() for n in rng.integers(2, 40, size=7)]
  a = layerwave.generate(tiny, prompts, 20, slots=2, temperature=1.0, seed=5, chunk_steps=3)
  b = layerwave.generate(tiny, prompts, 20, slots=6, temperature=1.0, seed=5, chunk_steps=7)
  c = layerwave.generate(tiny, prompts, 20, slots=6, temperature=1.0, seed=6, chunk_steps=7)
  assert a == b and a != c
  # A prompt's stream is its own: the same prompt alone (index 0) gives the row of index 0.
  assert layerwave.generate(tiny, prompts[:1], 20, slots=1, temperature=1.0, seed=5) == a[:1]
  # top-k 1 is greedy, whatever the stream.
  greedy = layerwave.generate(tiny, prompts, 12)
  assert layerwave.generate(tiny, prompts, 12, slots=4, temperature=1.3, top_k=1, seed=2) == greedy


def test_stop_fn_ends_a_row_and_the_next_prompt_takes_it(tiny):
  prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
  full = layerwave.generate(tiny, prompts, 24, ignore_eos=True)
  seen = []

  def stop(tokens):
    seen.append(len(tokens))
    return len(tokens) >= 6

  got, stats = layerwave.generate(tiny, prompts, 24, slots=2, chunk_steps=3, stop_fn=stop, ignore_eos=True,
                                  return_stats=True)
  # With chunks of 3 steps a row is asked after 4, 7, ... tokens: it stops at 7 with its first 7 tokens.
  assert got == [row[:7] for row in full]
  assert stats["stopped"] == len(prompts) and set(seen) == {4, 7}


def test_slots_beyond_the_prompts_and_one_token_budgets(tiny):
  prompts = [[5, 6, 7], [8, 9]]
  assert layerwave.generate(tiny, prompts, 9, slots=64) == layerwave.generate(tiny, prompts, 9)
  assert layerwave.generate(tiny, prompts, 1, slots=1) == layerwave.generate(tiny, prompts, 1)


def test_an_engine_takes_requests_while_it_runs(tiny):
  """A conversation's next turn can be queued (at the front) while others decode."""
  engine = continuous.Engine(tiny, 2, 6, 32, ignore_eos=True, chunk_steps=2)
  for i in range(3):
    engine.submit(continuous.Request(ids=[3 + i, 4, 5], tag=i))
  results = {}
  while engine.busy:
    for f in engine.step():
      results[f.request.tag] = f.tokens
      if f.request.tag == 0:
        engine.submit(continuous.Request(ids=[3, 4, 5] + f.tokens, tag="next"), front=True)
  assert results["next"] == layerwave.generate(tiny, [[3, 4, 5] + results[0]], 6, ignore_eos=True)[0]


def test_bounded_reads_equal_full_reads(tiny):
  """`read_slots` drops cache slots no row can read: the logits do not change."""
  config = tiny.config
  cache = KVCache.zeros(config, 2, 128)
  tokens = jnp.asarray([[5, 6, 7, 8], [9, 10, 0, 0]], jnp.int32)
  valid = jnp.asarray([[1, 1, 1, 1], [1, 1, 0, 0]], jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(4), (2, 4)).astype(jnp.int32)
  out = cached_forward(tiny.graphdef, tiny.params, tokens, positions, causal_mask(valid), cache,
                       jnp.zeros((2,), jnp.int32))
  lengths = jnp.asarray([4, 2], jnp.int32)
  step = lambda read: cached_forward(tiny.graphdef, tiny.params, jnp.asarray([[11], [12]]), lengths[:, None],
                                     jnp.ones((2, 1, 1), bool), out.cache, lengths, read_slots=read)
  full, bounded = step(None), step(64)
  np.testing.assert_allclose(np.asarray(bounded.logits), np.asarray(full.logits), rtol=1e-6, atol=1e-6)
  # The new key is written into the full cache either way.
  np.testing.assert_array_equal(np.asarray(bounded.cache.keys[0]), np.asarray(full.cache.keys[0]))


def test_bad_inputs_name_the_problem(tiny):
  with pytest.raises(ValueError, match="longer than the engine's cache allows"):
    continuous.Engine(tiny, 2, 8, 4).submit(continuous.Request(ids=[1] * 5))
  with pytest.raises(ValueError, match="max_position_embeddings"):
    layerwave.generate(tiny, [[1, 2]], tiny.config.max_position_embeddings, slots=2)
  with pytest.raises(ValueError, match="slots must be a positive integer"):
    continuous.Engine(tiny, 0, 8, 4)
  with pytest.raises(ValueError, match="Prompt 1 is empty"):
    layerwave.generate(tiny, [[1, 2], []], 4, slots=2)
  with pytest.raises(ValueError, match="stop_fn needs continuous batching"):
    layerwave.generate(tiny, [[1, 2]], 4, stop_fn=lambda t: False)
  with pytest.raises(ValueError, match=r"Token ids must lie in \[0, "):
    layerwave.generate(tiny, [[1, 10 ** 6]], 4, slots=1)
