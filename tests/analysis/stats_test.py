"""Tests for layerwave.analysis.stats: streaming accumulator vs direct float64 computations; merge; the layout
with the layers split over 8 simulated devices against one device."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layerwave.analysis import cka
from layerwave.analysis import entropy as entropy_lib
from layerwave.analysis import stats

from tests.multidevice import run_on_eight_devices

L1, B, T, D = 4, 4, 8, 6
_update = jax.jit(stats.update)  # one compilation per (shapes, static config), shared by the tests


def _ref_entropy(z, normalize_rows=True, centre=True):
  z = np.asarray(z, np.float64)
  if centre:
    z = z - z.mean(0)
  if normalize_rows:
    z = z / np.linalg.norm(z, axis=1, keepdims=True)
  k = z @ z.T
  lam = np.clip(np.linalg.eigvalsh(k / np.trace(k)), 0, None)
  p = lam[lam > 1e-12] / lam.sum()
  return float(-(p * np.log(p)).sum())


def _batch(seed):
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=(L1, B, T, D)) + rng.normal(size=(L1, 1, 1, D)) * 3
  hidden[1] = hidden[0] @ rng.normal(size=(D, D))  # some cross-layer structure
  hidden[3] = hidden[2] + 0.1 * rng.normal(size=(B, T, D))
  # kept counts 5+3 | 6+2: each half of the batch holds a multiple of 8 kept tokens (HSIC chunks align).
  keep = np.zeros((B, T), bool)
  for b, n in enumerate((5, 3, 6, 2)):
    keep[b, rng.choice(T, n, replace=False)] = True
  return hidden.astype(np.float32), keep


def test_single_batch_against_direct_computation():
  hidden, keep = _batch(0)
  acc = stats.init(L1, D, hsic_batch_size=8, buffer_size=64)
  acc = _update(acc, jnp.asarray(hidden), jnp.asarray(keep), jax.random.key(0))
  out = stats.finalize(acc)
  assert out.num_tokens == 16 and out.num_prompts == 4 and out.num_sequences == 4
  assert out.num_exact_tokens == 16

  h64 = hidden.astype(np.float64)
  pe = [np.mean([_ref_entropy(h64[l, b][keep[b]]) for b in range(B)]) for l in range(L1)]
  np.testing.assert_allclose(out.prompt_entropy, pe, rtol=5e-4, atol=5e-4)
  pen = [np.mean([_ref_entropy(h64[l, b][keep[b]]) / np.log(min(keep[b].sum(), D)) for b in range(B)])
         for l in range(L1)]
  np.testing.assert_allclose(out.prompt_entropy_normalized, pen, rtol=5e-4, atol=5e-4)

  # Dataset entropy: pooled vectors scaled to unit norm, then centred (streaming order).
  pooled = np.stack([[h64[l, b][keep[b]].mean(0) for b in range(B)] for l in range(L1)])
  pooled /= np.linalg.norm(pooled, axis=-1, keepdims=True)
  de = [_ref_entropy(pooled[l], normalize_rows=False) for l in range(L1)]
  np.testing.assert_allclose(out.dataset_entropy, de, rtol=1e-3, atol=1e-3)
  np.testing.assert_allclose(out.dataset_entropy_normalized, np.array(de) / np.log(min(B, D)), rtol=1e-3,
                             atol=1e-3)

  # The buffer holds every kept token, so exact CKA is the CKA of all kept tokens.
  tokens = h64[:, keep]
  np.testing.assert_allclose(out.cka_exact, cka.all_pairs_cka(jnp.asarray(tokens)), rtol=1e-4, atol=1e-5)
  assert out.cka_minibatch.shape == (L1, L1)
  np.testing.assert_allclose(np.diag(out.cka_minibatch), 1.0, rtol=1e-5)
  assert out.cka_minibatch[2, 3] > 0.9  # layers 2 and 3 are near copies


def test_minibatch_hsic_without_key_uses_consecutive_kept_tokens():
  hidden, keep = _batch(1)
  acc = _update(stats.init(L1, D, hsic_batch_size=8), jnp.asarray(hidden), jnp.asarray(keep))
  tokens = hidden[:, keep]  # (sequence, position) order
  ref = sum(np.asarray(cka.unbiased_hsic_all_pairs(jnp.asarray(tokens[:, i:i + 8]))[0]) for i in (0, 8))
  np.testing.assert_allclose(acc.hsic_sum, ref, rtol=1e-4, atol=1e-3)
  assert int(acc.num_hsic_batches) == 2


def test_merge_of_halves_equals_whole_batch():
  hidden, keep = _batch(2)
  init = stats.init(L1, D, hsic_batch_size=8)
  whole = _update(init, jnp.asarray(hidden), jnp.asarray(keep))
  first = _update(init, jnp.asarray(hidden[:, :2]), jnp.asarray(keep[:2]))
  second = _update(init, jnp.asarray(hidden[:, 2:]), jnp.asarray(keep[2:]))
  merged = stats.merge(first, second)
  for name in stats._SUM_FIELDS:
    np.testing.assert_allclose(getattr(merged, name), getattr(whole, name), rtol=1e-5, atol=1e-4, err_msg=name)


def test_buffer_merge_keeps_smallest_priorities():
  hidden, keep = _batch(3)
  init = stats.init(L1, D, buffer_size=5)
  a = _update(init, jnp.asarray(hidden[:, :2]), jnp.asarray(keep[:2]), jax.random.key(1))
  b = _update(init, jnp.asarray(hidden[:, 2:]), jnp.asarray(keep[2:]), jax.random.key(2))
  m = stats.merge(a, b)
  both = np.concatenate([a.buffer_priority, b.buffer_priority])
  np.testing.assert_allclose(np.sort(m.buffer_priority), np.sort(both)[:5])
  # Every buffered token is a kept token of the batch.
  kept = hidden[:, keep].reshape(L1, -1, D)
  for j in range(5):
    assert np.any(np.all(np.isclose(kept, np.asarray(m.buffer)[:, j:j + 1]), axis=(0, 2)))


def test_streaming_two_batches_equals_pooled_reference():
  (h0, k0), (h1, k1) = _batch(4), _batch(5)
  # No retrace for the second batch (the accumulator's pytree structure and avals are stable).
  update = jax.jit(chex.assert_max_traces(lambda a, h, k: stats.update(a, h, k), n=1))
  acc = stats.init(L1, D, hsic_batch_size=8)
  acc = update(acc, jnp.asarray(h0), jnp.asarray(k0))
  acc = update(acc, jnp.asarray(h1), jnp.asarray(k1))
  out = stats.finalize(acc)
  pe = [np.mean([_ref_entropy(h[l, b][k[b]]) for h, k in ((h0, k0), (h1, k1)) for b in range(B)])
        for l in range(L1)]
  np.testing.assert_allclose(out.prompt_entropy, pe, rtol=5e-4, atol=5e-4)
  assert out.num_tokens == int(k0.sum() + k1.sum()) and out.num_prompts == 2 * B
  assert out.cka_exact is None
  assert set(out.as_dict()) >= {"prompt_entropy", "cka_minibatch", "num_tokens"}


def test_short_sequences_are_excluded_from_prompt_entropy():
  hidden, keep = _batch(6)
  keep[3] = False
  keep[3, 0] = True  # one kept token: pooled, but no prompt entropy
  acc = _update(stats.init(L1, D, hsic_batch_size=8), jnp.asarray(hidden), jnp.asarray(keep))
  out = stats.finalize(acc)
  assert out.num_prompts == 3 and out.num_sequences == 4
  pe = [np.mean([_ref_entropy(hidden[l, b][keep[b]]) for b in range(3)]) for l in range(L1)]
  np.testing.assert_allclose(out.prompt_entropy, pe, rtol=5e-4, atol=5e-4)


def test_a_coarser_eigendecomposition_ladder_gives_the_same_statistics():
  """`ladder_ratio` changes only how far each sequence's kept tokens are padded before its eigendecomposition
  (fewer sizes to compile at scale), not the entropies: 2.0 against the default 1.3, with kept counts that land
  on different rungs, and against float64."""
  rng = np.random.default_rng(11)
  l1, b, t, d = 3, 3, 64, 48
  hidden = rng.normal(size=(l1, b, t, d)).astype(np.float32)
  keep = np.zeros((b, t), bool)
  for row, n in enumerate((20, 37, 9)):
    keep[row, rng.choice(t, n, replace=False)] = True
  assert entropy_lib.bucket_sizes(t, d) != entropy_lib.bucket_sizes(t, d, ratio=2.0)
  outs = [stats.finalize(jax.jit(stats.update)(stats.init(l1, d, ladder_ratio=r), jnp.asarray(hidden),
                                               jnp.asarray(keep)))
          for r in (entropy_lib.LADDER_RATIO, 2.0)]
  np.testing.assert_allclose(outs[1].prompt_entropy, outs[0].prompt_entropy, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(outs[1].prompt_entropy_normalized, outs[0].prompt_entropy_normalized, rtol=1e-5)
  pe = [np.mean([_ref_entropy(hidden[l, r][keep[r]]) for r in range(b)]) for l in range(l1)]
  np.testing.assert_allclose(outs[1].prompt_entropy, pe, rtol=5e-4, atol=5e-4)
  with pytest.raises(ValueError, match="ladder_ratio must be > 1"):
    stats.init(l1, d, ladder_ratio=1.0)
  with pytest.raises(ValueError, match="different ladder_ratio"):
    stats.merge(stats.init(l1, d), stats.init(l1, d, ladder_ratio=2.0))


def test_errors():
  hidden, keep = _batch(7)
  with pytest.raises(ValueError, match="kept no token"):
    stats.finalize(_update(stats.init(L1, D), jnp.asarray(hidden), jnp.zeros((B, T), bool)))
  bad = hidden.copy()
  bad[2, 0, np.argmax(keep[0])] = np.nan
  with pytest.raises(FloatingPointError, match=r"\[2\]"):
    stats.finalize(_update(stats.init(L1, D), jnp.asarray(bad), jnp.asarray(keep)))
  with pytest.raises(ValueError, match="PRNG key"):
    _update(stats.init(L1, D, buffer_size=4), jnp.asarray(hidden), jnp.asarray(keep))
  with pytest.raises(ValueError, match="does not match"):
    _update(stats.init(L1, D + 1), jnp.asarray(hidden), jnp.asarray(keep))
  with pytest.raises(ValueError, match="alpha"):
    stats.init(L1, D, alpha=0.0)
  with pytest.raises(ValueError, match="different alpha"):
    stats.merge(stats.init(L1, D, alpha=1.0), stats.init(L1, D, alpha=2.0))


def test_padded_layers_are_dropped_by_finalize():
  # Dummy layers (the padding for a split over devices) change no statistic of the real ones.
  hidden, keep = _batch(8)
  args = (jnp.asarray(hidden), jnp.asarray(keep), jax.random.key(3))
  plain = stats.finalize(_update(stats.init(L1, D, hsic_batch_size=8, buffer_size=16), *args))
  padded_acc = _update(stats.init(L1, D, hsic_batch_size=8, buffer_size=16, shards=3), *args)
  assert padded_acc.padded_layers == 6 and padded_acc.num_layers_plus_one == L1
  padded = stats.finalize(padded_acc)
  for name, value in plain.as_dict().items():
    np.testing.assert_allclose(getattr(padded, name), value, rtol=1e-6, atol=1e-6, err_msg=name)
  with pytest.raises(ValueError, match=r"cannot split over 4 devices.*shards=4"):
    stats.update(padded_acc, *args[:2], args[2], mesh=type("M", (), {"devices": np.empty(4)})())


SHARDED = """
    import numpy as np
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding
    from layerwave import sharding
    from layerwave.analysis import stats

    def batch(seed, l1, b, t, d):
      rng = np.random.default_rng(seed)
      hidden = rng.normal(size=(l1, b, t, d)) + rng.normal(size=(l1, 1, 1, d)) * 3
      hidden[1] = hidden[0] @ rng.normal(size=(d, d))
      keep = rng.random((b, t)) < 0.6
      keep[:, :2] = True
      return jnp.asarray(hidden, jnp.float32), jnp.asarray(keep)

    result = {}
    # 5 layers over 8 devices (3 dummies), and positions B*T = 15 that 8 does not divide (padded on the way in).
    for name, spec, (l1, b, t, d) in (("data8", (("data", -1),), (5, 4, 8, 6)),
                                      ("data2_model4", (("data", 2), ("model", 4)), (4, 3, 5, 6))):
      mesh = sharding.make_mesh(spec)
      axes = tuple(mesh.axis_names)
      out = {}
      for where in ("one", "eight"):
        m = mesh if where == "eight" else None
        shards = mesh.devices.size if m is not None else 1
        accs = [stats.init(l1, d, hsic_batch_size=8, buffer_size=12, shards=shards),
                stats.init(l1, d, hsic_batch_size=8, shards=shards)]
        if m is not None:
          accs = [jax.device_put(a, jax.tree.map(lambda s: NamedSharding(mesh, s), stats.partition_specs(a, axes)))
                  for a in accs]
        step = jax.jit(lambda accs, h, k1, k2, i: stats.update_many(
            accs, h, (k1, k2), (jax.random.key(i), jax.random.key(i + 7)), mesh=m))
        halves = []
        for i in range(2):
          h, k = batch(i, l1, b, t, d)
          accs = step(accs, h, k, k & (jnp.arange(t) % 2 == 0), i)
          halves.append(accs)
        if m is not None:
          shard = accs[0].pooled_second_moment.addressable_shards[0].data.shape
          out["shard_shape"] = list(shard)
          out["spec"] = str(accs[0].pooled_second_moment.sharding.spec)
        merged = stats.merge(accs[0], halves[0][0])
        out[where] = [stats.finalize(a, m).as_dict() for a in (accs[0], accs[1], merged)]
      result[name] = out
    write_result(result)
"""


def test_layers_split_over_eight_devices_match_one(tmp_path):
  result = run_on_eight_devices(SHARDED, tmp_path)
  for name, shard in (("data8", [1, 6, 6]), ("data2_model4", [1, 6, 6])):
    out = result[name]
    assert out["shard_shape"] == shard, name  # 1/8 of the padded layers on each device
    assert "data" in out["spec"] and (name == "data8" or "model" in out["spec"])
    for one, eight in zip(out["one"], out["eight"]):
      for field, value in one.items():
        if isinstance(value, list):
          np.testing.assert_allclose(eight[field], value, rtol=2e-5, atol=2e-6, err_msg=f"{name}.{field}")
        else:
          assert eight[field] == value, (name, field)
