"""Tests for layerwave.analysis.collect: streaming collection on a tiny random Llama vs float64 numpy.

The reference recomputes every statistic in numpy float64 from the full hidden states and logits of the same
batches (token entropy, filter, prompt / dataset entropy, exact and minibatch CKA). Also: 8 simulated devices
equal 1, one compilation per stream, the percentile calibration, and the clear errors.
"""

import dataclasses

import chex
import jax
import numpy as np
import pytest

import layerwave
from layerwave.analysis import collect
from layerwave.analysis import token_filter

from tests import configs
from tests.models import hf_reference
from tests.multidevice import run_on_eight_devices

B, T = 8, 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tiny") / "llama")
  hf_reference.save_hf_model("llama", path)
  return path, layerwave.load_target(path)


@dataclasses.dataclass
class FakeBatch:
  input_ids: np.ndarray
  attention_mask: np.ndarray
  assistant_mask: np.ndarray


def _batches(n, seed=0, shapes=((B, T),)):
  """n batches of random tokens, cycling through `shapes` ([rows, width]: length buckets of B * T slots)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    rows, width = shapes[i % len(shapes)]
    lengths = rng.integers(width // 2, width + 1, size=rows)
    attention = (np.arange(width)[None] < lengths[:, None]).astype(np.int32)
    assistant = attention * (np.arange(width)[None] >= rng.integers(0, 4, size=(rows, 1))).astype(np.int32)
    ids = rng.integers(3, 97, size=(rows, width)).astype(np.int32) * attention
    out.append(FakeBatch(ids, attention, assistant))
  return out


def _ref_entropy(z):
  z = z - z.mean(0)
  norm = np.linalg.norm(z, axis=1, keepdims=True)
  z = z / np.where(norm > 0, norm, 1.0)  # a zero row (tokens equal at this depth) stays zero
  k = z @ z.T if z.shape[0] <= z.shape[1] else z.T @ z
  if np.trace(k) == 0:  # every kept token the same: no spread, entropy 0
    return 0.0
  lam = np.clip(np.linalg.eigvalsh(k / np.trace(k)), 0, None)
  p = lam[lam > 1e-10]
  return float(-(p * np.log(p)).sum())


def _ref_cka(x, y):
  x, y = x - x.mean(0), y - y.mean(0)
  return np.linalg.norm(y.T @ x) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y))


def _ref_hsic(ka, kb):
  m = ka.shape[0]
  ka, kb = ka - np.diag(np.diag(ka)), kb - np.diag(np.diag(kb))
  one = np.ones(m)
  return (np.trace(ka @ kb) + one @ ka @ one * (one @ kb @ one) / ((m - 1) * (m - 2))
          - 2 / (m - 2) * one @ ka @ kb @ one) / (m * (m - 3))


def _reference(target, batches, threshold):
  """float64 statistics of the kept tokens: prompt / dataset entropy, exact and minibatch CKA, counts."""
  prompt, pooled, tokens, hsic = [], [], [], 0.0
  kept = eligible_total = 0
  for batch in batches:
    out = target.forward(batch.input_ids, batch.attention_mask, return_hidden_states=True)
    hidden = np.asarray(out.hidden_states, np.float64)
    logits = np.asarray(out.logits, np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    ent = -(np.exp(logp) * logp).sum(-1)
    eligible = batch.attention_mask.astype(bool) & batch.assistant_mask.astype(bool)
    keep = eligible & (ent >= threshold)
    kept += keep.sum()
    eligible_total += eligible.sum()
    for b in range(keep.shape[0]):
      z = hidden[:, b][:, keep[b]]  # [L1, n, D]
      if z.shape[1] >= 2:
        prompt.append(([_ref_entropy(zl) for zl in z], z.shape[1]))
      if z.shape[1] >= 1:
        v = z.mean(1)
        pooled.append(v / np.linalg.norm(v, axis=1, keepdims=True))
    x = hidden[:, keep]  # [L1, n, D]: the batch's kept tokens (one HSIC minibatch: hsic_batch_size >= B*T)
    tokens.append(x)
    x = x - x.mean(1, keepdims=True)
    grams = np.einsum("lnd,lmd->lnm", x, x)
    hsic = hsic + np.array([[_ref_hsic(ga, gb) for gb in grams] for ga in grams])
  d = hidden.shape[-1]
  pe = np.mean([p for p, _ in prompt], axis=0)
  pen = np.mean([np.asarray(p) / np.log(min(n, d)) for p, n in prompt], axis=0)
  pooled = np.stack(pooled, 1)  # [L1, S, D]
  de = np.array([_ref_entropy_covariance(v) for v in pooled])
  x = np.concatenate(tokens, axis=1)
  exact = np.array([[_ref_cka(a, b) for b in x] for a in x])
  minibatch = hsic / np.sqrt(np.outer(np.diag(hsic), np.diag(hsic)))
  return dict(prompt=pe, prompt_norm=pen, dataset=de, exact=exact, minibatch=minibatch, kept=int(kept),
              eligible=int(eligible_total), sequences=pooled.shape[1])


def _ref_entropy_covariance(v):
  v = v - v.mean(0)
  c = v.T @ v
  lam = np.clip(np.linalg.eigvalsh(c / np.trace(c)), 0, None)
  p = lam[lam > 1e-10]
  return float(-(p * np.log(p)).sum())


def _threshold_in_a_gap(target, batches):
  """The median eligible entropy, moved to the middle of a gap so float32 vs float64 cannot flip a token."""
  values = []
  for batch in batches:
    out = target.forward(batch.input_ids, batch.attention_mask)
    ent = np.asarray(token_filter.token_entropy(out.logits))
    values.append(ent[batch.attention_mask.astype(bool) & batch.assistant_mask.astype(bool)])
  v = np.sort(np.concatenate(values))
  gaps = np.diff(v)
  mid = len(v) // 2
  i = mid - 5 + int(np.argmax(gaps[mid - 5:mid + 5]))
  return float(0.5 * (v[i] + v[i + 1]))


def _options(**kw):
  base = dict(filter_mode="threshold", hsic_batch_size=B * T, exact_cka_tokens=B * T * 3, unfiltered="all",
              halves=True, log_every=1)
  base.update(kw)
  return collect.CollectOptions(**base)


def test_collection_matches_float64_reference(tiny, monkeypatch):
  _, target = tiny
  batches = _batches(3)
  threshold = _threshold_in_a_gap(target, batches)
  chex.clear_trace_counter()
  monkeypatch.setattr(collect, "stats_step", chex.assert_max_traces(collect.stats_step, n=1))
  result = collect.collect_stats(target, batches, _options(threshold=threshold))  # one trace per stream
  ref = _reference(target, batches, threshold)
  f = result.filtered
  assert result.counts["kept"] == f.num_tokens == ref["kept"]
  assert result.counts["eligible"] == ref["eligible"] and result.counts["batches"] == 3
  assert f.num_sequences == ref["sequences"] and f.num_exact_tokens == ref["kept"]
  tol = dict(rtol=2e-3, atol=2e-3)
  np.testing.assert_allclose(f.prompt_entropy, ref["prompt"], **tol)
  np.testing.assert_allclose(f.prompt_entropy_normalized, ref["prompt_norm"], **tol)
  np.testing.assert_allclose(f.dataset_entropy, ref["dataset"], **tol)
  np.testing.assert_allclose(f.cka_exact, ref["exact"], **tol)
  np.testing.assert_allclose(f.cka_minibatch, ref["minibatch"], **tol)
  # No filter ("all"): every eligible token.
  ref_all = _reference(target, batches, -np.inf)
  np.testing.assert_allclose(result.unfiltered.prompt_entropy, ref_all["prompt"], **tol)
  np.testing.assert_allclose(result.unfiltered.cka_minibatch, ref_all["minibatch"], **tol)
  assert result.unfiltered.num_tokens == ref_all["kept"] == ref["eligible"]
  # Halves: even / odd batches, disjoint, summing to the whole.
  halves = result.halves["filtered"]
  assert halves[0].num_tokens + halves[1].num_tokens == f.num_tokens
  hist = np.asarray(result.token_entropy["histogram_kept"])
  assert hist.sum() == ref["kept"] and len(result.token_entropy["histogram_edges"]) == hist.size + 1


def test_length_buckets_match_float64_reference_with_one_trace_per_shape(tiny, monkeypatch):
  # Batches of two shapes with the same B * T slots, as BatchIterator's length buckets cut them: every statistic
  # is still the float64 one of the same sequences (each batch's kept tokens are one HSIC minibatch here).
  _, target = tiny
  batches = _batches(4, seed=3, shapes=((2 * B, T // 2), (B, T)))
  threshold = _threshold_in_a_gap(target, batches)
  chex.clear_trace_counter()
  monkeypatch.setattr(collect, "stats_step", chex.assert_max_traces(collect.stats_step, n=2))
  result = collect.collect_stats(target, batches, _options(threshold=threshold))
  ref = _reference(target, batches, threshold)
  f = result.filtered
  assert result.counts["kept"] == f.num_tokens == ref["kept"] and f.num_sequences == ref["sequences"]
  assert result.counts["shapes"] == [[2 * B, T // 2, 2], [B, T, 2]]
  assert result.counts["padded_positions"] == 4 * B * T
  assert (result.counts["batch_size"], result.counts["seq_len"]) == (B, T)  # the widest
  assert result.counts["positions"] == sum(int(b.attention_mask.sum()) for b in batches)
  tol = dict(rtol=2e-3, atol=2e-3)
  for name, value in (("prompt_entropy", "prompt"), ("dataset_entropy", "dataset"), ("cka_exact", "exact"),
                      ("cka_minibatch", "minibatch")):
    np.testing.assert_allclose(getattr(f, name), ref[value], **tol, err_msg=name)
  # The stability halves alternate within each shape, so both get the same mix of lengths: the first batch of
  # each shape (batches 0 and 1) against the second (2 and 3), not even / odd batch numbers (0, 2: one shape).
  first = _reference(target, batches[:2], threshold)
  assert [h.num_tokens for h in result.halves["filtered"]] == [first["kept"], ref["kept"] - first["kept"]]
  assert result.halves["filtered"][0].num_sequences == first["sequences"]


def test_matched_control_has_the_kept_count_per_sequence(tiny):
  _, target = tiny
  batches = _batches(2, seed=1)
  result = collect.collect_stats(target, batches, _options(threshold=_threshold_in_a_gap(target, batches),
                                                           unfiltered="matched", halves=False))
  assert result.unfiltered.num_tokens == result.filtered.num_tokens
  assert result.unfiltered.num_prompts == result.filtered.num_prompts
  assert result.halves is None


def test_percentile_calibration_sets_the_threshold(tiny):
  _, target = tiny
  batches = _batches(3, seed=2)
  result = collect.collect_stats(target, batches, collect.CollectOptions(
      percentile=30.0, calibration_batches=2, hsic_batch_size=16, unfiltered="none"))
  values = []
  for batch in batches[:2]:
    ent = np.asarray(token_filter.token_entropy(target.forward(batch.input_ids, batch.attention_mask).logits))
    values.append(ent[batch.attention_mask.astype(bool) & batch.assistant_mask.astype(bool)])
  assert result.threshold == pytest.approx(np.percentile(np.concatenate(values), 30.0), abs=1e-5)
  assert result.counts["batches"] == 3  # the calibration batches are analysed too
  assert 0.6 < result.counts["kept_fraction"] < 0.8
  assert result.unfiltered is None


def test_clear_errors(tiny, monkeypatch):
  _, target = tiny
  with pytest.raises(ValueError, match="kept no token"):
    collect.collect_stats(target, _batches(1), _options(threshold=1e9))
  with pytest.raises(ValueError, match="no batch"):
    collect.collect_stats(target, [], collect.CollectOptions())
  with pytest.raises(ValueError, match="unknown filter mode"):
    collect.CollectOptions(filter_mode="median")
  broken = _batches(2)
  broken[1] = FakeBatch(*(a[:, :T // 2] for a in (broken[1].input_ids, broken[1].attention_mask,
                                                    broken[1].assistant_mask)))
  monkeypatch.setattr(collect, "MAX_SHAPES", 1)  # every new shape compiles again: a stream has a few at most
  with pytest.raises(ValueError, match=r"batch 1 has shape \(8, 8\), a new one after \[\(8, 16\)\].*at most 1"):
    collect.collect_stats(target, broken, _options(threshold=0.0))
  monkeypatch.undo()

  def poison(path, x):  # inf in block 1's MLP: hidden states 2.. (HF indexing) become non-finite
    name = jax.tree_util.keystr(path)
    return x * np.inf if "[1]['mlp']['down_proj']" in name.replace('"', "'") else x

  bad = dataclasses.replace(target, params=jax.tree_util.tree_map_with_path(poison, target.params))
  with pytest.raises(FloatingPointError, match=r"layer index\(es\) \[2, 3\]"):
    collect.collect_stats(bad, _batches(1), _options(threshold=0.0, halves=False))


SCRIPT = """
    from layerwave.analysis import collect
    from tests.analysis import collect_test as ct
    out = {}
    # Data parallel over 8, and the scale layout: weights split over 'model' (4), batch over 'data' (2). Either
    # way the accumulators' layers are split over all 8 devices (4 real + 4 dummy layers here).
    for name, spec in (("data8", (("data", -1),)), ("data2_model4", (("data", 2), ("model", 4)))):
      target = layerwave.load_target(ARGS[0], mesh_spec=spec)
      r = collect.collect_stats(target, ct._batches(3), ct._options(threshold=float(ARGS[1])))
      state = collect.init_state(target, ct._options(), target.mesh)
      out[name] = {"filtered": r.filtered.as_dict(), "unfiltered": r.unfiltered.as_dict(), "counts": r.counts,
                   "halves": [h.as_dict() for h in r.halves["filtered"]],
                   "shard": list(state["filtered"].pooled_second_moment.addressable_shards[0].data.shape),
                   "bytes": collect.state_bytes(target.config, ct._options(), target.mesh),
                   "device_bytes": sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))}
    write_result(out)
