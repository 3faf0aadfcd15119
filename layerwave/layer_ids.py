"""Layer ids: the one numbering of target layers, its conversions, the record of a chosen set (docs/METHOD.md §1).

Place in the pipeline: every stage that names target layers speaks these ids — the configs (`parse_layer_ids`
reads `config.layers` and `compare.manual`), `layerwave.selection` (whose strategies return a
`LayerSelection`), draft checkpoints, EAGLE-3 exports and imports (`to_block_outputs` / `from_block_outputs`
at that boundary). The `LayerSelection` record is saved as JSON, carried into every draft checkpoint and
export, and validated against the target (L, D) on every load.

Layer-id convention ("hf_hidden_states", the only one stored): ids index Hugging Face's `hidden_states` stack,
[L+1, B, T, D]: 0 = embedding output, i (1 ≤ i < L) = output of decoder block i−1, L = final norm output.
EAGLE-3's rule is (2, L//2, L−3) here — the numbers vLLM / SGLang store in `eagle_aux_hidden_state_layer_ids`.
SpecForge and TensorRT-LLM count "output of block j" instead, i.e. hf id = block id + 1; convert only at that
boundary with `from_block_outputs` / `to_block_outputs`. (Block outputs cover hf ids 1..L−1 and, for the last
block, the pre-norm tensor that HF does not return — hence `to_block_outputs` refuses 0 and L.)

Legend (`layerwave.axes`): L target layers, B batch, T tokens, D target width.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from layerwave import atomic
from layerwave import options as options_lib

__all__ = [
    "CONVENTION",
    "LayerSelection",
    "as_layer_id",
    "default_candidates",
    "eagle3_layer_ids",
    "from_block_outputs",
    "parse_layer_ids",
    "to_block_outputs",
]

CONVENTION = "hf_hidden_states"


# ----------------------------------------------------------------------------------------------------------
# Ids and conventions.


def as_layer_id(v) -> int:
  """An integer-valued number (a layer id, L or D read from JSON) as an int; ValueError otherwise."""
  if isinstance(v, bool) or not float(v).is_integer():
    raise ValueError(f"layer id {v!r} is not an integer")
  return int(v)


def parse_layer_ids(value: Any, field: str = "layers") -> tuple[int, ...]:
  """Layer ids given by hand: a tuple / list of ints, the command-line forms, or one int.

  The one parser of `config.layers` and each `compare.manual` set: `(2, 15, 27)`, `[2, 15, 27]`, `"2,15,27"`
  and `("2,15,27",)` all give `(2, 15, 27)`; `()` and `""` give `()` (no ids given). Conversion is
  `layerwave.options.convert`'s; validation against a target is `LayerSelection.validate_for`'s.

  Raises:
    ValueError: a non-integer entry, naming `--config.{field}` and the expected form.
  """
  return options_lib.convert(value, tuple[int, ...], f"--config.{field}")


def from_block_outputs(block_ids: Sequence[int], num_layers: int | None = None) -> tuple[int, ...]:
  """SpecForge / TensorRT-LLM "output of block j" ids → hf_hidden_states ids (j + 1).

  Args:
    block_ids: 0-based decoder-block indices.
    num_layers: L, to validate the range 0 ≤ j ≤ L−2 (the last block's output is not an HF hidden state
      before the final norm).

  Returns:
    Tuple of hf ids.
  """
  out = []
  for j in block_ids:
    j = as_layer_id(j)
    if j < 0 or (num_layers is not None and j > num_layers - 2):
      raise ValueError(f"block-output id {j} has no hf_hidden_states equivalent "
                       f"(valid: 0..{'L-2' if num_layers is None else num_layers - 2})")
    out.append(j + 1)
  return tuple(out)


def to_block_outputs(ids: Sequence[int], num_layers: int | None = None) -> tuple[int, ...]:
  """hf_hidden_states ids → SpecForge / TensorRT-LLM "output of block j" ids (id − 1).

  Args:
    ids: hf ids, 1 ≤ id ≤ L−1.
    num_layers: L, to validate the upper bound.

  Returns:
    Tuple of block ids.
  """
  out = []
  for i in ids:
    i = as_layer_id(i)
    if i < 1 or (num_layers is not None and i > num_layers - 1):
      raise ValueError(f"hf id {i} has no block-output equivalent (0 = embeddings, L = final norm)")
    out.append(i - 1)
  return tuple(out)


def eagle3_layer_ids(num_layers: int, k: int = 3) -> tuple[int, ...]:
  """EAGLE-3's fixed rule in hf ids: (2, L//2, L−3).

  For k ≠ 3 (our generalisation, not part of EAGLE-3): k ids evenly spaced from 2 to L−3 inclusive,
  rounded; k = 1 gives (L//2,).

  Args:
    num_layers: L.
    k: number of layers.

  Returns:
    Sorted tuple of k distinct ids.
  """
  if k < 1:
    raise ValueError(f"k must be >= 1, got {k}")
  if k == 3:
    ids = (2, num_layers // 2, num_layers - 3)
  elif k == 1:
    ids = (num_layers // 2,)
  else:
    ids = tuple(int(round(v)) for v in np.linspace(2, num_layers - 3, k))
  if len(set(ids)) != k or min(ids) < 1 or max(ids) > num_layers - 1:
    raise ValueError(f"the eagle3 rule gives invalid ids {ids} for L={num_layers}, k={k}")
  return tuple(sorted(ids))


def default_candidates(num_layers: int, include_embeddings: bool = False,
                       include_final: bool = False) -> tuple[int, ...]:
  """Candidate ids 1..L−1, optionally with 0 (embeddings) and/or L (final norm)."""
  lo = 0 if include_embeddings else 1
  hi = num_layers if include_final else num_layers - 1
  return tuple(range(lo, hi + 1))


# ----------------------------------------------------------------------------------------------------------
# The record.


@dataclasses.dataclass(frozen=True)
class LayerSelection:
  """Which target layers the draft reads, and how they were chosen (immutable, JSON round-trips).

  Attributes:
    ids: sorted, unique hf_hidden_states ids, each in [0, L].
    num_layers: L (decoder blocks) of the target.
    hidden_size: D of the target (None if unknown; then not validated).
    convention: always "hf_hidden_states".
    strategy: one of `layerwave.selection.STRATEGIES` (or a free name for hand-made records).
    lam: λ of the objective.
    min_gap: minimum distance between chosen ids (0 = none).
    scores: objective and per-layer values of the chosen set.
    data_hash: hash of the statistics' data (None if unknown).
    config: the settings that produced the record.
    seed: seed (used by `random`).
  """

  ids: tuple[int, ...]
  num_layers: int
  hidden_size: int | None = None
  convention: str = CONVENTION
  strategy: str = "manual"
  lam: float = 1.0
  min_gap: int = 0
  scores: dict = dataclasses.field(default_factory=dict)
  data_hash: str | None = None
  config: dict = dataclasses.field(default_factory=dict)
  seed: int = 0

  def __post_init__(self):
    if self.convention != CONVENTION:
      raise ValueError(
          f"layer ids in convention {self.convention!r}; only {CONVENTION!r} is stored. Convert "
          "SpecForge / TensorRT-LLM 'output of block j' ids with from_block_outputs (hf id = block id + 1)")
    num_layers = as_layer_id(self.num_layers)
    if num_layers < 1:
      raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    ids = tuple(as_layer_id(i) for i in self.ids)
    if not ids:
      raise ValueError("a layer selection needs at least one id")
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
      raise ValueError(f"duplicate layer ids {dup} in {list(ids)}")
    neg = [i for i in ids if i < 0]
    if neg:
      raise ValueError(f"negative layer ids {neg}; ids index hidden_states [0, L={num_layers}]")
    out = [i for i in ids if i > num_layers]
    if out:
      raise ValueError(f"layer ids {out} out of range for L={num_layers} (valid 0..{num_layers}, "
                       f"hf_hidden_states convention)")
    ids = tuple(sorted(ids))
    if self.strategy == "eagle3" and len(ids) == 3 and num_layers >= 6:
      expected = eagle3_layer_ids(num_layers)
      if ids != expected:
        hint = ""
        if ids == tuple(sorted(to_block_outputs(expected))):
          hint = (" — these are the EAGLE-3 ids in the SpecForge / TensorRT-LLM block-output convention; "
                  "convert them with from_block_outputs")
        raise ValueError(f"strategy 'eagle3' with ids {list(ids)}, but the rule (2, L//2, L-3) gives "
                         f"{list(expected)} for L={num_layers}{hint}")
    if self.hidden_size is not None and as_layer_id(self.hidden_size) < 1:
      raise ValueError(f"hidden_size must be >= 1, got {self.hidden_size}")
    if self.min_gap < 0:
      raise ValueError(f"min_gap must be >= 0, got {self.min_gap}")
    object.__setattr__(self, "ids", ids)
    object.__setattr__(self, "num_layers", num_layers)
    if self.hidden_size is not None:
      object.__setattr__(self, "hidden_size", as_layer_id(self.hidden_size))

  @property
  def k(self) -> int:
    return len(self.ids)

  def block_output_ids(self) -> tuple[int, ...]:
    """The ids in the SpecForge / TensorRT-LLM convention (id − 1)."""
    return to_block_outputs(self.ids, self.num_layers)

  def validate_for(self, num_layers: int | None = None, hidden_size: int | None = None) -> None:
    """Raises if this record was made for another model.

    Args:
      num_layers: L of the target in hand (None: not checked).
      hidden_size: D of the target in hand (None: not checked).
    """
    mismatch = []
    if num_layers is not None and int(num_layers) != self.num_layers:
      mismatch.append(f"L={self.num_layers} vs L={int(num_layers)}")
    if hidden_size is not None and self.hidden_size is not None and int(hidden_size) != self.hidden_size:
      mismatch.append(f"D={self.hidden_size} vs D={int(hidden_size)}")
    if mismatch:
      raise ValueError("layer selection was made for another model (record vs this target): "
                       + ", ".join(mismatch))

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["ids"] = list(self.ids)
    return atomic.jsonable(d)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> LayerSelection:
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
      raise ValueError(f"unknown fields in layer selection record: {unknown}")
    if "ids" not in d or "num_layers" not in d:
      raise ValueError("layer selection record needs 'ids' and 'num_layers'")
    d = dict(d)
    d["ids"] = tuple(d["ids"])
    return cls(**d)

  @classmethod
  def from_json(cls, text: str) -> LayerSelection:
    return cls.from_dict(json.loads(text))

  def save(self, path: str | os.PathLike) -> None:
    """Writes the record as JSON, atomically (`layerwave.atomic`)."""
    atomic.write_text(path, self.to_json() + "\n")

  @classmethod
  def load(cls, path: str | os.PathLike, num_layers: int | None = None,
           hidden_size: int | None = None) -> LayerSelection:
    """Reads and validates a record; with num_layers / hidden_size, also checks it fits this target.

    Raises:
      ValueError: malformed record, invalid ids, other convention, or another model's record.
    """
    with open(path) as f:
      try:
        d = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{os.fspath(path)} is not a JSON layer selection: {e}") from e
    sel = cls.from_dict(d)
    sel.validate_for(num_layers, hidden_size)
    return sel
