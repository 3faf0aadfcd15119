"""layerwave.models.layers against float64 numpy: linear, RMSNorm, RoPE frequencies and rotation, GQA, MLP."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layerwave.models import layers

RNG = np.random.default_rng(0)


def _silu(x):
  return x / (1 + np.exp(-x))


def test_linear_is_x_at_kernel_plus_bias():
  lin = layers.Linear(5, 3, use_bias=True, rngs=nnx.Rngs(0))
  lin.bias[...] = jnp.asarray(RNG.normal(size=3), jnp.float32)
  x = RNG.normal(size=(2, 4, 5)).astype(np.float32)
  kernel, bias = np.asarray(lin.kernel[...], np.float64), np.asarray(lin.bias[...], np.float64)
  assert kernel.shape == (5, 3)
  np.testing.assert_allclose(lin(jnp.asarray(x)), x @ kernel + bias, rtol=1e-5, atol=1e-5)


def _bf16(x):
  """x rounded to bfloat16 and back to float64 (what a bf16 operand holds)."""
  return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)


def test_low_precision_matmul_gradients_are_the_exact_ones_of_rounded_operands():
  """`matmul_low`: forward and both gradients equal float64 math on bf16-rounded operands and cotangent, the
  kernel's gradient in the kernel's float32 and dx in x's bfloat16; XLA keeps all three dots in bf16."""
  x = jnp.asarray(RNG.normal(size=(2, 6, 8)), jnp.bfloat16)
  w = jnp.asarray(RNG.normal(size=(8, 5)), jnp.float32)
  g = RNG.normal(size=(2, 6, 5))
  y, vjp = jax.vjp(layers.matmul_low, x, w)
  dx, dw = vjp(jnp.asarray(g, jnp.float32))
  xs, ws, gs = np.asarray(x, np.float64), _bf16(w), _bf16(g)
  assert y.dtype == jnp.float32 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  np.testing.assert_allclose(y, xs @ ws, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dx, np.float64), _bf16(gs @ ws.T), rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(dw, np.einsum("bti,bto->io", xs, gs), rtol=1e-5, atol=1e-5)
  hlo = jax.jit(jax.grad(lambda x, w: layers.matmul_low(x, w).sum(), argnums=(0, 1))).lower(x, w).as_text()
  operands = re.findall(r"dot_general.*: \((tensor<[^>]*>), (tensor<[^>]*>)\)", hlo)
  assert len(operands) == 2 and all("bf16" in a and "bf16" in b for a, b in operands)  # both backward dots
  if jax.default_backend() == "cpu":  # and XLA:CPU keeps them bf16 (a folded transpose would upcast dw's dot)
    big = (jnp.asarray(RNG.normal(size=(512, 256)), jnp.bfloat16),
           jnp.asarray(RNG.normal(size=(256, 128)), jnp.float32),
           jnp.asarray(RNG.normal(size=(512, 128)), jnp.float32))
    text = jax.jit(lambda x, w, g: jax.vjp(layers.matmul_low, x, w)[1](g)).lower(*big).compile().as_text()
    # Each dot sits in its own fused computation, whose parameters carry the operand types.
    assert text.count(" dot(") == 2
    for computation in text.split("\n\n"):
      if " dot(" in computation:
        operands = re.search(r"\bdot\((%[\w.\-]+), (%[\w.\-]+)\)", computation).groups()
        types = dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", computation))
        assert [types[o] for o in operands] == ["bf16", "bf16"], computation
  # A float32 Linear keeps plain float32 autodiff; a bfloat16 one goes through matmul_low.
  lin = layers.Linear(8, 5, rngs=nnx.Rngs(1))
  np.testing.assert_allclose(jax.grad(lambda x: lin(x).sum())(jnp.asarray(xs, jnp.float32)),
                             np.broadcast_to(np.asarray(lin.kernel[...]).sum(1), (2, 6, 8)), rtol=1e-5)
  assert lin(x).dtype == jnp.bfloat16


