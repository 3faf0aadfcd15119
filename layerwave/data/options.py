"""The `data` section as typed options: which conversations, how long, how they split; the dataset they build.

Place in the pipeline: the analysis and draft-training stages read the same chat dataset; both build it here
from `config.data`, so the two cannot read the section differently.
"""

from __future__ import annotations

import dataclasses

from layerwave.data import distilled
from layerwave.data import tfds_builders

__all__ = ["DataOptions"]


@dataclasses.dataclass(frozen=True)
class DataOptions:
  """`config.data`.

  Attributes:
    source: a source name (`sharegpt`, ...), a path the readers accept, or `distilled:DIR` (a dataset
      experiments/distill.py wrote with this target).
    max_length: tokens per training / analysis sequence.
    max_records: read at most this many conversations (0 = all).
    heldout_fraction: share of conversations held out (training's evaluation split).
    split_seed: the train / held-out split's seed.
  """

  source: str
  max_length: int
  max_records: int = 0
  heldout_fraction: float = 0.05
  split_seed: int = 0

  def __post_init__(self):
    if self.max_length < 2:
      raise ValueError(f"data.max_length must be >= 2 tokens, got {self.max_length}; set "
                       "--config.data.max_length=512.")
    if self.max_records < 0:
      raise ValueError(f"data.max_records must be >= 0 (0 = every conversation), got {self.max_records}.")
    if not 0.0 <= self.heldout_fraction < 1.0:
      raise ValueError(f"data.heldout_fraction must be in [0, 1), got {self.heldout_fraction}; set e.g. "
                       "--config.data.heldout_fraction=0.05.")

  def build(self, tokenizer) -> tfds_builders.ChatDataset:
    """Builds (or reuses) the chat dataset these options name.

    A self-distilled source (`distilled:DIR`) must have been written by the target this tokenizer belongs
    to (`distilled.check_source`): another model's answers are refused.
    """
    distilled.check_source(self.source, tokenizer)
    return tfds_builders.build_chat_dataset(
        tokenizer, self.source, max_length=self.max_length, heldout_fraction=self.heldout_fraction,
        split_seed=self.split_seed, source_options={"limit": self.max_records} if self.max_records else None)
