"""Decoding in two real JAX processes (`jax.distributed` over 127.0.0.1, one CPU device each), as on a pod.

Every stage that decodes runs once in this process (the reference, one device) and once in two processes over a
global mesh, in two layouts: `model=2` (the target's weights really split across the processes, every batch row
on both) and `data=2` (each process holds half of the rows). The two processes must return the same tokens as
one, greedy and sampled: a row's tokens depend on its prompt and the seed, not on where it ran.
"""

import json

import pytest

from tests import multihost

# The two layouts of two one-device processes, by name; the reference runs on this process's one device.
MESHES = {"model": (("data", -1), ("model", 2)), "data": (("data", -1),)}
ONE = (("data", -1),)


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
  import layerwave  # pylint: disable=g-import-not-at-top
  from layerwave import layer_ids  # pylint: disable=g-import-not-at-top
  from tests.speculative.conftest import make_draft, overfit_draft  # pylint: disable=g-import-not-at-top
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


@pytest.mark.parametrize("mesh", sorted(MESHES))
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

