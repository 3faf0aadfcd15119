"""Decoding in two real JAX processes (`jax.distributed` over 127.0.0.1, one CPU device each), as on a pod.

Every stage that decodes runs once in this process (the reference, one device) and once in two processes over a
global mesh, in two layouts: `model=2` (the target's weights really split across the processes, every batch row
on both) and `data=2` (each process holds half of the rows). The two processes must return the same tokens as
one, greedy and sampled: a row's tokens depend on its prompt and the seed, not on where it ran.
"""

import json
import os
import signal
import sys
import time

import pytest

import layerwave
from layerwave import layer_ids
from layerwave import options as options_lib
from layerwave.data import distill
from layerwave.data.options import DistillOptions

from tests import configs
from tests import multihost
from tests.speculative.conftest import make_draft, overfit_draft

# The two layouts of two one-device processes, by name; the reference runs on this process's one device.
MESHES = {"model": (("data", -1), ("model", 2)), "data": (("data", -1),)}
ONE = (("data", -1),)
# The default suite runs speculative decoding and distillation with the target split over the processes
# (model=2); with the batch split (data=2) they run in `make test-all`, as generation checks both in every run.
SLOW_DATA_MESH = ["model", pytest.param("data", marks=pytest.mark.slow)]


def _runs(script, tmp_path, name, *args, mesh):
  """(one process's result, the two processes' results) of `script`, each with its own workdir."""
  results = []
  for n, spec in ((1, ONE), (2, MESHES[mesh])):
    workdir = tmp_path / f"{name}-{n}"
    workdir.mkdir()
    args_n = (*args, json.dumps(spec), str(workdir))
    results.append(multihost.run_here(script, *args_n) if n == 1 else
                   multihost.run_in_processes(script, workdir, *args_n, num_processes=2))
  return results[0], results[1]


_GENERATE = """
import importlib.util
from layerwave import sharding
from tests import configs
sharding.maybe_initialize_distributed(DISTRIBUTED)  # before anything touches the backend
import layerwave
mesh = tuple(tuple(axis) for axis in json.loads(ARGS[1]))
target = layerwave.load_target(ARGS[0], mesh_spec=mesh)
prompts = [[1, 5, 9, 33, 12], [7, 8], [100, 200, 300, 400, 500, 600, 700], [42], [3, 4, 5], [9] * 11]
stop = lambda tokens: len(tokens) >= 2 + tokens[0] % 4  # rows leave at different chunks; queued prompts refill
out = {"static": layerwave.generate(target, prompts, 8),
       "static_sampled": layerwave.generate(target, prompts, 8, temperature=1.0, top_p=0.9, seed=3),
       "slots": layerwave.generate(target, prompts, 8, slots=2, chunk_steps=2, stop_fn=stop),
       "slots_sampled": layerwave.generate(target, prompts, 8, temperature=1.0, seed=3, slots=2, chunk_steps=3)}
if DISTRIBUTED:  # the launcher, which starts (here: finds) the distributed runtime itself
  spec = importlib.util.spec_from_file_location(
      "generate_launcher", os.path.join(os.path.dirname(configs.CONFIGS), "experiments", "generate.py"))
  launcher = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(launcher)
  config = configs.load("smoke", "generate")
  config.model, config.mesh, config.distributed, config.max_new_tokens = ARGS[0], mesh, True, 4
  records = launcher.run(config, os.path.join(ARGS[2], "launcher"))
  out["launcher"] = [r["new_tokens"] for r in records]
write_result(out)
"""


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_generate_in_two_processes_equals_one(tiny_chat_target_dir, tmp_path, mesh):
  """Static batches and continuous batching (rows stopped by `stop_fn` and refilled), greedy and sampled."""
  one, two = _runs(_GENERATE, tmp_path, "generate", tiny_chat_target_dir, mesh=mesh)
  assert two[0] == two[1]
  assert {k: two[0][k] for k in one} == one
  assert [len(row) for row in one["slots"]] != [8] * 6  # stop_fn ended rows early
  assert len(two[0]["launcher"]) == 2
  written = tmp_path / "generate-2" / "launcher" / "generations.jsonl"
  assert len(written.read_text().splitlines()) == 2  # written once, by process 0


