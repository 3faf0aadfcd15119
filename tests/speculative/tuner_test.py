"""layerwave.speculative.tuner: `method="auto"` measures costs and acceptance and picks a setting, losslessly."""

import dataclasses

import numpy as np
import pytest

import layerwave
from layerwave.speculative import decode
from layerwave.speculative import evaluate
from layerwave.speculative import tree as tree_lib
from layerwave.speculative import tuner
from tests import configs
from tests.speculative.conftest import PROMPTS


def _tau_by_enumeration(acceptance, k):
  """E[1 + accepted drafts] from the distribution of the accepted length m (independent of `chain_tau`)."""
  a = list(acceptance)[:k]
  expected = 0.0
  for m in range(k + 1):
    p = np.prod(a[:m]) * (1.0 - a[m] if m < k else 1.0)
    expected += (m + 1) * p
  return expected


@pytest.mark.parametrize("acceptance", [(0.5, 0.5, 0.5), (0.9, 0.1, 0.7, 0.3), (0.0, 1.0), (1.0, 1.0, 1.0)])
def test_chain_tau_is_the_expected_accepted_length(acceptance):
  for k in range(1, len(acceptance) + 1):
    assert tuner.chain_tau(acceptance, k) == pytest.approx(_tau_by_enumeration(acceptance, k), abs=1e-12)


def test_chain_tau_inverts_the_loops_acceptance_metrics():
  # A histogram of accepted lengths → conditional acceptance (what the loop reports) → τ (what the tuner
  # predicts) gives back the histogram's own mean accepted length + 1.
  rng = np.random.default_rng(0)
  for _ in range(20):
    hist = rng.integers(0, 50, size=6)
    m = decode.acceptance_metrics(hist[None])
    assert tuner.chain_tau(m["acceptance"], 5) == pytest.approx(m["tau"], rel=1e-12)


@pytest.fixture(scope="module")
def tuned(llama):
  target, _, trained = llama
  result = tuner.tune(target, trained, PROMPTS, batch_size=2, max_new_tokens=12, chain_lengths=(1, 2, 3),
                      tree_budgets=(tree_lib.TreeBudget(2, 2, 3),), repeats=2)
  return target, trained, result


def test_tune_predicts_every_candidate_and_picks_the_fastest(tuned):
  target, trained, result = tuned
  names = [c.name for c in result.candidates]
  assert sorted(names) == sorted(["chain K=1", "chain K=2", "chain K=3", "tree d=2 k=2 n=3"])
  speedups = [c.speedup for c in result.candidates]
  assert speedups == sorted(speedups, reverse=True) and result.choice is result.candidates[0]
  assert result.beats_plain == (result.choice.speedup > 1)
  c = result.costs
  assert c.batch_size == 2 and [n for n, _ in c.verify_s] == [1, 2, 3, 4] and c.plain_token_s > 0
  for cand in result.candidates:
    assert cand.iteration_s > 0 and cand.speedup == pytest.approx(cand.tau * c.plain_token_s / cand.iteration_s)
  # The probe chain's τ, from the acceptance it measured, equals τ measured directly by the same run.
  _, m = decode.generate(target, trained, PROMPTS[:2], 12, num_draft_tokens=3,
                         prompt_width=max(len(p) for p in PROMPTS))
  _, m2 = decode.generate(target, trained, PROMPTS[2:], 12, num_draft_tokens=3,
                          prompt_width=max(len(p) for p in PROMPTS))
  both = decode.acceptance_metrics(np.asarray([m["accept_length_hist"], m2["accept_length_hist"]]))
  assert result.acceptance == pytest.approx(tuple(both["acceptance"]))
  chain3 = next(x for x in result.candidates if x.name == "chain K=3")
  assert chain3.tau == pytest.approx(both["tau"])
  table = result.table()
  assert "(chosen)" in table and "predicted speedup" in table
  assert result.to_dict()["choice"] == result.choice.name


def test_auto_settings_decode_with_the_choice_and_stay_lossless(llama):
  target, _, trained = llama
  settings = evaluate.DecodeSettings(max_new_tokens=8, batch_size=2, timing_repeats=1,
                                     spec=decode.SpecOptions(num_draft_tokens=2), auto=True)
  assert settings.name.startswith("auto")
  ev = evaluate.evaluate(target, trained, PROMPTS, settings, seed=0, paired=False)
  assert ev.tuning is not None and not ev.settings.auto
  assert ev.settings.spec == ev.tuning.choice.spec
  assert {c.name for c in ev.tuning.candidates} >= {"chain K=1", "chain K=2"}
  plain = layerwave.generate(target, PROMPTS, 8)
  assert ev.outputs == plain
  summary = evaluate.summary(ev)
  assert summary["auto"]["choice"] == ev.tuning.choice.name and summary["setting"] == ev.settings.name
  assert "(auto)" in evaluate.table(summary, settings)


def test_auto_from_the_config_and_bad_input():
  s = configs.load("smoke").speculate
  s.unlock()
  s.method = "auto"
  settings = evaluate.DecodeSettings.from_config(s)
  assert settings.auto and settings.spec.method == "chain"
  assert not dataclasses.replace(settings, auto=False).auto
  s.method = "beam"
  with pytest.raises(ValueError, match="method must be one of"):
    evaluate.DecodeSettings.from_config(s)
  with pytest.raises(ValueError, match="at least one calibration prompt"):
    tuner.tune(None, None, [], batch_size=1)
  with pytest.raises(ValueError, match="at least one candidate"):
    tuner.tune(None, None, PROMPTS, batch_size=1, chain_lengths=())
  with pytest.raises(ValueError, match="chain lengths must be >= 1"):
    tuner.tune(None, None, PROMPTS, batch_size=1, chain_lengths=(0, 2))
