"""The speculative loop end to end: greedy equals `layerwave.generate`, sampling is lossless, no retrace."""

import dataclasses
import itertools

import chex
import jax
import numpy as np
import pytest
from scipy import stats

import layerwave
from layerwave import inference
from layerwave.sampling import SamplingParams, log_probs
from layerwave.speculative import decode

from tests.speculative.conftest import PROMPTS

CHAIN = dict(method="chain", num_draft_tokens=3)
TREE = dict(method="tree", tree_depth=4, tree_top_k=3, tree_tokens=10)


@pytest.mark.parametrize("options", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("which", ["untrained", "trained"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_generate(llama, options, which, batch):
  target, untrained, trained = llama
  prompts = PROMPTS[:batch]
  ref = layerwave.generate(target, prompts, 24)
  out, metrics = layerwave.speculative.generate(
      target, trained if which == "trained" else untrained, prompts, 24, **options)
  assert out == ref
  if which == "trained":  # paths were accepted, committed and continued from
    assert metrics["tau"] > 1.5
    if batch > 1:  # prompt 2's continuation is accepted several drafts deep
      assert max(np.nonzero(metrics["accept_length_hist"])[0]) >= 3


@pytest.mark.parametrize("options", [CHAIN, TREE], ids=["chain", "tree"])
def test_gemma_target_greedy_equals_generate_past_the_window(gemma, options):
  """Verification and commits against a Gemma 3 target whose sliding window (4) is far shorter than the text."""
  target, trained = gemma
  ref = layerwave.generate(target, PROMPTS, 24)
  out, metrics = layerwave.speculative.generate(target, trained, PROMPTS, 24, **options)
  assert out == ref
  assert metrics["tau"] > 1.5  # drafts were accepted, so accepted paths were committed and read back


@pytest.mark.parametrize("options", [CHAIN, TREE], ids=["chain", "tree"])
def test_prefills_through_the_kernel_change_no_token(llama, gemma, options):
  """The target's and the draft's prompt prefills through the memory-efficient kernel ("chunked" here, splash on
  TPU, cuDNN on GPU: `[T, T]` never whole) give the dense prefill's tokens and acceptance, Gemma's window too."""
  for target, trained in ((llama[0], llama[2]), gemma):
    chunked = inference.with_attention(target, "chunked")
    ref, ref_metrics = layerwave.speculative.generate(target, trained, PROMPTS, 24, **options)
    out, metrics = layerwave.speculative.generate(chunked, trained, PROMPTS, 24, **options)
    assert out == ref and metrics["tau"] == ref_metrics["tau"]


@pytest.mark.parametrize("options", [CHAIN, TREE], ids=["chain", "tree"])
def test_rows_stop_at_their_own_eos(llama, options):
  target, _, trained = llama
  free = layerwave.generate(target, PROMPTS, 16, ignore_eos=True)
  # Extra EOS ids that rows reach at different steps (some inside an accepted run of drafts).
  eos_ids = target.config.eos_token_ids + (free[0][2], free[2][9])
  config = dataclasses.replace(target.config, eos_token_ids=eos_ids)
  cut_target = dataclasses.replace(target, config=config)
  ref = layerwave.generate(cut_target, PROMPTS, 16)
  out, _ = layerwave.speculative.generate(cut_target, trained, PROMPTS, 16, **options)
  assert out == ref
  assert len(out[0]) == 3 and len({len(r) for r in out}) > 1


def test_prompt_width_pads_without_changing_the_output(llama):
  target, _, trained = llama
  ref = layerwave.generate(target, PROMPTS, 12)
  assert layerwave.generate(target, PROMPTS, 12, prompt_width=40) == ref
  out, _ = layerwave.speculative.generate(target, trained, PROMPTS, 12, prompt_width=40, **CHAIN)
  assert out == ref


def test_metrics_are_consistent(llama):
  target, _, trained = llama
  out, m = layerwave.speculative.generate(target, trained, PROMPTS, 24, ignore_eos=True, **CHAIN)
  hist = np.asarray(m["accept_length_hist"])
  assert len(hist) == CHAIN["num_draft_tokens"] + 1 and hist.sum() == m["verify_calls"]
  assert m["tau"] == pytest.approx((hist * np.arange(1, len(hist) + 1)).sum() / hist.sum())
  assert all(0 <= a <= 1 for a in m["acceptance"]) and m["tokens_per_s"] > 0
  assert [len(r) for r in out] == [24] * len(PROMPTS) and m["new_tokens"] == 24 * len(PROMPTS)


def test_no_retrace_for_equal_shapes(llama, monkeypatch):
  target, untrained, trained = llama
  chex.clear_trace_counter()
  # The library's loop and static arguments, in a fresh jit that fails on a second trace.
  loop = jax.jit(chex.assert_max_traces(decode._speculate.__wrapped__, n=1),  # pylint: disable=protected-access
                 static_argnames=decode.SPECULATE_STATIC)
  monkeypatch.setattr(decode, "_speculate", loop)
  layerwave.speculative.generate(target, untrained, [[1, 2, 3]], 8, **CHAIN)
  layerwave.speculative.generate(target, trained, [[4, 5, 6, 7]], 8, seed=3, **CHAIN)  # another draft, seed
  layerwave.speculative.generate(target, untrained, [[9, 9]], 8, **CHAIN)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_draft_tokens=0), r"num_draft_tokens \(K\) must be a positive integer"),
    (dict(method="beam"), "method must be one of"),
    (dict(method="tree", tree_depth=4, tree_top_k=2, tree_tokens=40), "Inconsistent tree budget"),
    (dict(method="tree", tree_depth=4, tree_top_k=2, tree_tokens=3), "Inconsistent tree budget"),
    (dict(method="tree", tree_depth=0), "tree_depth must be a positive integer"),
    (dict(method="tree", tree_depth=2, tree_top_k=98, tree_tokens=10), "exceeds the draft vocabulary"),
    (dict(method="tree", draft_sample=True), "draft_sample applies to method='chain'"),
    (dict(bogus=1), "Unknown draft options"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.2), r"top_p must be in \(0, 1\]"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(max_new_tokens=300), "exceeds the model's max_position_embeddings"),
    (dict(prompt_ids=[[1, 2], []]), "Prompt 1 is empty"),
])
def test_bad_inputs(llama, kwargs, match):
  target, untrained, _ = llama
  args = dict(prompt_ids=[[1, 2, 3]], max_new_tokens=4)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    layerwave.speculative.generate(target, untrained, **args)


