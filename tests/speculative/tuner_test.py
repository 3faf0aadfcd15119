"""layerwave.speculative.tuner: `method="auto"` times every candidate end to end and picks one, losslessly."""

import dataclasses

import numpy as np
import pytest

import layerwave
from layerwave.speculative import decode
from layerwave.speculative import evaluate
from layerwave.speculative import timing
from layerwave.speculative import tree as tree_lib
from layerwave.speculative import tuner
from tests import configs
from tests.speculative.conftest import PROMPTS

WIDTH = max(len(p) for p in PROMPTS)
TREE = tree_lib.TreeBudget(2, 2, 3)


def _record(spec, ratios):
  """A candidate whose paired timing has the given per-pair ratios (plain at 1 token/s)."""
  n = len(ratios)
  measured = timing.PairedTiming(tuple(ratios), (1.0,) * n, tuple(ratios), 1, [], [], np.ones(2, np.int64),
                                 [])
  return tuner.Candidate(spec, measured)


def _median_ratio(c):
  return float(np.median(c.measured.ratios))


@pytest.fixture(scope="module")
def tuned(llama):
  target, _, trained = llama
  result = tuner.tune(target, trained, PROMPTS, batch_size=2, max_new_tokens=12, chain_lengths=(3, 1, 2, 2),
                      tree_budgets=(TREE,), repeats=1)
  return target, trained, result


def test_tune_times_each_candidate_once_and_chooses_among_them(tuned):
  _, _, result = tuned
  requested = [decode.SpecOptions(method="chain", num_draft_tokens=k) for k in (1, 2, 3)] + [
      decode.SpecOptions(method="tree", tree_depth=2, tree_top_k=2, tree_tokens=3)]
  # Every requested setting, duplicates dropped, and nothing else; each timed on every calibration batch.
  assert sorted((c.spec for c in result.candidates), key=str) == sorted(requested, key=str)
  assert len({c.name for c in result.candidates}) == len(requested)
  for c in result.candidates:
    assert c.measured.num_pairs == len(PROMPTS) // 2 and c.measured.repeats == 1
    assert len(c.measured.ratios) == len(c.measured.plain_tokens_per_s) == len(c.measured.spec_tokens_per_s)
  assert any(result.choice is c for c in result.candidates)
  # The choice is the fastest in the records the tuner returns: no other candidate measured a higher median.
  assert all(_median_ratio(result.choice) >= _median_ratio(c) for c in result.candidates)
  assert result.beats_plain == any(_median_ratio(c) > 1 for c in result.candidates)


def test_every_timed_candidate_is_lossless_and_its_record_reproduces(tuned):
  target, trained, result = tuned
  plain = layerwave.generate(target, PROMPTS, 12, prompt_width=WIDTH)
  for c in result.candidates:
    # Greedy: both sides of every pair emit plain decoding's tokens.
    assert c.measured.plain_outputs == plain and c.measured.spec_outputs == plain
    # The record's acceptance is that of an independent run of the same setting over the same batches.
    hists = [decode.generate(target, trained, PROMPTS[i:i + 2], 12, prompt_width=WIDTH,
                             **dataclasses.asdict(c.spec))[1]["accept_length_hist"]
             for i in range(0, len(PROMPTS), 2)]
    np.testing.assert_array_equal(c.measured.accept_length_hist, np.sum(hists, axis=0))
    assert 1.0 <= c.tau <= 1.0 + (c.spec.num_draft_tokens if c.spec.method == "chain" else c.spec.tree_depth)
  # The chosen setting, decoded on its own, gives plain decoding's output too.
  out, _ = decode.generate(target, trained, PROMPTS, 12, **dataclasses.asdict(result.choice.spec))
  assert out == layerwave.generate(target, PROMPTS, 12)


def test_table_and_dict_report_the_records(tuned):
  _, _, result = tuned
  table = result.table()
  # The best candidate is marked as what runs only when it beats plain decoding (else `auto` decodes plainly).
  mark = "(chosen)" if result.beats_plain else "(best; plain decoding chosen)"
  assert table.count(mark) == 1 and f"{result.choice.name} {mark}" in table
  assert all(c.name in table for c in result.candidates)
  assert ("No setting beats plain decoding" in table) == (not result.beats_plain)
  d = result.to_dict()
  assert d["choice"] == result.choice.name and d["choice_spec"] == dataclasses.asdict(result.choice.spec)
  assert [x["name"] for x in d["candidates"]] == [c.name for c in result.candidates]
  chosen = next(x for x in d["candidates"] if x["name"] == d["choice"])
  assert chosen["measured"]["speedup"] == max(x["measured"]["speedup"] for x in d["candidates"])


def test_an_odd_prompt_count_pads_the_last_batch(llama):
  target, _, trained = llama
  result = tuner.tune(target, trained, PROMPTS[:3], batch_size=2, max_new_tokens=6, chain_lengths=(2,))
  (c,) = result.candidates
  padded = PROMPTS[:3] + PROMPTS[2:3]
  assert result.prompts == len(padded) and result.choice is c
  # repeats=None: the fewest repeats per batch that give at least MIN_PAIRS pairs over the two batches.
  assert c.measured.num_pairs == 2 * result.repeats
  assert c.measured.num_pairs >= tuner.MIN_PAIRS > 2 * (result.repeats - 1)
  width = max(len(p) for p in PROMPTS[:3])
  assert c.measured.spec_outputs == layerwave.generate(target, padded, 6, prompt_width=width)