@pytest.mark.parametrize("spec, a_shape, b_shape", [
    ("btgrd,bsgd->bgrts", (2, 5, 2, 3, 4), (2, 5, 2, 4)),
    ("bgrts,bsgd->btgrd", (2, 2, 3, 5, 5), (2, 5, 2, 4)),
    ("btgrd,jbtgd->bgrtj", (2, 5, 2, 3, 4), (3, 2, 5, 2, 4)),
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_low_precision_einsum_matches_float64_einsum_and_its_gradients(spec, a_shape, b_shape, dtype):
  a = jnp.asarray(RNG.normal(size=a_shape), dtype)
  b = jnp.asarray(RNG.normal(size=b_shape), dtype)
  out, vjp = jax.vjp(lambda a, b: layers.einsum_low(spec, a, b), a, b)
  g = RNG.normal(size=out.shape)
  da, db = vjp(jnp.asarray(g, jnp.float32))
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  g64 = g if dtype == jnp.float32 else _bf16(g)
  ins, o = spec.split("->")
  sa, sb = ins.split(",")
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  assert out.dtype == jnp.float32 and da.dtype == dtype and db.dtype == dtype
  np.testing.assert_allclose(out, np.einsum(spec, a64, b64), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(da, np.float64), np.einsum(f"{o},{sb}->{sa}", g64, b64), rtol=tol, atol=tol)
  np.testing.assert_allclose(np.asarray(db, np.float64), np.einsum(f"{sa},{o}->{sb}", a64, g64), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_matches_numpy_and_keeps_the_input_dtype(dtype):
  norm = layers.RMSNorm(16, 1e-5)
  norm.scale[...] = jnp.asarray(RNG.uniform(0.5, 1.5, 16), jnp.float32)
  x = jnp.asarray(RNG.normal(size=(3, 16)) * 4, dtype)
  x64 = np.asarray(x.astype(jnp.float32), np.float64)
  ref = np.asarray(norm.scale[...], np.float64) * x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5)
  out = norm(x)
  assert out.dtype == dtype
  np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), ref, rtol=1e-2 if dtype == jnp.bfloat16 else 1e-5)


def _llama3_reference(inv_freq, factor, low, high, old_len):
  """Hugging Face's llama3 rule written per frequency."""
  out = []
  for f in inv_freq:
    wavelen = 2 * math.pi / f
    if wavelen < old_len / high:
      out.append(f)
    elif wavelen > old_len / low:
      out.append(f / factor)
    else:
      smooth = (old_len / wavelen - low) / (high - low)
      out.append((1 - smooth) * f / factor + smooth * f)
  return np.array(out)


def test_rope_inverse_frequencies():
  plain = layers.rope_inv_freq(64, 10000.0, None)
  np.testing.assert_allclose(plain, 10000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-12)
  linear = layers.rope_inv_freq(64, 10000.0, {"rope_type": "linear", "factor": 4.0})
  np.testing.assert_allclose(linear, plain / 4, rtol=1e-12)
  scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 64}
  got = layers.rope_inv_freq(64, 500000.0, scaling)
  base = layers.rope_inv_freq(64, 500000.0, None)
  np.testing.assert_allclose(got, _llama3_reference(base, 8.0, 1.0, 4.0, 64), rtol=1e-12)
  assert got[0] == base[0] and got[-1] == pytest.approx(base[-1] / 8) and (got <= base).all()


