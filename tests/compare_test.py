"""layerwave.compare: layer sets against brute-force references, statistics, resumption, bad inputs.

The end-to-end test runs experiments/compare_layers.py (`:smoke` budget) on the tiny chat target of
tests/conftest.py (L = 8) once as a user does, then the same stage in this process: grown by a set (every
finished cell skipped), with a release, the dynamics and finalists, and the refusals of a typo, a cell of
another recipe and a different config.
"""

import dataclasses
import functools
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import ml_collections
import numpy as np
import pytest
from scipy import stats as scipy_stats

import layerwave
from layerwave import compare
from layerwave.compare import release as compare_release
from layerwave.compare import summary as compare_summary
from layerwave.compare import table as compare_table
from layerwave import layer_ids
from layerwave.analysis import report
from layerwave.speculative import evaluate
from layerwave.training import release as draft_release
from layerwave.training import options as training_options
from layerwave.training import restore

from tests import configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L = 12


def _record(seed=0, unfiltered=True):
  """A layer_stats.json-like record with a random entropy profile and a random PSD-ish CKA matrix."""
  rng = np.random.default_rng(seed)
  e = rng.uniform(1.0, 4.0, L + 1)
  x = rng.normal(size=(L + 1, 4))
  c = np.abs(np.corrcoef(x))
  stats = {"prompt_entropy": e.tolist(), "prompt_entropy_normalized": (e / 5).tolist(),
           "dataset_entropy": e.tolist(), "dataset_entropy_normalized": (e / 5).tolist(),
           "cka_minibatch": c.tolist(), "cka_exact": None, "num_tokens": 1000, "num_prompts": 10,
           "num_sequences": 10, "num_hsic_batches": 4, "num_exact_tokens": 0}
  e2 = e[::-1].copy()
  other = dict(stats, prompt_entropy=e2.tolist())
  return report.AnalysisRecord.from_content({
      "model": {"name": "m", "num_layers": L, "hidden_size": 64},
      "settings": {"selection": {"k": 3, "lam": 1.0, "min_gap": 0, "seed": 0, "include_embeddings": False,
                                 "include_final": False, "granularity": "prompt", "normalized_entropy": False,
                                 "cka": "minibatch"}},
      "compartments": {"blocks": [[1, 4], [4, 8], [8, 12]]},
      "filtered": stats, "unfiltered": other if unfiltered else None})


def _compare(**overrides):
  c = ml_collections.ConfigDict({
      "sets": "eagle3,entropy,greedy,exhaustive,compartment,nofilter,entropy_only,cka_only", "baseline": "eagle3",
      "ablation_strategy": "exhaustive", "lams": "0,0.5,4", "num_random": 2, "random_seed": 7,
      "manual": "1,2,3; 9,10,11", "seeds": 3, "speedup": False, "temperatures": "0,1"})
  c.update(overrides)
  return compare.CompareOptions.from_config(c)


def _brute(e, c, lam):
  """argmax over all 3-subsets of 1..L-1 of Σ Ê − λ Σ C (Ê min-max normalised over the candidates)."""
  cands = list(range(1, L))
  lo, hi = e[cands].min(), e[cands].max()
  e_hat = (e - lo) / (hi - lo)
  best = max(itertools.combinations(cands, 3),
             key=lambda s: e_hat[list(s)].sum() - lam * sum(c[a, b] for a, b in itertools.combinations(s, 2)))
  return tuple(best), e_hat


def test_layer_sets_match_brute_force_references():
  record = _record()
  e, c = record.filtered.prompt_entropy, record.filtered.cka_minibatch
  sets = {s.name: s for s in compare.layer_sets(record, _compare())}
  assert sets["eagle3"].ids == layer_ids.eagle3_layer_ids(L) == (2, 6, 9)
  assert sets["eagle3"].kind == "baseline" and sets["exhaustive"].kind == "strategy"
  best, e_hat = _brute(e, c, 1.0)
  assert sets["exhaustive"].ids == best
  assert sets["entropy"].ids == tuple(sorted(np.argsort(-e[1:L])[:3] + 1))
  assert sets["entropy_only"].ids == sets["entropy"].ids == sets["lam=0"].ids
  assert sets["lam=4"].ids == _brute(e, c, 4.0)[0]
  assert sets["nofilter"].ids == _brute(record.unfiltered.prompt_entropy, c, 1.0)[0]
  least = min(itertools.combinations(range(1, L), 3),
              key=lambda s: sum(c[a, b] for a, b in itertools.combinations(s, 2)))
  assert sets["cka_only"].ids == tuple(least)
  assert sets["manual-0"].ids == (1, 2, 3) and sets["manual-1"].ids == (9, 10, 11)
  for name in ("random-0", "random-1"):
    assert len(set(sets[name].ids)) == 3 and all(1 <= i < L for i in sets[name].ids)
  assert sets["random-0"].ids != sets["random-1"].ids
  for s in sets.values():  # the objective is the filtered statistics' Σ Ê − λ Σ C at the analysis' λ
    want = e_hat[list(s.ids)].sum() - sum(c[a, b] for a, b in itertools.combinations(s.ids, 2))
    assert s.objective == pytest.approx(want, abs=1e-12)
  assert sets["exhaustive"].objective >= max(s.objective for s in sets.values()) - 1e-12
  assert sets["exhaustive"].key == "L" + "-".join(map(str, best))


def test_other_ks_give_the_last_layer_the_objective_and_even_spacing():
  record = _record()
  e, c = record.filtered.prompt_entropy, record.filtered.cka_minibatch
  sets = {s.name: s for s in compare.layer_sets(record, _compare(sets="eagle3", lams="", num_random=0, manual="",
                                                                 ks="1,5"))}
  assert sets["last"].ids == (L,) and sets["last"].kind == "k"
  assert sets["even-k5"].ids == layer_ids.eagle3_layer_ids(L, 5) == (2, 4, 6, 7, 9)
  _, e_hat = _brute(e, c, 1.0)
  best = max(itertools.combinations(range(1, L), 5),
             key=lambda s: e_hat[list(s)].sum() - sum(c[a, b] for a, b in itertools.combinations(s, 2)))
  assert sets["exhaustive-k5"].ids == best
  assert sets["exhaustive-k5"].objective >= sets["even-k5"].objective
  # Spearman stays over the baseline's k: the k = 1 and k = 5 sets are left out of it.
  cfg = _compare(sets="eagle3,exhaustive,entropy", lams="", num_random=0, manual="", ks="1,5")
  all_sets = compare.layer_sets(record, cfg)
  results = {(s.key, 0): _result(1.0 + 0.1 * i, 1.0, 1.0) for i, s in enumerate({s.key: s for s in all_sets}.values())}
  summary = compare.summarize(all_sets, results, [0], cfg, {"mtbench": None})
  k3 = {tuple(s.ids) for s in all_sets if len(s.ids) == 3}
  assert summary.spearman_objective["T0/all"].num_sets == len(k3)
  assert summary.spearman_objective["T0/all"].k == 3