@pytest.fixture(scope="module")
def overfit_draft_dir(tiny_chat_target_dir, tmp_path_factory):
  """An EAGLE-3 directory of a draft overfit to the tiny target's greedy continuations of `_PROMPTS` (so that it
  accepts often and long paths are committed), which every process loads by path, as a trained draft."""
  target = layerwave.load_target(tiny_chat_target_dir)
  continuations = layerwave.generate(target, _PROMPTS, 24, ignore_eos=True)
  ids = layer_ids.eagle3_layer_ids(target.config.num_layers)
  draft = overfit_draft(target, make_draft(target, ids, seed=1), [p + c for p, c in zip(_PROMPTS, continuations)])
  return layerwave.export_eagle3(draft, target, str(tmp_path_factory.mktemp("draft") / "eagle3"))


_PROMPTS = [[1, 5, 9, 33, 12], [7, 8], [100, 200, 300, 400, 500, 600, 700], [42], [3, 4, 5]]
_SPECULATE = """
import importlib.util
from layerwave import sharding
from tests import configs
sharding.maybe_initialize_distributed(DISTRIBUTED)
import layerwave
from layerwave.speculative import decode, evaluate
prompts, mesh = json.loads(ARGS[2]), tuple(tuple(axis) for axis in json.loads(ARGS[3]))
target = layerwave.load_target(ARGS[0], mesh_spec=mesh)
draft = evaluate.load_draft(ARGS[1], target)
out = {}
methods = {"chain": dict(method="chain", num_draft_tokens=3),
           "tree": dict(method="tree", tree_depth=3, tree_top_k=2, tree_tokens=6),
           "chain-drafts-sampled": dict(method="chain", num_draft_tokens=3, draft_sample=True)}
for name, options in methods.items():
  for temperature in ((1.0,) if options.get("draft_sample") else (0.0, 1.0)):
    tokens, m = decode.generate(target, draft, prompts, 16, temperature=temperature, seed=3, **options)
    out[f"{name} T={temperature:g}"] = {"tokens": tokens, "hist": m["accept_length_hist"],
                                        "accept_lengths": m["accept_lengths"], "steps": m["steps"]}
# The evaluation stage: τ alone, then paired with plain decoding (its timings: the slowest process's).
settings = evaluate.DecodeSettings(max_new_tokens=8, batch_size=2, timing_repeats=1,
                                   spec=decode.SpecOptions(num_draft_tokens=3))
alone = evaluate.evaluate(target, draft, prompts, settings, 0, paired=False)
paired = evaluate.evaluate(target, draft, prompts, settings, 0, paired=True)
out["evaluate"] = {"outputs": alone.outputs, "hist": alone.accept_length_hist.tolist(),
                   "paired_outputs": paired.outputs, "equal_to_ar": evaluate.summary(paired)["equal_to_ar"],
                   "plain_outputs": paired.timed.plain_outputs}
out["timing"] = {"seconds": [b["seconds"] for b in alone.per_batch], "ratios": list(paired.timed.ratios)}
if DISTRIBUTED:  # the launcher
  spec = importlib.util.spec_from_file_location(
      "speculate_launcher", os.path.join(os.path.dirname(configs.CONFIGS), "experiments", "speculate.py"))
  launcher = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(launcher)
  config = configs.load("smoke")
  config.model, config.mesh, config.distributed, config.draft = ARGS[0], mesh, True, ARGS[1]
  s = config.speculate
  s.dataset, s.num_prompts, s.max_new_tokens, s.timing_repeats, s.batch_size = "gsm8k", 2, 4, 1, 2
  out["launcher"] = launcher.run(config, os.path.join(ARGS[4], "launcher"))["tau"]
write_result(out)
"""


@pytest.mark.parametrize("mesh", SLOW_DATA_MESH)
def test_speculative_decoding_in_two_processes_equals_one(tiny_chat_target_dir, overfit_draft_dir, tmp_path,
                                                          mesh):
  """Chain and tree, greedy and sampled (and drafts sampled from q), the evaluation's τ and paired stages, and
  experiments/speculate.py: two processes agree with each other, timings included, and with one process."""
  one, two = _runs(_SPECULATE, tmp_path, "speculate", tiny_chat_target_dir, overfit_draft_dir,
                   json.dumps(_PROMPTS), mesh=mesh)
  assert two[0] == two[1]  # every process holds the same tokens, τ and (slowest-process) timings
  for key in set(one) - {"timing"}:
    for field in set(one[key]) - {"steps"}:  # the loop's iteration count also counts the row data=2 pads on
      assert two[0][key][field] == one[key][field], (key, field)
  assert sum(one["chain T=0"]["hist"][1:]) > 0 and sum(one["tree T=0"]["hist"][1:]) > 0  # drafts were accepted
  assert one["evaluate"]["equal_to_ar"] == 1.0
  assert one["evaluate"]["paired_outputs"] == one["evaluate"]["outputs"]
  assert two[0]["launcher"] >= 1.0
  metrics = tmp_path / "speculate-2" / "launcher" / "spec_metrics.json"
  assert json.loads(metrics.read_text())["spec"]["prompts"] == 2  # written once, by process 0


