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
