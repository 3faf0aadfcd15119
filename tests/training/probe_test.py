"""Linear next-token probes on a real feature store, against a float64 numpy ridge regression."""

import numpy as np
import pytest

import layerwave
from layerwave.training import probe
from layerwave.data.options import DataOptions
from layerwave.training import features
from layerwave.training.features import store as store_lib

DATA = DataOptions(source="sharegpt", max_length=64, max_records=60, heldout_fraction=0.2)
DEPTHS = (1, 2, 3)


@pytest.fixture(scope="module")
def store(tiny_chat_target_dir, tmp_path_factory):
  target = layerwave.load_target(tiny_chat_target_dir)
  out = str(tmp_path_factory.mktemp("probe") / "store")
  features.extract(target, DATA.build(target.tokenizer), out, depths=DEPTHS, dtype="float32", batch_size=4,
                   shard_sequences=8, data=DATA.record())
  return out


def _reference(train, heldout, ids, options):
  """Ridge onto one-hot classes in float64: standardise, solve, argmax (the docstring's formula)."""
  ids_, counts = np.unique(train.labels, return_counts=True)
  classes = np.sort(ids_[np.lexsort((ids_, -counts))[:options.vocab]])
  x = np.concatenate([train.features[i] for i in ids], -1).astype(np.float64)
  xh = np.concatenate([heldout.features[i] for i in ids], -1).astype(np.float64)
  mean, scale = x.mean(0), np.maximum(x.std(0), 1e-6)
  x, xh = (x - mean) / scale, (xh - mean) / scale
  y = np.stack([train.labels == c for c in classes], 1).astype(np.float64)
  prior = y.mean(0)
  gram = x.T @ x
  w = np.linalg.solve(gram + options.ridge * np.trace(gram) / gram.shape[0] * np.eye(gram.shape[0]),
                      x.T @ (y - prior))
  pred = classes[np.argmax(xh @ w + prior, -1)]
  return float(np.mean(pred == heldout.labels))


def test_probe_reads_assistant_positions_in_dataset_order(store):
  s = store_lib.open_store(store)
  data = probe.read_tokens(s, "train", [2, 3], 50)
  first = s.split("train")[0]
  keep = np.flatnonzero(first["assistant_mask"])
  n = min(50, keep.size)
  np.testing.assert_array_equal(data.labels[:n], first["argmax"][keep][:n])
  np.testing.assert_array_equal(data.features[2][:n], first["hidden"][s.layer_slots([2])[0]][keep][:n])
  assert data.num_tokens == 50 and data.features[3].shape == (50, s.hidden_size)
  final = probe.read_tokens(s, "train", [s.num_layers], 5)  # h_L from the final rows
  np.testing.assert_array_equal(final.features[s.num_layers], first["final"][keep][:5])


@pytest.mark.parametrize("ids", [(2,), (1, 3), (1, 2, 3)])
def test_probe_accuracy_equals_a_float64_ridge(store, ids):
  options = probe.ProbeOptions(tokens=400, heldout_tokens=200, vocab=16, ridge=1e-2)
  s = store_lib.open_store(store)
  train = probe.read_tokens(s, "train", DEPTHS, options.tokens)
  heldout = probe.read_tokens(s, "heldout", DEPTHS, options.heldout_tokens)
  got = probe.fit_accuracy(train, heldout, ids, options)
  assert got == pytest.approx(_reference(train, heldout, ids, options), abs=1.5 / heldout.num_tokens)
  majority = np.mean(heldout.labels == np.bincount(train.labels).argmax())
  assert 0.0 <= got <= 1.0 and got >= majority - 0.05


def test_a_decodable_label_is_found_and_noise_is_not():
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 8, 3000)
  signal = np.eye(8, dtype=np.float32)[labels] @ rng.normal(size=(8, 32)).astype(np.float32)
  noise = rng.normal(size=(3000, 32)).astype(np.float32)
  data = lambda sl: probe.ProbeData({0: signal[sl] + 0.1 * noise[sl], 1: noise[sl]}, labels[sl])  # noqa: E731
  train, heldout = data(slice(0, 2000)), data(slice(2000, None))
  options = probe.ProbeOptions(tokens=2000, heldout_tokens=1000, vocab=8)
  assert probe.fit_accuracy(train, heldout, [0], options) > 0.95
  assert probe.fit_accuracy(train, heldout, [1], options) < 0.25
  assert probe.fit_accuracy(train, heldout, [0, 1], options) > 0.95


def test_probe_sets_and_bad_inputs(store):
  options = probe.ProbeOptions(tokens=200, heldout_tokens=100, vocab=8)
  out = probe.probe_sets(store, [(3, 1), (2,), (1, 3)], options)
  assert set(out["sets"]) == {"1-3", "2"} and set(out["layers"]) == {"1", "2", "3"}
  assert out["sets"]["2"] == out["layers"]["2"] and out["tokens"] == 200 and out["heldout_tokens"] == 100
  with pytest.raises(store_lib.StoreError, match="has no layer 7"):
    probe.probe_sets(store, [(1, 7)], options)
  with pytest.raises(ValueError, match="ridge > 0"):
    probe.ProbeOptions(ridge=0)
