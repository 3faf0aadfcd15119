"""layerwave.atomic: files and directories appear complete or not at all, on real files."""

import json
import math
import os
import stat

import numpy as np
import pytest

from layerwave import atomic


def _mode(path) -> int:
  return stat.S_IMODE(os.stat(path).st_mode)


def test_write_json_converts_numpy_and_leaves_only_the_file(tmp_path):
  path = tmp_path / "sub" / "record.json"  # the folder is created
  obj = {"a": np.arange(3, dtype=np.int64), "b": np.float32(0.5), "c": (1, 2), 4: [np.nan, math.inf],
         "d": {"e": np.array([[1.5, 2.5]])}}
  assert atomic.write_json(path, obj) == os.fspath(path)
  got = json.loads(path.read_text())
  assert got["a"] == [0, 1, 2] and got["b"] == 0.5 and got["c"] == [1, 2] and got["d"]["e"] == [[1.5, 2.5]]
  assert math.isnan(got["4"][0]) and got["4"][1] == math.inf
  assert path.read_text().endswith("\n") and os.listdir(path.parent) == ["record.json"]
  assert _mode(path) == 0o644


def test_write_json_sort_keys_indent_and_default(tmp_path):
  path = tmp_path / "r.json"
  atomic.write_json(path, {"b": 1, "a": 2}, indent=2, sort_keys=True)
  assert path.read_text() == '{\n  "a": 2,\n  "b": 1\n}\n'
  with pytest.raises(TypeError):
    atomic.write_json(path, {"x": object()})
  assert json.loads(path.read_text()) == {"a": 2, "b": 1}  # the failed write changed nothing
  atomic.write_json(path, {"y": range(2)}, default=str)
  assert json.loads(path.read_text()) == {"y": "range(0, 2)"}


def test_an_interrupted_file_write_keeps_the_old_file(tmp_path):
  path = tmp_path / "table.md"
  atomic.write_text(path, "old\n")
  with pytest.raises(RuntimeError):
    with atomic.atomic_file(path, suffix=".png") as tmp:
      assert tmp.endswith(".png") and os.path.basename(tmp).startswith(".table.md.")
      with open(tmp, "w") as f:
        f.write("half")
      raise RuntimeError("killed")
  assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["table.md"]
  atomic.write_text(path, "new\n")
  assert path.read_text() == "new\n" and os.listdir(tmp_path) == ["table.md"]


def test_atomic_directory_replaces_a_directory_only_when_complete(tmp_path):
  out = tmp_path / "model"
  with atomic.atomic_directory(str(out)) as tmp:
    with open(os.path.join(tmp, "config.json"), "w") as f:
      f.write("{}")
  assert os.listdir(out) == ["config.json"] and _mode(out) == 0o755
  with pytest.raises(RuntimeError):
    with atomic.atomic_directory(str(out)) as tmp:
      with open(os.path.join(tmp, "weights"), "w") as f:
        f.write("half")
      raise RuntimeError("killed")
  assert os.listdir(out) == ["config.json"] and os.listdir(tmp_path) == ["model"]
