"""The slice-by-slice safetensors loader against the whole-checkpoint path, bit for bit, on 1 and 8 devices."""

import hashlib
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

import layerwave
from layerwave import sharding
from layerwave.models import safetensors_loading, weights
from layerwave.models.config import ModelConfig

from tests.models import hf_reference
from tests.multidevice import run_on_eight_devices

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# A vocabulary and widths that 8 and 4 divide, so every split param_spec makes is exercised.
SETTINGS = dict(vocab_size=128, intermediate_size=64)


def _hf_llama(tie: bool, seed: int = 0):
  config = transformers.AutoConfig.for_model(
      "llama", **{**hf_reference.BASE, **SETTINGS, "tie_word_embeddings": tie})
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  with torch.no_grad():
    for n, p in model.named_parameters():
      if n.endswith("norm.weight"):
        p.add_(0.1 * torch.randn_like(p))
  return model


def _numpy_tensors(directory: str) -> dict[str, np.ndarray]:
  """Every tensor of a checkpoint directory in its stored dtype."""
  out = {}
  for name, stored in safetensors_loading.stored_tensors(directory).items():
    with safe_open(stored.file, framework="numpy") as f:
      out[name] = f.get_tensor(name)
  return out


def _write_sharded(directory: str, tensors: dict[str, np.ndarray], num_shards: int, config=None) -> None:
  """Writes `tensors` as `num_shards` safetensors files and their index (as save_pretrained lays them out)."""
  os.makedirs(directory, exist_ok=True)
  if config is not None:
    config.save_pretrained(directory)
  weight_map = {}
  for i, group in enumerate(np.array_split(sorted(tensors), num_shards)):
    file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
    save_file({n: np.ascontiguousarray(tensors[n]) for n in group}, os.path.join(directory, file),
              metadata={"format": "pt"})
    weight_map.update({str(n): file for n in group})
  with open(os.path.join(directory, safetensors_loading.INDEX), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _rounding_values(shape, rng) -> np.ndarray:
  """float32 values from random bit patterns: all magnitudes, subnormals and exact bfloat16 rounding ties."""
  bits = rng.integers(0, 2 ** 32, size=shape, dtype=np.uint64).astype(np.uint32)
  flat = bits.reshape(-1)
  flat[::3] = (flat[::3] & 0xFFFF0000) | 0x8000  # halfway between two bfloat16 values
  flat[1::7] &= 0x807FFFFF  # subnormal
  flat[(flat & 0x7F800000) == 0x7F800000] &= 0xBFFFFFFF  # no inf / NaN: clear the exponent's top bit
  return bits.view(np.float32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """name -> directory: single-file float32, several float32 and bfloat16 shards from save_pretrained, and
  hand-written float32 shards of random bit patterns with a tied model's stored `lm_head.weight` and a
  `rotary_emb.inv_freq` (both to be skipped)."""
  root = tmp_path_factory.mktemp("checkpoints")
  untied = _hf_llama(tie=False)
  out = {}
  for name, dtype, kw in [("single_f32", torch.float32, {}),
                          ("sharded_f32", torch.float32, dict(max_shard_size="40KB")),
                          ("sharded_bf16", torch.bfloat16, dict(max_shard_size="20KB"))]:
    out[name] = str(root / name)
    untied.to(dtype).save_pretrained(out[name], safe_serialization=True, **kw)  # `to` casts in place: f32 first
  assert len([f for f in os.listdir(out["sharded_f32"]) if f.endswith(".safetensors")]) >= 3
  assert len([f for f in os.listdir(out["sharded_bf16"]) if f.endswith(".safetensors")]) >= 3
  tied = _hf_llama(tie=True, seed=1)
  rng = np.random.default_rng(0)
  tensors = {n: _rounding_values(tuple(p.shape), rng) for n, p in tied.state_dict().items()}
  assert "lm_head.weight" in tensors
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
  out["rounding_f32"] = str(root / "rounding_f32")
  _write_sharded(out["rounding_f32"], tensors, 3, tied.config)
  return out


def _bits(model) -> dict[str, tuple[str, tuple, str]]:
  """Parameter path -> (dtype, shape, SHA-256 of its bytes)."""
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(model)):
    x = np.asarray(var[...])
    out["/".join(map(str, path))] = (x.dtype.name, list(x.shape), hashlib.sha256(x.tobytes()).hexdigest())
  return out


def _reference(directory, dtype, mesh=None):
  config = ModelConfig.from_pretrained(directory)
  fn = None if mesh is None else sharding.place_param(mesh)
  return weights.params_from_hf(config, weights.read_safetensors(directory), dtype, sharding_fn=fn)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", ["single_f32", "sharded_f32", "sharded_bf16", "rounding_f32"])
def test_one_device_matches_whole_checkpoint_path(checkpoints, name, dtype):
  directory = checkpoints[name]
  mesh = sharding.make_mesh()
  config = ModelConfig.from_pretrained(directory)
  new = _bits(safetensors_loading.load_params(config, directory, mesh, dtype))
  assert all(v[0] == jnp.dtype(dtype).name for v in new.values())
  assert new == _bits(_reference(directory, dtype, mesh))
  assert new == _bits(_reference(directory, dtype))  # the unplaced path: jnp.asarray(float32, dtype)


def test_bfloat16_is_float32_rounded_as_jnp_asarray(checkpoints):
  directory = checkpoints["rounding_f32"]
  config = ModelConfig.from_pretrained(directory)
  mesh = sharding.make_mesh()
  f32 = safetensors_loading.load_params(config, directory, mesh, jnp.float32)
  bf16 = safetensors_loading.load_params(config, directory, mesh, jnp.bfloat16)
  rounded = jax.tree.map(lambda x: jnp.asarray(np.asarray(x), jnp.bfloat16), nnx.state(f32))
  assert _bits(bf16) == _bits(nnx.merge(nnx.graphdef(bf16), rounded))
  # The checkpoint really has ties and subnormals, so the rounding rule is tested, not just assumed.
  kernel = np.asarray(nnx.state(f32)["layers"][0]["mlp"]["up_proj"]["kernel"][...])
  assert np.any(kernel.view(np.uint32) & 0xFFFF == 0x8000) and np.any(np.abs(kernel) < np.finfo(np.float32).tiny)


def test_load_target_reads_slice_by_slice(checkpoints, monkeypatch):
  directory = checkpoints["sharded_bf16"]

  def whole(*args, **kwargs):
    raise AssertionError("load_target read the whole checkpoint into host memory")

  monkeypatch.setattr(weights, "read_safetensors", whole)
  target = layerwave.load_target(directory, dtype="bfloat16")
  monkeypatch.undo()
  assert _bits(nnx.merge(target.graphdef, target.params)) == _bits(_reference(directory, jnp.bfloat16))


EIGHT_DEVICES = """
    import hashlib
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from layerwave import sharding
    from layerwave.models import safetensors_loading, weights
    from layerwave.models.config import ModelConfig

    # Every block the loader reads: (tensor, elements read).
    reads = []
    real_open = safetensors_loading._open

    class Recorded:
      def __init__(self, view, name):
        self.view, self.name = view, name
      def get_shape(self):
        return self.view.get_shape()
      def get_dtype(self):
        return self.view.get_dtype()
      def __getitem__(self, index):
        block = self.view[index]
        reads.append((self.name, int(block.size)))
        return block

    class Opened:
      def __init__(self, file):
        self.f = real_open(file)
      def __enter__(self):
        self.f.__enter__()
        return self
      def __exit__(self, *exc):
        return self.f.__exit__(*exc)
      def keys(self):
        return self.f.keys()
      def get_slice(self, name):
        return Recorded(self.f.get_slice(name), name)

    safetensors_loading._open = Opened

    def bits(model):
      out, specs = {}, {}
      for path, var in nnx.to_flat_state(nnx.state(model)):
        x = var[...]
        key = "/".join(map(str, path))
        host = np.asarray(x)
        out[key] = (host.dtype.name, list(host.shape), hashlib.sha256(host.tobytes()).hexdigest())
        specs[key] = [list(a) if isinstance(a, tuple) else a for a in x.sharding.spec]
        for shard in x.addressable_shards:  # each device holds its block of the value
          assert np.array_equal(np.asarray(shard.data).view(np.uint8), host[shard.index].view(np.uint8)), key
      return out, specs

    result = {}
    for mesh_name, spec in [("model8", (("data", 1), ("model", 8))), ("data2_model4", (("data", 2), ("model", 4)))]:
      mesh = sharding.make_mesh(spec)
      for directory in ARGS:
        config = ModelConfig.from_pretrained(directory)
        for dtype in ("float32", "bfloat16"):
          reads.clear()
          model = safetensors_loading.load_params(config, directory, mesh, jnp.dtype(dtype))
          new, specs = bits(model)
          ref, ref_specs = bits(weights.params_from_hf(config, weights.read_safetensors(directory), jnp.dtype(dtype),
                                                        sharding_fn=sharding.place_param(mesh)))
          # Each device's block is read alone, and once: replicas share a read.
          wrong_reads = []
          for path, var in nnx.to_flat_state(nnx.state(model)):
            x = var[...]
            blocks = 1
            for axes in x.sharding.spec:
              for axis in (axes if isinstance(axes, tuple) else (axes,)):
                blocks *= mesh.shape[axis] if axis else 1
            name = weights.hf_name(path)[0]
            got = [size for tensor, size in reads if tensor == name]
            if got != [x.size // blocks] * blocks:
              wrong_reads.append((name, got, x.size, blocks))
          result[f"{mesh_name}/{directory}/{dtype}"] = dict(
              bits=new, specs=specs, same_as_reference=new == ref, same_specs=specs == ref_specs,
              wrong_reads=wrong_reads)
    write_result(result)
"""


def test_eight_devices_match_one(checkpoints, tmp_path):
  names = ["sharded_f32", "sharded_bf16", "rounding_f32"]
  result = run_on_eight_devices(EIGHT_DEVICES, tmp_path, *[checkpoints[n] for n in names])
  mesh = sharding.make_mesh()
  for name in names:
    directory = checkpoints[name]
    config = ModelConfig.from_pretrained(directory)
    for dtype in ("float32", "bfloat16"):
      one = _bits(safetensors_loading.load_params(config, directory, mesh, jnp.dtype(dtype)))
      for mesh_name in ("model8", "data2_model4"):
        r = result[f"{mesh_name}/{directory}/{dtype}"]
        assert r["same_as_reference"] and r["same_specs"], (mesh_name, name, dtype)
        assert r["bits"] == {k: list(v) for k, v in one.items()}, (mesh_name, name, dtype)
        assert not r["wrong_reads"], (mesh_name, name, dtype, r["wrong_reads"])
        split = [k for k, v in r["specs"].items() if any(v)]
        # Both read directions happen: kernels split along 'in' are strided (column) blocks of the HF tensor.
        assert any(r["specs"][k][0] and k.endswith("kernel") for k in split), r["specs"]
        assert any(r["specs"][k][-1] and k.endswith("kernel") for k in split), r["specs"]


# --- Bad checkpoints: one clear error each, naming the file or tensor and the fix.


@pytest.fixture
def sharded(checkpoints, tmp_path):
  """A writable copy of the float32 shards as (directory, tensors, config)."""
  source = checkpoints["sharded_f32"]
  tensors = _numpy_tensors(source)
  config = transformers.AutoConfig.from_pretrained(source)
  return str(tmp_path / "ckpt"), tensors, config


def _load(directory):
  return safetensors_loading.load_params(ModelConfig.from_pretrained(directory), directory,
                                         sharding.make_mesh(), jnp.float32)


def test_index_naming_a_missing_shard_file(sharded):
  directory, tensors, config = sharded
  _write_sharded(directory, tensors, 4, config)
  os.remove(os.path.join(directory, "model-00003-of-00004.safetensors"))
  with pytest.raises(FileNotFoundError, match=r"model-00003-of-00004\.safetensors.*fetch every file"):
    _load(directory)


def test_shard_missing_a_tensor_the_index_maps_to_it(sharded):
  directory, tensors, config = sharded
  _write_sharded(directory, tensors, 2, config)
  with open(os.path.join(directory, safetensors_loading.INDEX)) as f:
    weight_map = json.load(f)["weight_map"]
  lost = "model.layers.1.mlp.up_proj.weight"
  file = weight_map[lost]
  kept = {n: t for n, t in tensors.items() if weight_map[n] == file and n != lost}
  save_file(kept, os.path.join(directory, file), metadata={"format": "pt"})
  with pytest.raises(ValueError, match=rf"miss tensors.*{lost} \(in {file}\).*download the checkpoint again"):
    _load(directory)


def test_tensor_missing_from_index_and_shards(sharded):
  directory, tensors, config = sharded
  del tensors["model.layers.2.self_attn.k_proj.weight"]
  tensors["model.layers.0.mlp.extra.weight"] = np.zeros(3, np.float32)
  _write_sharded(directory, tensors, 3, config)
  with pytest.raises(ValueError, match=r"missing tensors: \['model.layers.2.self_attn.k_proj.weight'\]; "
                                       r"unexpected tensors: \['model.layers.0.mlp.extra.weight'\]"):
    _load(directory)


def test_wrongly_shaped_tensor_same_message_as_whole_path(sharded):
  directory, tensors, config = sharded
  tensors["model.layers.1.self_attn.o_proj.weight"] = np.zeros((32, 16), np.float32)
  _write_sharded(directory, tensors, 3, config)
  with pytest.raises(ValueError, match=r"o_proj.weight has shape \(32, 16\), expected \(32, 32\)") as new:
    _load(directory)
  with pytest.raises(ValueError) as old:
    weights.params_from_hf(ModelConfig.from_pretrained(directory), weights.read_safetensors(directory))
  assert str(new.value) == str(old.value)


def test_truncated_shard_bad_index_and_no_weights(sharded, tmp_path):
  directory, tensors, config = sharded
  _write_sharded(directory, tensors, 2, config)
  shard = os.path.join(directory, "model-00002-of-00002.safetensors")
  with open(shard, "r+b") as f:
    f.truncate(64)
  with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors: it is truncated"):
    _load(directory)
  with open(os.path.join(directory, safetensors_loading.INDEX), "w") as f:
    f.write('{"metadata": {}}')
  with pytest.raises(ValueError, match="is not a safetensors index"):
    _load(directory)
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match="expected model.safetensors"):
    safetensors_loading.stored_tensors(str(empty))


def test_stored_dtype_is_kept_in_host_blocks(checkpoints):
  """A bfloat16 checkpoint is read as bfloat16 blocks (never widened when the parameters are bfloat16)."""
  stored = safetensors_loading.stored_tensors(checkpoints["sharded_bf16"])
  assert {t.dtype for t in stored.values()} == {"BF16"}
  block = np.zeros((2, 3), ml_dtypes.bfloat16)
  assert safetensors_loading._convert(block, np.dtype(jnp.bfloat16)) is block  # pylint: disable=protected-access
