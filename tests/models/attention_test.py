"""layerwave.models.attention: every kernel against today's dense-mask attention at the real query positions.

"xla" is `layers.attend` with `kv_cache.causal_mask` bit for bit; "chunked" (values and gradients), "splash"
(in Pallas' interpreter on CPU) and "cudnn"'s padding handling (through jax's XLA implementation) agree with
it to float32 tolerance under right and left padding, a sliding window and grouped-query heads. Where libtpu is
installed, a subprocess compiles the TPU kernel for a 4-chip v5e topology, heads sharded over 'model'.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layerwave import inference
from layerwave.models import attention
from layerwave.models import kv_cache
from layerwave.models import layers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inputs(b=2, t=200, h=6, g=2, dh=16, pad="right", dtype=jnp.float32, seed=0):
  """Random q, k, v and padding flags: row 0 padded (right or left), row 1 full."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, t, h, dh)), dtype)
  k = jnp.asarray(rng.normal(size=(b, t, g, dh)), dtype)
  v = jnp.asarray(rng.normal(size=(b, t, g, dh)), dtype)
  valid = np.ones((b, t), bool)
  if pad == "right":
    valid[0, t - t // 3:] = False
  elif pad == "left":
    valid[0, :t // 4] = False
  return q, k, v, jnp.asarray(valid)


def _values_and_grads(fn, q, k, v, valid):
  """fn's output and the gradients wrt q, k, v of a random loss over the real query positions only."""
  w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32) * valid[:, :, None, None]
  loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)
  return fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _assert_match(got, want, valid, rtol=1e-5):
  """Equal at real query positions (to rtol of the largest value), finite everywhere."""
  got, want, real = np.asarray(got, np.float32), np.asarray(want, np.float32), np.asarray(valid)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got[real], want[real], rtol=rtol, atol=rtol * np.abs(want).max())


def _assert_same_grads(got, want, rtol=1e-5):
  for g, w, name in zip(got, want, "qkv"):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.isfinite(g).all(), name
    np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max(), err_msg=f"d{name}")


CASES = {  # name: (padding, window); every case has grouped-query heads H = 6, G = 2 (r = 3)
    "right_padding": ("right", None),
    "left_padding": ("left", None),
    "window_right": ("right", 50),
    "window_left": ("left", 37),
    "no_padding_window_wider_than_t": (None, 500),
}


@pytest.mark.parametrize("pad", ["right", "left", None])
def test_xla_is_layers_attend_with_causal_mask_bit_for_bit(pad):
  q, k, v, valid = _inputs(pad=pad)
  got = attention.causal_attention(q, k, v, valid, impl="xla", scale=0.3)
  np.testing.assert_array_equal(got, layers.attend(q, k, v, kv_cache.causal_mask(valid), 0.3))
  # CPU's "auto" is the same path.
  np.testing.assert_array_equal(attention.causal_attention(q, k, v, valid, platform="cpu"), layers.attend(
      q, k, v, kv_cache.causal_mask(valid)))


@pytest.mark.parametrize("pad", ["right", "left"])
def test_xla_window_is_the_targets_window_mask_at_real_rows(pad):
  """The target's sliding layers: causal_mask & window_mask over positions counted from the padding."""
  q, k, v, valid = _inputs(pad=pad)
  mask = kv_cache.causal_mask(valid) & kv_cache.window_mask(inference.positions_from_mask(valid), 40)
  want = np.asarray(layers.attend(q, k, v, mask))
  got = np.asarray(attention.causal_attention(q, k, v, valid, impl="xla", window=40))
  real = np.asarray(valid)
  np.testing.assert_array_equal(got[real], want[real])


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunked_matches_xla_values_and_gradients(case):
  pad, window = CASES[case]
  q, k, v, valid = _inputs(pad=pad)  # T = 200 with blocks of 64: a padded last block, windows across blocks
  want, want_grads = _values_and_grads(
      lambda q, k, v: attention.xla_attention(q, k, v, valid, window=window), q, k, v, valid)
  got, got_grads = _values_and_grads(
      jax.jit(lambda q, k, v: attention.chunked_attention(q, k, v, valid, window=window, block_size=64)),
      q, k, v, valid)
  _assert_match(got, want, valid)
  _assert_same_grads(got_grads, want_grads)