def test_budgets_scale_the_schedule_and_name_their_sets():
  from layerwave.training.options import Recipe
  recipe = Recipe.from_config(_config())
  t = dataclasses.replace(recipe.train, num_steps=400, warmup_steps=40, schedule_steps=0, stop_after=7)
  recipe = dataclasses.replace(recipe, train=t)
  quarter = compare.cell_recipe(recipe, 2, 0.25)
  assert (quarter.seed, quarter.train.num_steps, quarter.train.warmup_steps, quarter.train.schedule_steps,
          quarter.train.stop_after) == (2, 100, 10, 0, 0)
  assert quarter.train.batch_size == t.batch_size and quarter.data == recipe.data
  assert compare.cell_recipe(recipe, 0).train == dataclasses.replace(t, stop_after=0)
  assert compare.cell_recipe(recipe, 0, 4.0).train.num_steps == 1600
  sets = compare.layer_sets(_record(), _compare(sets="eagle3,exhaustive,entropy", lams="", num_random=0, manual=""))
  assert compare.dynamics_sets(sets, _compare()) == []
  chosen = compare.dynamics_sets(sets, _compare(budgets="0.25,4", budget_sets="exhaustive,eagle3"))
  assert [s.name for s in chosen] == ["exhaustive", "eagle3"]
  with pytest.raises(ValueError, match="must include the baseline 'eagle3'"):
    compare.dynamics_sets(sets, _compare(budgets="4", budget_sets="exhaustive"))
  with pytest.raises(ValueError, match=r"budget_sets names \['bogus'\]"):
    compare.dynamics_sets(sets, _compare(budgets="4", budget_sets="eagle3,bogus"))


@pytest.mark.parametrize("overrides, message", [
    ({"ks": "0"}, "compare.ks holds 0"),
    ({"budgets": "0.5,0"}, "compare.budgets holds 0"),
    ({"sets": "eagle3,bogus"}, "neither a strategy"),
    ({"manual": "1,2,99"}, "not a valid layer set"),
    ({"manual": "1,1,2"}, "not a valid layer set"),
    ({"manual": "a,b"}, "';'-separated id lists"),
    ({"baseline": "greedy", "sets": "eagle3"}, "compare.baseline='greedy' is not among"),
    ({"lams": "-1"}, "λ must be >= 0"),
    ({"lams": "x"}, "comma-separated numbers"),
    ({"ablation_strategy": "random"}, "ablation_strategy must be"),
    ({"num_random": -1}, "num_random must be >= 0"),
])
def test_layer_sets_bad_inputs(overrides, message):
  with pytest.raises(ValueError, match=message):
    compare.layer_sets(_record(), _compare(**overrides))


def test_compare_options_parse_the_section_once():
  for variant, name in (("smoke", "smollm2_135m"), ("compare", "smollm2_135m"), ("demo", "smollm2_135m"),
                        ("paper", "smollm2_135m"), ("paper", "gemma3_270m")):
    section = configs.load(variant, name).compare
    opts = compare.CompareOptions.from_config(section)
    assert opts.sets == section.sets and opts.seeds == section.seeds
    assert {f for f in section.keys()} == {f.name for f in dataclasses.fields(opts)}
  opts = compare.CompareOptions.from_config(ml_collections.ConfigDict(
      {"sets": ("eagle3", "greedy"), "lams": (0.5,), "temperatures": "0, 1", "manual": "2,3,4;5, 6,7"}))
  assert opts.sets == ("eagle3", "greedy") and opts.lams == (0.5,) and opts.temperatures == (0.0, 1.0)
  assert opts.manual == ((2, 3, 4), (5, 6, 7)) and opts.seed_list == [0]
  # What ml_collections makes of --config.compare.sets=eagle3,greedy, --config.compare.lams=0.25,4,
  # --config.compare.lams= and --config.compare.temperatures=0; a tuple of tuples for manual.
  opts = compare.CompareOptions.from_config(ml_collections.ConfigDict(
      {"sets": ("eagle3,greedy",), "lams": ("",), "temperatures": (0,), "manual": ((2, 3, 4), (5, 6, 7))}))
  assert opts.sets == ("eagle3", "greedy") and opts.lams == () and opts.temperatures == (0.0,)
  assert opts.manual == ((2, 3, 4), (5, 6, 7))
  assert compare.CompareOptions.from_config(ml_collections.ConfigDict(
      {"lams": (0.25, 4), "datasets": ("mtbench", "gsm8k")})).lams == (0.25, 4.0)


@pytest.mark.parametrize("overrides, message", [
    ({"seeds": 0}, r"compare\.seeds must be >= 1"),
    ({"datasets": "mtbench,gsm9k"}, r"compare\.datasets names 'gsm9k'"),
    ({"datasets": ""}, r"compare\.datasets is empty"),
    ({"temperatures": "0,-1"}, r"compare\.temperatures must list temperatures >= 0"),
    ({"max_new_tokens": 0}, r"compare\.max_new_tokens must be >= 1"),
    ({"finalists": 3, "keep_checkpoints": False}, r"compare\.finalists .* needs their checkpoints"),
    ({"finalists": 3, "finalist_seeds": 2, "seeds": 1}, r"compare\.finalist_seeds in \[1, compare\.seeds=1\]"),
    ({"finalist_prompts": 0}, r"compare\.finalist_prompts >= 1"),
    ({"release_batch_size": 0}, r"compare\.release_batch_size must be >= 1"),
    ({"num_prompts": 0}, r"compare\.num_prompts=0 decodes no prompt .* set compare\.sort_by=sim_tau"),
    ({"num_prompts": 0, "sort_by": "sim_tau", "speedup": True}, r"no speculative τ to sort by nor speedup"),
    ({"num_prompts": 0, "sort_by": "sim_tau", "release": "x"}, r"compare\.release=''"),
])
def test_compare_options_refuse_bad_values_naming_the_field(overrides, message):
  with pytest.raises(ValueError, match=message):
    _compare(**{"datasets": "mtbench", "max_new_tokens": 8, **overrides})


def test_nofilter_needs_unfiltered_statistics():
  with pytest.raises(ValueError, match="no 'unfiltered' statistics"):
    compare.layer_sets(_record(unfiltered=False), _compare())


def test_mean_ci_is_the_student_t_interval():
  m = compare.mean_ci([1.0, 2.0, 3.0])
  # t_{0.975, 2} = 4.302653; sd = 1.
  assert m["mean"] == pytest.approx(2.0) and m["ci95"] == pytest.approx(4.302653 / np.sqrt(3), rel=1e-6)
  one = compare.mean_ci([1.5])
  assert one["mean"] == 1.5 and np.isnan(one["ci95"]) and compare.mean_ci([])["n"] == 0