_DISTILL = """
from layerwave.data import distill
from tests import configs
config = configs.load("smoke")
config.model, config.distributed = ARGS[0], DISTRIBUTED
config.mesh = tuple(tuple(axis) for axis in json.loads(ARGS[1]))
out = {}
for name, changes in {"greedy-slots": {}, "sampled-static": {"temperature": 1.0, "slots": 0}}.items():
  for key, value in changes.items():
    config.distill[key] = value
  manifest = distill.run(config, os.path.join(ARGS[2], name))
  out[name] = {"content": manifest["dataset"]["content"], "output": manifest["output"]}
write_result(out)
"""


@pytest.mark.parametrize("mesh", SLOW_DATA_MESH)
def test_distillation_in_two_processes_equals_one(tiny_chat_target_dir, tmp_path, mesh):
  """The smoke distillation (continuous batching greedy, static batches sampled): the same conversations as one
  process, chunks and dataset written once, by process 0; both processes return its manifest."""
  one, two = _runs(_DISTILL, tmp_path, "distill", tiny_chat_target_dir, mesh=mesh)
  assert two[0] == two[1]
  for name in one:
    assert two[0][name]["content"] == one[name]["content"], name
    assert two[0][name]["output"]["conversations"] == one[name]["output"]["conversations"] == 8
  for name in one:
    chunks = sorted(p.name for p in (tmp_path / "distill-2" / name / "chunks").iterdir())
    assert chunks == ["00000.json", "00001.json"]  # no temporary file left beside them


@pytest.mark.slow  # waits out JAX's 100 s heartbeat: `make test-all`
def test_a_killed_process_stops_the_other_and_a_restart_of_both_resumes(tiny_chat_target_dir, tmp_path):
  """experiments/distill.py in two processes: process 1 killed once chunk 0 is written stops process 0 within a
  bounded time with nothing half-written; both restarted finish the run with the conversations of one process,
  without duplicates or gaps."""
  workdir = tmp_path / "pod"
  argv = [sys.executable, os.path.join(multihost.REPO, "experiments", "distill.py"),
          "--config=" + os.path.join(configs.CONFIGS, "smollm2_135m.py") + ":smoke",
          "--config.model=" + tiny_chat_target_dir, "--config.distributed=True", "--workdir=" + str(workdir)]
  procs = multihost.launch(argv)
  first = workdir / "chunks" / "00000.json"
  deadline = time.time() + 400
  while not first.exists() and all(p.poll() is None for p in procs) and time.time() < deadline:
    time.sleep(0.05)
  procs[1].send_signal(signal.SIGKILL)
  assert first.exists(), procs[0].communicate(timeout=60)[1].decode()[-4000:]
  stopped = time.time()
  _, log = procs[0].communicate(timeout=300)  # JAX's runtime ends it once process 1's heartbeats stop
  procs[1].wait()
  assert procs[0].returncode != 0, log.decode()[-4000:]
  print(f"process 0 stopped {time.time() - stopped:.0f} s after process 1 was killed")
  assert not (workdir / "manifest.json").exists()
  assert [p.name for p in sorted((workdir / "chunks").iterdir())] == ["00000.json"]  # nothing half-written
  for p in multihost.launch(argv):
    _, log = p.communicate(timeout=600)
    assert p.returncode == 0, log.decode()[-4000:]
  target = layerwave.load_target(tiny_chat_target_dir)
  options = options_lib.from_section(DistillOptions, configs.load("smoke").distill, "distill")
  reference = distill.distill(target, options, str(tmp_path / "one"))
  resumed = json.loads((workdir / "manifest.json").read_text())
  assert resumed["dataset"]["content"] == reference["dataset"]["content"]
  assert resumed["dataset"]["num_examples"] == reference["dataset"]["num_examples"] == 8
