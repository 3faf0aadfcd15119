"""Two real JAX processes (`jax.distributed` over 127.0.0.1, one CPU device each), as a pod runs the launchers.

Each stage runs once in one process (this one) and once in two on the same global batches; the two must agree: the
analysis's statistics, online training's held-out metrics, and a checkpoint written by two processes restores
in one. The one-process run goes first, so the tfds dataset both read is built before two processes open it.
"""

import json

import jax
import numpy as np
import pytest
from flax import nnx

import layerwave
from layerwave.training import features


from tests import multihost


_ANALYSIS = """
from layerwave.analysis import analyze
from tests import configs
config = configs.load("smoke")
config.model, config.distributed = ARGS[0], DISTRIBUTED
config.analysis.strategies = ("eagle3", "greedy")
out = analyze.run(config, os.path.join(ARGS[1], "analysis"))
stats = json.load(open(os.path.join(ARGS[1], "analysis", "layer_stats.json"))) if PROCESS == 0 else None
write_result({"processes": jax.process_count(), "stats": stats,
              "selections": {k: list(v.ids) for k, v in out["selections"].items()}})
"""


def _stage(script, tmp_path, name, *args, num_processes, timeout=600):
  """The script in `num_processes` real processes (1: in this one, the reference), in workdir name-N."""
  workdir = tmp_path / f"{name}-{num_processes}"
  workdir.mkdir()
  if num_processes == 1:
    return [multihost.run_here(script, *args, str(workdir))]
  return multihost.run_in_processes(script, workdir, *args, str(workdir), num_processes=num_processes,
                                    timeout=timeout)


def test_analysis_in_two_processes_equals_one(tiny_chat_target_dir, tmp_path):
  one, = _stage(_ANALYSIS, tmp_path, "analysis", tiny_chat_target_dir, num_processes=1)
  two = _stage(_ANALYSIS, tmp_path, "analysis", tiny_chat_target_dir, num_processes=2)
  assert one["processes"] == 1 and [r["processes"] for r in two] == [2, 2]
  assert two[1]["stats"] is None  # process 0 writes
  a, b = one["stats"], two[0]["stats"]
  assert a["counts"] == b["counts"] and a["counts"]["batches"] == 4
  np.testing.assert_allclose(b["filter"]["threshold_nats"], a["filter"]["threshold_nats"], rtol=1e-5)
  for kind in ("filtered", "unfiltered"):
    for key in ("prompt_entropy", "dataset_entropy_normalized", "cka_minibatch"):
      np.testing.assert_allclose(b[kind][key], a[kind][key], rtol=1e-4, atol=1e-5, err_msg=f"{kind}.{key}")
  np.testing.assert_allclose(b["filtered"]["cka_exact"], a["filtered"]["cka_exact"], rtol=1e-4, atol=1e-5)
  assert one["selections"] == two[0]["selections"] == two[1]["selections"]


_TRAIN_CONFIG = """
from layerwave.training import loop
from tests import configs
config = configs.load("smoke")
config.model, config.distributed, config.layers = ARGS[0], DISTRIBUTED, (1, 2, 3)
config.data.max_length, config.data.max_records, config.data.heldout_fraction = 128, 80, 0.25
config.draft_model.vocab_size = 4096  # at 256 no next token of the random target is in it: zero gradients
t = config.train
t.batch_size, t.num_steps, t.warmup_steps, t.ttt_steps, t.lr = 4, 4, 1, 2, 1e-2
t.log_every = t.eval_every = t.checkpoint_every = 2
t.eval_batches = 2
"""
_TRAIN = _TRAIN_CONFIG + """
out = loop.run(config, os.path.join(ARGS[1], "train"))
write_result({k: out[k] for k in ("step", "heldout_loss", "heldout_acc", "heldout_sim_tau") if k in out})
"""


