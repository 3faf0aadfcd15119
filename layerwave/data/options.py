"""The data stages' sections as typed options: `data` (which conversations, how long, how they split; the
dataset they build) and `distill` (how the target answers them).

Place in the pipeline: the analysis and draft-training stages read the same chat dataset; both build it here
from `config.data`, so the two cannot read the section differently. Distillation (`data.distill`, answering
in `data.answering`) reads `DistillOptions`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from layerwave.data import chat
from layerwave.data import decontaminate
from layerwave.data import distilled
from layerwave.data import sources
from layerwave.data import tfds_builders
from layerwave.sampling import SamplingParams

__all__ = ["DataOptions", "DistillOptions"]


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
    """The options as the dict that workdirs, fingerprints and feature stores record."""
    return dataclasses.asdict(self)

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


@dataclasses.dataclass(frozen=True)
class DistillOptions:
  """`config.distill`.

  Attributes:
    source: prompt source: a `sources.get_source` name (`sharegpt`) or `distilled:DIR`.
    num_prompts: conversations to answer (the first ones that pass the filters); 0 = all.
    turns: user turns answered per conversation (1 = the first; k = up to k, each after the target's own
      earlier answers).
    max_new_tokens: the answer budget per turn.
    max_prompt_tokens: longer first prompts are skipped (and counted); a later turn that outgrows it ends
      its conversation.
    temperature, top_k, top_p: sampling (temperature 0 = greedy).
    seed: sampling seed (each batch derives its own from it, the chunk, turn and batch).
    batch_size: prompts per `generate` call (static batches, `slots` = 0).
    slots: > 0 answers with continuous batching (`layerwave.continuous`): conversations stream through this
      many decoding rows across chunks, a row leaves at EOS, `max_new_tokens`, a repetition loop or (plain
      format) a new turn, and the next prompt (a conversation's next turn first) takes it. 0 = static batches
      of `batch_size`.
    chunk_steps: with `slots`: decode steps between the host's refills and stop checks.
    chunk_size: conversations per chunk, the unit of resumption.
    loop_max_period: longest repeated block the loop cutter looks for (0 = no loop cutting).
    loop_min_repeats: a loop must cover at least this many periods...
    loop_min_tokens: ...and at least this many tokens.
    keep_unfinished: keep answers that stop at `max_new_tokens` without EOS or a loop (False drops the turn
      and ends the conversation there).
    exclude: comma-separated evaluation sets whose prompts must not enter the data ("" = none).
    exclude_min_chars: containment counts for strings of at least this many characters (equality always).
    chat_format: how prompts and the regenerated history become text, one of `chat.CHAT_FORMATS`: "template"
      (the tokenizer's chat template) or "plain" (base models; answers cut at the next turn). `run` sets it
      from `config.data.chat_format`, so the data is read back in the format its prompts were written in.
  """

  source: str = "sharegpt"
  num_prompts: int = 0
  turns: int = 1
  max_new_tokens: int = 512
  max_prompt_tokens: int = 512
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  batch_size: int = 16
  slots: int = 0
  chunk_steps: int = 16
  chunk_size: int = 64
  loop_max_period: int = 64
  loop_min_repeats: int = 3
  loop_min_tokens: int = 32
  keep_unfinished: bool = True
  exclude: str = ",".join(decontaminate.EVAL_SETS)
  exclude_min_chars: int = 40
  chat_format: str = "template"

  # Settings a rerun of the same workdir may change (they change how much is done or how fast, not what).
  RESUMABLE = ("num_prompts", "batch_size", "slots", "chunk_steps")
  # Left out of `settings()` while it holds its default: the settings fingerprint of the committed answers
  # release (releases/smollm2-135m-instruct-distilled) was recorded without it, and must keep resuming.
  LATE_DEFAULTS: ClassVar[dict] = {"chat_format": "template"}

  def __post_init__(self):
    checks = [
        (self.max_new_tokens >= 1, "max_new_tokens must be >= 1 (tokens per answer)", "max_new_tokens=512"),
        (self.turns >= 1, "turns must be >= 1", "turns=1"),
        (self.max_prompt_tokens >= 1, "max_prompt_tokens must be >= 1", "max_prompt_tokens=512"),
        (self.num_prompts >= 0, "num_prompts must be >= 0 (0 = every prompt)", "num_prompts=0"),
        (self.batch_size >= 1, "batch_size must be >= 1", "batch_size=32"),
        (self.chunk_size >= 1, "chunk_size must be >= 1", "chunk_size=64"),
        (self.slots >= 0, "slots must be >= 0 (0 = static batches)", "slots=16"),
        (self.chunk_steps >= 1, "chunk_steps must be >= 1", "chunk_steps=16"),
        (self.loop_max_period >= 0, "loop_max_period must be >= 0 (0 = off)", "loop_max_period=64"),
        (self.loop_min_repeats >= 2, "loop_min_repeats must be >= 2", "loop_min_repeats=3"),
        (self.loop_min_tokens >= 0, "loop_min_tokens must be >= 0", "loop_min_tokens=32"),
        (self.exclude_min_chars >= 1, "exclude_min_chars must be >= 1", "exclude_min_chars=40"),
    ]
    for ok, message, fix in checks:
      if not ok:
        value = getattr(self, fix.split("=")[0])
        raise ValueError(f"distill.{message}, got {value}; set e.g. --config.distill.{fix}.")
    if self.chat_format not in chat.CHAT_FORMATS:
      raise ValueError(f"distill: the chat format must be one of {list(chat.CHAT_FORMATS)}, got "
                       f"{self.chat_format!r}; set --config.data.chat_format=template (plain for a base model "
                       "without a chat template).")
    _ = self.sampling  # SamplingParams checks temperature, top-k and top-p
    unknown = [name for name in self.exclude_sets if name not in sources.SOURCES]
    if unknown:
      raise ValueError(f"distill.exclude names unknown evaluation sets {unknown}; use names of "
                       f"{sorted(sources.SOURCES)}, e.g. --config.distill.exclude={','.join(decontaminate.EVAL_SETS)}.")

  @property
  def sampling(self) -> SamplingParams:
    try:
      return SamplingParams(self.temperature, self.top_k, self.top_p)
    except ValueError as e:
      raise ValueError(f"distill: {e} Set --config.distill.temperature / top_k / top_p.") from e

  @property
  def exclude_sets(self) -> tuple[str, ...]:
    return tuple(s.strip() for s in self.exclude.split(",") if s.strip())

  def settings(self) -> dict[str, Any]:
    """Every field that fixes what the data is (the resumable ones and late defaults left out)."""
    return {k: v for k, v in dataclasses.asdict(self).items()
            if k not in self.RESUMABLE and not (k in self.LATE_DEFAULTS and v == self.LATE_DEFAULTS[k])}