def test_rope_rotates_pairs_by_relative_position():
  inv_freq = jnp.asarray(layers.rope_inv_freq(8, 100.0, None), jnp.float32)
  q = jnp.asarray(RNG.normal(size=(1, 1, 2, 8)), jnp.float32)
  k = jnp.asarray(RNG.normal(size=(1, 1, 2, 8)), jnp.float32)
  rope = lambda x, p: layers.apply_rope(x, jnp.full((1, 1), p), inv_freq)  # noqa: E731
  np.testing.assert_allclose(rope(q, 0), q, atol=1e-6)  # position 0 is the identity
  np.testing.assert_allclose(jnp.linalg.norm(rope(q, 7), axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5)
  dots = [float(jnp.sum(rope(q, m) * rope(k, m - 3))) for m in (3, 10, 40)]
  np.testing.assert_allclose(dots, dots[0], rtol=1e-4)  # only the distance m - n matters
  assert abs(float(jnp.sum(rope(q, 10) * rope(k, 3))) - dots[0]) > 1e-3  # and it does matter


def test_grouped_query_attention_matches_numpy():
  b, t, s, h, g, dh = 2, 3, 5, 4, 2, 8
  q = RNG.normal(size=(b, t, h, dh)).astype(np.float32)
  k = RNG.normal(size=(b, s, g, dh)).astype(np.float32)
  v = RNG.normal(size=(b, s, g, dh)).astype(np.float32)
  mask = RNG.random((b, t, s)) < 0.6
  mask[..., 0] = True  # every query reads at least one key
  got = np.asarray(layers.attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask)))
  ref = np.zeros((b, t, h, dh))
  for head in range(h):
    kv = head // (h // g)  # query heads share key/value heads in consecutive groups
    scores = np.einsum("btd,bsd->bts", q[:, :, head].astype(np.float64), k[:, :, kv]) / math.sqrt(dh)
    scores = np.where(mask, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref[:, :, head] = np.einsum("bts,bsd->btd", p, v[:, :, kv])
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_swiglu_mlp_matches_numpy():
  mlp = layers.MLP(6, 10, rngs=nnx.Rngs(1))
  x = RNG.normal(size=(2, 6)).astype(np.float32)
  w = {n: np.asarray(getattr(mlp, n).kernel[...], np.float64) for n in ("gate_proj", "up_proj", "down_proj")}
  ref = (_silu(x @ w["gate_proj"]) * (x @ w["up_proj"])) @ w["down_proj"]
  np.testing.assert_allclose(mlp(jnp.asarray(x)), ref, rtol=1e-5, atol=1e-5)


def test_gemma_rms_norm_multiplies_by_one_plus_w():
  norm = layers.RMSNorm(16, 1e-6, unit_offset=True)
  assert np.all(np.asarray(norm.scale[...]) == 0)  # w = 0 is the identity scale
  norm.scale[...] = jnp.asarray(RNG.normal(size=16) * 0.3, jnp.float32)
  x = RNG.normal(size=(3, 16)) * 4
  ref = (1 + np.asarray(norm.scale[...], np.float64)) * x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(norm(jnp.asarray(x, jnp.float32)), ref, rtol=1e-5)


def test_gelu_tanh_mlp_and_softcap_match_numpy():
  mlp = layers.MLP(6, 10, rngs=nnx.Rngs(1), gelu=True)
  x = RNG.normal(size=(2, 6)).astype(np.float32)
  w = {n: np.asarray(getattr(mlp, n).kernel[...], np.float64) for n in ("gate_proj", "up_proj", "down_proj")}
  g = x @ w["gate_proj"]
  gelu = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))  # PyTorch's 'tanh' GELU
  np.testing.assert_allclose(mlp(jnp.asarray(x)), (gelu * (x @ w["up_proj"])) @ w["down_proj"], rtol=1e-5,
                             atol=1e-5)
  z = RNG.normal(size=50) * 40
  np.testing.assert_allclose(layers.softcap(jnp.asarray(z, jnp.float32), 30.0), 30 * np.tanh(z / 30), rtol=1e-5)
  assert layers.softcap(jnp.asarray(z), None) is not None and np.allclose(layers.softcap(jnp.asarray(z), None), z)


def test_attention_scale_replaces_one_over_sqrt_head_dim():
  q, k, v = (jnp.asarray(RNG.normal(size=shape), jnp.float32) for shape in
             ((1, 2, 2, 8), (1, 3, 1, 8), (1, 3, 1, 8)))
  mask = jnp.ones((1, 2, 3), bool)
  np.testing.assert_allclose(layers.attend(q, k, v, mask, scale=1 / math.sqrt(8)), layers.attend(q, k, v, mask),
                             rtol=1e-6)
  assert not np.allclose(layers.attend(q, k, v, mask, scale=1 / math.sqrt(12)), layers.attend(q, k, v, mask))
