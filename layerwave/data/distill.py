"""Self-distilled training data: the target answers the training prompts itself (issue 12, part 1).

Place in the pipeline: before draft training. A draft learns to predict the target, so it should be trained
on the target's own answers rather than on ChatGPT's: `run(config, workdir)` (launcher
`experiments/distill.py`) takes the user turns of the prompt source (ShareGPT by default), lets the target
answer them with `layerwave.generate` in large ragged batches, and writes the regenerated conversations as
a tfds array_record dataset with the source's record schema (id, group, messages) plus `manifest.json`.
Analysis and training read it unchanged through `data.source=distilled:DIR` (`sources.read_distilled`).

Prompts. Conversations are taken in source order. A conversation is dropped (and counted) when any of its user
turns overlaps an evaluation prompt (`decontaminate`: MT-bench first and second turns, HumanEval, GSM8K),
when it has no user turn, or when its first prompt (system message if any plus the first user turn, through
the chat template with the generation prompt) is longer than `max_prompt_tokens`. The first `num_prompts`
survivors are answered. With `turns > 1` the k-th user turn is sent after the target's own earlier answers
(the regenerated history); a turn whose prompt outgrows `max_prompt_tokens` ends that conversation.

Batching. Each chunk of `chunk_size` conversations is answered turn by turn; a turn's prompts are sorted by
length and cut into batches of `batch_size`, padded to a few fixed prompt widths (powers of two from 64 up to
`max_prompt_tokens`) and row counts (powers of two up to `batch_size`), so decoding compiles a few times only.
Greedy answers do not depend on the batch (a test checks them against `layerwave.generate` on each prompt
alone), so `batch_size` may change between runs of one workdir.

Repetition loops (`find_loop`). A small model often ends an answer by repeating a phrase until the token
budget runs out. An answer contains a loop when some block of p tokens (1 <= p <= `loop_max_period`) repeats
back to back: a stretch `x[s : s + n]` with `x[i] == x[i + p]` throughout, covering n >= `loop_min_repeats`
* p tokens and n >= `loop_min_tokens` tokens (a partial last repeat counts). The earliest such stretch wins
(its smallest period at that start); the answer is cut after the block's first occurrence, `x[: s + p]`, so
the text says it once. Cut answers are counted.

Resumption. Chunk k's conversations are written atomically to `chunks/NNNNN.json` as soon as they are done;
a rerun skips every chunk whose file holds the expected conversation ids, so a killed run resumes without
duplicates or gaps. `settings.json`, written before the first chunk, records the settings fingerprint (target
and tokenizer fingerprints, sampling, budgets, prompt selection); a workdir holding another run's settings is
refused. Run-length settings (`num_prompts`, `batch_size`) may change: a larger `num_prompts` extends a
finished dataset (prompt selection is prefix-stable). When every chunk is done, the array_record dataset is
(re)built from the chunks into `dataset/` and `manifest.json` is written last.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import os
import shutil
import time
import zlib
from typing import Any, Sequence

import jax
import numpy as np
import tensorflow_datasets as tfds
from absl import logging

from layerwave import atomic
from layerwave import options as options_lib
from layerwave import sharding
from layerwave.data import chat
from layerwave.data import decontaminate
from layerwave.data import sources
from layerwave.data import tfds_builders
from layerwave.generate import generate
from layerwave.inference import Target, load_target
from layerwave.sampling import SamplingParams

__all__ = ["Answer", "DistillOptions", "Prompt", "answer_chunk", "answer_prompts", "check_source",
           "checkpoint_fingerprint", "cut_loop", "distill", "find_loop", "make_answer", "run", "select_prompts",
           "target_fingerprint"]

FORMAT_VERSION = 1
DATASET_NAME = "distilled_chat"
MIN_WIDTH = 64


@dataclasses.dataclass(frozen=True)
class DistillOptions:
  """`config.distill`.

  Attributes:
    source: prompt source: a `sources.get_source` name (`sharegpt`) or `distilled:DIR`.
    num_prompts: conversations to answer (the first ones that pass the filters); 0 = all.
    turns: user turns answered per conversation (1 = the first; k = up to k, each after the target's own
      earlier answers).
    max_new_tokens: the answer budget per turn.
    max_prompt_tokens: longer first prompts are skipped (and counted); a later turn that outgrows it ends
      its conversation.
    temperature, top_k, top_p: sampling (temperature 0 = greedy).
    seed: sampling seed (each batch derives its own from it, the chunk, turn and batch).
    batch_size: prompts per `generate` call.
    chunk_size: conversations per chunk, the unit of resumption.
    loop_max_period: longest repeated block the loop cutter looks for (0 = no loop cutting).
    loop_min_repeats: a loop must cover at least this many periods...
    loop_min_tokens: ...and at least this many tokens.
    keep_unfinished: keep answers that stop at `max_new_tokens` without EOS or a loop (False drops the turn
      and ends the conversation there).
    exclude: comma-separated evaluation sets whose prompts must not enter the data ("" = none).
    exclude_min_chars: containment counts for strings of at least this many characters (equality always).
  """

  source: str = "sharegpt"
  num_prompts: int = 0
  turns: int = 1
  max_new_tokens: int = 512
  max_prompt_tokens: int = 512
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  batch_size: int = 32
  chunk_size: int = 64
  loop_max_period: int = 64
  loop_min_repeats: int = 3
  loop_min_tokens: int = 32
  keep_unfinished: bool = True
  exclude: str = ",".join(decontaminate.EVAL_SETS)
  exclude_min_chars: int = 40

  # Settings a rerun of the same workdir may change (they change how much is done or how fast, not what).
  RESUMABLE = ("num_prompts", "batch_size")

  def __post_init__(self):
    checks = [
        (self.max_new_tokens >= 1, "max_new_tokens must be >= 1 (tokens per answer)", "max_new_tokens=512"),
        (self.turns >= 1, "turns must be >= 1", "turns=1"),
        (self.max_prompt_tokens >= 1, "max_prompt_tokens must be >= 1", "max_prompt_tokens=512"),
        (self.num_prompts >= 0, "num_prompts must be >= 0 (0 = every prompt)", "num_prompts=0"),
        (self.batch_size >= 1, "batch_size must be >= 1", "batch_size=32"),
        (self.chunk_size >= 1, "chunk_size must be >= 1", "chunk_size=64"),
        (self.loop_max_period >= 0, "loop_max_period must be >= 0 (0 = off)", "loop_max_period=64"),
        (self.loop_min_repeats >= 2, "loop_min_repeats must be >= 2", "loop_min_repeats=3"),
        (self.loop_min_tokens >= 0, "loop_min_tokens must be >= 0", "loop_min_tokens=32"),
        (self.exclude_min_chars >= 1, "exclude_min_chars must be >= 1", "exclude_min_chars=40"),
    ]
    for ok, message, fix in checks:
      if not ok:
        value = getattr(self, fix.split("=")[0])
        raise ValueError(f"distill.{message}, got {value}; set e.g. --config.distill.{fix}.")
    _ = self.sampling  # SamplingParams checks temperature, top-k and top-p
    unknown = [name for name in self.exclude_sets if name not in sources.SOURCES]
    if unknown:
      raise ValueError(f"distill.exclude names unknown evaluation sets {unknown}; use names of "
                       f"{sorted(sources.SOURCES)}, e.g. --config.distill.exclude={','.join(decontaminate.EVAL_SETS)}.")

  @property
  def sampling(self) -> SamplingParams:
    try:
      return SamplingParams(self.temperature, self.top_k, self.top_p)
    except ValueError as e:
      raise ValueError(f"distill: {e} Set --config.distill.temperature / top_k / top_p.") from e

  @property
  def exclude_sets(self) -> tuple[str, ...]:
    return tuple(s.strip() for s in self.exclude.split(",") if s.strip())

  def settings(self) -> dict[str, Any]:
    """Every field that fixes what the data is (the resumable ones left out)."""
    return {k: v for k, v in dataclasses.asdict(self).items() if k not in self.RESUMABLE}


# -- repetition loops -------------------------------------------------------------------------------

def find_loop(tokens: Sequence[int], max_period: int = 64, min_repeats: int = 3,
              min_tokens: int = 32) -> tuple[int, int] | None:
  """Finds the earliest repetition loop in a token sequence (see the module docstring).

  Args:
    tokens: the answer's token ids.
    max_period: the longest repeated block considered (0 = never a loop).
    min_repeats: the loop must cover at least this many periods (a partial last one counts).
    min_tokens: ...and at least this many tokens.

  Returns:
    `(start, period)`: `tokens[start : start + period]` is the block's first occurrence. None if no loop.
  """
  x = np.asarray(tokens, np.int64)
  n = x.shape[0]
  best = None
  for p in range(1, max_period + 1):
    need = max(min_repeats * p, min_tokens, p + 1)  # tokens the periodic stretch must cover
    if need > n:
      break  # `need` grows with p
    if best is not None and best[0] == 0:
      break
    # equal[i]: x[i] == x[i + p]. A stretch x[s : s + m + p] has period p iff equal[s : s + m] is all True.
    mismatches = np.concatenate([[0], np.cumsum(x[p:] != x[:-p])])
    m = need - p
    starts = np.flatnonzero(mismatches[m:] == mismatches[:-m])
    if starts.size and (best is None or starts[0] < best[0]):
      best = (int(starts[0]), p)
  return best


def cut_loop(tokens: Sequence[int], max_period: int = 64, min_repeats: int = 3,
             min_tokens: int = 32) -> tuple[list[int], bool]:
  """`tokens` cut after the first occurrence of its earliest loop's block; and whether it was cut."""
  loop = find_loop(tokens, max_period, min_repeats, min_tokens) if max_period else None
  if loop is None:
    return list(tokens), False
  return list(tokens[:loop[0] + loop[1]]), True


