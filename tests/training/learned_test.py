"""layerwave.training.learned on the tiny chat target (8 layers: candidates 1..7) and real feature stores: gated
drafts train offline (the loss falls, the regulariser pulls the gates towards k), their top-k sets are selection
files that train like any other, finished runs are skipped, and every refusal names its fix. The gate options
leave every recorded fingerprint as it was."""

import dataclasses
import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

import layerwave
from layerwave import compare
from layerwave.analysis import report
from layerwave.data.options import DataOptions
from layerwave.training import features
from layerwave.training import learned
from layerwave.training import loop
from layerwave.training import restore
from layerwave.training.options import Recipe, expand_home
from tests import configs

DATA = DataOptions(source="sharegpt", max_length=64, max_records=60, heldout_fraction=0.2)
DEPTHS = tuple(range(1, 8))
RELEASE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "releases",
                       "smollm2-135m-instruct-paper-sweep")


@pytest.fixture(scope="module")
def target(tiny_chat_target_dir):
  return layerwave.load_target(tiny_chat_target_dir)


@pytest.fixture(scope="module")
def stores(target, tmp_path_factory):
  dataset = DATA.build(target.tokenizer)
  root = tmp_path_factory.mktemp("stores")
  out = {}
  for name, depths in (("all", DEPTHS), ("some", (1, 2, 3))):
    features.extract(target, dataset, str(root / name), depths=depths, dtype="float32", batch_size=4,
                     shard_sequences=8, data=DATA.record())
    out[name] = str(root / name)
  return out


def gated_config(target_dir, store, kind="softmax", **train):
  c = configs.load("smoke")
  c.model = target_dir
  for key, value in dataclasses.asdict(DATA).items():
    c.data[key] = value
  c.draft_model.vocab_size = 4096  # at 256 no target token of the random model is in the vocabulary: zero loss
  c.draft_model.update(dict(fc_norm=True, gates=kind, gate_k=2, gate_strength=1.0))
  c.train.update(dict(batch_size=2, num_steps=12, warmup_steps=1, ttt_steps=2, log_every=1, eval_every=12,
                      eval_batches=2, checkpoint_every=6, lr=1e-2, features=store))
  c.train.update(train)
  c.learned.update(dict(ks=(2, 3), seeds=1))
  return c


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [r["train/loss"] for r in rows if "train/loss" in r]


def test_a_learned_selection_is_a_selection_file_that_trains(tiny_chat_target_dir, target, stores, tmp_path):
  c = gated_config(tiny_chat_target_dir, stores["all"])
  work = str(tmp_path / "learned")
  summary = learned.run(c, work)
  losses = _losses(os.path.join(work, "seed0"))
  assert len(losses) == 12 and np.mean(losses[-3:]) < np.mean(losses[:3])  # it trains
  gates = summary["mean_gates"]
  assert sorted(int(i) for i in gates) == list(DEPTHS)
  p = np.array(list(gates.values()))
  entropy = -float(np.sum(p * np.log(p)))
  assert entropy < math.log(7) - 0.05  # the regulariser pulled p away from uniform, towards k = 2 depths
  top = sorted(sorted(gates, key=lambda i: -gates[i])[:2], key=int)
  k2 = report.read_selection(os.path.join(work, "selection.json"), "learned_gates-k2", 8, 32)
  assert k2.strategy == learned.STRATEGY and list(k2.ids) == [int(i) for i in top]
  assert report.read_selection(os.path.join(work, "seed0", "selection.json"), "learned_gates-k3", 8).k == 3
  # Rerunning skips the finished run (nothing new is written to its metrics).
  assert learned.run(c, work)["mean_gates"] == gates and len(_losses(os.path.join(work, "seed0"))) == 12
  # The selection file trains an ordinary draft, as analyze.py's does.
  plain = configs.load("smoke")
  plain.model = tiny_chat_target_dir
  for key, value in dataclasses.asdict(DATA).items():
    plain.data[key] = value
  plain.draft_model.vocab_size = 4096
  plain.train.update(dict(batch_size=2, num_steps=1, eval_every=1, checkpoint_every=1, features=stores["all"]))
  plain.selection.update(dict(path=os.path.join(work, "selection.json"), strategy="learned_gates-k2"))
  assert loop.run(plain, str(tmp_path / "cell"))["layers"] == list(k2.ids)


