"""Distilled answers as a compact release: what the target wrote, without the prompts' text.

A distillation workdir (`layerwave.data.distill`) holds the prompts' text (third-party data: ShareGPT) beside
the target's answers. A release keeps only what this project made: for each finished chunk, each kept
conversation's position and id in the prompt source and the token ids of each answer, gzipped JSON
(`answers-NNNNN.json.gz`), plus the workdir's `settings.json` and `manifest.json` (counts, commands, the
content fingerprint of the records, the SHA-256 of every file). Any machine with the prompt source installed
rebuilds the workdir's chunk files from it (`unpack`): the user turns come from the source, the answers are
the token ids decoded by the target's tokenizer exactly as distillation decoded them. A rebuilt workdir is a
distillation workdir: `experiments/distill.py` on it with the same settings builds the dataset, or goes on
distilling the chunks the release does not hold yet.

  python -m layerwave.data.release pack WORKDIR RELEASE_DIR [--model=NAME]  # after (or during) a distillation
  python -m layerwave.data.release unpack RELEASE_DIR WORKDIR    # then experiments/distill.py --workdir=WORKDIR

The manifest names the target (`model`, as `--config.model` names it), so `unpack` loads the right one; a release
packed before it named one is SmolLM2's.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import re
import sys
from typing import Any

from layerwave import atomic
from layerwave.data import answering
from layerwave.data import distilled
from layerwave.data import sources
from layerwave.data import tfds_builders
from layerwave.inference import load_target

__all__ = ["ReleaseError", "pack", "unpack", "verify", "MANIFEST", "portable", "sha256"]

MANIFEST = "manifest.json"
DEFAULT_MODEL = "smollm2-135m-instruct"  # the target of releases whose manifest names none
FORMAT = "layerwave-distilled-answers"
FORMAT_VERSION = 1
_ANSWERS = re.compile(r"answers-(\d{5})\.json\.gz$")


class ReleaseError(ValueError):
  """A release that is incomplete, altered, or does not fit the target or prompt source it is used with."""


def sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(1 << 20):
      digest.update(block)
  return digest.hexdigest()


def pack(workdir: str, release_dir: str, commands: list[str] | None = None, extra: dict | None = None,
         model: str | None = None) -> dict[str, Any]:
  """Writes (or extends) the compact release of `workdir`'s finished chunks; returns its manifest.

  `model` is the target as `--config.model` names it, recorded for `unpack` (default: the one the workdir's
  manifest names once distillation has finished, else the release's earlier one).

  Only the leading run of consecutive chunks 0..n-1 is packed, so that a release always rebuilds a prefix of
  the prompt selection. Chunk files already in the release are kept (they are checked against the workdir).

  Raises:
    ReleaseError: the workdir has no settings or chunks, a chunk lacks the answers' token ids (a workdir from
      before they were stored), or the release holds another run's answers.
  """
  settings = distilled.read_settings(workdir)
  if settings is None:
    raise ReleaseError(f"{workdir} is not a distillation workdir (no {distilled.SETTINGS}); run "
                       "experiments/distill.py on it first.")
  chunks = distilled.finished_chunks(workdir)
  prefix = []
  for k, chunk in enumerate(chunks):
    if chunk["chunk"] != k:
      break
    prefix.append(chunk)
  if not prefix:
    raise ReleaseError(f"{workdir} has no finished chunk 0 yet: nothing to release.")
  os.makedirs(release_dir, exist_ok=True)
  old = _read_manifest(release_dir) if os.path.isfile(os.path.join(release_dir, MANIFEST)) else None
  if old is not None and old["settings_fingerprint"] != settings["fingerprint"]:
    raise ReleaseError(f"{release_dir} holds answers of another distillation (settings fingerprint "
                       f"{old['settings_fingerprint']} vs {settings['fingerprint']}); use a new release directory.")
  # (Another target's answers are refused above: the settings' fingerprint holds the target's.)
  model = model or _workdir_model(workdir) or (old or {}).get("model")
  records, stats_total = [], {}
  for chunk in prefix:
    compact = []
    for r in chunk["records"]:
      if "answer_tokens" not in r:
        raise ReleaseError(f"Chunk {chunk['chunk']} of {workdir} stores no answer token ids (written before "
                           "distillation kept them); distil it again into a new workdir to release it.")
      compact.append({"index": r["index"], "id": r["id"], "answers": r["answer_tokens"]})
    body = {"chunk": chunk["chunk"], "ids": chunk["ids"], "stats": chunk["stats"], "records": compact}
    path = os.path.join(release_dir, f"answers-{chunk['chunk']:05d}.json.gz")
    data = gzip.compress(json.dumps(body, separators=(",", ":")).encode(), mtime=0)
    if not os.path.isfile(path):
      with atomic.atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
    else:
      with gzip.open(path, "rt", encoding="utf-8") as f:
        if json.load(f) != json.loads(json.dumps(body)):
          raise ReleaseError(f"{path} differs from chunk {chunk['chunk']} of {workdir}.")
    for key, value in chunk["stats"].items():
      stats_total[key] = stats_total.get(key, 0) + value
  records = distilled.dataset_records(prefix)
  content = distilled.content_fingerprint(records)
  if old is not None and old["content"] == content and old["chunks"] == len(prefix):
    verify(release_dir)  # nothing new to pack: the release stays as committed, commands included
    return old
  atomic.write_json(os.path.join(release_dir, distilled.SETTINGS), settings)
  files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(release_dir, "answers-*.json.gz")))
  files.append(distilled.SETTINGS)
  manifest = {
      "format": FORMAT, "format_version": FORMAT_VERSION,
      "settings_fingerprint": settings["fingerprint"],
      "settings": settings["settings"],
      "chunks": len(prefix), "conversations": len(records),
      "prompts_covered": sum(len(c["ids"]) for c in prefix),
      "content": content,
      "stats": stats_total,
      "commands": [portable(c) for c in commands or (old or {}).get("commands", [])],
      **({"model": portable(model)} if model else {}),
      **(extra or {}),
      "sha256": {name: sha256(os.path.join(release_dir, name)) for name in files},
  }
  atomic.write_json(os.path.join(release_dir, MANIFEST), manifest)
  return manifest


def _workdir_model(workdir: str) -> str | None:
  """The target a finished distillation workdir's manifest names (None while it is still running)."""
  path = os.path.join(workdir, MANIFEST)
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f).get("target", {}).get("model")


