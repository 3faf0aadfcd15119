"""Typed stage options from a config section: the one place config values are converted and checked.

Each stage's options are a frozen dataclass (`training.options.TrainOptions`, `data.options.DataOptions`,
...); `from_section(Options, config.train, "train")` builds one from its config section, converting every
field to its annotated type (int, float, bool, str, tuple of ints) and refusing a missing field or a value of
the wrong kind with one error that names `section.field`. The dataclass' own `__post_init__` then checks
ranges. Library code reads the typed fields and casts nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from typing import Any

__all__ = ["convert", "fingerprint", "from_section"]

_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}


def _convert(value: Any, kind: str, where: str) -> Any:
  if kind == "bool":
    if isinstance(value, bool):
      return value
    raise ValueError(f"{where} must be True or False, got {value!r}.")
  if kind == "int":
    if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != int(value):
      raise ValueError(f"{where} must be an integer, got {value!r}.")
    return int(value)
  if kind == "float":
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ValueError(f"{where} must be a number, got {value!r}.")
    return float(value)
  if kind == "str":
    if not isinstance(value, str):
      raise ValueError(f"{where} must be a string, got {value!r}.")
    return value
  raise TypeError(f"{where}: no conversion for field type {kind!r}.")


def fingerprint(value: Any) -> str:
  """The first 16 hex digits of the sha256 of `value`'s JSON (keys sorted): the one hash of settings that
  workdirs record (training's config fingerprint, the comparison's, the analysis' data hash)."""
  text = json.dumps(value, sort_keys=True, default=str)
  return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def convert(value: Any, kind: type, where: str) -> Any:
  """`value` as `kind` (int, float, bool or str), or a ValueError naming the config field `where`."""
  return _convert(value, kind.__name__, where)


def from_section(cls, section, name: str, **overrides):
  """`cls(**fields)` from a ConfigDict (or dict) section, each field converted to its annotated type.

  Args:
    cls: a dataclass whose fields are int, float, bool or str.
    section: the config section (`config.train`); fields it lacks take the dataclass' defaults.
    name: the section's name in errors ("train" → "train.lr must be a number, got 'x'").
    **overrides: values that replace the section's (already typed).

  Raises:
    ValueError: a value of the wrong kind, or a required field the section lacks.
  """
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for f in dataclasses.fields(cls):
    if not f.init:
      continue
    if f.name in overrides:
      kwargs[f.name] = overrides[f.name]
      continue
    if f.name not in section:
      if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        raise ValueError(f"Config section {name!r} lacks the field {name}.{f.name}.")
      continue
    kind = getattr(hints[f.name], "__name__", str(hints[f.name]))
    kwargs[f.name] = _convert(section[f.name], kind, f"{name}.{f.name}")
  return cls(**kwargs)