def test_online_training_in_two_processes_equals_one_and_restores_in_one(tiny_chat_target_dir, tmp_path):
  one, = _stage(_TRAIN, tmp_path, "train", tiny_chat_target_dir, num_processes=1)
  two = _stage(_TRAIN, tmp_path, "train", tiny_chat_target_dir, num_processes=2)
  assert one["step"] == 4 and two[0] == two[1]
  assert set(one) == set(two[0]) and one["heldout_loss"] > 0  # tokens were evaluated
  lines = [json.loads(l) for l in open(tmp_path / "train-1" / "train" / "metrics.jsonl")]
  assert all(l["train/grad_norm"] > 0 for l in lines if "train/grad_norm" in l)  # and the steps trained
  for key in set(one) - {"step"}:
    np.testing.assert_allclose(two[0][key], one[key], rtol=2e-4, atol=1e-5, err_msg=key)
  # The checkpoint two processes wrote restores in this one process, with the one-process run's weights.
  target = layerwave.load_target(tiny_chat_target_dir)
  drafts = [layerwave.load_draft(str(tmp_path / f"train-{n}" / "train"), target) for n in (1, 2)]
  for a, b in zip(*(jax.tree.leaves(nnx.state(d, nnx.Param)) for d in drafts)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=2e-5)


_TRAIN_BF16 = _TRAIN_CONFIG + """
config.train.target_dtype = "bfloat16"  # the forward on the cast target (inference.with_dtype), eval float32
out = loop.run(config, os.path.join(ARGS[1], "train"))
write_result({k: out[k] for k in ("step", "heldout_loss", "heldout_acc", "heldout_sim_tau") if k in out})
"""


def test_online_training_with_a_bfloat16_forward_in_two_processes_equals_one(tiny_chat_target_dir, tmp_path):
  """The target cast to bfloat16 across two processes' global arrays: both processes agree and match one process
  (within what bf16 rounding of differently blocked matmuls allows)."""
  one, = _stage(_TRAIN_BF16, tmp_path, "bf16", tiny_chat_target_dir, num_processes=1)
  two = _stage(_TRAIN_BF16, tmp_path, "bf16", tiny_chat_target_dir, num_processes=2)
  assert one["step"] == 4 and two[0] == two[1] and one["heldout_loss"] > 0
  for key in set(one) - {"step"}:
    np.testing.assert_allclose(two[0][key], one[key], rtol=1e-2, atol=1e-3, err_msg=key)


_REFUSALS = _TRAIN_CONFIG + """
import copy
from layerwave import compare
from layerwave.data import distill


def refusal(run):
  try:
    run()
    return "ran"
  except ValueError as e:
    return str(e)


disagree = copy.deepcopy(config)
if PROCESS == 1:
  disagree.train.lr = 5e-3
errors = {"disagree": refusal(lambda: loop.run(disagree, os.path.join(ARGS[1], "disagree"))),
          "distill": refusal(lambda: distill.run(disagree, os.path.join(ARGS[1], "distill"))),
          "compare": refusal(lambda: compare.run(disagree, os.path.join(ARGS[1], "compare")))}
wide = copy.deepcopy(config)
wide.mesh = (("data", -1), ("model", 3))
errors["mesh"] = refusal(lambda: distill.run(wide, os.path.join(ARGS[1], "mesh")))
odd = copy.deepcopy(config)
odd.train.batch_size = 3
errors["odd"] = refusal(lambda: loop.run(odd, os.path.join(ARGS[1], "odd")))
write_result(errors)
"""


def test_two_processes_are_refused_before_any_work_where_they_cannot_run(tiny_chat_target_dir, tmp_path):
  """In one pair of processes: processes started with different configs (training, distillation, the layer-set
  comparison), a mesh the processes' devices cannot fill, and a global batch the processes cannot split are each
  refused by both, before anything is written."""
  errors = _stage(_REFUSALS, tmp_path, "refused", tiny_chat_target_dir, num_processes=2)
  expected = {"distill": "Distillation: processes [1] were started with a config other than process 0's",
              "compare": "The layer-set comparison: processes [1] were started with a config other than process 0's",
              "mesh": "does not fit 2 devices",
              "disagree": "processes [1] were started with a config other than process 0's",
              "odd": "Batch size 3 is not divisible by the mesh's 'data' axis (2 devices)"}
  for name, message in expected.items():
    assert all(message in e[name] for e in errors), (name, errors)
  workdir = tmp_path / "refused-2"
  assert not (workdir / "distill").exists() and not (workdir / "mesh").exists()
  assert not (workdir / "compare").exists()
  assert not (workdir / "disagree" / "checkpoints").exists() and not (workdir / "odd" / "checkpoints").exists()


_OFFLINE = _TRAIN.replace("out = loop.run", """from layerwave.training.features import extraction
config.features.dir = os.path.join(ARGS[1], "store")
extraction.run(config)
config.train.features = config.features.dir
out = loop.run""")


