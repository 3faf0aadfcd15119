"""8 simulated CPU devices give the same forward, hidden states and generations as one."""

import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

import layerwave
from layerwave import sharding

from tests.models import hf_reference
from tests.multidevice import run_on_eight_devices

SCRIPT = """
    import numpy as np
    ids = np.random.default_rng(0).integers(3, 97, size=(8, 9))
    result = {}
    for name, spec in [("data8", (("data", -1),)), ("data4_model2", (("data", -1), ("model", 2)))]:
      t = layerwave.load_target(ARGS[0], mesh_spec=spec)
      o = t.forward(ids, return_hidden_states=True)
      result[name] = dict(logits=np.asarray(o.logits).tolist(),
                          hidden=np.asarray(o.hidden_states).tolist(),
                          gen=layerwave.generate(t, [[5, 6, 7], [9, 10]] * 3, 6),
                          cont=layerwave.generate(t, [[5, 6, 7], [9, 10]] * 5, 6, slots=8 if name == "data8" else 4))
      from layerwave import inference
      import jax.numpy as jnp
      cache = jax.jit(lambda: inference.new_cache(t.config, 8, 64, jnp.float32, t.mesh))()
      result[name]["cache_spec"] = list(cache.keys[0].sharding.spec) + [None] * (4 - len(cache.keys[0].sharding.spec))
      try:
        layerwave.continuous.Engine(t, 3, 6, 8)
      except ValueError as e:
        result[name]["slots_error"] = str(e)
    write_result(result)
"""


def test_eight_devices_match_one(tmp_path):
  path = str(tmp_path / "model")
  hf_reference.save_hf_model("qwen2", path)
  result = run_on_eight_devices(SCRIPT, tmp_path, path)
  single = layerwave.load_target(path)
  ids = np.random.default_rng(0).integers(3, 97, size=(8, 9))
  ref = single.forward(ids, return_hidden_states=True)
  gen = layerwave.generate(single, [[5, 6, 7], [9, 10]] * 3, 6)
  for name in ("data8", "data4_model2"):
    np.testing.assert_allclose(result[name]["logits"], ref.logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(result[name]["hidden"], ref.hidden_states, atol=1e-4, rtol=1e-4)
    assert result[name]["gen"] == gen
    assert result[name]["cont"] == gen[:2] * 5  # continuous batching over the data axis, rows refilled
    assert "not a multiple of the mesh's data axis" in result[name]["slots_error"]
  # The cache's KV heads (2) follow the k/v projections over 'model'.
  assert result["data4_model2"]["cache_spec"] == ["data", None, "model", None]
  assert result["data8"]["cache_spec"] == ["data", None, None, None]


def test_mesh_errors():
  with pytest.raises(ValueError, match="does not fit"):
    sharding.make_mesh((("data", -1), ("model", 3)))
  with pytest.raises(ValueError, match="at most one axis"):
    sharding.make_mesh((("data", -1), ("model", -1)))
  mesh = sharding.make_mesh()
  sharding.check_batch(mesh, 3)  # one device divides everything


def test_batch_not_divisible_by_data_axis_is_a_clear_error():
  class FakeMesh:
    shape = {"data": 4}
  with pytest.raises(ValueError, match="not divisible by the mesh's 'data' axis"):
    sharding.check_batch(FakeMesh(), 6)


def test_fsdp_spec_splits_the_largest_divisible_axis_over_every_device():
  mesh = AbstractMesh((2, 4), ("data", "model"))  # specs read only the axes' names and sizes
  assert sharding.fsdp_spec((96, 32), mesh) == P(("data", "model"), None)
  assert sharding.fsdp_spec((12, 64), mesh) == P(None, ("data", "model"))  # 12 is not a multiple of 8
  assert sharding.fsdp_spec((7,), mesh) == P()
  assert sharding.fsdp_spec((), mesh) == P()


def test_embedding_and_lm_head_split_over_the_vocabulary():
  mesh = AbstractMesh((1, 4), ("data", "model"))
  assert sharding.param_spec(("embed_tokens", "embedding"), (128, 16), mesh) == P("model", None)
  assert sharding.param_spec(("lm_head", "kernel"), (16, 128), mesh) == P(None, "model")
  assert sharding.param_spec(("embed_tokens", "embedding"), (97, 16), mesh) == P()  # 97 does not split
  assert sharding.param_spec(("layers", 0, "self_attn", "q_proj", "kernel"), (16, 32), mesh) == P(None, "model")
