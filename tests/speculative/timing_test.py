"""Paired speedup timing: alternation, warm-up outside the clock, median of per-pair ratios, real decoding.

The logic is checked with fake decode functions whose durations are known: on a fake clock (exact ratios,
drift, compilation) and once on the real clock with `time.sleep`. The last test runs the tiny Llama and its
trained draft through it; nothing asserts how fast real decoding is.
"""

import time
import types

import numpy as np
import pytest

import layerwave
from layerwave.speculative import timing

from tests.speculative.conftest import PROMPTS


class FakeClock:
  """A clock the fake decode functions advance; `drift` slows every later call down linearly."""

  def __init__(self, drift: float = 0.0):
    self.now, self.calls, self.drift = 0.0, 0, drift

  def __call__(self) -> float:
    return self.now

  def spend(self, seconds: float) -> None:
    self.now += seconds * (1.0 + self.drift * self.calls)
    self.calls += 1


def _fake(name, seconds, log, clock=None, tokens=4, compile_seconds=0.0, hist=None, steps=None):
  """batch -> (outputs, metrics): `tokens` per prompt in `seconds` (+ `compile_seconds` per new size), in
  `steps` loop steps when given."""
  seen = set()

  def fn(ids):
    log.append((name, len(ids)))
    cost = seconds + (compile_seconds if len(ids) not in seen else 0.0)
    seen.add(len(ids))
    if clock is None:
      time.sleep(cost)
    else:
      clock.spend(cost)
    metrics = {} if hist is None else {"accept_length_hist": list(hist), "tau": 1.5,
                                       "verify_calls": int(sum(hist))}
    if steps is not None:
      metrics["steps"] = steps
    return [[name == "spec"] * tokens for _ in ids], metrics

  return fn


@pytest.fixture
def clock(monkeypatch):
  c = FakeClock()
  monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=c))
  return c


def test_alternates_abba_after_one_warmup_per_batch_shape(clock):
  log = []
  prompts = [[1, 2]] * 5  # batches of 2, 2, 1: the second batch has the first one's shape
  timing.paired_speedup(_fake("plain", 2.0, log, clock), _fake("spec", 1.0, log, clock), prompts, 2,
                        repeats=2)
  calls = [name for name, _ in log]
  warm = ["plain", "spec"]
  pairs_01 = ["plain", "spec", "spec", "plain"]  # pairs 0, 1 (batch 0), pairs 2, 3 (batch 1), 4, 5 (batch 2)
  assert calls == warm + pairs_01 + pairs_01 + warm + pairs_01
  assert [n for _, n in log][-6:] == [1] * 6
  # One repeat per batch still alternates across batches.
  log.clear()
  timing.paired_speedup(_fake("plain", 2.0, log, clock), _fake("spec", 1.0, log, clock), [[1]] * 3, 1,
                        repeats=1, warmup=False)
  assert [name for name, _ in log] == ["plain", "spec", "spec", "plain", "plain", "spec"]


def test_ratio_is_tokens_per_second_and_the_median_of_pairs(clock):
  log = []
  # Speculation 2.5x faster per call; at T > 0 it may emit other token counts: here 6 vs 4 per prompt.
  result = timing.paired_speedup(_fake("plain", 2.5, log, clock, tokens=4),
                                 _fake("spec", 1.0, log, clock, tokens=6), PROMPTS, 2, repeats=3)
  assert result.num_pairs == 6 and result.repeats == 3
  assert result.ratios == pytest.approx([2.5 * 6 / 4] * 6)
  assert result.speedup == pytest.approx(3.75)
  assert result.plain_tokens_per_s == pytest.approx([2 * 4 / 2.5] * 6)
  assert result.spec_tokens_per_s == pytest.approx([2 * 6 / 1.0] * 6)
  s = result.summary()
  assert s["speedup"] == s["speedup_p25"] == s["speedup_p75"] == pytest.approx(3.75)
  assert s["timing_pairs"] == 6 and s["tokens_per_s"] == pytest.approx(12.0)
  assert s["timing"].startswith("paired: median of 6 interleaved (ABBA) pairs, 3 per batch")
  assert result.per_batch[0]["seconds"] == pytest.approx(1.0)
  assert result.per_batch[0]["plain_seconds"] == pytest.approx(2.5)
  assert result.plain_outputs == [[False] * 4] * len(PROMPTS)
  assert result.spec_outputs == [[True] * 6] * len(PROMPTS)
  assert result.accept_length_hist is None and "tau" not in result.per_batch[0]


