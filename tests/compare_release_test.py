"""layerwave.compare.release: a sweep's finished results packed, verified and put back (file handling and
its refusals; tests/compare_test.py round-trips a real sweep through it)."""

import json
import os
import shutil

import pytest

from layerwave import atomic
from layerwave.compare import release as compare_release
from layerwave.compare.release import ReleaseError


def _workdir(root, fingerprint="f1", analysis=""):
  w = os.path.join(root, "compare")
  atomic.write_json(os.path.join(w, "compare.json"),
                    {"fingerprint": fingerprint, "settings": {"compare": {"analysis": analysis}}})
  atomic.write_json(os.path.join(analysis or os.path.join(w, "analysis"), "layer_stats.json"), {"model": "m"})
  for rel in ("cells/L2-15-27/seed0/result.json", "cells/L2-15-27/x4/seed1/result.json", "probe.json",
              "finalists/L2-15-27/seed0.json", "release/draft.json"):
    atomic.write_json(os.path.join(w, *rel.split("/")), {"path": rel})
  # Derived or scratch: never packed.
  for rel in ("results.json", "cells/L2-15-27/seed0/checkpoints/10/meta.json", "cells/L2-15-27/seed0/train.json"):
    atomic.write_json(os.path.join(w, *rel.split("/")), {"scratch": True})
  return w


def test_pack_keeps_results_and_statistics_only_and_unpack_restores_them(tmp_path):
  w = _workdir(str(tmp_path))
  release = str(tmp_path / "release")
  m = compare_release.pack(w, release, commands=[f"make paper-compare RUNS={os.path.expanduser('~')}/runs"])
  assert sorted(os.listdir(release)) == ["compare.json", "layer_stats.json", "manifest.json", "results.json"]
  assert m["cells"] == 2 and m["cells_by_budget"] == {"x1": 1, "x4": 1}
  assert m["other_results"] == ["finalists/L2-15-27/seed0.json", "probe.json", "release/draft.json"]
  assert m["commands"] == ["make paper-compare RUNS=~/runs"]  # no local path in the repository
  assert compare_release.verify(release) == m
  fresh = str(tmp_path / "fresh")
  out = compare_release.unpack(release, fresh)
  assert out["written"] == 5 and out["kept"] == 0
  for rel in ("compare.json", "analysis/layer_stats.json", "cells/L2-15-27/x4/seed1/result.json", "probe.json"):
    with open(os.path.join(w, rel)) as a, open(os.path.join(fresh, rel)) as b:
      assert json.load(a) == json.load(b)
  assert not os.path.exists(os.path.join(fresh, "results.json"))
  assert not os.path.exists(os.path.join(fresh, "cells", "L2-15-27", "seed0", "train.json"))
  # Unpacking again writes nothing; a result the workdir already holds is kept as it is.
  atomic.write_json(os.path.join(fresh, "probe.json"), {"newer": True})
  assert compare_release.unpack(release, fresh)["written"] == 0
  with open(os.path.join(fresh, "probe.json")) as f:
    assert json.load(f) == {"newer": True}


def test_the_analysis_goes_where_the_sweep_reads_it(tmp_path):
  elsewhere = str(tmp_path / "stats")
  w = _workdir(str(tmp_path), analysis=elsewhere)
  release = str(tmp_path / "release")
  compare_release.pack(w, release)
  os.remove(os.path.join(elsewhere, "layer_stats.json"))
  compare_release.unpack(release, str(tmp_path / "fresh"))
  assert os.path.isfile(os.path.join(elsewhere, "layer_stats.json"))


def test_refusals(tmp_path):
  w = _workdir(str(tmp_path))
  release = str(tmp_path / "release")
  with pytest.raises(ReleaseError, match="not a comparison workdir"):
    compare_release.pack(str(tmp_path / "nothing"), release)
  compare_release.pack(w, release)
  # An altered release file.
  with open(os.path.join(release, "results.json"), "a") as f:
    f.write(" ")
  with pytest.raises(ReleaseError, match="does not match its SHA-256"):
    compare_release.unpack(release, str(tmp_path / "fresh"))
  with pytest.raises(ReleaseError, match="does not match its SHA-256"):
    compare_release.pack(w, release)  # nor is a release that does not verify packed over
  shutil.rmtree(release)
  compare_release.pack(w, release)
  # A workdir of another sweep, on either side.
  other = _workdir(str(tmp_path / "other"), fingerprint="f2")
  with pytest.raises(ReleaseError, match="holds another sweep"):
    compare_release.pack(other, release)
  with pytest.raises(ReleaseError, match="holds a sweep of other settings"):
    compare_release.unpack(release, other)
  # Statistics that differ from those the sweep chose its sets from.
  fresh = str(tmp_path / "fresh")
  atomic.write_json(os.path.join(fresh, "analysis", "layer_stats.json"), {"model": "other"})
  with pytest.raises(ReleaseError, match="differs from the statistics"):
    compare_release.unpack(release, fresh)
  assert not os.path.exists(os.path.join(fresh, "compare.json"))  # nothing written before the refusal
  with pytest.raises(SystemExit, match="usage"):
    compare_release.main(["x", "unpack", release])
