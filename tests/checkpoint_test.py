"""layerwave.checkpoint: real orbax round trips of a TrainState, vocabulary tables and JSON metadata."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layerwave import checkpoint as ckpt_lib
from layerwave import sharding
from layerwave.training import step as step_lib


def _state(seed):
  rng = np.random.default_rng(seed)
  params = {"fc": {"kernel": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)},
            "norm": {"scale": jnp.asarray(rng.normal(size=4), jnp.float32)}}
  state = step_lib.init_state(params, step_lib.OptimizerSettings(1e-3, 2, 10))
  return state.replace(step=jnp.asarray(seed, jnp.int32))


def _vocab(seed):
  return {"d2t": jnp.arange(5, dtype=jnp.int32) * seed, "t2d": jnp.arange(9) % (seed + 1) == 0}


def _abstract(tree, mesh):
  rep = sharding.replicated(mesh)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), tree)


def _assert_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert np.asarray(x).dtype == np.asarray(y).dtype


def test_save_restore_round_trip_keeps_the_latest_two(tmp_path):
  mesh = sharding.make_mesh()
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"))
  assert ckpt.latest_step() is None
  for step in (1, 2, 3):
    ckpt.save(step, _state(step), _vocab(step), {"step": step, "note": "x" * step, "ids": [2, 4, 5]})
  assert ckpt.latest_step() == 3
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "3"]  # max_to_keep = 2
  state, vocab, meta = ckpt.restore(_abstract(_state(0), mesh), _abstract(_vocab(1), mesh))
  _assert_equal(state, _state(3))
  _assert_equal(vocab, _vocab(3))
  assert meta == {"step": 3, "note": "xxx", "ids": [2, 4, 5]} and ckpt.read_meta(2)["step"] == 2
  assert state.params["fc"]["kernel"].sharding.is_equivalent_to(sharding.replicated(mesh), 2)
  older, _, _ = ckpt.restore(_abstract(_state(0), mesh), _abstract(_vocab(1), mesh), step=2)
  _assert_equal(older, _state(2))
  ckpt.close()
  reopened = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"))  # a new process resumes from disk
  assert reopened.latest_step() == 3 and reopened.read_meta()["note"] == "xxx"
  reopened.close()


def test_empty_directory_is_a_clear_error(tmp_path):
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"))
  with pytest.raises(FileNotFoundError, match="No checkpoint"):
    ckpt.read_meta()
  with pytest.raises(FileNotFoundError, match="No checkpoint"):
    ckpt.restore(_state(0), _vocab(1))
  ckpt.close()