def test_median_and_quartiles_of_known_ratios():
  result = timing.PairedTiming(ratios=(0.5, 3.0, 1.0, 1.2, 0.9), plain_tokens_per_s=(1.0,) * 5,
                               spec_tokens_per_s=(1.0,) * 5, repeats=5, plain_outputs=[],
                               spec_outputs=[], accept_length_hist=None, per_batch=[])
  assert result.speedup == 1.0  # one disturbed pair (3.0) does not move the median
  assert result.quantiles() == pytest.approx((0.9, 1.2))
  s = result.summary()
  assert (s["speedup_min"], s["speedup_max"]) == (0.5, 3.0)
  assert "[p25 0.90, p75 1.20; min 0.50, max 3.00]" in result.describe()


def test_compilation_stays_outside_the_clock(clock):
  log = []
  fns = lambda: (_fake("plain", 2.0, log, clock, compile_seconds=50.0),  # noqa: E731
                 _fake("spec", 1.0, log, clock, compile_seconds=80.0))
  warm = timing.paired_speedup(*fns(), PROMPTS, 4, repeats=3)
  assert warm.ratios == pytest.approx([2.0] * 3)
  cold = timing.paired_speedup(*fns(), PROMPTS, 4, repeats=3, warmup=False)
  assert cold.ratios[0] == pytest.approx(52 / 81)  # the first pair paid both compilations
  assert cold.ratios[1:] == pytest.approx([2.0] * 2) and cold.speedup == pytest.approx(2.0)


def test_abba_order_brackets_the_true_ratio_under_drift(monkeypatch):
  c = FakeClock(drift=0.05)  # every call 5 % slower than the one before
  monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=c))
  log = []
  result = timing.paired_speedup(_fake("plain", 2.0, log, c), _fake("spec", 1.0, log, c), [[1]], 1,
                                 repeats=4, warmup=False)
  # Plain-first pairs see speculation slowed, speculative-first pairs plain decoding: below and above 2.
  assert result.ratios[0] < 2.0 < result.ratios[1] and result.ratios[2] < 2.0 < result.ratios[3]
  assert abs(np.mean(result.ratios) - 2.0) < abs(result.ratios[0] - 2.0)


def test_histogram_is_summed_over_batches_once_each(clock):
  log = []
  result = timing.paired_speedup(_fake("plain", 1.0, log, clock),
                                 _fake("spec", 1.0, log, clock, hist=[3, 2, 1]), PROMPTS, 1, repeats=3)
  assert result.accept_length_hist.tolist() == [12, 8, 4]  # 4 batches, not 4 x 3 repeats
  assert [r["verify_calls"] for r in result.per_batch] == [6] * 4
  pooled = timing.combine([result, result])
  assert pooled.num_pairs == 24 and pooled.accept_length_hist.tolist() == [24, 16, 8]
  assert len(pooled.spec_outputs) == 8 and pooled.repeats == 3


def test_speedup_splits_into_effective_tau_and_iteration_cost(clock):
  log = []
  # Plain: 12 steps in 2.4 s (0.2 s a step); speculation: 5 iterations in 1.5 s (0.3 s each, 1.5 steps' worth).
  result = timing.paired_speedup(_fake("plain", 2.4, log, clock, steps=12),
                                 _fake("spec", 1.5, log, clock, steps=5), PROMPTS, 2, repeats=3)
  row = result.per_batch[0]
  assert (row["steps"], row["plain_steps"]) == (5, 12)
  assert row["effective_tau"] == pytest.approx(2.4) and row["iteration_cost"] == pytest.approx(1.5)
  s = result.summary()
  assert s["effective_tau"] == pytest.approx(2.4) and s["iteration_cost"] == pytest.approx(1.5)
  assert s["speedup"] == pytest.approx(s["effective_tau"] / s["iteration_cost"])  # same tokens: exact
  # Pooled over batches by sums: batches of 2 and 1 prompts cost the same here, so the factors hold.
  assert timing.combine([result, result]).summary()["iteration_cost"] == pytest.approx(1.5)
  # Without steps from either side there is nothing to split.
  plain_only = timing.paired_speedup(_fake("plain", 2.4, log, clock, steps=12), _fake("spec", 1.5, log, clock),
                                     PROMPTS, 2, repeats=1)
  assert "iteration_cost" not in plain_only.summary() and "steps" not in plain_only.per_batch[0]