@pytest.mark.parametrize("kind", ["hard_concrete", "group_lasso"])
def test_the_regulariser_drives_the_gates_towards_k(tiny_chat_target_dir, target, stores, tmp_path, kind):
  c = gated_config(tiny_chat_target_dir, stores["all"], kind=kind, num_steps=10, eval_every=10)
  recipe = Recipe.from_config(c)
  record = layerwave.layer_ids.LayerSelection(ids=DEPTHS, num_layers=8, hidden_size=32)
  loop.train(target, record, recipe, str(tmp_path / "run"))
  draft = restore.load_draft(str(tmp_path / "run"), target)
  after = np.array(list(learned.gate_values(draft).values()))
  if kind == "hard_concrete":  # the expected number of open gates, 7 x 0.97 at the start, falls towards k
    assert after.sum() < 7 * 0.97 - 1.0
  else:  # every block outside the 2 largest shrinks against them (at the start all are alike, ratio ~1)
    ranked = np.sort(after)
    assert ranked[:-2].mean() / ranked[-2:].mean() < 0.8
  assert float(draft.gate_penalty()) >= 0.0


def test_a_store_without_every_depth_is_refused_naming_them(tiny_chat_target_dir, stores, tmp_path):
  c = gated_config(tiny_chat_target_dir, stores["some"])
  with pytest.raises(features.StoreError, match=r"stores depths \[1, 2, 3, 8\].*it lacks \[4, 5, 6, 7\]\. Extract a "
                     r"store of every depth.*features\.depths=all"):
    learned.run(c, str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w")  # refused before anything was written


def test_k_larger_than_the_candidates_is_refused(tiny_chat_target_dir, stores, tmp_path):
  c = gated_config(tiny_chat_target_dir, stores["all"])
  c.learned.ks = (3, 8)
  with pytest.raises(ValueError, match=r"learned\.ks holds \[8\], but the gates choose among 7 candidate depths "
                     r"\(1\.\.7\): every k must be in \[1, 7\]"):
    learned.run(c, str(tmp_path / "w"))
  with pytest.raises(ValueError, match=r"every k must be in \[1, 3\]"):
    learned.select_top_k({1: 0.1, 2: 0.5, 3: 0.2}, 4, num_layers=8)
  assert learned.select_top_k({1: 0.1, 2: 0.5, 3: 0.5}, 2, num_layers=8).ids == (2, 3)


def test_an_ungated_run_refuses_and_a_gated_run_needs_a_store(tiny_chat_target_dir, stores, tmp_path):
  c = gated_config(tiny_chat_target_dir, stores["all"])
  c.draft_model.gates = ""
  with pytest.raises(ValueError, match=r"set --config\.draft_model\.gates=softmax"):
    learned.run(c, str(tmp_path / "w"))
  c = gated_config(tiny_chat_target_dir, "")
  with pytest.raises(ValueError, match=r"trains offline from a store of every depth"):
    learned.run(c, str(tmp_path / "w"))


def test_the_gates_score_the_released_sweeps_sets():
  sets = learned.sweep_sets(RELEASE)
  k3 = [ids for ids in sets if len(ids) == 3]
  assert len(k3) == 13 and all(len(s["sim_tau"]) == 3 for s in sets.values())
  depth = {i: float(i) for i in range(1, 30)}  # a gate that grows with depth scores deeper sets higher
  p = learned.gate_predictor(depth, sets, 3)
  assert p["num_sets"] == 13 and -1 <= p["rho"] <= 1
  assert [r["gate_score"] for r in p["rows"] if r["ids"] == [2, 15, 27]] == [44.0]


def test_the_gate_options_leave_the_released_sweeps_fingerprints_unchanged():
  c = configs.load("paper")
  c.data.source = "distilled:" + os.path.expanduser("~/layerwave-runs/campaign/distilled")
  with open(os.path.join(RELEASE, "results.json")) as f:
    cell = json.load(f)["cells/L2-15-27/seed0/result.json"]
  assert compare.recipe_key(compare.cell_recipe(Recipe.from_config(c), 0)) == cell["recipe"]
  c.compare.analysis = os.path.expanduser("~/layerwave-runs/paper/analysis")  # as `make paper-compare` names them
  c.train.features = os.path.expanduser("~/layerwave-runs/paper/features")
  c.train.eval_features = os.path.expanduser("~/layerwave-runs/paper/heldout32")
  with open(os.path.join(RELEASE, "compare.json")) as f:
    assert compare.fingerprint(c)[0] == json.load(f)["fingerprint"]
  c.draft_model.update(dict(gates="softmax", fc_norm=True))
  assert compare.recipe_key(compare.cell_recipe(Recipe.from_config(c), 0)) != cell["recipe"]


def test_an_ungated_draft_ignores_the_gate_step():
  from tests.training import losses_test  # pylint: disable=g-import-not-at-top
  from layerwave.training import losses  # pylint: disable=g-import-not-at-top
  draft, feats, logits, tokens, attn, loss_mask = losses_test.setup()
  args = (draft, feats, *losses.target_targets(logits, draft), jnp.asarray(tokens), jnp.asarray(attn),
          jnp.asarray(loss_mask))
  a, _ = losses.ttt_loss(*args, steps=2)
  b, _ = losses.ttt_loss(*args, steps=2, gate_step=jnp.asarray(5))
  assert float(a) == float(b)


def _summary(gates, sim_tau, rho=0.0):
  return {"mean_gates": {str(i): v for i, v in enumerate(gates, 1)}, "gated_sim_tau": {"mean": sim_tau},
          "minutes": {"gated_runs": 1.0}, "selections": {"k3": [1, 2, 3]}, "predictor": {"rho": rho}}


def test_the_pilot_chooses_the_best_gated_draft_among_kinds_that_select():
  apart = [0.9, 0.8, 0.7, 0.05, 0.05, 0.05]
  assert learned.gate_gap({i: v for i, v in enumerate(apart)}, 3) == pytest.approx(1 - 0.05 / 0.8)
  assert learned.gate_gap({i: 1.0 for i in range(6)}, 3) == 0.0
  kind, rows = learned.choose_kind({"open": _summary([1.0] * 6, 1.30), "a": _summary(apart, 1.20, rho=-0.9),
                                    "b": _summary(apart, 1.22, rho=0.9)})
  assert kind == "b" and len(rows) == 3  # "open" scores higher but selects nothing; the sweep's ρ plays no part
  kind, _ = learned.choose_kind({"open": _summary([1.0] * 6, 1.30), "weak": _summary([1.0, 0.9, 0.9, 0.6, 0.6, 0.6],
                                                                                      1.1)})
  assert kind == "weak"  # none stands apart: the largest gap


def test_a_learned_selection_file_reads_as_compare_manual(tmp_path):
  gates = {i: float(i % 7) for i in range(1, 30)}
  path = tmp_path / "selection.json"
  path.write_text(json.dumps(learned.selection_file(gates, (5, 3), 30, 576)))
  assert learned.manual_sets(str(path)) == "6,13,20;5,6,13,20,27"  # ties go to the shallower


def test_a_campaign_release_keeps_the_gates_beside_the_sweeps_cells(tmp_path):
  from layerwave.compare import release as compare_release  # pylint: disable=g-import-not-at-top
  work, analysis = tmp_path / "compare", tmp_path / "analysis"
  with open(os.path.join(RELEASE, "compare.json")) as f:
    recorded = json.load(f)
  recorded["settings"]["compare"]["analysis"] = str(analysis)  # the statistics in tmp_path, not under ~/
  with open(os.path.join(RELEASE, "results.json")) as f:
    cells = json.load(f)
  files = {"compare.json": recorded, "cells/L2-15-27/seed0/result.json": cells["cells/L2-15-27/seed0/result.json"],
           "learned/learned.json": {"kind": "softmax"}, "learned/seed0/gates.json": {"seed": 0},
           "learned/seed0/checkpoints/1/meta.json": {"step": 1}}
  for rel, content in files.items():
    os.makedirs(os.path.dirname(work / rel), exist_ok=True)
    (work / rel).write_text(json.dumps(content))
  os.makedirs(analysis)
  with open(os.path.join(RELEASE, "layer_stats.json")) as f:  # released with "~/" for the home directory
    (analysis / "layer_stats.json").write_text(json.dumps(expand_home(json.load(f))))
  compare_release.pack(str(work), str(tmp_path / "release"))
  with open(tmp_path / "release" / "results.json") as f:
    kept = sorted(json.load(f))
  assert kept == ["cells/L2-15-27/seed0/result.json", "learned/learned.json", "learned/seed0/gates.json"]
  compare_release.unpack(str(tmp_path / "release"), str(tmp_path / "again"))  # checkpoints stayed out
  assert json.loads((tmp_path / "again" / "learned" / "seed0" / "gates.json").read_text()) == {"seed": 0}
