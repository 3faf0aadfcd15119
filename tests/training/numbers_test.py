"""The training loop's numbers, pinned: the per-step losses and gradient norms, the held-out evaluations and the
final parameters of two tiny real runs, online (float32, evaluated deeper than trained) and offline (bfloat16
compute with the memory-saving path), equal the values recorded before the loop was restructured, bit for bit.

The values are XLA:CPU's on this repository's pinned JAX; a restructuring of the loop, the step or the loss that
is meant to leave the arithmetic alone must leave them alone. A change that is meant to move them records new
ones (`pytest -s` prints the trace a run computed) and says why in its commit.
"""

import hashlib
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

import layerwave
from layerwave.training import loop
from tests.training import features_test

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the values were recorded on XLA:CPU")


def _trace(config, workdir):
  """Every scalar the run wrote, by step, and a digest of its final parameters."""
  result = loop.run(config, workdir)
  rows = {}
  for line in open(os.path.join(workdir, "metrics.jsonl")):
    row = json.loads(line)
    keep = {k: v for k, v in row.items() if k.startswith(("train/loss", "train/grad_norm", "eval/"))}
    rows.setdefault(str(row["step"]), {}).update(keep)
  target = layerwave.load_target(config.model)
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(nnx.state(layerwave.load_draft(workdir, target), nnx.Param)):
    digest.update(np.asarray(leaf).tobytes())
  trace = {"rows": rows, "params": digest.hexdigest()[:16], "heldout_loss": result.get("heldout_loss")}
  print(json.dumps(trace, sort_keys=True))
  return trace


ONLINE = {'heldout_loss': 20.304237365722656,
 'params': '287326c500fb4002',
 'rows': {'1': {'train/grad_norm': 0.05160065367817879, 'train/loss': 14.98361873626709},
          '2': {'eval/draft/acc_0': 0.0,
                'eval/draft/acc_1': 0.0,
                'eval/draft/acc_2': 0.0,
                'eval/draft/acc_in_vocab_0': 0.0,
                'eval/draft/acc_in_vocab_1': 0.0,
                'eval/draft/acc_in_vocab_2': 0.0,
                'eval/loss': 20.30417251586914,
                'eval/sim_tau': 1.0,
                'train/grad_norm': 0.042265236377716064,
                'train/loss': 14.98426628112793},
          '3': {'train/grad_norm': 0.04111774265766144, 'train/loss': 14.979876518249512},
          '4': {'eval/draft/acc_0': 0.017543859779834747,
                'eval/draft/acc_1': 0.017543859779834747,
                'eval/draft/acc_2': 0.0,
                'eval/draft/acc_in_vocab_0': 0.10000000149011612,
                'eval/draft/acc_in_vocab_1': 0.10000000149011612,
                'eval/draft/acc_in_vocab_2': 0.0,
                'eval/loss': 20.304237365722656,
                'eval/sim_tau': 1.0178515911102295,
                'train/grad_norm': 0.08866017311811447,
                'train/loss': 14.976729393005371}}}
OFFLINE = {'heldout_loss': 14.978006362915039,
 'params': 'd05f29dd088261c3',
 'rows': {'1': {'train/grad_norm': 0.05151374265551567, 'train/loss': 14.983623504638672},
          '2': {'eval/draft/acc_0': 0.0,
                'eval/draft/acc_1': 0.0,
                'eval/draft/acc_in_vocab_0': 0.0,
                'eval/draft/acc_in_vocab_1': 0.0,
                'eval/loss': 14.978181838989258,
                'eval/sim_tau': 1.0,
                'train/grad_norm': 0.0424465611577034,
                'train/loss': 14.984251022338867},
          '3': {'train/grad_norm': 0.04110642895102501, 'train/loss': 14.97987174987793},
          '4': {'eval/draft/acc_0': 0.017543859779834747,
                'eval/draft/acc_1': 0.017543859779834747,
                'eval/draft/acc_in_vocab_0': 0.10000000149011612,
                'eval/draft/acc_in_vocab_1': 0.10000000149011612,
                'eval/loss': 14.978006362915039,
                'eval/sim_tau': 1.0178515911102295,
                'train/grad_norm': 0.08883007615804672,
                'train/loss': 14.976737022399902}}}


def test_online_run_computes_the_recorded_numbers(tiny_config, tmp_path):
  tiny_config.train.log_every = 1
  tiny_config.train.eval_ttt_steps = 3
  trace = _trace(tiny_config, str(tmp_path))
  assert trace == ONLINE


def test_offline_run_computes_the_recorded_numbers(features_store, tiny_chat_target_dir, tmp_path):
  config = features_test.tiny_config(tiny_chat_target_dir, features=features_store, log_every=1,
                                     compute_dtype="bfloat16", remat=True)
  config.draft_model.vocab_size = 4096
  trace = _trace(config, str(tmp_path))
  assert trace == OFFLINE


@pytest.fixture(scope="module")
def features_store(tiny_chat_target_dir, tmp_path_factory):
  target = layerwave.load_target(tiny_chat_target_dir)
  dataset = features_test.DATA.build(target.tokenizer)
  out = tmp_path_factory.mktemp("store") / "f32"
  features_test._extract(target, dataset, out)  # pylint: disable=protected-access
  return str(out)