def portable(command: str) -> str:
  """`command` with this machine's home directory written as `~`, so that no manifest names a local path."""
  home = os.path.expanduser("~").rstrip("/")
  return command.replace(home + "/", "~/") if home and home != "~" else command


def _read_manifest(release_dir: str, fmt: str = FORMAT) -> dict[str, Any]:
  path = os.path.join(release_dir, MANIFEST)
  if not os.path.isfile(path):
    raise ReleaseError(f"{release_dir} has no {MANIFEST}: not a release ({fmt}).")
  with open(path, encoding="utf-8") as f:
    manifest = json.load(f)
  if manifest.get("format") != fmt:
    raise ReleaseError(f"{path} is not a {fmt} release (format {manifest.get('format')!r}).")
  return manifest


def verify(release_dir: str, fmt: str = FORMAT) -> dict[str, Any]:
  """Checks every file of the release against its manifest's SHA-256; returns the manifest.

  `fmt` is the manifest's expected format (distilled answers by default; drafts use this check too).

  Raises:
    ReleaseError: a file is missing, altered, or not listed.
  """
  manifest = _read_manifest(release_dir, fmt)
  listed = manifest["sha256"]
  present = {os.path.basename(p) for p in glob.glob(os.path.join(release_dir, "*")) if os.path.basename(p) != MANIFEST}
  for name in sorted(set(listed) | present):
    path = os.path.join(release_dir, name)
    if name not in listed:
      raise ReleaseError(f"{path} is not listed in {MANIFEST}: remove it, or pack the release again.")
    if not os.path.isfile(path):
      raise ReleaseError(f"{path} is missing (listed in {MANIFEST}); restore it from the repository.")
    if sha256(path) != listed[name]:
      raise ReleaseError(f"{path} does not match its SHA-256 in {MANIFEST} (altered or truncated); restore it "
                         "from the repository.")
  return manifest


