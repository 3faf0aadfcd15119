"""The `data` section as typed options: which conversations, how long, how they split; the dataset they build.

Place in the pipeline: the analysis and draft-training stages read the same chat dataset; both build it here
from `config.data`, so the two cannot read the section differently.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from layerwave.data import chat
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
    chat_format: how conversations become text: "template" (the tokenizer's chat template) or "plain"
      ("User: ...\n\nAssistant: ..." paragraphs, for base models without a template; `chat.encode_plain`).
  """

  source: str
  max_length: int
  max_records: int = 0
  heldout_fraction: float = 0.05
  split_seed: int = 0
  chat_format: str = "template"

  # Fields added after workdirs recorded this section: `record()` leaves them out while they hold these
  # defaults, so the fingerprints of earlier checkpoints, comparisons and stores still match.
  LATE_DEFAULTS: ClassVar[dict] = {"chat_format": "template"}

  def __post_init__(self):
    if self.max_length < 2:
      raise ValueError(f"data.max_length must be >= 2 tokens, got {self.max_length}; set "
                       "--config.data.max_length=512.")
    if self.max_records < 0:
      raise ValueError(f"data.max_records must be >= 0 (0 = every conversation), got {self.max_records}.")
    if not 0.0 <= self.heldout_fraction < 1.0:
      raise ValueError(f"data.heldout_fraction must be in [0, 1), got {self.heldout_fraction}; set e.g. "
                       "--config.data.heldout_fraction=0.05.")
    if self.chat_format not in chat.CHAT_FORMATS:
      raise ValueError(f"data.chat_format must be one of {list(chat.CHAT_FORMATS)}, got {self.chat_format!r}; "
                       "set --config.data.chat_format=template (plain for a base model).")

  def record(self) -> dict[str, Any]:
    """The options as the dict that workdirs, fingerprints and feature stores record (late defaults left out)."""
    return self.drop_late_defaults(dataclasses.asdict(self))

  @classmethod
  def drop_late_defaults(cls, data_section: dict) -> dict:
    """Removes `LATE_DEFAULTS` fields holding their defaults from a data section (in place; returned)."""
    for name, default in cls.LATE_DEFAULTS.items():
      if name in data_section and data_section[name] == default:
        data_section.pop(name)
    return data_section

  def build(self, tokenizer) -> tfds_builders.ChatDataset:
    """Builds (or reuses) the chat dataset these options name.

    A self-distilled source (`distilled:DIR`) must have been written by the target this tokenizer belongs
    to (`distilled.check_source`) and is read in the chat format its prompts were written in: another model's
    answers, or answers to another rendering, are refused.
    """
    distilled.check_source(self.source, tokenizer, self.chat_format)
    return tfds_builders.build_chat_dataset(
        tokenizer, self.source, max_length=self.max_length, heldout_fraction=self.heldout_fraction,
        split_seed=self.split_seed, source_options={"limit": self.max_records} if self.max_records else None,
        chat_format=self.chat_format)
