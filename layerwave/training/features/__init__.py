"""Feature stores: the target's features extracted once, so that drafts train without the target.

`extract` (the stage `run`, experiments/extract_features.py) writes a store; `open_store` reads it back
checked; `FeatureBatchIterator` yields the fixed-shape batches `training.step.train_step_offline` reads.
Re-exports only; see `store`, `extraction` and `batches`.
"""

from layerwave.training.features.batches import device_arrays
from layerwave.training.features.batches import FeatureBatch
from layerwave.training.features.batches import FeatureBatchIterator
from layerwave.training.features.extraction import extract
from layerwave.training.features.extraction import FeatureOptions
from layerwave.training.features.store import check_for_training
from layerwave.training.features.store import FeatureStore
from layerwave.training.features.store import JoinedSplit
from layerwave.training.features.store import open_store
from layerwave.training.features.store import StoreError