def _result(tau0, tau1, sim, acc=(0.5, 0.2)):
  return {"train": {"heldout_sim_tau": sim},
          "eval": {"T0/mtbench": {"tau": tau0, "acceptance": list(acc)},
                   "T0/all": {"tau": tau0, "acceptance": list(acc)},
                   "T1/mtbench": {"tau": tau1}, "T1/all": {"tau": tau1}}}


def test_summarize_paired_differences_and_spearman(tmp_path):
  cfg = _compare(sets="eagle3,exhaustive,entropy", lams="", num_random=0, manual="1,2,3")
  sets = compare.layer_sets(_record(), cfg)
  by_name = {s.name: s for s in sets}
  # τ rises with the objective: Spearman must be +1 across the distinct sets.
  order = sorted({s.key: s for s in sets}.values(), key=lambda s: s.objective)
  tau = {s.key: 1.0 + 0.1 * i for i, s in enumerate(order)}
  results = {}
  for seed in range(3):
    for s in order:
      results[(s.key, seed)] = _result(tau[s.key] + 0.01 * seed, 1.0, tau[s.key] + 0.02 * seed)
  summary = compare.summarize(sets, results, [0, 1, 2], cfg, {"mtbench": None})
  assert summary.spearman_objective["T0/all"].rho == pytest.approx(1.0)
  assert summary.spearman_objective["T0/all"].num_sets == len(order)
  base = by_name["eagle3"].key
  for name, s in by_name.items():
    diff = summary.row(name).vs_baseline["T0/all"]
    assert diff.mean == pytest.approx(tau[s.key] - tau[base])
    assert diff.values == pytest.approx([tau[s.key] - tau[base]] * 3)
    assert summary.row(name).metrics["T0/all"].mean == pytest.approx(tau[s.key] + 0.01)
    assert summary.row(name).acceptance == pytest.approx([0.5, 0.2])
  table = compare.markdown_table(summary)
  assert "(baseline)" in table and "ρ = +1.00" in table and "τ T1/all" in table and "Δ sim τ vs eagle3" in table
  # Sorted by held-out sim τ instead: the first row is the set of highest sim τ.
  first_ids = lambda t: [l for l in t.splitlines() if l.startswith("| ")][1].split("|")[2].strip()  # noqa: E731
  flipped = dataclasses.replace(summary, rows=tuple(  # sim τ ordered against τ, so the two sorts disagree
      dataclasses.replace(r, metrics={**r.metrics, "sim_tau": dataclasses.replace(r.metrics["sim_tau"],
                                                                                  mean=-r.metrics["T0/all"].mean)})
      for r in summary.rows))
  best_sim = max(flipped.rows, key=lambda r: r.metrics["sim_tau"].mean).ids
  assert first_ids(compare.markdown_table(dataclasses.replace(flipped, sort_by="sim_tau"))) == ",".join(
      map(str, best_sim))
  assert first_ids(compare.markdown_table(flipped)) != ",".join(map(str, best_sim))
  lines = [l for l in table.splitlines() if l.startswith("| ")][1:]
  assert lines[0].split("|")[1].strip().strip("*") == order[-1].name or tau[order[-1].key] == max(tau.values())
  # Cells that decoded nothing (compare.num_prompts=0, held-out sim τ alone): no τ columns, the seeds counted
  # from sim τ, and no Spearman against a τ that was not measured.
  sim_only = compare.summarize(sets, {key: dict(r, eval={}) for key, r in results.items()}, [0, 1, 2],
                               dataclasses.replace(cfg, num_prompts=0, sort_by="sim_tau"), {})
  table = compare.markdown_table(dataclasses.replace(sim_only, sort_by="sim_tau"))
  header, _, first = [l for l in table.splitlines() if l.startswith("| ")][:3]
  assert header.split("|")[1:6] == [" set ", " layers ", " k ", " seeds ", " objective "]
  assert "τ T0" not in header and "held-out sim τ" in header and first.split("|")[4].strip() == "3"
  assert "Spearman(selection objective, sim_tau)" in table and "T0/all" not in table
  # A partial run: one seed missing for one set.
  del results[(order[0].key, 2)]
  partial = compare.summarize(sets, results, [0, 1, 2], cfg, {"mtbench": None})
  assert partial.row(order[0].name).metrics["T0/all"].n == 2


@pytest.mark.parametrize("n", [3, 4, 7, 9, 10, 13])
def test_spearman_p_is_exact_for_few_sets_and_scipys_above(n):
  rng = np.random.default_rng(n)
  x = rng.permutation(n).astype(float)
  for y in (x + 0.1, -x, x + rng.normal(0, n / 2, n), np.round(rng.normal(0, 1, n), 0)):  # ρ = +1, −1, some, ties
    got = compare.spearman(list(zip(x, y)), 3)
    want = scipy_stats.spearmanr(x, y)
    assert got.rho == pytest.approx(want.statistic) and got.num_sets == n
    if n <= compare_summary.EXACT_SPEARMAN_MAX:
      ry = scipy_stats.rankdata(y) - scipy_stats.rankdata(y).mean()

      def rho(a, axis=-1):  # Spearman's ρ of each row of a against y: the Pearson correlation of their ranks
        ra = scipy_stats.rankdata(a, axis=axis)
        ra = ra - ra.mean(axis=axis, keepdims=True)
        return (ra @ ry) / np.sqrt((ra * ra).sum(axis=axis) * (ry @ ry))

      exact = scipy_stats.permutation_test((x,), rho, permutation_type="pairings", vectorized=True,
                                           n_resamples=400_000)
      assert got.p == pytest.approx(exact.pvalue, abs=1e-9)
    else:
      assert got.p == pytest.approx(want.pvalue)
  # The case that made the t approximation useless: three sets in perfect order are 2 of 6 orderings.
  assert compare.spearman([(1, 1), (2, 2), (3, 3)], 3).p == pytest.approx(1 / 3)