def test_choose_takes_the_highest_median_whatever_the_order():
  rng = np.random.default_rng(0)
  specs = [decode.SpecOptions(method="chain", num_draft_tokens=k) for k in range(1, 7)]
  for _ in range(20):
    records = [_record(s, rng.uniform(0.5, 1.5, size=rng.integers(1, 6))) for s in specs]
    chosen = tuner.choose(records)
    assert any(chosen is r for r in records)
    assert all(_median_ratio(chosen) >= _median_ratio(r) for r in records)
    for perm in (rng.permutation(len(records)) for _ in range(3)):
      # The same timings in another order: the same record (distinct medians, so no tie decides).
      assert tuner.choose([records[i] for i in perm]) is chosen
    assert tuner.choose(records) is chosen


def test_choose_breaks_a_tie_by_the_order_given():
  a = _record(decode.SpecOptions(num_draft_tokens=1), (0.9, 1.1))
  b = _record(decode.SpecOptions(num_draft_tokens=2), (1.1, 0.9))
  assert a.speedup == b.speedup
  assert tuner.choose([a, b]) is a and tuner.choose([b, a]) is b
  with pytest.raises(ValueError, match="at least one timed candidate"):
    tuner.choose([])


def test_auto_settings_decode_with_the_choice_and_stay_lossless(llama):
  target, _, trained = llama
  settings = evaluate.DecodeSettings(max_new_tokens=8, batch_size=2, timing_repeats=1,
                                     spec=decode.SpecOptions(num_draft_tokens=2), auto=True)
  assert settings.name.startswith("auto")
  ev = evaluate.evaluate(target, trained, PROMPTS, settings, seed=0, paired=False)
  assert ev.tuning is not None and not ev.settings.auto
  assert ev.settings.spec == ev.tuning.choice.spec
  # When nothing beat plain decoding at calibration, auto decodes plainly (τ 1); otherwise with the choice.
  assert ev.settings.plain == (not ev.tuning.beats_plain)
  assert (evaluate.summary(ev)["tau"] == 1.0) if ev.settings.plain else ev.settings.name == ev.tuning.choice.name
  assert {"chain K=1", "chain K=2"} <= {c.name for c in ev.tuning.candidates}
  assert all(c.spec.num_draft_tokens <= 2 for c in ev.tuning.candidates if c.spec.method == "chain")
  plain = layerwave.generate(target, PROMPTS, 8)
  assert ev.outputs == plain
  summary = evaluate.summary(ev)
  assert summary["auto"]["choice"] == ev.tuning.choice.name and summary["setting"] == ev.settings.name
  assert "(auto)" in evaluate.table(summary, settings)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plain_settings_decode_plainly_as_speculation_that_drafts_nothing(llama, temperature):
  """What auto settles on when no setting pays: plain decoding, in the speculative rows' format, timed in pairs."""
  target, _, trained = llama
  settings = evaluate.DecodeSettings(max_new_tokens=8, batch_size=2, timing_repeats=1, temperature=temperature,
                                     spec=decode.SpecOptions(num_draft_tokens=2), plain=True)
  assert settings.name == "plain (no setting beat it)"
  ev = evaluate.evaluate(target, trained, PROMPTS, settings, seed=3, paired=True)
  # Both sides are plain decoding of the same batches with the same seed: the same tokens at any temperature.
  plain = ev.timed.plain_outputs
  assert ev.outputs == plain and len(plain) == len(PROMPTS)
  if temperature == 0:
    assert plain == layerwave.generate(target, PROMPTS, 8)
  m = evaluate.summary(ev)
  n = sum(len(o) for o in plain)
  assert m["tau"] == 1.0 and m["acceptance"] == [] and m["accept_length_hist"] == [n] and m["verify_calls"] == n
  assert m["effective_tau"] == pytest.approx(1.0) and m["equal_to_ar"] == 1.0
  assert ev.prompt_stats() == [[len(o), len(o)] for o in plain]
  assert "plain (no setting beat it)" in evaluate.table(m, settings)


def test_auto_from_the_config():
  s = configs.load("smoke").speculate
  s.unlock()
  s.method = "auto"
  settings = evaluate.DecodeSettings.from_config(s)
  assert settings.auto and settings.spec.method == "chain"
  assert not dataclasses.replace(settings, auto=False).auto
  s.method = "beam"
  with pytest.raises(ValueError, match="method must be one of"):
    evaluate.DecodeSettings.from_config(s)


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[]), "at least one calibration prompt"),
    (dict(chain_lengths=()), "at least one candidate: give chain_lengths or tree_budgets"),
    (dict(chain_lengths=(0, 2)), r"chain lengths must be >= 1"),
    (dict(chain_lengths=(1.5,)), r"chain lengths must be >= 1"),
    (dict(tree_budgets=((3, 4, 8),)), r"tree_budgets must be tree.TreeBudget"),
    (dict(batch_size=0), r"batch_size must be a positive integer"),
    (dict(batch_size=True), r"batch_size must be a positive integer"),
    (dict(max_new_tokens=0), r"max_new_tokens must be a positive integer"),
    (dict(repeats=0), r"repeats must be a positive integer"),
    (dict(repeats=1.5), r"repeats must be a positive integer"),
])
def test_bad_input_is_refused_before_decoding(kwargs, match):
  # target and draft are None: a check that ran after decoding started would fail differently.
  args = {"batch_size": 1, **kwargs}
  prompts = args.pop("prompts", PROMPTS)
  with pytest.raises(ValueError, match=match):
    tuner.tune(None, None, prompts, **args)
