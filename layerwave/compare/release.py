"""A comparison's finished work as a release: what a sweep's CPU-hours made, kept in the repository.

A sweep of the paper's experiment (`layerwave.compare`) spans days and machines; its feature store can be
extracted again in minutes, but its cells cost hours. A release keeps what cannot be rebuilt cheaply and
nothing that can: the sweep's settings (`compare.json`), the statistics its layer sets were chosen from (the
analysis' `layer_stats.json`: an analysis run again on another machine could round a selection differently),
and every finished result (each cell's `result.json`, the probes, the finalists' and the released draft's
evaluations) in one JSON file, with a manifest (counts, commands, the SHA-256 of every file). `unpack` puts
them back into a workdir, where `experiments/compare_layers.py` skips the finished cells and goes on.

  python -m layerwave.compare.release pack WORKDIR RELEASE_DIR [--made-by=COMMAND]   # as cells finish
  python -m layerwave.compare.release unpack RELEASE_DIR WORKDIR                       # before resuming
  python -m layerwave.compare.release verify RELEASE_DIR
"""

from __future__ import annotations

import fnmatch
import json
import os
import sys
from typing import Any

from layerwave import atomic
from layerwave.data import release as answers_release
from layerwave.data.release import ReleaseError
from layerwave.training.options import expand_home, home_as_tilde

__all__ = ["pack", "unpack", "verify", "FORMAT", "ReleaseError"]

FORMAT = "layerwave-compare-results"
FORMAT_VERSION = 1
RESULTS = "results.json"
ANALYSIS = "layer_stats.json"
SETTINGS = "compare.json"
# What a workdir's CPU-hours made (relative paths): everything else there is derived (results.md, plots) or
# scratch (checkpoints).
# A learned selection run inside the workdir (`layerwave.training.learned`, W/learned) keeps its gates, selections
# and report.
KEPT = ("probe.json", "cells/*/seed*/result.json", "cells/*/x*/seed*/result.json", "finalists/*/seed*.json",
        "release/*.json", "learned/*.json", "learned/seed*/*.json")


def _kept_files(workdir: str) -> list[str]:
  out = []
  for root, dirs, files in os.walk(workdir):
    dirs[:] = sorted(d for d in dirs if d != "checkpoints")
    for name in files:
      rel = os.path.relpath(os.path.join(root, name), workdir).replace(os.sep, "/")
      if any(fnmatch.fnmatchcase(rel, pattern) and rel.count("/") == pattern.count("/") for pattern in KEPT):
        out.append(rel)
  return sorted(out)


def _by_budget(cells: list[str]) -> dict[str, int]:
  """Cells per budget: cells/<set>/seed<s>/result.json is 1x, cells/<set>/x<b>/seed<s>/result.json is b."""
  out: dict[str, int] = {}
  for rel in cells:
    parts = rel.split("/")
    budget = parts[2] if len(parts) == 5 else "x1"
    out[budget] = out.get(budget, 0) + 1
  return dict(sorted(out.items()))


def _analysis_dir(workdir: str, settings: dict[str, Any]) -> str:
  """Where the sweep reads its statistics: `compare.analysis` (as recorded, "~/" expanded), else W/analysis."""
  path = (settings.get("compare") or {}).get("analysis") or ""
  return expand_home(path) if path else os.path.join(workdir, "analysis")


def _read_settings(workdir: str) -> dict[str, Any]:
  path = os.path.join(workdir, SETTINGS)
  if not os.path.isfile(path):
    raise ReleaseError(f"{workdir} has no {SETTINGS}: not a comparison workdir (experiments/compare_layers.py "
                       "writes it when a sweep starts).")
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def pack(workdir: str, release_dir: str, commands: list[str] | None = None) -> dict[str, Any]:
  """Writes (or replaces) the release of `workdir`'s finished results; returns its manifest.

  The release is built beside `release_dir` and renamed into place (`atomic.atomic_directory`), so a killed
  pack leaves the old one.

  Raises:
    ReleaseError: not a comparison workdir, no analysis where the sweep reads it, or a release of another sweep
      (other settings) or holding results this workdir lacks (packing would lose them: unpack it first).
  """
  recorded = _read_settings(workdir)
  analysis = os.path.join(_analysis_dir(workdir, recorded["settings"]), ANALYSIS)
  if not os.path.isfile(analysis):
    raise ReleaseError(f"{analysis} does not exist: the sweep's statistics must be released with its cells.")
  results = {}
  for rel in _kept_files(workdir):
    with open(os.path.join(workdir, rel), encoding="utf-8") as f:
      results[rel] = json.load(f)
  old = None
  if os.path.isfile(os.path.join(release_dir, answers_release.MANIFEST)):
    old = verify(release_dir)
    if old["fingerprint"] != recorded["fingerprint"]:
      raise ReleaseError(f"{release_dir} holds another sweep (settings fingerprint {old['fingerprint']} vs "
                         f"{recorded['fingerprint']}); use a new release directory.")
    with open(os.path.join(release_dir, RESULTS), encoding="utf-8") as f:
      lost = sorted(set(json.load(f)) - set(results))
    if lost:
      raise ReleaseError(f"{release_dir} holds {len(lost)} results {workdir} lacks (e.g. {lost[0]}): unpack the "
                         "release into the workdir first, so that packing keeps them.")
  with atomic.atomic_directory(release_dir) as staging:
    with open(analysis, encoding="utf-8") as f:  # paths under the home directory as "~/..." (no local path)
      atomic.write_json(os.path.join(staging, ANALYSIS), home_as_tilde(json.load(f)))
    atomic.write_json(os.path.join(staging, SETTINGS), recorded)
    with open(os.path.join(staging, RESULTS), "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1, sort_keys=True)
      f.write("\n")
    cells = [r for r in results if r.startswith("cells/")]
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "fingerprint": recorded["fingerprint"],
        "cells": len(cells),
        "cells_by_budget": _by_budget(cells),
        "other_results": sorted(r for r in results if not r.startswith("cells/")),
        "commands": [answers_release.portable(c) for c in commands or (old or {}).get("commands", [])],
        "sha256": {name: answers_release.sha256(os.path.join(staging, name)) for name in sorted(os.listdir(staging))},
    }
    atomic.write_json(os.path.join(staging, answers_release.MANIFEST), manifest)
  return manifest


