"""Fixed-shape batches from a feature store: what the offline training step reads instead of the target.

`FeatureBatchIterator` is `layerwave.data.BatchIterator` over a store split (`store.StoreSplit`): the same
seeded per-epoch permutation, resumable `Position`, `num_epochs` and multi-host row split, so with the same
seed it visits exactly the sequences the online iterator visits over the chat dataset the store was extracted
from. Each `FeatureBatch` carries the online step's `[B, T]` fields plus the draft's layers picked out of
the stored depths, `features [k, B, T, D]`, h_L as `final [B, T, D]` (both in the store's dtype; the step
casts to float32 on device) and the target's argmax `[B, T]`. `device_arrays` places a batch on the mesh with
its batch axis over `'data'`.

Legend (`layerwave.axes`): B batch, T tokens, k selected layers, D target width.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from layerwave.data import batching
from layerwave.training.features import store as store_lib


@dataclasses.dataclass(frozen=True)
class FeatureBatch:
  """One process's share of a global batch of stored features (B = batch_size / process_count rows).

  Attributes:
    input_ids, attention_mask, assistant_mask, example_mask, indices, position: as `data.Batch`.
    features: `[k, B, T, D]` the requested layers (store dtype), zero on padding.
    final: `[B, T, D]` h_L (store dtype).
    argmax: `[B, T]` int32 the target's full-vocabulary argmax.
  """
  input_ids: np.ndarray
  attention_mask: np.ndarray
  assistant_mask: np.ndarray
  example_mask: np.ndarray
  indices: np.ndarray
  position: batching.Position
  features: np.ndarray
  final: np.ndarray
  argmax: np.ndarray

  def arrays(self) -> dict[str, np.ndarray]:
    """What `train_step_offline` reads (no `example_mask`: filler rows are already all padding)."""
    return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
            "assistant_mask": self.assistant_mask, "features": self.features, "final": self.final,
            "argmax": self.argmax}


class FeatureBatchIterator(batching.BatchIterator):
  """Deterministic, resumable batches of stored features (see `data.BatchIterator` for the walk).

  Example:
    >>> store = open_store(DIR)
    >>> it = FeatureBatchIterator(store.split("train", max_length=384), store.layer_slots((2, 15, 27)),
    ...                           batch_size=8, seq_len=384, pad_id=2, seed=0)
  """

  def __init__(self, source: store_lib.StoreSplit, slots: Sequence[int], **kwargs: Any):
    """Creates the iterator.

    Args:
      source: a store split.
      slots: `FeatureStore.layer_slots(layer_ids)`: each requested layer's row in the stored hidden states
        (-1 = L, from h_L).
      **kwargs: `data.BatchIterator`'s (batch_size, seq_len, pad_id, seed, shuffle, drop_remainder,
        num_epochs, position, process_index, process_count).
    """
    super().__init__(source, **kwargs)
    self._slots = [int(s) for s in slots]

  def collate(self, examples: Sequence[Mapping[str, Any]], indices: np.ndarray,
              position: batching.Position, shape: tuple[int, int] | None = None) -> FeatureBatch:
    base = super().collate(examples, indices, position, shape)
    b, t = base.input_ids.shape
    dtype, d = self._source.dtype, self._source.hidden_size
    features = np.zeros((len(self._slots), b, t, d), dtype)
    final = np.zeros((b, t, d), dtype)
    argmax = np.zeros((b, t), np.int32)
    hidden_rows = [s for s in self._slots if s >= 0]
    for row, ex in enumerate(examples):
      n = min(ex["final"].shape[0], t)
      final[row, :n] = ex["final"][:n]
      argmax[row, :n] = ex["argmax"][:n]
      picked = ex["hidden"][hidden_rows, :n] if hidden_rows else None  # one gather from the memory map
      k = 0
      for i, slot in enumerate(self._slots):
        if slot < 0:
          features[i, row, :n] = final[row, :n]
        else:
          features[i, row, :n] = picked[k]
          k += 1
    return FeatureBatch(base.input_ids, base.attention_mask, base.assistant_mask, base.example_mask,
                        base.indices, position, features, final, argmax)


def shardings(mesh: Mesh) -> dict[str, NamedSharding]:
  """Per field of `FeatureBatch.arrays()`: the batch axis over `'data'` (axis 1 of `features`)."""
  row = NamedSharding(mesh, P("data"))
  return {"input_ids": row, "attention_mask": row, "assistant_mask": row, "argmax": row,
          "final": NamedSharding(mesh, P("data")), "features": NamedSharding(mesh, P(None, "data"))}


def device_arrays(batch: FeatureBatch, mesh: Mesh) -> dict[str, jax.Array]:
  """The batch's arrays as global arrays on `mesh` (each process contributes its own rows)."""
  specs = shardings(mesh)
  return {k: jax.make_array_from_process_local_data(specs[k], v) for k, v in batch.arrays().items()}