"""


def test_eight_devices_match_one(tiny, tmp_path):
  path, target = tiny
  batches = _batches(3)
  threshold = _threshold_in_a_gap(target, batches)
  multi = run_on_eight_devices(SCRIPT, tmp_path, path, repr(threshold))
  single = collect.collect_stats(target, batches, _options(threshold=threshold))
  d = target.config.hidden_size
  for mesh, out in multi.items():
    assert out["counts"] == single.counts, mesh
    assert out["shard"] == [1, d, d], mesh  # 1/8 of the padded layers' second moments on each device
    assert out["bytes"][1] == out["device_bytes"], mesh  # state_bytes' per-device count is what a device holds
    pairs = [("filtered", single.filtered.as_dict(), out["filtered"]),
             ("unfiltered", single.unfiltered.as_dict(), out["unfiltered"])]
    pairs += [(f"half{i}", h.as_dict(), m) for i, (h, m) in enumerate(zip(single.halves["filtered"], out["halves"]))]
    for kind, one, eight in pairs:
      for name, value in one.items():
        if isinstance(value, list):
          np.testing.assert_allclose(eight[name], value, rtol=1e-4, atol=1e-4, err_msg=f"{mesh} {kind}.{name}")
        else:
          assert eight[name] == value, (mesh, kind, name)


def test_state_layout_on_one_device(tiny):
  _, target = tiny
  options = _options()
  state = collect.init_state(target, options, target.mesh)
  shapes = jax.eval_shape(lambda: collect.empty_state(target.config, options, target.mesh))
  assert jax.tree.structure(state) == jax.tree.structure(shapes)
  layout = collect.state_shardings(target.config, options, target.mesh)
  assert jax.tree.structure(layout) == jax.tree.structure(state)
  total, per_device = collect.state_bytes(target.config, options, target.mesh)
  assert total == per_device == sum(x.nbytes for x in jax.tree.leaves(state))
  l1, d = target.config.num_layers + 1, target.config.hidden_size
  assert state["filtered"].pooled_second_moment.shape == (l1, d, d)  # no padding for one device


def test_options_from_the_analysis_section():
  section = configs.load("smoke").analysis
  options = collect.options_from_config(section)
  assert options.filter_mode == section.filter and options.halves == section.stability  # renamed fields
  assert options.normalize is True and options.percentile == section.percentile
  assert options.exact_cka_tokens == section.exact_cka_tokens and isinstance(options.percentile, float)
  section.normalize = "none"
  assert collect.options_from_config(section).normalize is False
  section.normalize = "whiten"
  with pytest.raises(ValueError, match=r"analysis\.normalize must be one of \['none', 'skean'\]"):
    collect.options_from_config(section)
  with pytest.raises(ValueError, match=r"analysis\.stability must be True or False"):
    collect.options_from_config({**section.to_dict(), "normalize": "skean", "stability": 1})
  assert options.ladder_ratio == section.ladder_ratio == 1.3
  with pytest.raises(ValueError, match=r"analysis\.ladder_ratio must be > 1, got 0\.9"):
    collect.options_from_config({**section.to_dict(), "normalize": "skean", "ladder_ratio": 0.9})
