"""Keeping evaluation prompts out of training data: text overlap between training and evaluation prompts.

Place in the pipeline: the self-distillation stage (`layerwave.data.distill`) drops every training
conversation that shares a prompt with an evaluation set (MT-bench first and second turns, HumanEval, GSM8K
test) before the target answers it, so a draft is never trained on the prompts it is measured on.

Texts are compared after `normalize` (lower-cased, every run of whitespace collapsed to one space, trimmed).
A training prompt overlaps an evaluation prompt when the two are equal, or, for strings of at least
`min_chars` characters, when one contains the other (a ShareGPT user who pasted a GSM8K problem inside a
longer request; a short request that is a piece of an MT-bench question).

The containment test is exact, not approximate, and fast enough for all of ShareGPT (60k user turns against
~1.8k evaluation prompts in seconds): if a normalised string `e = w0 w1 … wk` (words) occurs inside `t`, its
inner words `w1 … w(k-1)` are whole words of `t`, so the word trigram `(w1, w2, w3)` of `e` occurs among
`t`'s word trigrams. Candidates found through that anchor are then confirmed with a substring test. Strings
of fewer than five words (no inner trigram) are checked by direct substring search.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

from layerwave.data import sources

__all__ = ["EvalIndex", "EVAL_SETS", "eval_prompts", "normalize"]

# The evaluation sets the speculative-decoding stage measures on.
EVAL_SETS = ("mtbench", "humaneval", "gsm8k")


def normalize(text: str) -> str:
  """`text` lower-cased with every run of whitespace collapsed to one space and the ends trimmed."""
  return " ".join(text.lower().split())


def eval_prompts(names: Iterable[str]) -> dict[str, list[str]]:
  """Every prompt of the named evaluation sets, as the decoding stage sends them and in their raw form.

  Args:
    names: source names (`EVAL_SETS` or any `sources.get_source` name).

  Returns:
    {name: prompts}: all user turns (MT-bench's first and second turns), plus HumanEval's bare task prompt
    (the signature and docstring, without the instruction the chat prompt wraps around it).

  Raises:
    sources.SourceError: an evaluation set is not installed (the message names the package).
  """
  out = {}
  for name in names:
    texts = []
    for record in sources.get_source(name):
      texts.extend(record.turns)
      texts.extend(m["content"] for m in record.messages if m["role"] == "user")
      if record.meta.get("prompt"):
        texts.append(str(record.meta["prompt"]))
    out[name] = list(dict.fromkeys(t for t in texts if t.strip()))
  return out


def _trigrams(words: Sequence[str]) -> Iterable[tuple[str, str, str]]:
  return zip(words, words[1:], words[2:])


@dataclasses.dataclass
class EvalIndex:
  """An index of evaluation prompts that finds the one a training prompt overlaps.

  Build it with `EvalIndex.build({name: prompts})`; `match(text)` returns the name of an overlapping set.

  Attributes:
    min_chars: containment (either way) counts only for strings of at least this many characters;
      equality always counts.
    texts: the normalised evaluation prompts.
    names: the evaluation set of each text.
  """

  min_chars: int
  texts: list[str]
  names: list[str]
  _exact: dict[str, int] = dataclasses.field(default_factory=dict)
  _anchors: dict[tuple[str, str, str], list[int]] = dataclasses.field(default_factory=dict)
  _all_trigrams: dict[tuple[str, str, str], set[int]] = dataclasses.field(default_factory=dict)
  _few_words: list[int] = dataclasses.field(default_factory=list)
  _joined: str = ""

  @classmethod
  def build(cls, prompts: Mapping[str, Sequence[str]], min_chars: int = 40) -> "EvalIndex":
    """Indexes `{eval set name: prompts}`; `min_chars` as the attribute (>= 1)."""
    if min_chars < 1:
      raise ValueError(f"min_chars must be >= 1, got {min_chars}.")
    index = cls(min_chars=int(min_chars), texts=[], names=[])
    for name, texts in prompts.items():
      for text in texts:
        norm = normalize(text)
        if not norm or norm in index._exact:
          continue
        i = len(index.texts)
        index.texts.append(norm)
        index.names.append(name)
        index._exact[norm] = i
        words = norm.split(" ")
        for gram in _trigrams(words):
          index._all_trigrams.setdefault(gram, set()).add(i)
        if len(norm) >= min_chars:
          if len(words) >= 5:
            index._anchors.setdefault(tuple(words[1:4]), []).append(i)
          else:
            index._few_words.append(i)
    # Separated by a character that normalised text never holds, so no match spans two prompts.
    index._joined = "\n".join(index.texts)
    return index

  def __len__(self) -> int:
    return len(self.texts)

  def match(self, text: str) -> str | None:
    """The name of an evaluation set with a prompt that `text` equals, contains or is contained in.

    Args:
      text: a training prompt (any whitespace and case).

    Returns:
      The set's name, or None when `text` overlaps no evaluation prompt.
    """
    norm = normalize(text)
    if not norm:
      return None
    if norm in self._exact:
      return self.names[self._exact[norm]]
    words = norm.split(" ")
    # The training prompt contains an evaluation prompt.
    for gram in _trigrams(words):
      for i in self._anchors.get(gram, ()):
        if self.texts[i] in norm:
          return self.names[i]
    for i in self._few_words:
      if self.texts[i] in norm:
        return self.names[i]
    # An evaluation prompt contains the training prompt.
    if len(norm) >= self.min_chars:
      if len(words) >= 5:
        for i in sorted(self._all_trigrams.get(tuple(words[1:4]), ())):
          if norm in self.texts[i]:
            return self.names[i]
      elif norm in self._joined:
        at = self._joined.index(norm)
        return self.names[self._joined.count("\n", 0, at)]
    return None

  def match_record(self, record: sources.Record) -> str | None:
    """`match` over every user message and turn of a record: the first overlapping set, or None."""
    texts = list(record.turns) + [m["content"] for m in record.messages if m["role"] == "user"]
    for text in dict.fromkeys(texts):
      name = self.match(text)
      if name is not None:
        return name
    return None