def test_predictors_by_hand_and_their_spearman():
  record = _record()
  e = np.asarray(record.filtered.prompt_entropy, np.float64)
  c = np.asarray(record.filtered.cka_minibatch, np.float64)
  cands = list(record.candidates)
  e_hat = (e - e[cands].min()) / (e[cands].max() - e[cands].min())
  got = compare.set_predictors(record, (3, 7, 10))
  assert got["informativeness Σ Ê"] == pytest.approx(e_hat[3] + e_hat[7] + e_hat[10])
  assert got["redundancy Σ C"] == pytest.approx(c[3, 7] + c[3, 10] + c[7, 10])
  assert got["deepest layer"] == 10 and got["distance to the last layer"] == L - 10
  assert got["filtered entropy of the deepest layer"] == pytest.approx(e[10])
  assert got["spread (deepest − shallowest)"] == 7 and got["mean depth"] == pytest.approx(20 / 3)
  assert compare.set_predictors(record, (L,))["redundancy Σ C"] == 0.0  # k = 1: no pairs
  # sim τ rising with the deepest layer: ρ = +1 for depth, −1 for the distance to the last layer.
  cfg = _compare(sets="eagle3", lams="", num_random=4, manual="1,2,3")
  sets = compare.layer_sets(record, cfg)
  distinct = list({s.key: s for s in sets}.values())
  results = {(s.key, 0): _result(1.5, 1.2, 1.0 + 0.01 * max(s.ids) + 0.001 * np.mean(s.ids)) for s in distinct}
  summary = compare.summarize(sets, results, [0], cfg, {"mtbench": None},
                              predictors={s.name: compare.set_predictors(record, s.ids) for s in sets})
  preds = summary.spearman_predictors
  sim = [results[(s.key, 0)]["train"]["heldout_sim_tau"] for s in distinct]
  want = scipy_stats.spearmanr([max(s.ids) for s in distinct], sim)
  assert preds["deepest layer"]["sim_tau"].rho == pytest.approx(want.statistic) and want.statistic > 0.9
  # 6 sets: the exact p (every pairing), which scipy's permutation test enumerates independently.
  exact = scipy_stats.permutation_test(([max(s.ids) for s in distinct],),
                                       lambda x: scipy_stats.spearmanr(x, sim).statistic,
                                       permutation_type="pairings", n_resamples=10_000)
  assert preds["deepest layer"]["sim_tau"].p == pytest.approx(exact.pvalue)
  assert preds["distance to the last layer"]["sim_tau"].rho == pytest.approx(-want.statistic)
  assert preds["deepest layer"]["sim_tau"].num_sets == len(distinct) == 6
  assert np.isnan(preds["deepest layer"]["T0/all"].rho)  # τ constant across sets: undefined, not an error
  table = compare.markdown_table(summary)
  assert "What predicts τ" in table and "| selection objective Σ Ê − λ Σ C |" in table
  assert "Strongest candidate against sim τ" in table


def test_auto_dynamics_are_the_baseline_the_three_best_and_the_two_worst():
  cfg = _compare(sets="eagle3,exhaustive,entropy,greedy", lams="0.5", num_random=3, manual="1,2,3;9,10,11",
                 seeds=1, budgets="0.25,4", budget_sets="auto")
  sets = compare.layer_sets(_record(), cfg)
  assert compare.dynamics_sets(sets, cfg) == []  # chosen only once the 1x cells are done
  distinct = list({s.key: s for s in sets}.values())
  sim = {s.key: 1.0 + 0.01 * i for i, s in enumerate(distinct)}
  results = {(s.key, 0): _result(1.5, 1.2, sim[s.key]) for s in distinct}
  summary = compare.summarize(sets, results, [0], cfg, {"mtbench": None})
  got = compare.auto_dynamics_sets(sets, summary, cfg)
  base = next(s for s in sets if s.name == "eagle3")
  others = sorted((s for s in distinct if s.key != base.key), key=lambda s: -sim[s.key])
  assert len(others) >= 5
  assert [s.key for s in got] == [base.key] + [s.key for s in others[:3]] + [s.key for s in others[-2:]]
  # Named sets beside auto join the chosen ones (once, wherever they rank); unknown names fail up front.
  middle = next(s for s in sets if s.key == others[3].key)  # ranked 4th: not among auto's own
  named = dataclasses.replace(cfg, budget_sets=("auto", middle.name, "eagle3"))
  assert compare.dynamics_sets(sets, named) == []
  assert [s.key for s in compare.auto_dynamics_sets(sets, summary, named)] == [s.key for s in got] + [middle.key]
  with pytest.raises(ValueError, match=r"budget_sets names \['bogus'\]"):
    compare.dynamics_sets(sets, dataclasses.replace(cfg, budget_sets=("auto", "bogus")))


