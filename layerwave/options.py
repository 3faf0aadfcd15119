"""Typed stage options from a config section: the one place config values are converted and checked.

Each stage's options are a frozen dataclass (`training.options.TrainOptions`, `data.options.DataOptions`,
...); `from_section(Options, config.train, "train")` builds one from its config section, converting every
field to its annotated type and refusing a missing field or a value of the wrong kind with one error that
names `section.field`. The dataclass' own `__post_init__` then checks ranges. Library code reads the typed
fields and casts nothing. Configs are `Config`s, whose sections hold each dataclass' defaults (`section`), so a
key no stage reads, in a config file or as `--config.train.lerning_rate=...`, is refused with one error that
names the nearest known key.

Field types: int, float, bool, str, a tuple of one of int / float / str (`tuple[int, ...]`), or a tuple of
tuples of ints (`tuple[tuple[int, ...], ...]`, lists of layer sets). A tuple field takes a tuple or list, or
the command-line forms: `--config.layers=2,15,27` and `--config.layers='(2,15,27)'` both reach the config as
`(2, 15, 27)` (ml_collections' tuple parser), `--config.compare.sets=eagle3,greedy` as
`('eagle3,greedy',)` (a bare word is not a Python literal), and an old comma string `"2,15,27"` stays a
string; each string item is split at commas, empty items are dropped. A tuple of tuples also takes
';'-separated sets (`"2,15,27;5,18,29"`) or one flat set (`(2, 15, 27)`).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.util
import json
import os
import typing
from collections.abc import Mapping
from typing import Any, Callable

import ml_collections

from layerwave import atomic

__all__ = ["Config", "UnknownKeyError", "config_module", "convert", "differing_fields", "fingerprint",
           "from_section", "record_settings", "section"]

# What each tuple kind looks like, for errors.
_EXAMPLES = {int: "comma-separated integers like 2,15,27 (or a tuple (2, 15, 27))",
             float: "comma-separated numbers like 0.25,4 (or a tuple (0.25, 4.0))",
             str: "comma-separated names like eagle3,greedy (or a tuple ('eagle3', 'greedy'))"}
_SETS_EXAMPLE = ("';'-separated id lists like '2,15,27;5,18,29' (or a tuple of tuples "
                 "((2, 15, 27), (5, 18, 29)))")


def _scalar(value: Any, kind: type, where: str) -> Any:
  if kind is bool:
    if isinstance(value, bool):
      return value
    raise ValueError(f"{where} must be True or False, got {value!r}.")
  if kind is int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != int(value):
      raise ValueError(f"{where} must be an integer, got {value!r}.")
    return int(value)
  if kind is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ValueError(f"{where} must be a number, got {value!r}.")
    return float(value)
  if kind is str:
    if not isinstance(value, str):
      raise ValueError(f"{where} must be a string, got {value!r}.")
    return value
  raise TypeError(f"{where}: no conversion for field type {kind!r}.")


def _items(value: Any) -> list[Any]:
  """The items of a list-like value: tuple / list entries, string entries split at commas, '' dropped."""
  entries = list(value) if isinstance(value, (tuple, list)) else [value]
  out = []
  for entry in entries:
    if isinstance(entry, str):
      out += [s.strip() for s in entry.split(",") if s.strip()]
    else:
      out.append(entry)
  return out


def _item(value: Any, kind: type) -> Any:
  """One tuple item as `kind`; a string from the comma form is read as a number for int / float."""
  if kind is str:
    if not isinstance(value, str):
      raise ValueError
    return value
  if isinstance(value, str):
    value = float(value)  # ValueError for 'a'; '2' and '2.0' are both the integer 2
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ValueError
  if kind is int:
    if float(value) != int(value):
      raise ValueError
    return int(value)
  return float(value)


def _tuple(value: Any, kind: type, where: str) -> tuple:
  if value is None or not isinstance(value, (tuple, list, str, int, float)):
    raise ValueError(f"{where} must be {_EXAMPLES[kind]}, got {value!r}.")
  try:
    return tuple(_item(v, kind) for v in _items(value))
  except (TypeError, ValueError, OverflowError) as e:
    raise ValueError(f"{where} must be {_EXAMPLES[kind]}, got {value!r}.") from e


def _sets(value: Any, where: str) -> tuple[tuple[int, ...], ...]:
  """Sets of ints: "1,2,3;4,5,6", ((1, 2, 3), (4, 5, 6)), ("1,2,3", "4,5,6") or one flat set (1, 2, 3)."""
  if isinstance(value, str):
    chunks = [c for c in value.split(";") if c.strip()]
  elif isinstance(value, (tuple, list)) and value and not any(isinstance(v, (tuple, list, str)) for v in value):
    chunks = [value]  # one set given flat, e.g. --config.compare.manual=2,15,27
  elif isinstance(value, (tuple, list)):
    chunks = [c for v in value for c in (v.split(";") if isinstance(v, str) else [v])]
    chunks = [c for c in chunks if not isinstance(c, str) or c.strip()]
  else:
    raise ValueError(f"{where} must be {_SETS_EXAMPLE}, got {value!r}.")
  try:
    return tuple(tuple(_item(v, int) for v in _items(c)) for c in chunks)
  except (TypeError, ValueError, OverflowError) as e:
    raise ValueError(f"{where} must be {_SETS_EXAMPLE}, got {value!r}.") from e


def convert(value: Any, kind: Any, where: str) -> Any:
  """`value` as `kind`, or one ValueError naming the config field `where` and the expected form.

  Args:
    value: a config value.
    kind: int, float, bool, str, a tuple of one of int / float / str (`tuple[int, ...]`), or
      `tuple[tuple[int, ...], ...]` (the module docstring lists the forms a tuple accepts).
    where: the field's name in errors ("train.lr", "--config.layers").
  """
  if typing.get_origin(kind) is tuple:
    args = typing.get_args(kind)
    if len(args) == 2 and args[1] is Ellipsis:
      if args[0] in _EXAMPLES:
        return _tuple(value, args[0], where)
      if args[0] == tuple[int, ...]:
        return _sets(value, where)
    raise TypeError(f"{where}: no conversion for field type {kind!r}.")
  return _scalar(value, kind, where)


def fingerprint(value: Any) -> str:
  """The first 16 hex digits of the sha256 of `value`'s JSON (keys sorted): the one hash of settings that
  workdirs record (training's config fingerprint, the comparison's, the analysis' data hash)."""
  text = json.dumps(value, sort_keys=True, default=str)
  return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(d, dict):
    return {prefix: d}
  out = {}
  for k, v in d.items():
    out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
  return out


def differing_fields(recorded: Mapping[str, Any], current: Mapping[str, Any], limit: int = 8) -> str:
  """The dotted names of the settings that differ between two nested records, for a refused resume's error
  ("train.lr, seed"; at most `limit`, then "...")."""
  a, b = _flat(dict(recorded)), _flat(dict(current))
  # JSON turns tuples into lists: compare them as lists.
  norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731
  diff = [k for k in sorted(set(a) | set(b)) if norm(a.get(k)) != norm(b.get(k))]
  return ", ".join(diff[:limit]) + (" ..." if len(diff) > limit else "") if diff else "none recorded"


def record_settings(path: str, settings: Mapping[str, Any], holds: str,
                    normalize: Callable[[dict], dict] | None = None) -> None:
  """Records `settings` (JSON) at `path` for a new workdir, or refuses one recorded under other settings.

  `holds` says what the workdir holds, for the error ("comparison results", "benchmark rows"); the error
  names the differing fields and the fix. The file is {"fingerprint": ..., "settings": ...}, written
  atomically, so a killed writer leaves none. `normalize` (settings -> settings) maps both the recorded and
  the new settings to what must agree, e.g. dropping fields added since at their defaults, so that a record
  written before a field existed, or with it at its default, still matches.
  """
  settings = json.loads(json.dumps(dict(settings), default=str))  # as the file will hold it
  value = fingerprint(settings)
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    if old.get("fingerprint") == value:
      return
    if normalize is not None:
      mine = normalize(json.loads(json.dumps(settings)))
      theirs = normalize(json.loads(json.dumps(old.get("settings", {}))))
      if fingerprint(mine) == fingerprint(theirs):
        return
      settings, old = mine, {"fingerprint": old.get("fingerprint"), "settings": theirs}
    raise ValueError(f"{os.path.dirname(path) or '.'} holds {holds} of a different config (fingerprint "
                     f"{old.get('fingerprint')} vs {value}; differing fields: "
                     f"{differing_fields(old.get('settings', {}), settings)}). Resume with the same config or "
                     "use a new --workdir.")
  atomic.write_json(path, {"fingerprint": value, "settings": settings})


def from_section(cls, section, name: str, *, aliases: Mapping[str, str] | None = None, **overrides):
  """`cls(**fields)` from a ConfigDict (or dict) section, each field converted to its annotated type.

  Args:
    cls: a dataclass whose fields have the types `convert` takes.
    section: the config section (`config.train`); fields it lacks take the dataclass' defaults.
    name: the section's name in errors ("train" → "train.lr must be a number, got 'x'").
    aliases: field → the config key that holds it, where the names differ ({"halves": "stability"}).
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
    key = (aliases or {}).get(f.name, f.name)
    if key not in section:
      if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        raise ValueError(f"Config section {name!r} lacks the field {name}.{key}.")
      continue
    kwargs[f.name] = convert(section[key], hints[f.name], f"{name}.{key}")
  return cls(**kwargs)


class UnknownKeyError(KeyError):
  """A config key that no section holds (a KeyError, as ml_collections expects, that prints as a sentence)."""

  def __str__(self) -> str:
    return str(self.args[0])


class Config(ml_collections.ConfigDict):
  """A ConfigDict that refuses an unknown key with one error naming the nearest known key.

  Reading a missing key, or adding one once the config is locked (launchers load configs with
  `lock_config=True`, so `--config.train.lerning_rate=1` is an unknown key; configs/smollm2/base.py locks its
  sections, so a typo in a config file is one too), raises `UnknownKeyError`: "config has no key
  train.lerning_rate; the nearest known key is train.end_lr_fraction (train holds: ...)".

  Args:
    initial: the fields, as for ConfigDict.
    name: the section's dotted name in errors ("train"; "" at the top).
  """

  def __init__(self, initial: Mapping[str, Any] | None = None, *, name: str = "", **kwargs):
    super().__init__(initial, **kwargs)
    object.__setattr__(self, "_name", name)

  def _unknown(self, key: str) -> UnknownKeyError:
    name = self.__dict__.get("_name", "")
    keys = sorted(str(k) for k in self.keys())
    where = lambda k: f"{name}.{k}" if name else k  # noqa: E731
    nearest = difflib.get_close_matches(key, keys, 1, 0.0)
    hint = f"; the nearest known key is {where(nearest[0])}" if nearest else ""
    return UnknownKeyError(f"config has no key {where(key)}{hint} ({name or 'the config'} holds: "
                           f"{', '.join(keys)}).")

  def _known(self, key: Any) -> bool:
    fields = self.__dict__.get("_fields")  # absent while copy / pickle rebuild the object
    return fields is None or not isinstance(key, str) or "." in key or key.startswith("__") or key in fields

  def __getitem__(self, key):
    if not self._known(key):
      raise self._unknown(key)
    return super().__getitem__(key)

  def __setitem__(self, key, value):
    if self.__dict__.get("_locked") and not self._known(key):
      raise self._unknown(key)
    super().__setitem__(key, value)


def section(cls, name: str, *, skip: tuple[str, ...] = (), aliases: Mapping[str, str] | None = None,
            **values: Any) -> Config:
  """A config section holding `cls`' defaults: the one place a default is written is the dataclass.

  Args:
    cls: the section's options dataclass (`TrainOptions` for `train`).
    name: the section's name ("train").
    skip: fields that are not config keys (set by the stage itself).
    aliases: field -> config key, where they differ (as `from_section` takes them).
    **values: config keys without a default in `cls` (required fields, keys no dataclass holds) or whose
      config value differs from the dataclass' default (each such key says why where it is set).

  Raises:
    ValueError: a value that restates the dataclass' default (a default lives in one place).
  """
  out = {}
  fields = {(aliases or {}).get(f.name, f.name): f for f in dataclasses.fields(cls) if f.init and f.name not in skip}
  for key, f in fields.items():
    if f.default is not dataclasses.MISSING:
      out[key] = f.default
    elif f.default_factory is not dataclasses.MISSING:
      out[key] = f.default_factory()
  for key, value in values.items():
    if key in out and type(out[key]) is type(value) and out[key] == value:
      raise ValueError(f"{name}.{key} = {value!r} restates the default of {cls.__name__}: drop it from the config.")
    out[key] = value  # may hold another type than the field (analysis.normalize: "skean" for True)
  return Config(out, name=name)


def config_module(path: str):
  """The config file at `path` as a module (configs are files, loaded by path as `--config=PATH` loads them,
  not a package): how an experiment's config reads the base it builds on."""
  name = "configs." + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