def test_chunked_in_bfloat16_and_through_causal_attention():
  q, k, v, valid = _inputs(pad="left", dtype=jnp.bfloat16)
  got = attention.causal_attention(q, k, v, valid, impl="chunked", scale=0.2)
  assert got.dtype == jnp.bfloat16
  _assert_match(got, attention.xla_attention(q, k, v, valid, scale=0.2), valid, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 100])
def test_splash_in_interpret_mode_matches_xla(window):
  """The TPU kernel run by Pallas' interpreter: T 256 in blocks of 128, Dh 64 (SmolLM2's), one row
  right-padded and one left-padded, so segment ids carry all the padding."""
  q, k, v, valid = _inputs(t=256, dh=64)
  valid = valid.at[1, :37].set(False)
  want, want_grads = _values_and_grads(
      lambda q, k, v: attention.xla_attention(q, k, v, valid, window=window, scale=0.1), q, k, v, valid)
  got, got_grads = _values_and_grads(jax.jit(lambda q, k, v: attention.splash_attention(
      q, k, v, valid, window=window, scale=0.1, block_size=128, interpret=True)), q, k, v, valid)
  _assert_match(got, want, valid)
  _assert_same_grads(got_grads, want_grads)


@pytest.mark.parametrize("case", ["left_padding", "window_right", "window_left"])
def test_cudnn_padding_and_window_through_jax_xla_implementation(case):
  """cuDNN's form of the problem (rows rotated to right padding, lengths, a left window), run by jax's XLA
  implementation on CPU."""
  pad, window = CASES[case]
  q, k, v, valid = _inputs(pad=pad)
  want, want_grads = _values_and_grads(
      lambda q, k, v: attention.xla_attention(q, k, v, valid, window=window), q, k, v, valid)
  got, got_grads = _values_and_grads(
      lambda q, k, v: attention.cudnn_attention(q, k, v, valid, window=window, implementation="xla"),
      q, k, v, valid)
  _assert_match(got, want, valid)
  _assert_same_grads(got_grads, want_grads)


def test_cudnn_falls_back_where_cudnn_refuses():
  q, k, v, valid = _inputs(pad="right")  # float32, and no GPU here: both refusals end in jax's XLA attention
  _assert_match(attention.causal_attention(q, k, v, valid, impl="cudnn"), attention.xla_attention(
      q, k, v, valid), valid)
  q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
  _assert_match(attention.causal_attention(q16, k16, v16, valid, impl="cudnn"), attention.xla_attention(
      q16, k16, v16, valid), valid, rtol=2e-2)


def test_auto_follows_the_platform_it_is_given():
  assert [attention.default_impl(p) for p in ("tpu", "gpu", "cuda", "rocm", "cpu")] == [
      "splash", "cudnn", "cudnn", "cudnn", "xla"]
  with pytest.raises(ValueError, match="mesh.devices.flat"):
    attention.default_impl("metal")
  q, k, v, valid = _inputs(t=128, dh=64)
  traced = lambda **kw: str(jax.make_jaxpr(lambda q: attention.causal_attention(q, k, v, valid, **kw))(q))
  assert "pallas_call" in traced(platform="tpu")  # traced on this CPU host for a TPU: the splash kernel
  assert "pallas_call" not in traced()  # the host's platform (cpu): the dense path
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  assert "pallas_call" not in traced(mesh=mesh)