def test_draft_for_another_target_is_rejected(llama, tiny_vocab):
  target, _, _ = llama
  _, other_draft = tiny_vocab
  with pytest.raises(ValueError, match="trained for a target with"):
    layerwave.speculative.generate(target, other_draft, [[1, 2, 3]], 4)
  with pytest.raises(TypeError, match="draft must be a layerwave Draft"):
    layerwave.speculative.generate(target, object(), [[1, 2, 3]], 4)


# -- losslessness at temperature > 0 ------------------------------------------------------------------

SAMPLES = 100_000
NEW = 3  # the first three tokens: the prefill's, then tokens from one or two verifications


def _exact_joint(target, prompt, params):
  """P(x1, x2, x3 | prompt) under the processed target distribution, `[V, V, V]`."""
  v = target.config.vocab_size
  rows = np.asarray([prompt + [a, b] for a, b in itertools.product(range(v), repeat=2)], np.int32)
  logits = np.asarray(target.forward(rows).logits)[:, len(prompt) - 1:]  # [V*V, 3, V]
  p = np.exp(np.asarray(log_probs(logits, params), np.float64))
  p = p.reshape(v, v, 3, v)  # [x1, x2, position, next token]
  joint = p[0, 0, 0][:, None, None] * p[:, 0, 1][:, :, None] * p[:, :, 2]
  return joint / joint.sum()


SLOW = pytest.mark.slow  # ~30 s each on 2 CPU cores; the default run keeps one chain and one tree case


@pytest.mark.parametrize("sampling,options", [
    (dict(temperature=0.8, top_k=5), CHAIN),
    (dict(temperature=0.9, top_p=0.85), dict(method="tree", tree_depth=3, tree_top_k=2,
                                             tree_tokens=5)),
    pytest.param(dict(temperature=1.0), CHAIN, marks=SLOW),
    pytest.param(dict(temperature=0.8, top_k=5), dict(CHAIN, draft_sample=True), marks=SLOW),
    pytest.param(dict(temperature=1.2, top_p=0.9), dict(CHAIN, num_draft_tokens=2, draft_sample=True),
                 marks=SLOW),
    pytest.param(dict(temperature=1.0, top_k=6), dict(method="tree", tree_depth=2, tree_top_k=2,
                                                      tree_tokens=4), marks=SLOW),
], ids=["chain-topk", "tree-topp", "chain", "chain-sampled-topk", "chain-sampled-topp", "tree-topk"])
def test_sampling_matches_target_distribution(tiny_vocab, sampling, options):
  target, draft = tiny_vocab
  prompt = [3, 1, 4, 1, 5]
  joint = _exact_joint(target, prompt, SamplingParams(**sampling)).reshape(-1)
  out, metrics = layerwave.speculative.generate(target, draft, [prompt] * SAMPLES, NEW, seed=11,
                                                ignore_eos=True, **sampling, **options)
  v = target.config.vocab_size
  cells = np.asarray(out) @ np.asarray([v * v, v, 1])
  counts = np.bincount(cells, minlength=v ** 3).astype(np.float64)
  assert counts[joint == 0].sum() == 0  # nothing outside the filtered support
  # Pool cells with small expectations into one so the chi-square approximation holds.
  expected = joint * SAMPLES
  small = expected < 5
  obs = np.append(counts[~small], counts[small].sum())
  exp = np.append(expected[~small], expected[small].sum())
  obs, exp = obs[exp > 0], exp[exp > 0]
  assert stats.chisquare(obs, exp).pvalue > 0.01
  assert metrics["accept_length_hist"][1] > 0  # drafts were accepted, not only bonus tokens