def test_real_clock_with_sleeping_functions():
  log = []
  result = timing.paired_speedup(_fake("plain", 0.04, log), _fake("spec", 0.02, log), [[1]] * 2, 1,
                                 repeats=3)
  assert result.num_pairs == 6
  assert result.speedup == pytest.approx(2.0, rel=0.25)
  assert result.speedup == pytest.approx(np.median(result.ratios))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(prompts=[]), ValueError, "at least one prompt"),
    (dict(batch_size=0), ValueError, "batch_size must be a positive integer"),
    (dict(repeats=0), ValueError, "repeats must be a positive integer"),
    (dict(repeats=1.5), ValueError, "repeats must be a positive integer"),
    (dict(plain_fn=lambda ids: [[1]] * len(ids)), TypeError, "plain_fn must return"),
    (dict(spec_fn=lambda ids: ([[1]], {})), ValueError, "spec_fn returned 1 outputs for a batch of 2"),
])
def test_bad_inputs(kwargs, error, match):
  args = dict(plain_fn=lambda ids: ([[1]] * len(ids), {}), spec_fn=lambda ids: ([[1]] * len(ids), {}),
              prompts=[[1], [2]], batch_size=2, repeats=1)
  args.update(kwargs)
  with pytest.raises(error, match=match):
    timing.paired_speedup(**args)


def test_combine_refuses_mixed_repeat_counts():
  one = timing.PairedTiming((1.0,), (1.0,), (1.0,), 1, [], [], None, [])
  three = timing.PairedTiming((1.0,), (1.0,), (1.0,), 3, [], [], None, [])
  with pytest.raises(ValueError, match="one repeat count"):
    timing.combine([one, three])
  with pytest.raises(ValueError, match="at least one"):
    timing.combine([])


def test_real_target_and_draft(llama):
  target, _, trained = llama
  options = dict(method="chain", num_draft_tokens=3)
  log = []

  def plain(ids):
    log.append("plain")
    return layerwave.generate(target, ids, 12, return_stats=True)

  def spec(ids):
    log.append("spec")
    return layerwave.speculative.generate(target, trained, ids, 12, **options)

  result = timing.paired_speedup(plain, spec, PROMPTS, 3, repeats=2)
  warm, pair, riap = ["plain", "spec"], ["plain", "spec"], ["spec", "plain"]
  assert log == warm + pair + riap + warm + pair + riap  # batches of 3 and 1: two shapes, two warm-ups
  ref = layerwave.generate(target, PROMPTS, 12)
  assert result.plain_outputs == ref and result.spec_outputs == ref  # greedy: identical outputs
  assert result.num_pairs == 4 and all(np.isfinite(r) and r > 0 for r in result.ratios)
  want = sum(np.asarray(layerwave.speculative.generate(target, trained, b, 12, **options)[1]
                        ["accept_length_hist"]) for b in (PROMPTS[:3], PROMPTS[3:]))
  assert result.accept_length_hist.tolist() == want.tolist()
  assert sum(r["verify_calls"] for r in result.per_batch) == want.sum()
  assert sum(r["new_tokens"] for r in result.per_batch) == sum(len(o) for o in ref)
  # Both loops report their steps: one prompt alone, speculation needs its verifications, plain decoding
  # one step per token after the prefill's.
  alone = result.per_batch[1]
  assert alone["steps"] == alone["verify_calls"] and alone["plain_steps"] in (len(ref[3]), len(ref[3]) - 1)
  assert alone["effective_tau"] == pytest.approx(alone["plain_steps"] / alone["steps"])
  assert result.summary()["iteration_cost"] > 0
  # Per prompt [emitted, verifications]: they add up to the histogram, and each prompt emitted its output.
  stats = np.asarray([p for r in result.per_batch for p in r["prompt_stats"]])
  assert stats.shape == (len(PROMPTS), 2) and stats[:, 1].sum() == want.sum()
  assert stats[:, 0].sum() == (want * np.arange(1, want.size + 1)).sum()
  assert all(e >= len(o) - 1 for (e, _), o in zip(stats, ref))  # the first token comes from the prefill
  assert result.summary()["speedup"] == pytest.approx(np.median(result.ratios))