def unpack(release_dir: str, workdir: str, target=None, records=None) -> dict[str, Any]:
  """Rebuilds a distillation workdir's `settings.json` and chunk files from a release.

  Args:
    release_dir: the release (verified first).
    workdir: a new or matching distillation workdir.
    target: the target (its tokenizer decodes the answers, its fingerprint must be the release's); default
      the model the manifest names, in the release's dtype.
    records: the prompt source's records (default: `sources.get_source(settings.source)`).

  Returns:
    The release manifest.

  Raises:
    ReleaseError: an altered release, another target, a prompt source whose conversations differ, or answers
      whose rebuilt records do not match the release's content fingerprint.
  """
  manifest = verify(release_dir)
  settings = distilled.read_settings(release_dir)
  values = settings["settings"]
  if target is None:
    model = manifest.get("model", DEFAULT_MODEL)
    target = load_target(os.path.expanduser(model) if model.startswith("~/") else model,
                         dtype=values.get("dtype", "float32"))
  if distilled.target_fingerprint(target) != values["target_fingerprint"]:
    raise ReleaseError(f"{release_dir} was distilled by another target (fingerprint {values['target_fingerprint']}, "
                       f"this one {distilled.target_fingerprint(target)}); load the target the release names.")
  if tfds_builders.tokenizer_fingerprint(target.tokenizer) != values["tokenizer_fingerprint"]:
    raise ReleaseError(f"{release_dir} was decoded with another tokenizer; load the release's target.")
  if records is None:
    records = sources.get_source(values["source"])
  chunks = []
  for path in sorted(glob.glob(os.path.join(release_dir, "answers-*.json.gz"))):
    with gzip.open(path, "rt", encoding="utf-8") as f:
      body = json.load(f)
    out = []
    for r in body["records"]:
      if r["index"] >= len(records) or records[r["index"]].id != r["id"]:
        raise ReleaseError(f"Conversation {r['id']} of {path} is not at position {r['index']} of the prompt source "
                           f"{values['source']!r}: the installed source differs from the one distilled.")
      source = records[r["index"]]
      turns = answering.user_turns(source)
      messages = answering.system_messages(source)
      for t, ids in enumerate(r["answers"]):
        text = target.tokenizer.decode(ids, skip_special_tokens=True).strip()
        messages += [{"role": "user", "content": turns[t]}, {"role": "assistant", "content": text}]
      out.append({"index": r["index"], "id": r["id"], "group": source.split_key, "messages": messages,
                  "answer_tokens": r["answers"]})
    chunks.append({"chunk": body["chunk"], "fingerprint": settings["fingerprint"], "ids": body["ids"],
                   "stats": body["stats"], "records": out})
  rebuilt = json.loads(json.dumps(distilled.dataset_records(chunks)))  # as a chunk file reads back
  if distilled.content_fingerprint(rebuilt) != manifest["content"]:
    raise ReleaseError(f"The conversations rebuilt from {release_dir} do not match its content fingerprint "
                       f"{manifest['content']}: the prompt source or tokenizer decodes differently here.")
  existing = distilled.read_settings(workdir)
  if existing is not None and existing["fingerprint"] != settings["fingerprint"]:
    raise ReleaseError(f"{workdir} holds a distillation with other settings; unpack into a new workdir.")
  if existing is None:
    atomic.write_json(os.path.join(workdir, distilled.SETTINGS), settings)
  for chunk in chunks:
    distilled.write_chunk(workdir, chunk)
  return manifest


def main(argv: list[str]) -> None:
  made_by = [a.split("=", 1)[1] for a in argv[4:] if a.startswith("--made-by=")]
  models = [a.split("=", 1)[1] for a in argv[4:] if a.startswith("--model=")]
  if (len(argv) - len(made_by) - len(models) != 4 or argv[1] not in ("pack", "unpack", "verify")
      or ((made_by or models) and argv[1] != "pack") or len(models) > 1):
    raise SystemExit("usage: python -m layerwave.data.release pack WORKDIR RELEASE_DIR [--made-by=COMMAND ...] "
                     "[--model=NAME] | unpack RELEASE_DIR WORKDIR | verify RELEASE_DIR -")
  if argv[1] == "pack":
    # The manifest's commands: what made the answers (--made-by, e.g. `make campaign-distill`), then this pack.
    m = pack(argv[2], argv[3], commands=made_by + [" ".join(["python -m layerwave.data.release"] + argv[1:4])],
             model=models[0] if models else None)
  elif argv[1] == "unpack":
    m = unpack(argv[2], argv[3])
  else:
    m = verify(argv[2])
  print(json.dumps({k: m[k] for k in ("chunks", "conversations", "content")}))


if __name__ == "__main__":
  main(sys.argv)
