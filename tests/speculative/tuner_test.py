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
                      tree_budgets=(tree_lib.TreeBudget(2, 2, 3),), repeats=2, confirm=2)
  return target, trained, result


def test_tune_predicts_every_candidate_and_picks_the_fastest_confirmed(tuned):
  target, trained, result = tuned
  names = [c.name for c in result.candidates]
  assert sorted(names) == sorted(["chain K=1", "chain K=2", "chain K=3", "tree d=2 k=2 n=3"])
  confirmed, rest = result.candidates[:2], result.candidates[2:]
  # The two best predictions were decoded end to end; the measured best is chosen, the rest stay ranked by
  # prediction.
  assert all(c.measured is not None for c in confirmed) and all(c.measured is None for c in rest)
  assert min(c.speedup for c in confirmed) >= max(c.speedup for c in rest)
  measured = [c.measured_speedup for c in confirmed]
  assert measured == sorted(measured, reverse=True) and result.choice is result.candidates[0]
  assert [c.speedup for c in rest] == sorted((c.speedup for c in rest), reverse=True)
  assert result.beats_plain == (result.choice.measured_speedup > 1)
  padded = PROMPTS + PROMPTS[:len(PROMPTS) % 2]
  plain = layerwave.generate(target, padded, 12, prompt_width=max(len(p) for p in PROMPTS))
  for c in confirmed:
    # One ABBA pair per calibration batch, lossless against plain decoding, and the run's acceptance equals
    # an independent speculative run of the same setting over the same prompts.
    assert c.measured.num_pairs == len(padded) // 2 and c.measured.repeats == 1
    assert c.measured.plain_outputs == plain and c.measured.spec_outputs == plain
    hists = [decode.generate(target, trained, padded[i:i + 2], 12, prompt_width=max(len(p) for p in PROMPTS),
                             **dataclasses.asdict(c.spec))[1]["accept_length_hist"]
             for i in range(0, len(padded), 2)]
    np.testing.assert_array_equal(c.measured.accept_length_hist, np.sum(hists, axis=0))
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
  assert "(chosen)" in table and "predicted speedup" in table and "not confirmed" in table
  d = result.to_dict()
  assert d["choice"] == result.choice.name
  assert d["candidates"][0]["measured"]["speedup"] == result.choice.measured_speedup


def test_tune_without_confirmation_chooses_by_prediction(llama):
  target, _, trained = llama
  result = tuner.tune(target, trained, PROMPTS[:2], batch_size=2, max_new_tokens=8, chain_lengths=(1, 2),
                      repeats=1, confirm=0)
  assert all(c.measured is None for c in result.candidates)
  assert result.choice is max(result.candidates, key=lambda c: c.speedup)
  assert result.beats_plain == (result.choice.speedup > 1)


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
  for bad in (-1, 1.5, True):
    with pytest.raises(ValueError, match="confirm must be an integer >= 0"):
      tuner.tune(None, None, PROMPTS, batch_size=1, confirm=bad)
