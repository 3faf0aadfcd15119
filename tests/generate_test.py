"""Autoregressive decoding against transformers' greedy `generate`, seeded sampling, bad inputs."""

import dataclasses

import pytest

import layerwave

from tests.models import hf_reference

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("llama"))
  hf_model = hf_reference.save_hf_model("llama", directory, seed=3)
  return hf_model, layerwave.load_target(directory)


PROMPTS = [[5, 17, 33, 8, 41], [12, 9], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74,
                                          75, 76, 77]]


def test_greedy_equals_transformers_generate(pair):
  hf_model, target = pair
  ours = layerwave.generate(target, PROMPTS, max_new_tokens=12)
  for prompt, got in zip(PROMPTS, ours):
    with torch.no_grad():
      ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              eos_token_id=2, pad_token_id=0)
    assert got == ref[0, len(prompt):].tolist()


def test_rows_stop_at_their_own_eos(pair):
  _, target = pair
  free = layerwave.generate(target, PROMPTS, max_new_tokens=8)
  # Declare row 0's third token an extra EOS: rows must now end there, each at its own step.
  eos_ids = target.config.eos_token_ids + (free[0][2],)
  config = dataclasses.replace(target.config, eos_token_ids=eos_ids)
  cut = layerwave.generate(dataclasses.replace(target, config=config), PROMPTS, max_new_tokens=8)
  assert len(cut[0]) == 3
  for row_free, row_cut in zip(free, cut):
    ends = [i for i, t in enumerate(row_free) if t in eos_ids]
    assert row_cut == (row_free[:ends[0] + 1] if ends else row_free)


def test_sampling_is_seeded_and_top_k_1_is_greedy(pair):
  _, target = pair
  greedy = layerwave.generate(target, PROMPTS, 10)
  assert layerwave.generate(target, PROMPTS, 10, temperature=1.5, top_k=1, seed=4) == greedy
  a = layerwave.generate(target, PROMPTS, 10, temperature=2.0, seed=1)
  b = layerwave.generate(target, PROMPTS, 10, temperature=2.0, seed=1)
  c = layerwave.generate(target, PROMPTS, 10, temperature=2.0, seed=2)
  assert a == b and a != c


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt_ids=[]), "non-empty list"),
    (dict(prompt_ids=[[1, 2], []]), "Prompt 1 is empty"),
    (dict(prompt_ids=[1, 2, 3]), "list of token-id lists"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(max_new_tokens=300), "exceeds the model's max_position_embeddings"),
    (dict(prompt_ids=[[1, 2, 100000]]), "Token ids must lie in"),
])
def test_bad_inputs(pair, kwargs, match):
  _, target = pair
  args = dict(prompt_ids=[[1, 2, 3]], max_new_tokens=4)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    layerwave.generate(target, **args)