def test_extraction_and_offline_training_in_two_processes_equal_one(tiny_chat_target_dir, tmp_path):
  one, = _stage(_OFFLINE, tmp_path, "offline", tiny_chat_target_dir, num_processes=1)
  two = _stage(_OFFLINE, tmp_path, "offline", tiny_chat_target_dir, num_processes=2)
  assert one["step"] == 4 and two[0] == two[1] and one["heldout_loss"] > 0
  for key in set(one) - {"step"}:
    np.testing.assert_allclose(two[0][key], one[key], rtol=2e-4, atol=1e-5, err_msg=key)
  stores = [features.open_store(str(tmp_path / f"offline-{n}" / "store")) for n in (1, 2)]
  assert stores[0].counts("train") == stores[1].counts("train")
  a, b = stores[0].split("train"), stores[1].split("train")
  np.testing.assert_array_equal(a.dataset_index, b.dataset_index)
  for i in range(len(a)):
    for key in ("hidden", "final", "argmax", "input_ids"):
      np.testing.assert_allclose(np.asarray(b[i][key]), np.asarray(a[i][key]), atol=1e-5)


_COMPARE = """
from layerwave import atomic
from layerwave import compare
from tests import configs
config = configs.load("smoke")  # the smallest sweep the tests run: eagle3 and exhaustive, one seed, timed
config.model, config.distributed = ARGS[0], DISTRIBUTED
workdir = os.path.join(ARGS[1], "compare")
written, atomic_file = [], atomic.atomic_file


def spy(path, *args, **kwargs):  # every file a stage writes goes through atomic.atomic_file
  written.append(os.path.relpath(os.path.abspath(path), workdir))
  return atomic_file(path, *args, **kwargs)


atomic.atomic_file = spy
try:
  summary = compare.run(config, workdir)
finally:
  atomic.atomic_file = atomic_file
results = json.load(open(os.path.join(workdir, "results.json"))) if PROCESS == 0 else None
write_result({"processes": jax.process_count(), "written": sorted(set(written)), "summary": summary.to_json(),
              "results": results})
"""


@pytest.mark.slow  # an analysis and two cells, once in one process and once in two: ~19 min on two busy cores
def test_compare_in_two_processes_equals_one_and_process_0_writes(tiny_chat_target_dir, tmp_path):
  """The sweep under `config.distributed` in two processes: both train and decode every cell over the global mesh,
  process 0 alone writes the workdir (cells, results, table, figures, the analysis), and the table equals one
  process's: the same sets, held-out sim τ and speculative τ (the timings aside)."""
  one, = _stage(_COMPARE, tmp_path, "compare", tiny_chat_target_dir, num_processes=1)
  two = _stage(_COMPARE, tmp_path, "compare", tiny_chat_target_dir, num_processes=2, timeout=1800)
  assert one["processes"] == 1 and [r["processes"] for r in two] == [2, 2]
  assert two[1]["written"] == [] and two[0]["written"] == one["written"]
  assert {"results.json", "results.md", "plots/compare.png", "cells/L2-4-5/seed0/result.json",
          "analysis/layer_stats.json"} <= set(two[0]["written"])
  a, b = one["summary"], two[0]["summary"]
  same = lambda x, y: json.dumps(x) == json.dumps(y)  # noqa: E731  (NaN, a one-seed CI, equals itself here)
  assert same(two[0]["results"], b) and same(two[1]["summary"]["rows"], b["rows"])  # what process 0 wrote, all hold
  assert [r["ids"] for r in a["rows"]] == [r["ids"] for r in b["rows"]] and b["rows"][0]["ids"] == [2, 4, 5]
  assert a["cells_done"] == b["cells_done"] == 2
  for ra, rb in zip(a["rows"], b["rows"]):
    for metric in ("sim_tau", "T0/all", "T0/mtbench"):
      np.testing.assert_allclose(rb["metrics"][metric]["values"], ra["metrics"][metric]["values"], rtol=2e-4,
                                 err_msg=f"{ra['name']} {metric}")
    np.testing.assert_allclose(rb["acceptance"], ra["acceptance"], rtol=2e-4, atol=1e-6)
    assert rb["metrics"]["equal_to_ar:T0/all"]["values"] == [1.0]  # greedy speculation = plain decoding
    assert rb["metrics"]["timing_pairs:T0/all"]["values"] == ra["metrics"]["timing_pairs:T0/all"]["values"]