def verify(release_dir: str) -> dict[str, Any]:
  """Checks every file of the release against its manifest's SHA-256; returns the manifest."""
  return answers_release.verify(release_dir, FORMAT)


def unpack(release_dir: str, workdir: str) -> dict[str, Any]:
  """Puts a release's settings, statistics and results into `workdir` (and its analysis directory).

  Results the workdir already holds are kept as they are; the rest are written. The analysis is written
  where the recorded settings read it (`compare.analysis`, or W/analysis) unless an identical one is there.

  Raises:
    ReleaseError: an altered release, a workdir recorded under other settings, or an analysis there that
      differs from the release's (the layer sets would differ: move it aside, or unpack into a new workdir).
  """
  manifest = verify(release_dir)
  with open(os.path.join(release_dir, SETTINGS), encoding="utf-8") as f:
    recorded = json.load(f)
  settings_path = os.path.join(workdir, SETTINGS)
  if os.path.isfile(settings_path):
    mine = _read_settings(workdir)
    if mine["fingerprint"] != recorded["fingerprint"]:
      raise ReleaseError(f"{workdir} holds a sweep of other settings (fingerprint {mine['fingerprint']} vs the "
                         f"release's {recorded['fingerprint']}); unpack into a new workdir.")
  analysis = os.path.join(_analysis_dir(workdir, recorded["settings"]), ANALYSIS)
  with open(os.path.join(release_dir, ANALYSIS), encoding="utf-8") as f:
    stats = expand_home(json.load(f))
  if os.path.isfile(analysis):
    with open(analysis, encoding="utf-8") as f:
      if json.dumps(json.load(f), sort_keys=True) != json.dumps(stats, sort_keys=True):
        raise ReleaseError(f"{analysis} differs from the statistics {release_dir} was swept on: its layer sets "
                           "could differ. Move that analysis aside (the release restores its own), or unpack into "
                           "a new workdir with another compare.analysis.")
  else:
    atomic.write_json(analysis, stats)
  if not os.path.isfile(settings_path):
    atomic.write_json(settings_path, recorded)
  with open(os.path.join(release_dir, RESULTS), encoding="utf-8") as f:
    results = json.load(f)
  written = 0
  for rel, content in results.items():
    path = os.path.join(workdir, *rel.split("/"))
    if not os.path.isfile(path):
      atomic.write_json(path, content)
      written += 1
  return {**manifest, "written": written, "kept": len(results) - written}


def main(argv: list[str]) -> None:
  made_by = [a.split("=", 1)[1] for a in argv[2:] if a.startswith("--made-by=")]
  args = [a for a in argv[1:] if not a.startswith("--made-by=")]
  usage = ("usage: python -m layerwave.compare.release pack WORKDIR RELEASE_DIR [--made-by=COMMAND ...] | "
           "unpack RELEASE_DIR WORKDIR | verify RELEASE_DIR")
  if not args or args[0] not in ("pack", "unpack", "verify") or len(args) != (2 if args[0] == "verify" else 3) or (
      made_by and args[0] != "pack"):
    raise SystemExit(usage)
  if args[0] == "pack":
    m = pack(args[1], args[2], commands=made_by + [" ".join(["python -m layerwave.compare.release"] + args)])
  elif args[0] == "unpack":
    m = unpack(args[1], args[2])
  else:
    m = verify(args[1])
  print(json.dumps({k: m[k] for k in ("cells", "cells_by_budget", "fingerprint", "written", "kept") if k in m}))


if __name__ == "__main__":
  main(sys.argv)
