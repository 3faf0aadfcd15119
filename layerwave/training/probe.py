"""Linear probes of the next token: how well a ridge regression from a layer set's hidden states predicts the
target's own next token (its argmax: what a draft must guess) on held-out sequences.

Place in the pipeline: a candidate predictor of τ beside the selection objective (`layerwave.compare`,
`compare.probe_tokens`). It reads a feature store (`layerwave.training.features`), so it sees exactly the
features a draft trains on. Per set, the probe is one ridge regression on the concatenated, standardised
features of its layers onto the one-hot of the `vocab` most frequent next tokens (others count as misses):

  W = (XᵀX + α I)⁻¹ Xᵀ(Y − ȳ),   α = ridge · tr(XᵀX) / (k·D),   prediction = argmax(X W + ȳ)

a closed form, computed on device in float32; its accuracy on the held-out split is the set's score. A layer's
own probe is the same with k = 1.

Legend (`layerwave.axes`): n kept tokens, D target width, k selected layers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from layerwave.training.features import store as store_lib

__all__ = ["ProbeData", "ProbeOptions", "fit_accuracy", "probe_sets", "read_tokens"]


@dataclasses.dataclass(frozen=True)
class ProbeOptions:
  """How much of the store the probes read and how they are regularised.

  Attributes:
    tokens: training tokens (assistant positions of the store's `train` split, in dataset order).
    heldout_tokens: evaluation tokens (of its `heldout` split).
    vocab: classes: the `vocab` most frequent next tokens among the training tokens.
    ridge: α relative to the mean diagonal of XᵀX (the features are standardised, so ≈ α / tokens).
  """

  tokens: int = 20000
  heldout_tokens: int = 5000
  vocab: int = 1024
  ridge: float = 1e-3

  def __post_init__(self):
    if self.tokens < 2 or self.heldout_tokens < 1 or self.vocab < 2 or not self.ridge > 0:
      raise ValueError(f"probe options need tokens >= 2, heldout_tokens >= 1, vocab >= 2 and ridge > 0; got "
                       f"{self.tokens}, {self.heldout_tokens}, {self.vocab} and {self.ridge}.")


@dataclasses.dataclass(frozen=True)
class ProbeData:
  """Assistant positions read from a store: per depth `[n, D]` float32 features, and the next-token labels."""

  features: Mapping[int, np.ndarray]
  labels: np.ndarray  # [n] int64: the target's argmax at each position

  @property
  def num_tokens(self) -> int:
    return int(self.labels.shape[0])


def read_tokens(store: store_lib.FeatureStore, split: str, depths: Sequence[int], num_tokens: int) -> ProbeData:
  """The first `num_tokens` assistant positions of `split` (dataset order), at `depths` (h_L from `final`).

  Raises:
    StoreError: the store lacks a depth or the split (naming the fix).
  """
  depths = sorted({int(d) for d in depths})
  slots = dict(zip(depths, store.layer_slots(depths)))
  data = store.split(split)
  feats: dict[int, list[np.ndarray]] = {d: [] for d in depths}
  labels, have = [], 0
  for i in range(len(data)):
    if have >= num_tokens:
      break
    item = data[i]
    keep = np.flatnonzero(np.asarray(item["assistant_mask"]))[:num_tokens - have]
    if not keep.size:
      continue
    for d, slot in slots.items():
      rows = item["final"] if slot < 0 else item["hidden"][slot]
      feats[d].append(np.asarray(rows[keep], np.float32))
    labels.append(np.asarray(item["argmax"][keep], np.int64))
    have += keep.size
  if not have:
    raise store_lib.StoreError(f"Feature store {store.path}: its {split!r} split has no assistant tokens to probe.")
  return ProbeData({d: np.concatenate(v) for d, v in feats.items()}, np.concatenate(labels))


@functools.partial(jax.jit, static_argnames=("vocab",))
def _fit_and_score(x, y, xh, yh, ridge, vocab: int):
  """Accuracy on (xh, yh) of the ridge probe fit on (x, y); labels are class ids, -1 = outside the classes."""
  mean = x.mean(0)
  scale = jnp.maximum(x.std(0), 1e-6)
  x = (x - mean) / scale
  xh = (xh - mean) / scale
  onehot = jax.nn.one_hot(y, vocab, dtype=jnp.float32)  # -1 → a zero row
  prior = onehot.mean(0)
  gram = x.T @ x
  alpha = ridge * jnp.trace(gram) / gram.shape[0]
  w = jax.scipy.linalg.solve(gram + alpha * jnp.eye(gram.shape[0], dtype=gram.dtype), x.T @ (onehot - prior),
                             assume_a="pos")
  pred = jnp.argmax(xh @ w + prior, axis=-1)
  return jnp.mean((pred == yh) & (yh >= 0))


def _classes(train_labels: np.ndarray, vocab: int) -> np.ndarray:
  """The `vocab` most frequent labels (ties by smaller id), sorted by id."""
  ids, counts = np.unique(train_labels, return_counts=True)
  order = np.lexsort((ids, -counts))[:vocab]
  return np.sort(ids[order])


def _class_ids(labels: np.ndarray, classes: np.ndarray) -> np.ndarray:
  pos = np.searchsorted(classes, labels)
  pos = np.minimum(pos, classes.size - 1)
  return np.where(classes[pos] == labels, pos, -1).astype(np.int32)


def fit_accuracy(train: ProbeData, heldout: ProbeData, ids: Sequence[int], options: ProbeOptions) -> float:
  """Held-out next-token accuracy of the ridge probe on the concatenated features of layers `ids`."""
  classes = _classes(train.labels, options.vocab)
  x = np.concatenate([train.features[int(i)] for i in ids], axis=-1)
  xh = np.concatenate([heldout.features[int(i)] for i in ids], axis=-1)
  return float(_fit_and_score(jnp.asarray(x), jnp.asarray(_class_ids(train.labels, classes)), jnp.asarray(xh),
                              jnp.asarray(_class_ids(heldout.labels, classes)), float(options.ridge),
                              vocab=int(classes.size)))


def probe_sets(store_path: str, sets: Sequence[Sequence[int]], options: ProbeOptions) -> dict[str, Any]:
  """Probe accuracy of every set (concatenated layers) and of every layer among them alone.

  Returns:
    {"sets": {"2-15-27": accuracy, ...}, "layers": {"2": accuracy, ...}, "tokens", "heldout_tokens",
     "classes", "store": the store's fingerprint}.
  """
  store = store_lib.open_store(store_path)
  depths = sorted({int(i) for ids in sets for i in ids})
  train = read_tokens(store, "train", depths, options.tokens)
  heldout = read_tokens(store, "heldout", depths, options.heldout_tokens)
  layers = {str(d): fit_accuracy(train, heldout, [d], options) for d in depths}
  by_set = {"-".join(map(str, ids)): (layers[str(ids[0])] if len(ids) == 1 else
                                      fit_accuracy(train, heldout, ids, options))
            for ids in {tuple(sorted(int(i) for i in s)) for s in sets}}
  return {"sets": by_set, "layers": layers, "tokens": train.num_tokens, "heldout_tokens": heldout.num_tokens,
          "classes": int(_classes(train.labels, options.vocab).size), "store": store.fingerprint}