# -- fingerprints ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def _directory_fingerprint(path: str, stamp: tuple) -> str:
  del stamp  # part of the cache key only: a rewritten file is hashed again
  digest = hashlib.sha256()
  with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
    digest.update(json.dumps(json.load(f), sort_keys=True).encode())
  for name in _weight_files(path):
    digest.update(os.path.basename(name).encode() + b"\0")
    with open(name, "rb") as f:
      while block := f.read(1 << 24):
        digest.update(block)
  return digest.hexdigest()[:16]


def _weight_files(path: str) -> list[str]:
  return sorted(glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(os.path.join(path, "*.bin")))


def checkpoint_fingerprint(path: str) -> str | None:
  """A hash of a checkpoint directory's config.json (parsed) and weight files (bytes): the model's identity.

  Args:
    path: an HF-layout directory (what `hub.resolve` returns and `Target.path` holds).

  Returns:
    16 hex digits (about 0.4 s for SmolLM2-135M's 538 MB, then cached), or None if `path` is no checkpoint.
  """
  if not path or not os.path.isfile(os.path.join(path, "config.json")):
    return None
  files = [os.path.join(path, "config.json")] + _weight_files(path)
  stamp = tuple((f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files)
  return _directory_fingerprint(os.path.realpath(path), stamp)


def target_fingerprint(target: Target) -> str:
  """The target's identity: its checkpoint directory's fingerprint (independent of the compute dtype).

  A target built in memory (no checkpoint directory) is hashed from its parameters instead.
  """
  found = checkpoint_fingerprint(target.path)
  if found is not None:
    return found
  digest = hashlib.sha256(json.dumps(dataclasses.asdict(target.config), sort_keys=True, default=str).encode())
  for leaf in jax.tree.leaves(target.params):
    digest.update(np.asarray(leaf, np.float32).tobytes())
  return digest.hexdigest()[:16]


def check_source(source: str, tokenizer: Any) -> None:
  """Refuses a distilled dataset written by another target or tokenizer than the one reading it.

  Analysis and training call this (through `DataOptions.build`) with the target's tokenizer; the target's
  identity is the checkpoint directory the tokenizer was loaded from (`tokenizer.name_or_path`, which
  `load_target` sets to the target's directory). Other sources pass.

  Raises:
    ValueError: the manifest names another tokenizer or target, with the fix.
  """
  directory = sources.distilled_path(source)
  if directory is None:
    return
  manifest = sources.read_distilled_manifest(directory)
  wrote = manifest["target"]
  fix = (f"Distil the data with this model (python experiments/distill.py --config.model=MODEL "
         f"--workdir=NEW_DIR) or read it with the model that wrote it (--config.model={wrote['model']}).")
  tok_fp = tfds_builders.tokenizer_fingerprint(tokenizer)
  if manifest["tokenizer"]["fingerprint"] != tok_fp:
    raise ValueError(f"{directory} was distilled with another tokenizer (fingerprint "
                     f"{manifest['tokenizer']['fingerprint']}, {manifest['tokenizer']['name']}) than the one "
                     f"reading it ({tok_fp}, {getattr(tokenizer, 'name_or_path', '')}). {fix}")
  model_fp = checkpoint_fingerprint(str(getattr(tokenizer, "name_or_path", "") or ""))
  if model_fp is None:
    logging.warning("Cannot identify the model reading %s (its tokenizer was not loaded from a checkpoint "
                     "directory); only the tokenizer was checked.", directory)
  elif model_fp != wrote["fingerprint"]:
    raise ValueError(f"{directory} holds the answers of another target ({wrote['model']}, fingerprint "
                     f"{wrote['fingerprint']}) than the one reading it ({tokenizer.name_or_path}, fingerprint "
                     f"{model_fp}): a draft trained on them would learn another model. {fix}")


# -- prompt selection --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Prompt:
  """One selected conversation: its position in the source, the record and its first prompt's token ids."""

  index: int
  record: sources.Record
  ids: np.ndarray


def _user_turns(record: sources.Record) -> list[str]:
  return list(record.turns) or [m["content"] for m in record.messages if m["role"] == "user"]


def _system(record: sources.Record) -> list[dict[str, str]]:
  return [dict(m) for m in record.messages[:1] if m["role"] == "system"]


def select_prompts(records: Sequence[sources.Record], tokenizer: Any, options: DistillOptions,
                   index: decontaminate.EvalIndex | None) -> tuple[list[Prompt], dict[str, Any]]:
  """The conversations to answer, in source order, and the counts of what was left out.

  Args:
    records: the prompt source.
    tokenizer: the target's tokenizer (prompt lengths).
    options: `num_prompts`, `max_prompt_tokens`.
    index: evaluation prompts to exclude (None = no exclusion).

  Returns:
    (prompts, counts): counts has `records`, `eval_excluded` ({set: conversations}, over the whole source),
    `no_user_turn`, `too_long` and `considered` (records examined before `num_prompts` were found).

  Raises:
    sources.SourceError: no record of the source has a user turn.
    ValueError: no conversation is left to answer.
  """
  excluded: dict[str, int] = {}
  clean = []
  for n, record in enumerate(records):
    hit = index.match_record(record) if index is not None else None
    if hit is None:
      clean.append(n)
    else:
      excluded[hit] = excluded.get(hit, 0) + 1
  prompts, no_user, too_long, considered = [], 0, 0, 0
  for n in clean:
    if options.num_prompts and len(prompts) >= options.num_prompts:
      break
    considered += 1
    record = records[n]
    turns = _user_turns(record)
    if not turns:
      no_user += 1
      continue
    ids = chat.encode_prompt(tokenizer, _system(record) + [{"role": "user", "content": turns[0]}])
    if len(ids) > options.max_prompt_tokens:
      too_long += 1
      continue
    prompts.append(Prompt(index=n, record=record, ids=ids))
  name = options.source
  if not any(_user_turns(r) for r in records):
    raise sources.SourceError(f"The prompt source {name!r} has no user turns ({len(records)} records): "
                              "distillation answers user prompts. Use a conversation source, e.g. "
                              "--config.distill.source=sharegpt.")
  if not prompts:
    raise ValueError(f"No prompt of {name!r} is left to answer: {sum(excluded.values())} overlap evaluation "
                     f"prompts, {no_user} have no user turn, {too_long} are longer than max_prompt_tokens="
                     f"{options.max_prompt_tokens}. Raise --config.distill.max_prompt_tokens.")
  counts = {"records": len(records), "eval_excluded": excluded, "no_user_turn": no_user,
            "too_long": too_long, "considered": considered, "selected": len(prompts)}
  return prompts, counts


# -- answering ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Answer:
  """One answer: its text, kept tokens (after a loop cut, without EOS), and what ended it."""

  text: str
  tokens: int
  generated: int
  eos: bool
  loop_cut: bool


def make_answer(tokens: Sequence[int], target: Target, options: DistillOptions) -> Answer:
  """One generated row (as `layerwave.generate` returns it, cut after EOS) → its `Answer`.

  The EOS token is dropped, a repetition loop cut (`cut_loop`), the rest decoded without special tokens
  and trimmed.
  """
  tokens = list(tokens)
  eos = bool(tokens) and tokens[-1] in target.eos_token_ids
  body, cut = cut_loop(tokens[:-1] if eos else tokens, options.loop_max_period, options.loop_min_repeats,
                       options.loop_min_tokens)
  text = target.tokenizer.decode(body, skip_special_tokens=True).strip()
  return Answer(text=text, tokens=len(body), generated=len(tokens), eos=eos, loop_cut=cut)


def _pow2_at_least(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def _seed(seed: int, *parts: int) -> int:
  return zlib.crc32(json.dumps([seed, *parts]).encode()) & 0x7FFFFFFF


def answer_prompts(target: Target, prompt_ids: Sequence[np.ndarray], options: DistillOptions,
                   seed_parts: tuple[int, ...] = (), log_prefix: str = "") -> tuple[list[Answer], float]:
  """Answers prompts in length-sorted batches; returns the answers in input order and the seconds spent.

  Args:
    target: the target (its tokenizer decodes the answers).
    prompt_ids: one int array of token ids per prompt.
    options: sampling, budgets, batch size and loop settings.
    seed_parts: distinguishes this call's sampling seeds from other calls' (chunk, turn).
    log_prefix: prepended to the per-batch log line.
  """
  order = sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), i))
  cap = -(-options.max_prompt_tokens // 16) * 16
  multiple = sharding.data_size(target.mesh)
  answers: list[Answer | None] = [None] * len(prompt_ids)
  seconds = 0.0
  num_batches = -(-len(order) // options.batch_size)
  for b in range(num_batches):
    rows = order[b * options.batch_size:(b + 1) * options.batch_size]
    batch = [list(map(int, prompt_ids[i])) for i in rows]
    width = min(max(MIN_WIDTH, _pow2_at_least(max(len(p) for p in batch))), cap)
    padded = min(_pow2_at_least(len(batch)), options.batch_size)
    padded = -(-padded // multiple) * multiple
    batch += [batch[0]] * (padded - len(batch))  # a few fixed row counts: few compilations
    tic = time.perf_counter()
    out = generate(target, batch, options.max_new_tokens, temperature=options.temperature,
                   top_k=options.top_k, top_p=options.top_p, seed=_seed(options.seed, *seed_parts, b),
                   prompt_width=width)
    seconds += time.perf_counter() - tic
    generated = 0
    for i, tokens in zip(rows, out):
      generated += len(tokens)
      answers[i] = make_answer(tokens, target, options)
    elapsed = time.perf_counter() - tic
    logging.info("%sbatch %d/%d: %d prompts (width %d, %d rows), %d tokens in %.1f s (%.1f tokens/s).",
                 log_prefix, b + 1, num_batches, len(rows), width, padded, generated, elapsed,
                 generated / max(elapsed, 1e-9))
  return answers, seconds


def _new_stats() -> dict[str, Any]:
  keys = ("conversations", "assistant_turns", "tokens_written", "generated_tokens", "loops_cut",
          "eos_terminated", "unfinished", "unfinished_dropped", "empty_dropped", "turns_too_long", "seconds")
  return {k: 0 for k in keys}


def answer_chunk(target: Target, prompts: Sequence[Prompt], options: DistillOptions, chunk: int,
                 log_prefix: str = "") -> tuple[list[dict[str, Any]], dict[str, Any]]:
  """Answers one chunk of conversations turn by turn; returns (conversation dicts, counts)."""
  stats = _new_stats()
  convs = [{"index": p.index, "id": p.record.id, "group": p.record.split_key,
            "messages": _system(p.record), "turns": _user_turns(p.record), "alive": True} for p in prompts]
  for turn in range(options.turns):
    active, ids = [], []
    for c, p in zip(convs, prompts):
      if not c["alive"] or turn >= len(c["turns"]):
        continue
      if turn == 0:
        prompt = p.ids
      else:
        prompt = chat.encode_prompt(target.tokenizer,
                                    c["messages"] + [{"role": "user", "content": c["turns"][turn]}])
        if len(prompt) > options.max_prompt_tokens:
          stats["turns_too_long"] += 1
          c["alive"] = False
          continue
      active.append(c)
      ids.append(prompt)
    if not active:
      break
    answers, seconds = answer_prompts(target, ids, options, (chunk, turn),
                                      f"{log_prefix}turn {turn + 1}/{options.turns} ")
    stats["seconds"] += seconds
    for c, a in zip(active, answers):
      stats["generated_tokens"] += a.generated
      stats["loops_cut"] += a.loop_cut
      stats["eos_terminated"] += a.eos
      unfinished = not (a.eos or a.loop_cut)
      stats["unfinished"] += unfinished
      if not a.text:
        stats["empty_dropped"] += 1
        c["alive"] = False
      elif unfinished and not options.keep_unfinished:
        stats["unfinished_dropped"] += 1
        c["alive"] = False
      else:
        c["messages"] += [{"role": "user", "content": c["turns"][turn]},
                          {"role": "assistant", "content": a.text}]
        stats["assistant_turns"] += 1
        stats["tokens_written"] += a.tokens
  records = [{k: c[k] for k in ("index", "id", "group", "messages")} for c in convs
             if any(m["role"] == "assistant" for m in c["messages"])]
  stats["conversations"] = len(records)
  return records, stats


# -- the dataset on disk -----------------------------------------------------------------------------

class DistilledChat(tfds.core.GeneratorBasedBuilder):
  """tfds builder of the regenerated conversations; constructed by `distill` from the finished chunks."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "id, group, index, messages (role, content)."}

  def __init__(self, *, records: Sequence[dict[str, Any]], **kwargs: Any):
    self._records = records
    super().__init__(**kwargs)

  @tfds.core.utils.classproperty
  @classmethod
  def name(cls) -> str:
    return DATASET_NAME

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> None:  # nothing is downloaded: no checksum file (see tfds_builders.ChatTokens)
    return None

  def _info(self) -> tfds.core.DatasetInfo:
    text = tfds.features.Text()
    return tfds.core.DatasetInfo(
        builder=self, description="Conversations whose assistant turns the target wrote (layerwave).",
        features=tfds.features.FeaturesDict({
            "id": text, "group": text, "index": np.int64,
            "messages": tfds.features.Sequence({"role": text, "content": text}),
        }))

  def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
    del dl_manager
    return {"train": self._generate_examples()}

  def _generate_examples(self):
    for r in self._records:
      yield r["id"], {"id": r["id"], "group": r["group"], "index": r["index"], "messages": r["messages"]}


def _build_dataset(workdir: str, records: Sequence[dict[str, Any]]) -> str:
  """Writes the array_record dataset into `workdir/dataset` atomically; returns its path relative to workdir."""
  tfds.disable_progress_bar()
  with atomic.atomic_directory(os.path.join(workdir, "dataset")) as tmp:
    builder = DistilledChat(records=records, data_dir=tmp, file_format="array_record")
    builder.download_and_prepare()
    relative = os.path.relpath(str(builder.data_dir), tmp)
    shutil.rmtree(os.path.join(tmp, "downloads"), ignore_errors=True)  # tfds makes it; nothing is downloaded
  return os.path.join("dataset", relative)


# -- the stage ---------------------------------------------------------------------------------------

def _chunk_path(workdir: str, k: int) -> str:
  return os.path.join(workdir, "chunks", f"{k:05d}.json")


def _read_chunk(path: str, ids: list[str], fingerprint: str) -> dict[str, Any] | None:
  """A finished chunk file holding exactly `ids` under `fingerprint`, or None (missing or stale)."""
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    chunk = json.load(f)
  if chunk.get("fingerprint") != fingerprint or chunk.get("ids") != ids:
    return None
  return chunk


def _check_workdir(workdir: str, settings: dict[str, Any], fingerprint: str) -> None:
  """Refuses a workdir holding a run with other settings; records this run's settings otherwise."""
  path = os.path.join(workdir, "settings.json")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      old = json.load(f)
    if old.get("fingerprint") != fingerprint:
      before = old.get("settings", {})
      diff = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
      raise ValueError(
          f"{workdir} holds distilled data made with other settings (fingerprint {old.get('fingerprint')} vs "
          f"{fingerprint}; differing: {', '.join(diff) or 'format'}). Mixing them would give a dataset "
          "whose answers disagree: rerun with the same settings (only num_prompts and batch_size may "
          "change) or use a new --workdir.")
    return
  if os.path.isfile(os.path.join(workdir, sources.DISTILLED_MANIFEST)) or glob.glob(
      os.path.join(workdir, "chunks", "*.json")):
    raise ValueError(f"{workdir} holds distilled chunks but no settings.json; use a new --workdir.")
  atomic.write_json(path, {"fingerprint": fingerprint, "settings": settings})


def distill(target: Target, options: DistillOptions, workdir: str, *, model: str = "",
            records: Sequence[sources.Record] | None = None,
            eval_prompts: dict[str, list[str]] | None = None) -> dict[str, Any]:
  """Answers the training prompts with the target and writes the distilled dataset (resumable).

  Args:
    target: the target; its tokenizer formats the prompts and decodes the answers.
    options: the `distill` section.
    workdir: output directory: settings.json, chunks/, dataset/, manifest.json.
    model: the target's spec as configured (recorded in the manifest; default its path).
    records: the prompt source's records (default: `sources.get_source(options.source)`).
    eval_prompts: {set: prompts} to exclude (default: `decontaminate.eval_prompts(options.exclude_sets)`).

  Returns:
    The manifest (also written to `workdir/manifest.json`).

  Raises:
    ValueError: bad settings, a workdir with other settings, or nothing to answer.
    sources.SourceError: a missing source or evaluation set, or a source without user turns.
  """
  tokenizer = target.tokenizer
  if tokenizer is None or tokenizer.chat_template is None:
    raise ValueError(f"{model or target.path} has no tokenizer with a chat template; distillation formats "
                     "chat prompts. Use a chat (instruct) model.")
  longest = options.max_prompt_tokens + options.max_new_tokens
  if longest > target.config.max_position_embeddings:
    raise ValueError(f"distill.max_prompt_tokens + max_new_tokens = {longest} exceeds the target's "
                     f"max_position_embeddings ({target.config.max_position_embeddings}); lower one of them.")
  wall = time.perf_counter()
  model = model or str(target.path)
  identity = {"target_fingerprint": target_fingerprint(target),
              "tokenizer_fingerprint": tfds_builders.tokenizer_fingerprint(tokenizer),
              "dtype": str(np.dtype(target.model.compute_dtype)), "format_version": FORMAT_VERSION}
  settings = {**options.settings(), **identity}
  fingerprint = options_lib.fingerprint(settings)
  _check_workdir(workdir, settings, fingerprint)

  if records is None:
    records = sources.get_source(options.source)
  if eval_prompts is None:
    eval_prompts = decontaminate.eval_prompts(options.exclude_sets)
  if not eval_prompts:
    logging.warning("distill.exclude is empty: evaluation prompts may enter the distilled data.")
  index = decontaminate.EvalIndex.build(eval_prompts, options.exclude_min_chars) if eval_prompts else None
  prompts, counts = select_prompts(records, tokenizer, options, index)
  logging.info("Prompts from %s: %d selected of %d records (%s excluded as evaluation prompts, %d without a "
               "user turn, %d longer than %d tokens).", options.source, len(prompts), len(records),
               counts["eval_excluded"] or "none", counts["no_user_turn"], counts["too_long"],
               options.max_prompt_tokens)

  size = options.chunk_size
  num_chunks = -(-len(prompts) // size)
  chunks, todo = [], []
  for k in range(num_chunks):
    ids = [p.record.id for p in prompts[k * size:(k + 1) * size]]
    chunk = _read_chunk(_chunk_path(workdir, k), ids, fingerprint)
    chunks.append(chunk)
    if chunk is None:
      todo.append(k)
  if len(todo) < num_chunks:
    logging.info("Resuming: %d of %d chunks already done.", num_chunks - len(todo), num_chunks)
  run_seconds, run_tokens = 0.0, 0
  for done, k in enumerate(todo):
    part = prompts[k * size:(k + 1) * size]
    tic = time.perf_counter()
    conversations, stats = answer_chunk(target, part, options, k, f"chunk {k + 1}/{num_chunks} ")
    stats["seconds"] = time.perf_counter() - tic
    chunk = {"chunk": k, "fingerprint": fingerprint, "ids": [p.record.id for p in part],
             "stats": stats, "records": conversations}
    atomic.write_json(_chunk_path(workdir, k), chunk)
    chunks[k] = chunk
    run_seconds += stats["seconds"]
    run_tokens += stats["generated_tokens"]
    left = len(todo) - done - 1
    logging.info("Chunk %d/%d done: %d conversations, %d tokens in %.1f s; this run %.1f tokens/s, %d loops "
                 "cut so far; %d chunks left, ETA %s.", k + 1, num_chunks, stats["conversations"],
                 stats["generated_tokens"], stats["seconds"], run_tokens / max(run_seconds, 1e-9),
                 sum(c["stats"]["loops_cut"] for c in chunks if c), left,
                 _duration(run_seconds / (done + 1) * left))
  return _finish(workdir, chunks, counts, options, identity, fingerprint, model, target, wall)


def _duration(seconds: float) -> str:
  seconds = int(round(seconds))
  return f"{seconds // 3600}h{seconds // 60 % 60:02d}m{seconds % 60:02d}s" if seconds >= 3600 else (
      f"{seconds // 60}m{seconds % 60:02d}s")


def _finish(workdir, chunks, counts, options, identity, fingerprint, model, target, wall) -> dict[str, Any]:
  """Builds the dataset from the chunks when they changed, then writes the manifest."""
  records = [r for c in chunks for r in c["records"]]
  totals = _new_stats()
  for c in chunks:
    for k in totals:
      totals[k] += c["stats"][k]
  content = hashlib.sha256(json.dumps(records, sort_keys=True).encode("utf-8", "surrogatepass")).hexdigest()[:16]
  manifest_path = os.path.join(workdir, sources.DISTILLED_MANIFEST)
  old = None
  if os.path.isfile(manifest_path):
    with open(manifest_path, encoding="utf-8") as f:
      old = json.load(f)
  if not records:
    raise ValueError(f"No conversation was kept ({totals['empty_dropped']} empty answers, "
                     f"{totals['unfinished_dropped']} unfinished ones dropped); set "
                     "--config.distill.keep_unfinished=True or raise max_new_tokens.")
  if old and old["dataset"].get("content") == content and os.path.isdir(
      os.path.join(workdir, old["dataset"]["path"])):
    logging.info("%s is complete (%d conversations); nothing to do.", workdir, len(records))
    return old
  tic = time.perf_counter()
  relative = _build_dataset(workdir, records)
  logging.info("Wrote %d conversations to %s in %.1f s.", len(records), os.path.join(workdir, relative),
               time.perf_counter() - tic)
  turns = max(totals["assistant_turns"], 1)
  manifest = {
      "format": sources.DISTILLED_FORMAT, "format_version": FORMAT_VERSION,
      "target": {"model": model, "path": target.path, "fingerprint": identity["target_fingerprint"],
                 "dtype": identity["dtype"], "num_layers": target.config.num_layers,
                 "vocab_size": target.config.vocab_size},
      "tokenizer": {"name": str(getattr(target.tokenizer, "name_or_path", "")),
                    "fingerprint": identity["tokenizer_fingerprint"]},
      "settings_fingerprint": fingerprint,
      "sampling": {"temperature": options.temperature, "top_k": options.top_k, "top_p": options.top_p,
                   "seed": options.seed, "max_new_tokens": options.max_new_tokens, "turns": options.turns,
                   "loop_max_period": options.loop_max_period, "loop_min_repeats": options.loop_min_repeats,
                   "loop_min_tokens": options.loop_min_tokens, "keep_unfinished": options.keep_unfinished},
      "prompts": {"source": options.source, "num_prompts": options.num_prompts,
                  "max_prompt_tokens": options.max_prompt_tokens, "exclude": list(options.exclude_sets),
                  "exclude_min_chars": options.exclude_min_chars, **counts},
      "output": {**{k: v for k, v in totals.items() if k != "seconds"},
                 "mean_answer_tokens": totals["tokens_written"] / turns,
                 "loops_cut_fraction": totals["loops_cut"] / turns},
      "time": {"generation_s": totals["seconds"], "wall_s_this_run": time.perf_counter() - wall,
               "generated_tokens_per_s": totals["generated_tokens"] / max(totals["seconds"], 1e-9)},
      "dataset": {"path": relative, "num_examples": len(records), "chunks": len(chunks), "content": content},
      "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
  }
  atomic.write_json(manifest_path, manifest)
  return manifest


def run(config, workdir: str) -> dict[str, Any]:
  """The stage: loads the target of `config` and distils `config.distill` into `workdir`.

  Args:
    config: the experiment config: `model`, `dtype`, `mesh`, `distributed` and the `distill` section.
    workdir: the output directory (rerun it to resume).

  Returns:
    The manifest.
  """
  if not workdir:
    raise ValueError("distill needs --workdir: the folder for the chunks, the dataset and manifest.json.")
  options = options_lib.from_section(DistillOptions, config.distill, "distill")
  sharding.maybe_initialize_distributed(config.distributed)
  mesh = sharding.make_mesh(config.mesh)
  target = load_target(config.model, dtype=config.dtype, mesh=mesh)
  manifest = distill(target, options, workdir, model=config.model)
  out = manifest["output"]
  logging.info("Distilled %d conversations (%d answers, %d tokens written, mean %.1f tokens per answer; %d loops "
               "cut, %d ended with EOS) at %.1f generated tokens/s into %s.", manifest["dataset"]["num_examples"],
               out["assistant_turns"], out["tokens_written"], out["mean_answer_tokens"], out["loops_cut"],
               out["eos_terminated"], manifest["time"]["generated_tokens_per_s"], workdir)
  return manifest