@pytest.mark.parametrize("change,match", [
    (dict(impl="flash"), "Unknown attention impl 'flash'"),
    (dict(k=(2, 200, 4, 16), v=(2, 200, 4, 16)), "multiple of key/value heads"),
    (dict(v=(2, 200, 2, 8)), "of one shape"),
    (dict(k=(2, 100, 2, 16), v=(2, 100, 2, 16)), "must agree in batch, tokens"),
    (dict(valid=(2, 200, 200)), r"valid must be \[B, T\]"),
    (dict(window=0), "positive int"),
])
def test_bad_inputs_raise_one_clear_value_error(change, match):
  q, k, v, valid = _inputs()
  args = dict(q=q, k=k, v=v, valid=valid)
  for name in ("k", "v", "valid"):
    if name in change:
      args[name] = jnp.ones(change[name], valid.dtype if name == "valid" else jnp.float32)
  kwargs = {key: val for key, val in change.items() if key in ("impl", "window")}
  with pytest.raises(ValueError, match=match):
    attention.causal_attention(args["q"], args["k"], args["v"], args["valid"], **kwargs)


_TPU_SCRIPT = """
import json, os, sys
os.environ.update(TPU_SKIP_MDS_QUERY="1", TPU_ACCELERATOR_TYPE="v5litepod-4", TPU_WORKER_HOSTNAMES="localhost")
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P
from layerwave.models import attention

topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(1, 4), ("data", "model"))
b, t, h, g, dh = 1, 2048, 32, 8, 128
heads = NamedSharding(mesh, P("data", None, "model", None))
args = [jax.ShapeDtypeStruct((b, t, h, dh), jnp.bfloat16, sharding=heads),
        jax.ShapeDtypeStruct((b, t, g, dh), jnp.bfloat16, sharding=heads),
        jax.ShapeDtypeStruct((b, t, g, dh), jnp.bfloat16, sharding=heads),
        jax.ShapeDtypeStruct((b, t), jnp.bool_, sharding=NamedSharding(mesh, P("data", None)))]
result = {"platform": mesh.devices.flat[0].platform}
for impl in ("xla", "splash"):
  loss = lambda q, k, v, valid: attention.causal_attention(
      q, k, v, valid, impl=impl, mesh=mesh).astype(jnp.float32).sum()
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
  text = compiled.as_text()
  result[impl] = {"temp": compiled.memory_analysis().temp_size_in_bytes,
                  "kernels": text.count("custom_call_target=\\"tpu_custom_call\\""),
                  "all_gathers": text.count("all-gather"),
                  "dq_sharding": str(compiled.output_shardings[0].spec)}
with open(sys.argv[2], "w") as f:
  json.dump(result, f)
"""


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_splash_compiles_for_a_tpu_topology_with_heads_sharded(tmp_path):
  """An 8B layer's attention (B 1, T 2048, H 32, G 8, Dh 128, bf16) with its backward, compiled from this CPU
  host for 4 v5e chips, heads over 'model': splash runs under shard_map (no gathers), and its per-chip
  temporaries are a fraction of the dense path's `[8 heads, T, T]` float32 scores (128 MiB)."""
  # This process' own jax may hold libtpu's one-process-per-host lockfile (it looked for TPUs when it
  # started); compiling for a topology needs no chips, so the subprocess may load libtpu beside it.
  env = {key: val for key, val in os.environ.items()
         if key not in ("JAX_PLATFORMS", "XLA_FLAGS") and not key.startswith("JAX_COMPILATION_CACHE")}
  env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
  out = tmp_path / "tpu.json"
  subprocess.run([sys.executable, "-c", textwrap.dedent(_TPU_SCRIPT), REPO, str(out)], check=True, env=env,
                 timeout=600)
  result = json.loads(out.read_text())
  assert result["platform"] == "tpu"
  splash, dense = result["splash"], result["xla"]
  assert splash["kernels"] >= 2 and dense["kernels"] == 0  # the forward and backward kernels
  assert splash["all_gathers"] == 0 and "model" in splash["dq_sharding"]
  assert dense["temp"] >= 8 * 2048 * 2048 * 4
  assert splash["temp"] < dense["temp"] // 16
