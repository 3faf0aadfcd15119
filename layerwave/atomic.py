"""Atomic writes: build under a temporary name beside the target, then rename into place.

Every file and model directory layerwave writes goes through here: directories (GGUF conversion, EAGLE-3
export) through `atomic_directory`; JSON records (`layer_stats.json`, `selection.json`, results) through
`write_json`; tables and other text through `write_text`; figures through `atomic_file`. An interrupted
write never leaves a half-written file or directory where a complete one is expected, and a reader never
sees one. Temporary names are unique (`tempfile`), so two writers of the same path never share one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Any, Callable, Iterator

import numpy as np


@contextlib.contextmanager
def atomic_directory(out_dir: str, prefix: str = ".tmp-") -> Iterator[str]:
  """Yields a fresh temporary directory; on success it replaces `out_dir`, on error it is removed.

  The new directory is complete before an existing `out_dir` (directory, file or link) is removed. Its
  permissions are opened to 0755 / 0644 like any model directory (mkdtemp makes it private).
  """
  out_dir = os.path.abspath(os.fspath(out_dir))
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
  try:
    yield tmp
    os.chmod(tmp, 0o755)
    for name in os.listdir(tmp):
      os.chmod(os.path.join(tmp, name), 0o644)
    if os.path.lexists(out_dir):
      if os.path.isdir(out_dir) and not os.path.islink(out_dir):
        shutil.rmtree(out_dir)
      else:
        os.remove(out_dir)
    os.replace(tmp, out_dir)
  finally:
    if os.path.exists(tmp):
      shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[str]:
  """Yields a temporary file path beside `path`; on success it replaces `path`, on error it is removed.

  Args:
    path: the file to write; its folder is created.
    suffix: the temporary name's ending (`.png` for writers that read the format off the name).

  The temporary file is named `.<name>.<random><suffix>` and opened to 0644 before the rename, like any
  output file (mkstemp makes it private).
  """
  path = os.path.abspath(os.fspath(path))
  folder = os.path.dirname(path)
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=suffix, dir=folder)
  os.close(fd)
  try:
    yield tmp
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def write_text(path: str | os.PathLike, text: str) -> str:
  """Writes `text` to `path` atomically; returns the path."""
  with atomic_file(path) as tmp:
    with open(tmp, "w") as f:
      f.write(text)
  return os.fspath(path)


def jsonable(value: Any) -> Any:
  """`value` with numpy arrays and scalars made lists and Python numbers, tuples lists, keys strings."""
  if isinstance(value, dict):
    return {str(k): jsonable(x) for k, x in value.items()}
  if isinstance(value, (list, tuple)):
    return [jsonable(x) for x in value]
  if isinstance(value, np.ndarray):
    return jsonable(value.tolist())
  if isinstance(value, np.generic):
    return value.item()
  return value


def write_json(path: str | os.PathLike, obj: Any, *, indent: int = 1, sort_keys: bool = False,
               default: Callable[[Any], Any] | None = None) -> str:
  """Writes `jsonable(obj)` as JSON (NaN and infinities allowed) to `path` atomically; returns the path.

  Args:
    path: the file.
    obj: dicts, lists, numbers, strings, numpy values.
    indent, sort_keys: as `json.dumps`.
    default: as `json.dumps`: turns any other object into something JSON can write (e.g. `str`); by
      default such an object is an error.
  """
  text = json.dumps(jsonable(obj), indent=indent, sort_keys=sort_keys, allow_nan=True, default=default)
  return write_text(path, text + "\n")