def test_paired_bootstrap_resamples_prompts_as_a_plain_loop_does():
  rng = np.random.default_rng(3)
  calls = rng.integers(5, 30, size=40)
  base = np.stack([calls * 2 + rng.integers(0, 5, 40), calls], 1)
  better = np.stack([base[:, 0] + calls // 3, calls], 1)  # ~+0.33 tokens per verification on every prompt
  got = compare.paired_bootstrap(better, base, num=500, seed=7)
  # The reference: the same resamples, one at a time, τ as Σ emitted / Σ calls in float64.
  idx = np.random.default_rng(7).integers(0, 40, (500, 40))
  ref = [better[i, 0].sum() / better[i, 1].sum() - base[i, 0].sum() / base[i, 1].sum() for i in idx]
  assert got["lo"] == pytest.approx(np.percentile(ref, 2.5)) and got["hi"] == pytest.approx(np.percentile(ref, 97.5))
  assert got["delta"] == pytest.approx(better[:, 0].sum() / calls.sum() - base[:, 0].sum() / calls.sum())
  assert 0 < got["lo"] < got["delta"] < got["hi"] and got["p_le_0"] == 0.0 and got["prompts"] == 40
  same = compare.paired_bootstrap(base, base)
  assert same["delta"] == same["lo"] == same["hi"] == 0.0 and same["p_le_0"] == 1.0
  with pytest.raises(ValueError, match="the same prompts for both"):
    compare.paired_bootstrap(base, base[:-1])


def test_finalists_are_the_best_by_sim_tau_then_the_baseline():
  cfg = _compare(sets="eagle3,exhaustive,entropy,greedy", lams="", num_random=2, manual="1,2,3", finalists=2,
                 seeds=2)
  sets = compare.layer_sets(_record(), cfg)
  distinct = list({s.key: s for s in sets}.values())
  sim = {s.key: 1.0 + 0.1 * i for i, s in enumerate(distinct)}
  results = {(s.key, seed): _result(1.5, 1.2, sim[s.key]) for s in distinct for seed in range(2)}
  summary = compare.summarize(sets, results, [0, 1], cfg, {"mtbench": None})
  chosen = compare.choose_finalists(sets, summary, cfg)
  base = next(s for s in sets if s.name == "eagle3")
  best = [s.key for s in sorted(distinct, key=lambda s: -sim[s.key]) if s.key != base.key][:2]
  assert [s.key for s in chosen] == best + [base.key] and chosen[-1].name == "eagle3"
  # Per prompt [emitted, calls]: the first finalist emits one more token per prompt than the baseline, per seed.
  stats = lambda extra: [[10 + extra, 4], [7 + extra, 3], [12 + extra, 6]]  # noqa: E731
  evals = {(s.key, seed): {"eval": {"T0/mtbench": {"prompt_stats": stats(extra)},
                                    "T0/all": {"prompt_stats": stats(extra)}}}
           for s, extra in zip(chosen, (1, 0, 0)) for seed in range(2)}
  out = compare.finalist_summary(chosen, evals, [0, 1], dataclasses.replace(cfg, temperatures=(0.0,)), ["mtbench"])
  rows = {r["name"]: r for r in out["rows"]}
  first = rows[chosen[0].name]
  assert first["tau"]["T0/all"] == pytest.approx(32 / 13) and first["seeds"] == 2
  assert first["vs_baseline"]["T0/all"]["delta"] == pytest.approx(32 / 13 - 29 / 13)
  assert first["vs_baseline"]["T0/all"]["lo"] > 0 and "T0/all" not in rows["eagle3"]["vs_baseline"]
  table = "\n".join(compare_table._finalist_lines(out))
  assert "| **eagle3** |" in table and "paired bootstrap over prompts" in table
  assert compare_table._finalist_lines({"pending": 4})[1].endswith("(4 cells to go).")


def _config():
  return configs.load("smoke")


def _smoke_config(target_dir):
  c = configs.load("smoke")
  c.model = target_dir
  return c


def test_workdir_of_a_different_config_is_refused(tmp_path):
  config = _config()
  compare.check_workdir(str(tmp_path), config)
  grown = _config()
  grown.compare.sets = ("eagle3", "exhaustive", "greedy")
  grown.compare.seeds = 3
  compare.check_workdir(str(tmp_path), grown)  # more sets / seeds: the same cells, resumable
  other = _config()
  other.train.lr = 0.5
  with pytest.raises(ValueError, match=r"different config .*train\.lr"):
    compare.check_workdir(str(tmp_path), other)
  buckets = _config()  # the analysis the sweep runs, in length buckets: other HSIC minibatches
  buckets.analysis.bucket_widths = (64,)
  with pytest.raises(ValueError, match=r"different config .*analysis\.bucket_widths"):
    compare.check_workdir(str(tmp_path), buckets)
  # An older comparison: finished cells but no compare.json to check them against.
  old = tmp_path / "old-sweep"
  (old / "cells" / "L2-15-27" / "seed0").mkdir(parents=True)
  (old / "cells" / "L2-15-27" / "seed0" / "result.json").write_text("{}")
  with pytest.raises(ValueError, match="finished cells but no compare.json: a comparison of an older layerwave"):
    compare.check_workdir(str(old), config)
  assert not (old / "compare.json").exists()


def test_timing_repeats_fix_the_cells_only_when_speedups_are_timed(tmp_path):
  config = _config()  # :smoke times speedups
  compare.check_workdir(str(tmp_path / "timed"), config)
  other = _config()
  other.speculate.timing_repeats = 5
  with pytest.raises(ValueError, match=r"speculate\.timing_repeats"):
    compare.check_workdir(str(tmp_path / "timed"), other)
  untimed = _config()
  untimed.compare.speedup = False
  compare.check_workdir(str(tmp_path / "untimed"), untimed)
  resumed = _config()
  resumed.compare.speedup = False
  resumed.speculate.timing_repeats = 7
  compare.check_workdir(str(tmp_path / "untimed"), resumed)  # nothing is timed: the same cells


def _timed_eval(speedup, p25, p75, pairs=3):
  row = {"tau": 1.2, "acceptance": [0.2], "speedup": speedup, "speedup_p25": p25, "speedup_p75": p75,
         "timing_pairs": pairs, "equal_to_ar": 1.0}
  return {"train": {"heldout_sim_tau": 1.1}, "eval": {"T0/mtbench": row, "T0/all": row}}


@pytest.mark.parametrize("seeds", [1, 3])
def test_table_says_how_speedups_were_timed(seeds):
  cfg = _compare(sets="eagle3,exhaustive", lams="", num_random=0, manual="", speedup=True, temperatures="0",
                 seeds=seeds)
  sets = compare.layer_sets(_record(), cfg)
  results = {(s.key, seed): _timed_eval(0.5 + 0.1 * seed, 0.45 + 0.1 * seed, 0.6 + 0.1 * seed)
             for s in sets for seed in range(seeds)}
  summary = compare.summarize(sets, results, list(range(seeds)), cfg, {"mtbench": None})
  row = summary.rows[0].metrics
  assert row["speedup:T0/all"].mean == pytest.approx(0.5 + 0.1 * (seeds - 1) / 2)
  assert row["timing_pairs:T0/all"].values == (3,) * seeds
  table = compare.markdown_table(summary)
  assert "timed in alternation on the same batches inside each cell" in table
  assert "the median of 3 pair ratios, [p25, p75] of the pairs with one seed" in table
  line = next(l for l in table.splitlines() if l.startswith("| **eagle3**"))
  if seeds == 1:
    assert line.endswith("| 0.50 [0.45, 0.60] | 100% |")
  else:  # between-seed spread instead
    assert "| 0.600 ± 0.248 | 100% |" in line and "[" not in line


def test_evaluate_draft_pairs_plain_and_speculative_calls(monkeypatch):
  log = []

  def plain(target, ids, max_new_tokens, **kw):
    log.append(("plain", len(ids)))
    assert kw["return_stats"] and kw["temperature"] == 0 and kw["prompt_width"] == 9
    return [[7] * 4 for _ in ids], {"steps": 4}

  def spec(target, draft, ids, max_new_tokens, **kw):
    log.append(("spec", len(ids)))
    assert kw["prompt_width"] == 9 and kw["method"] == "chain"
    out = [[7] * 4 if p[0] != 3 else [8] * 4 for p in ids]  # prompt [3] differs from plain decoding
    return out, {"accept_length_hist": [len(ids), 1, 0, 0], "tau": 1.2, "verify_calls": len(ids) + 1}

  monkeypatch.setattr(evaluate, "plain_generate", plain)
  monkeypatch.setattr(evaluate, "speculative_generate", spec)
  config = _config()
  settings = evaluate.DecodeSettings.from_config(config.speculate, max_new_tokens=4, prompt_width=9)
  prompts = {"mtbench": [[1, 2], [3], [4, 5, 6]], "gsm8k": [[5]]}  # batch_size 2: batches 2+1, then 1
  result = compare.evaluate_draft(None, None, prompts, settings, [0.0], 0, speedup=True)
  names = [n for n, _ in log]
  warm, pairs = ["plain", "spec"], ["plain", "spec", "spec", "plain", "plain", "spec"]
  assert names[:2 + 6] == warm + pairs and len(names) == 3 * (2 + 6)
  mt, gsm, pooled = result["T0/mtbench"], result["T0/gsm8k"], result["T0/all"]
  assert (mt["timing_pairs"], gsm["timing_pairs"], pooled["timing_pairs"]) == (6, 3, 9)
  assert mt["speedup_p25"] <= mt["speedup"] <= mt["speedup_p75"] and "ABBA" in mt["timing"]
  assert mt["equal_to_ar"] == pytest.approx(2 / 3) and pooled["equal_to_ar"] == pytest.approx(3 / 4)
  assert mt["accept_length_hist"] == [3, 2, 0, 0] and pooled["accept_length_hist"] == [4, 3, 0, 0]
  log.clear()
  untimed = compare.evaluate_draft(None, None, prompts, settings, [0.0], 0, speedup=False)
  assert {n for n, _ in log} == {"spec"} and len(log) == 3 and "speedup" not in untimed["T0/all"]
  assert untimed["T0/all"]["tau"] == pooled["tau"]


def test_finalists_decode_once_and_only_what_is_new(monkeypatch, tmp_path):
  log = []

  def spec(target, draft, ids, max_new_tokens, **kw):
    log.append((draft, kw["temperature"], len(ids)))
    lengths = [[2, 1] if draft == "L1-2-3" else [0, 0] for _ in ids]  # the first finalist accepts more
    hist = [sum(r.count(m) for r in lengths) for m in range(4)]
    return [[7] * 3 for _ in ids], {"accept_length_hist": hist, "tau": 1.0, "verify_calls": 2 * len(ids),
                                    "accept_lengths": lengths}

  monkeypatch.setattr(evaluate, "speculative_generate", spec)
  monkeypatch.setattr(restore, "load_draft", lambda cell_dir, target: os.path.basename(
      os.path.dirname(cell_dir)))
  monkeypatch.setattr(compare.cells, "eval_prompts", lambda cmp, tokenizer, chat_format, **_: {
      "mtbench": [[1] * (i + 1) for i in range(cmp.num_prompts)]})
  cfg = _compare(sets="eagle3", lams="", num_random=0, manual="1,2,3", seeds=1, finalists=1, finalist_prompts=3,
                 temperatures="0")
  sets = compare.layer_sets(_record(), cfg)
  results = {(s.key, 0): _result(1.5, 1.2, 2.0 if s.name == "manual-0" else 1.0) for s in sets}
  summary = compare.summarize(sets, results, [0], cfg, {"mtbench": None})
  for s in sets:
    os.makedirs(tmp_path / "cells" / s.key / "seed0" / "checkpoints")
  settings = evaluate.DecodeSettings.from_config(_config().speculate, max_new_tokens=3, prompt_width=3)

  def run(c):
    return compare.run_finalists(SimpleNamespace(tokenizer=None), sets, results, summary, c, settings,
                                 compare.finalist_prompts(c, None), str(tmp_path))

  out = run(cfg)
  assert [r["name"] for r in out["rows"]] == ["manual-0", "eagle3"] and len(log) == 4  # 2 drafts x 2 batches
  d = out["rows"][0]["vs_baseline"]["T0/all"]
  assert d["delta"] == pytest.approx(2.5 - 1.0) and d["prompts"] == 3
  log.clear()
  assert run(cfg)["rows"] == out["rows"] and log == []  # kept: nothing decodes again
  both = run(dataclasses.replace(cfg, finalist_temperatures=(0.0, 1.0)))
  assert {t for _, t, _ in log} == {1.0} and "T1/all" in both["rows"][0]["tau"]  # only the new temperature
  log.clear()
  run(dataclasses.replace(cfg, finalist_prompts=4))
  assert sum(n for _, _, n in log) == 2 * 4  # other prompts: decoded anew
  with pytest.raises(ValueError, match="needs their checkpoints"):
    dataclasses.replace(cfg, keep_checkpoints=False)
  shutil.rmtree(tmp_path / "finalists")
  shutil.rmtree(tmp_path / "cells" / "L1-2-3" / "seed0" / "checkpoints")
  with pytest.raises(FileNotFoundError, match="has no checkpoint"):
    run(cfg)


def _compare_in_process(target_dir, workdir, caplog, **overrides):
  """compare.run as the launcher runs it (`:smoke`, `--config.compare.K=V` for each override); its log."""
  config = _smoke_config(target_dir)
  for key, value in overrides.items():
    section, field = key.split("__")
    config[section][field] = value
  caplog.clear()
  with caplog.at_level(logging.INFO):
    compare.run(config, workdir)
  return caplog.text


def test_compare_layers_smoke_runs_resumes_and_grows(tiny_chat_target_dir, tmp_path, caplog, monkeypatch):
  """The launcher once (a subprocess, as a user runs it), then the same stage in this process: resumed, grown,
  with a release, the dynamics and finalists, and the refusals (no second import of JAX per phase)."""
  workdir = str(tmp_path / "w")
  base = [sys.executable, os.path.join(ROOT, "experiments", "compare_layers.py"),
          "--config=" + os.path.join(ROOT, "configs", "smollm2_135m.py") + ":smoke",
          "--config.model=" + tiny_chat_target_dir, "--workdir=" + workdir]
  subprocess.run(base, check=True, cwd=ROOT, timeout=600)
  with open(os.path.join(workdir, "results.json")) as f:
    summary = json.load(f)
  rows = {r["name"]: r for r in summary["rows"]}
  assert set(rows) == {"eagle3", "exhaustive"} and rows["eagle3"]["ids"] == [2, 4, 5]
  assert summary["cells_done"] == 2
  for r in rows.values():
    tau = r["metrics"]["T0/all"]["mean"]
    assert 1.0 <= tau <= 1 + 3  # K = 3 drafted tokens + the bonus
    assert len(r["acceptance"]) == 3
    assert r["metrics"]["speedup:T0/all"]["mean"] > 0
    assert r["metrics"]["timing_pairs:T0/all"]["values"] == [3]  # one batch of 2 prompts, 3 repeats
    assert r["metrics"]["equal_to_ar:T0/all"]["mean"] == 1.0
  with open(os.path.join(workdir, "cells", "L2-4-5", "seed0", "result.json")) as f:
    cell = json.load(f)
  assert cell["eval"]["T0/mtbench"]["equal_to_ar"] == 1.0  # greedy speculative output == plain decoding
  timed = cell["eval"]["T0/mtbench"]
  assert timed["speedup_p25"] <= timed["speedup"] <= timed["speedup_p75"]
  assert timed["timing"].startswith("paired: median of 3 interleaved (ABBA) pairs")
  cells = [os.path.join(workdir, "cells", "L2-4-5", "seed0", "result.json")]
  stamp = os.path.getmtime(cells[0])
  with open(os.path.join(workdir, "plots", "compare.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  with open(os.path.join(workdir, "results.md")) as f:
    table = f.read()
  assert "| **eagle3** | 2,4,5 |" in table and "the median of 3 pair ratios" in table
  assert "Released draft" not in table  # :smoke names no release
  # The eagle3 cell's draft released (bf16) into a releases folder of the test's own.
  target = layerwave.load_target(tiny_chat_target_dir)
  releases = tmp_path / "releases"
  draft_release.write(restore.load_draft(os.path.join(workdir, "cells", "L2-4-5", "seed0"), target),
                      target, str(releases / "tiny-eagle3"), model=tiny_chat_target_dir)
  monkeypatch.setenv("LAYERWAVE_RELEASES", str(releases))
  run = functools.partial(_compare_in_process, tiny_chat_target_dir, workdir, caplog)
  # Rerun with one more manual set and the release: finished cells are skipped, only the new one trains, and
  # the released draft decodes the same prompts beside them.
  manual = next(s for s in ([5, 6, 7], [1, 2, 3]) if s not in [r["ids"] for r in rows.values()])  # a new set
  manual_flag = ",".join(map(str, manual))
  log = run(compare__manual=manual_flag, compare__release="tiny-eagle3")
  assert os.path.getmtime(cells[0]) == stamp
  assert "Cell 1/3" not in log and f"Cell 3/3: manual-0 {manual} seed 0" in log
  with open(os.path.join(workdir, "results.json")) as f:
    summary = json.load(f)
  assert summary["cells_done"] == 3
  released = summary["release"]["eval"]["T0/all"]
  assert released["equal_to_ar"] == 1.0 and 1.0 <= released["tau"] <= 4 and released["speedup"] > 0
  # Decoded one prompt a call (compare.release_batch_size): 3 timed pairs for each prompt's batch.
  assert summary["release"]["batch_size"] == 1 and summary["release"]["layer_ids"] == [2, 4, 5]
  assert released["timing_pairs"] == 3 * summary["eval_settings"]["prompts_per_dataset"]
  with open(os.path.join(workdir, "results.md")) as f:
    assert "Released draft `tiny-eagle3` (layers 2,4,5, bfloat16, chain of 3 at batch 1): τ T0/all" in f.read()
  # The dynamics: eagle3 again at half the steps; only that cell trains.
  # With the finalists: the best set by sim τ and eagle3 decode 3 prompts each, paired by prompt.
  log = run(compare__manual=manual_flag, compare__budgets=(0.5,), compare__budget_sets=("eagle3",),
            compare__finalists=1, compare__finalist_prompts=3, compare__finalist_temperatures=(0.0, 1.0))
  assert "Cell 4/4: eagle3 [2, 4, 5] seed 0 budget x0.5" in log and "Cell 3/4" not in log
  with open(os.path.join(workdir, "cells", "L2-4-5", "x0.5", "seed0", "result.json")) as f:
    halved = json.load(f)
  full_steps = cell["train"]["step"]
  assert halved["budget"] == 0.5 and halved["train"]["step"] == max(1, round(full_steps / 2)) < full_steps
  with open(os.path.join(workdir, "results.json")) as f:
    dynamics = json.load(f)["dynamics"]
  assert list(dynamics) == ["x0.5", "x1"] and [r["name"] for r in dynamics["x1"]["rows"]] == ["eagle3"]
  assert dynamics["x0.5"]["rows"][0]["sim_tau"]["values"] == [halved["train"]["heldout_sim_tau"]]
  with open(os.path.join(workdir, "results.json")) as f:
    finalists = json.load(f)["finalists"]
  assert [r["name"] for r in finalists["rows"]][-1] == "eagle3" and len(finalists["rows"]) == 2
  assert finalists["prompts_per_dataset"] == {"mtbench": 3}
  winner = finalists["rows"][0]
  assert 1.0 <= winner["tau"]["T0/all"] <= 4 and winner["vs_baseline"]["T0/all"]["prompts"] == 3
  assert finalists["temperatures"] == ["T0", "T1"] and 1.0 <= winner["tau"]["T1/all"] <= 4
  with open(os.path.join(workdir, "finalists", "L2-4-5", "seed0.json")) as f:
    assert len(json.load(f)["eval"]["T0/all"]["prompt_stats"]) == 3
  assert len(cell["eval"]["T0/all"]["prompt_stats"]) == 2  # every cell keeps its per-prompt counts too
  with open(os.path.join(workdir, "results.md")) as f:
    md = f.read()
  assert "Dynamics: held-out sim τ as the budget grows" in md and "Finalists: speculative τ on 3 mtbench" in md
  # What the sweep's CPU-hours made, released (layerwave.compare.release) and put back on a "new machine": a
  # fresh workdir with no analysis. Nothing trains or decodes again, and the table is the same.
  sweep = str(tmp_path / "sweep-release")
  packed = compare_release.pack(workdir, sweep, commands=["make paper-compare"])
  assert packed["cells_by_budget"] == {"x0.5": 1, "x1": 3} and packed["cells"] == 4
  assert {"release/tiny-eagle3.json", "finalists/L2-4-5/seed0.json"} <= set(packed["other_results"])
  moved = str(tmp_path / "moved")
  assert compare_release.unpack(sweep, moved)["written"] == 4 + len(packed["other_results"])
  grown = dict(compare__manual=manual_flag, compare__release="tiny-eagle3", compare__budgets=(0.5,),
               compare__budget_sets=("eagle3",), compare__finalists=1, compare__finalist_prompts=3,
               compare__finalist_temperatures=(0.0, 1.0))
  run(**grown)
  log = _compare_in_process(tiny_chat_target_dir, moved, caplog, **grown)
  assert "— training" not in log and "speculative decoding" not in log
  with open(os.path.join(workdir, "results.json")) as a, open(os.path.join(moved, "results.json")) as b:
    here, there = json.load(a), json.load(b)
  for key in ("rows", "dynamics", "finalists", "release", "spearman_objective"):
    assert here[key] == there[key], key
  # A finalist whose evaluation is not kept has no checkpoint there either: its cell trains again (the same
  # recipe and seed give the same draft: the held-out sim τ its cell recorded), then decodes.
  winner_key = next(s for s in os.listdir(os.path.join(moved, "finalists")) if s != "L2-4-5")
  os.remove(os.path.join(moved, "finalists", winner_key, "seed0.json"))
  log = _compare_in_process(tiny_chat_target_dir, moved, caplog, **grown)
  assert "no checkpoint in" in log and "— training" not in log
  with open(os.path.join(moved, "finalists", winner_key, "seed0.json")) as f:
    retrained = json.load(f)["retrained"]
  assert retrained["sim_tau"] == pytest.approx(retrained["recorded_sim_tau"], abs=1e-5)
  with open(os.path.join(moved, "results.json")) as f:
    assert json.load(f)["finalists"]["rows"] == here["finalists"]["rows"]
  assert compare_release.pack(moved, sweep)["commands"] == ["make paper-compare"]  # kept from the release
  os.remove(os.path.join(moved, "cells", "L2-4-5", "seed0", "result.json"))
  with pytest.raises(compare_release.ReleaseError, match="unpack the release into the workdir first"):
    compare_release.pack(moved, sweep)  # packing would lose a released cell
  log = run(compare__release="no-such-draft", compare__report_only=True)
  assert "no such release" in log and "releases: tiny-eagle3" in log
  with open(os.path.join(workdir, "results.md")) as f:
    assert "Released draft `no-such-draft`: not under releases/ yet (there: tiny-eagle3" in f.read()
  # A typo fails before anything is recorded: the corrected config then starts cleanly in that workdir.
  fresh = str(tmp_path / "fresh")
  with pytest.raises(ValueError, match="compare.datasets names 'gsm9k'"):
    _compare_in_process(tiny_chat_target_dir, fresh, caplog, compare__datasets=("mtbench", "gsm9k"),
                        compare__analysis=os.path.join(workdir, "analysis"))
  assert not os.path.exists(os.path.join(fresh, "compare.json"))
  # So do finalists with too few prompts short enough: refused before any cell trains, not after the sweep.
  with pytest.raises(ValueError, match=r"mtbench has only \d+ prompts of <= 8 tokens; raise "
                                       r"compare\.finalist_max_prompt_tokens or lower compare\.finalist_prompts"):
    _compare_in_process(tiny_chat_target_dir, fresh, caplog, compare__finalists=1, compare__finalist_prompts=80,
                        compare__finalist_max_prompt_tokens=8, compare__analysis=os.path.join(workdir, "analysis"))
  assert not os.path.exists(os.path.join(fresh, "compare.json"))
  # A cell trained with another recipe (here: its record edited) is refused, naming the cell.
  with open(cells[0]) as f:
    edited = json.load(f)
  assert edited["recipe"] == compare.recipe_key(compare.cell_recipe(
      training_options.Recipe.from_config(_smoke_config(tiny_chat_target_dir)), 0))
  with open(cells[0], "w") as f:
    json.dump(dict(edited, recipe="0" * 16), f)
  with pytest.raises(ValueError, match="was trained with another recipe") as refused:
    run(compare__report_only=True)
  assert "L2-4-5" in str(refused.value)
  with open(cells[0], "w") as f:
    json.dump(edited, f)
  with pytest.raises(ValueError, match=r"holds comparison results of a different config(.|\n)*train\.lr"):
    run(train__lr=0.123)


@pytest.mark.slow
def test_the_paper_variant_runs_end_to_end_at_tiny_scale(tiny_chat_target_dir, tmp_path):
  """`make paper-store paper-compare`'s commands with :paper, on the tiny target and its sizes: both stores,
  every k, the probes, the finalists and the automatic dynamics in one unattended run."""
  common = ["--config=" + os.path.join(ROOT, "configs", "smollm2_135m.py") + ":paper",
            "--config.model=" + tiny_chat_target_dir, "--config.data.source=sharegpt", "--config.data.max_length=64",
            "--config.data.max_records=60", "--config.data.heldout_fraction=0.2", "--config.features.batch_size=4",
            "--config.features.shard_sequences=8"]
  extract = [sys.executable, os.path.join(ROOT, "experiments", "extract_features.py")] + common
  store, heldout = str(tmp_path / "features"), str(tmp_path / "heldout32")
  subprocess.run(extract + ["--config.features.dir=" + store], check=True, cwd=ROOT, timeout=900)
  subprocess.run(extract + ["--config.features.dir=" + heldout, "--config.features.splits=heldout",
                            "--config.features.dtype=float32"], check=True, cwd=ROOT, timeout=900)
  workdir = str(tmp_path / "compare")
  sizes = ["--config.analysis.batch_size=4", "--config.analysis.num_batches=4", "--config.analysis.max_tokens=0",
           "--config.analysis.calibration_batches=1", "--config.analysis.hsic_batch_size=64",
           "--config.analysis.exact_cka_tokens=256", "--config.train.batch_size=2", "--config.train.num_steps=4",
           "--config.train.warmup_steps=1", "--config.train.vocab_examples=0", "--config.draft_model.vocab_size=256",
           "--config.train.bucket_widths=16,32",
           "--config.compare.sets=eagle3,exhaustive,cka_only", "--config.compare.lams=", "--config.compare.num_random=1",
           "--config.compare.manual=1,2,3;5,6,7", "--config.compare.ks=1,4", "--config.compare.seeds=2",
           "--config.compare.datasets=mtbench", "--config.compare.max_new_tokens=8",
           "--config.compare.finalists=1", "--config.compare.finalist_prompts=2", "--config.compare.probe_tokens=200",
           "--config.compare.probe_vocab=8"]
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "compare_layers.py")] + common + sizes + [
      "--config.train.features=" + store, "--config.train.eval_features=" + heldout, "--workdir=" + workdir]
  subprocess.run(cmd, check=True, cwd=ROOT, timeout=3000)
  with open(os.path.join(workdir, "results.json")) as f:
    summary = json.load(f)
  rows = {r["name"]: r for r in summary["rows"]}
  assert {"eagle3", "exhaustive", "cka_only", "random-0", "manual-0", "manual-1", "last", "exhaustive-k4",
          "even-k4"} <= set(rows) and rows["last"]["ids"] == [8]
  assert all(r["metrics"]["sim_tau"]["n"] == 2 for r in rows.values())
  assert summary["sort_by"] == "sim_tau" and summary["spearman_objective"]["sim_tau"]["k"] == 3
  assert any(name.startswith("linear probe") for name in summary["spearman_predictors"])
  assert [r["name"] for r in summary["finalists"]["rows"]][-1] == "eagle3"
  assert summary["finalists"]["temperatures"] == ["T0", "T1"]
  dynamics = summary["dynamics"]
  assert list(dynamics) == ["x0.25", "x1", "x4"] and dynamics["x4"]["num_steps"] == 16
  names = [r["name"] for r in dynamics["x1"]["rows"]]  # auto's six, and the paper's choice wherever it ranks
  assert names[0] == "eagle3" and len(names) in (6, 7)
  assert rows["exhaustive"]["ids"] in [r["ids"] for r in dynamics["x1"]["rows"]]
  assert all(r["sim_tau"]["n"] == 2 for b in dynamics.values() for r in b["rows"])
  with open(os.path.join(workdir, "results.md")) as f:
    md = f.read()
  assert "What predicts τ" in md and "Finalists:" in md and "Dynamics:" in md
  assert os.path.exists(os.path.join(workdir, "plots", "sim_tau.png"))
  # `compare.report_only` (make paper-report) tabulates what is finished and trains nothing, not even the probes.
  os.remove(os.path.join(workdir, "probe.json"))
  subprocess.run(cmd + ["--config.compare.report_only=True"], check=True, cwd=ROOT, timeout=900)
  assert not os.path.exists(os.path.join(workdir, "probe.json"))
  with open(os.path.join(workdir, "results.json")) as f:
    reported = json.load(f)
  sim_taus = lambda s: [(r["name"], r["metrics"]["sim_tau"]["values"]) for r in s["rows"]]  # noqa: E731
  assert sim_taus(reported) == sim_taus(summary) and list(reported["dynamics"]) == ["x0.25", "x1", "x4"]
  assert not any(name.startswith("linear probe") for name in reported["spearman_predictors"])
  assert reported["finalists"]["rows"] == summary["finalists"]["rows"]  # kept evaluations, none decoded again

