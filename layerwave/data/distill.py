"""Self-distilled training data: the target answers the training prompts itself (issue 12, part 1).

Place in the pipeline: before draft training. A draft learns to predict the target, so it should be trained
on the target's own answers rather than on ChatGPT's: `run(config, workdir)` (launcher
`experiments/distill.py`) takes the user turns of the prompt source (ShareGPT by default), lets the target
answer them with `layerwave.generate` in large ragged batches, and writes the regenerated conversations as
a tfds array_record dataset with the source's record schema (id, group, messages) plus `manifest.json`.
Analysis and training read it unchanged through `data.source=distilled:DIR` (`sources.read_distilled`).

Prompts. Conversations are taken in source order. A conversation is dropped (and counted) when any of its user
turns overlaps an evaluation prompt (`decontaminate`: MT-bench first and second turns, HumanEval, GSM8K),
when it has no user turn, or when its first prompt (system message if any plus the first user turn, rendered
for generation by `chat.encode_prompt`) is longer than `max_prompt_tokens`. The first `num_prompts` survivors
are answered. With `turns > 1` the k-th user turn is sent after the target's own earlier answers (the
regenerated history); a turn whose prompt outgrows `max_prompt_tokens` ends that conversation.

Formats. `chat_format` ("template" or "plain"; `run` takes it from `config.data.chat_format`, the field
analysis and training read the data back with) renders prompts and history: the tokenizer's chat template, or
for base models without one (Gemma-3-270M) `chat.render_plain`'s "User: ...\n\nAssistant: ..." paragraphs
after BOS, ending with an open "Assistant:". A base model writes on past its answer into the next "\n\nUser:"
paragraph instead of stopping at EOS, so a plain answer is cut where a new turn starts (`chat.cut_turn_end`)
and counted (`turn_ends_cut`). Generation still runs to EOS or `max_new_tokens` (`layerwave.generate` has no
multi-token stop), except that with `segment_tokens` > 0 such a row leaves after its round. The format enters
the settings fingerprint and the manifest; `DataOptions.build` refuses to read the data in the other format.

Batching. Each chunk of `chunk_size` conversations is answered turn by turn (`answer_prompts`): a turn's
prompts are sorted by length and cut into batches of `batch_size`, padded to a few fixed widths (powers of
two from 64) and row counts (powers of two up to `batch_size`), so decoding compiles a few times only. A
batch decodes until its longest answer ends. With `segment_tokens` > 0 it decodes in rounds of that many
tokens instead: rows that reached EOS, `max_new_tokens` or a repetition loop leave after each round and the
rest are re-batched, at the cost of re-reading each live row's context in a prefill per round. That can
only pay where a prefill token is much cheaper than a decode step (accelerators; not measured): on 2 CPU
cores rounds of 64 were 1.5x slower than one call (same answers, byte for byte), so the default is 0. Greedy answers do not depend on
the batching (a test checks them against `layerwave.generate` on each prompt alone), so `batch_size` and
`segment_tokens` may change between runs of one workdir.

Continuous batching (`slots` > 0, the configs' default). One `layerwave.continuous.Engine` answers every
chunk still to do: conversations stream through `slots` decoding rows, a row leaves as soon as its answer
ends (EOS, `max_new_tokens`) or would be cut anyway (`stop_fn`: a repetition loop, or in the plain format the
start of a new turn, checked every `chunk_steps` tokens), and the next prompt takes it; a conversation's next
turn goes to the front of the queue. A chunk file is written when its last conversation is done, so resumption
is unchanged. Greedy answers are those of the static path (tested), so `slots` may change between runs.

Repetition loops. A small model often ends an answer by repeating a phrase until the token budget runs out;
such answers are cut after the first occurrence of the repeated block (`repetition.find_loop` says how a loop
is detected) and counted.

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
import glob
import hashlib
import json
import os
import time
import zlib
from typing import Any, ClassVar, Sequence

import numpy as np
from absl import logging

from layerwave import atomic
from layerwave import continuous
from layerwave import options as options_lib
from layerwave import sharding
from layerwave.data import chat
from layerwave.data import decontaminate
from layerwave.data import distilled
from layerwave.data import repetition
from layerwave.data import sources
from layerwave.data import tfds_builders
from layerwave.generate import generate
from layerwave.inference import Target, load_target
from layerwave.sampling import SamplingParams

__all__ = ["Answer", "DistillOptions", "Prompt", "answer_chunk", "answer_prompts", "distill", "make_answer", "run",
           "select_prompts", "stop_fn", "stream_chunks"]

FORMAT_VERSION = 1
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
    segment_tokens: tokens decoded per round before finished rows leave and the rest are re-batched
      (`answer_prompts`); 0 = the whole budget in one call (faster on a CPU).
    slots: > 0 answers with continuous batching (`layerwave.continuous`): conversations stream through this
      many decoding rows across chunks, a row leaves at EOS, `max_new_tokens`, a repetition loop or (plain
      format) a new turn, and the next prompt (a conversation's next turn first) takes it. 0 = static batches
      of `batch_size` (`segment_tokens` applies only there).
    chunk_steps: with `slots`: decode steps between the host's refills and stop checks.
    chunk_size: conversations per chunk, the unit of resumption.
    loop_max_period: longest repeated block the loop cutter looks for (0 = no loop cutting).
    loop_min_repeats: a loop must cover at least this many periods...
    loop_min_tokens: ...and at least this many tokens.
    keep_unfinished: keep answers that stop at `max_new_tokens` without EOS or a loop (False drops the turn
      and ends the conversation there).
    exclude: comma-separated evaluation sets whose prompts must not enter the data ("" = none).
    exclude_min_chars: containment counts for strings of at least this many characters (equality always).
    chat_format: how prompts and the regenerated history become text, one of `chat.CHAT_FORMATS`: "template"
      (the tokenizer's chat template) or "plain" (base models; answers cut at the next turn). `run` sets it
      from `config.data.chat_format`, so the data is read back in the format its prompts were written in.
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
  batch_size: int = 16
  segment_tokens: int = 0
  slots: int = 0
  chunk_steps: int = 16
  chunk_size: int = 64
  loop_max_period: int = 64
  loop_min_repeats: int = 3
  loop_min_tokens: int = 32
  keep_unfinished: bool = True
  exclude: str = ",".join(decontaminate.EVAL_SETS)
  exclude_min_chars: int = 40
  chat_format: str = "template"

  # Settings a rerun of the same workdir may change (they change how much is done or how fast, not what).
  RESUMABLE = ("num_prompts", "batch_size", "segment_tokens", "slots", "chunk_steps")
  # Fields added after workdirs recorded their settings: left out of `settings()` while they hold these
  # defaults, so those workdirs keep their fingerprint and resume.
  LATE_DEFAULTS: ClassVar[dict] = {"chat_format": "template"}

  def __post_init__(self):
    checks = [
        (self.max_new_tokens >= 1, "max_new_tokens must be >= 1 (tokens per answer)", "max_new_tokens=512"),
        (self.turns >= 1, "turns must be >= 1", "turns=1"),
        (self.max_prompt_tokens >= 1, "max_prompt_tokens must be >= 1", "max_prompt_tokens=512"),
        (self.num_prompts >= 0, "num_prompts must be >= 0 (0 = every prompt)", "num_prompts=0"),
        (self.batch_size >= 1, "batch_size must be >= 1", "batch_size=32"),
        (self.chunk_size >= 1, "chunk_size must be >= 1", "chunk_size=64"),
        (self.segment_tokens >= 0, "segment_tokens must be >= 0 (0 = the whole budget at once)", "segment_tokens=0"),
        (self.slots >= 0, "slots must be >= 0 (0 = static batches)", "slots=16"),
        (self.chunk_steps >= 1, "chunk_steps must be >= 1", "chunk_steps=16"),
        (self.loop_max_period >= 0, "loop_max_period must be >= 0 (0 = off)", "loop_max_period=64"),
        (self.loop_min_repeats >= 2, "loop_min_repeats must be >= 2", "loop_min_repeats=3"),
        (self.loop_min_tokens >= 0, "loop_min_tokens must be >= 0", "loop_min_tokens=32"),
        (self.exclude_min_chars >= 1, "exclude_min_chars must be >= 1", "exclude_min_chars=40"),
    ]
    for ok, message, fix in checks:
      if not ok:
        value = getattr(self, fix.split("=")[0])
        raise ValueError(f"distill.{message}, got {value}; set e.g. --config.distill.{fix}.")
    if self.chat_format not in chat.CHAT_FORMATS:
      raise ValueError(f"distill: the chat format must be one of {list(chat.CHAT_FORMATS)}, got "
                       f"{self.chat_format!r}; set --config.data.chat_format=template (plain for a base model "
                       "without a chat template).")
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
    """Every field that fixes what the data is (the resumable ones and late defaults left out)."""
    return {k: v for k, v in dataclasses.asdict(self).items()
            if k not in self.RESUMABLE and not (k in self.LATE_DEFAULTS and v == self.LATE_DEFAULTS[k])}


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
    options: `num_prompts`, `max_prompt_tokens`, `chat_format`.
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
    ids = chat.encode_prompt(tokenizer, _system(record) + [{"role": "user", "content": turns[0]}],
                             chat_format=options.chat_format)
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
  """One answer: its text, kept tokens (after the cuts, without EOS), and what ended it.

  Attributes:
    text: the answer, decoded without special tokens and stripped.
    tokens: the tokens kept (those that spell `text`).
    generated: the tokens generated (EOS and everything cut included).
    eos: the kept answer ends at EOS (not when a new turn started before it).
    loop_cut: a repetition loop was cut.
    turn_end_cut: (plain format) the model started a new turn, and the answer was cut there.
    ids: the kept token ids (`text` is their decoding): what a release stores to rebuild the data.
  """

  text: str
  tokens: int
  generated: int
  eos: bool
  loop_cut: bool
  turn_end_cut: bool = False
  ids: tuple[int, ...] = ()


def make_answer(tokens: Sequence[int], target: Target, options: DistillOptions) -> Answer:
  """One generated row (as `layerwave.generate` returns it, cut after EOS) → its `Answer`.

  The EOS token is dropped; in the plain format the answer ends where a new turn starts (`chat.cut_turn_end`);
  then a repetition loop is cut (`cut_loop`), the rest decoded without special tokens and trimmed.
  """
  tokens = list(tokens)
  eos = bool(tokens) and tokens[-1] in target.eos_token_ids
  body, turn_end = tokens[:-1] if eos else tokens, False
  if options.chat_format == "plain":
    body, turn_end = chat.cut_turn_end(body, target.tokenizer)
  body, cut = repetition.cut_loop(body, options.loop_max_period, options.loop_min_repeats, options.loop_min_tokens)
  text = target.tokenizer.decode(body, skip_special_tokens=True).strip()
  return Answer(text=text, tokens=len(body), generated=len(tokens), eos=eos and not turn_end, loop_cut=cut,
                turn_end_cut=turn_end, ids=tuple(int(t) for t in body))


def _pow2_at_least(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def _seed(seed: int, *parts: int) -> int:
  return zlib.crc32(json.dumps([seed, *parts]).encode()) & 0x7FFFFFFF


def answer_prompts(target: Target, prompt_ids: Sequence[np.ndarray], options: DistillOptions,
                   seed_parts: tuple[int, ...] = (), log_prefix: str = "") -> tuple[list[Answer], dict[str, float]]:
  """Answers prompts in length-sorted batches; answers come in input order.

  With `segment_tokens` = 0, one `generate` call per batch decodes the whole budget. Otherwise every round
  decodes up to `segment_tokens` more tokens for each unfinished prompt (its prompt plus what it has so far,
  re-read in one prefill) in batches of prompts of similar length. A prompt is finished at EOS, at
  `max_new_tokens`, or as soon as its tokens hold a repetition loop (`repetition.find_loop`) or, in the plain
  format, the start of a new turn (`chat.plain_turn_end`): either would be cut anyway. Finished rows leave,
  so the next round's batches hold live rows only. Greedy answers are those of one `generate` call per
  prompt either way.

  Args:
    target: the target (its tokenizer decodes the answers).
    prompt_ids: one int array of token ids per prompt.
    options: sampling, budgets, batch and segment sizes, loop settings.
    seed_parts: distinguishes this call's sampling seeds from other calls' (chunk, turn).
    log_prefix: prepended to the per-batch log line.

  Returns:
    (answers, counts): counts has `seconds` (in `generate`) and `row_steps` (rows x decode steps run,
    padding rows included: generated tokens / row_steps is the batches' efficiency).
  """
  n = len(prompt_ids)
  segment = options.segment_tokens or options.max_new_tokens
  cap = -(-(options.max_prompt_tokens + options.max_new_tokens) // 16) * 16
  multiple = sharding.data_size(target.mesh)
  prompts = [list(map(int, p)) for p in prompt_ids]
  tokens: list[list[int]] = [[] for _ in range(n)]
  live = list(range(n))
  counts = {"seconds": 0.0, "row_steps": 0}
  rounds = -(-options.max_new_tokens // segment)
  for r in range(rounds):
    budget = min(segment, options.max_new_tokens - r * segment)  # every live row holds r * segment tokens
    order = sorted(live, key=lambda i: (len(prompts[i]), i))
    num_batches = -(-len(order) // options.batch_size)
    for b in range(num_batches):
      rows = order[b * options.batch_size:(b + 1) * options.batch_size]
      batch = [prompts[i] + tokens[i] for i in rows]
      width = min(max(MIN_WIDTH, _pow2_at_least(max(len(p) for p in batch))), cap)
      padded = -(-min(_pow2_at_least(len(batch)), options.batch_size) // multiple) * multiple
      batch += [batch[0]] * (padded - len(batch))  # a few fixed row counts and widths: few compilations
      tic = time.perf_counter()
      out, stats = generate(target, batch, budget, temperature=options.temperature, top_k=options.top_k,
                            top_p=options.top_p, seed=_seed(options.seed, *seed_parts, r, b), prompt_width=width,
                            return_stats=True)
      elapsed = time.perf_counter() - tic
      counts["seconds"] += elapsed
      counts["row_steps"] += padded * stats["steps"]
      for i, new in zip(rows, out):
        tokens[i] += new
      logging.info("%sround %d/%d batch %d/%d: %d prompts (width %d, %d rows), %d tokens in %.1f s (%.1f "
                   "tokens/s).", log_prefix, r + 1, rounds, b + 1, num_batches, len(rows), width, padded,
                   sum(len(x) for x in out[:len(rows)]), elapsed,
                   sum(len(x) for x in out[:len(rows)]) / max(elapsed, 1e-9))
    live = [i for i in live if not _finished(tokens[i], target, options)]
    if not live:
      break
  return [make_answer(t, target, options) for t in tokens], counts


def _finished(tokens: list[int], target: Target, options: DistillOptions) -> bool:
  if len(tokens) >= options.max_new_tokens or (tokens and tokens[-1] in target.eos_token_ids):
    return True
  if options.chat_format == "plain" and chat.plain_turn_end(
      target.tokenizer.decode(tokens, skip_special_tokens=True)) is not None:
    return True
  return bool(options.loop_max_period) and repetition.find_loop(
      tokens, options.loop_max_period, options.loop_min_repeats, options.loop_min_tokens) is not None


def _new_stats() -> dict[str, Any]:
  keys = ("conversations", "assistant_turns", "tokens_written", "generated_tokens", "row_steps", "loops_cut",
          "turn_ends_cut", "eos_terminated", "unfinished", "unfinished_dropped", "empty_dropped", "turns_too_long",
          "seconds")
  return {k: 0 for k in keys}


def _new_conversation(p: Prompt) -> dict[str, Any]:
  return {"index": p.index, "id": p.record.id, "group": p.record.split_key, "messages": _system(p.record),
          "turns": _user_turns(p.record), "alive": True, "answer_tokens": []}


def _turn_prompt(c: dict[str, Any], p: Prompt, turn: int, target: Target, options: DistillOptions,
                 stats: dict[str, Any]) -> np.ndarray | None:
  """The prompt of `turn` for conversation `c` (after its regenerated history), or None when it has none."""
  if not c["alive"] or turn >= len(c["turns"]):
    return None
  if turn == 0:
    return p.ids
  prompt = chat.encode_prompt(target.tokenizer, c["messages"] + [{"role": "user", "content": c["turns"][turn]}],
                              chat_format=options.chat_format)
  if len(prompt) > options.max_prompt_tokens:
    stats["turns_too_long"] += 1
    c["alive"] = False
    return None
  return prompt


def _record_answer(c: dict[str, Any], a: Answer, turn: int, options: DistillOptions, stats: dict[str, Any]) -> None:
  """Counts answer `a` to `turn` and appends it to the conversation (or ends the conversation)."""
  stats["generated_tokens"] += a.generated
  stats["loops_cut"] += a.loop_cut
  stats["turn_ends_cut"] += a.turn_end_cut
  stats["eos_terminated"] += a.eos
  unfinished = not (a.eos or a.loop_cut or a.turn_end_cut)
  stats["unfinished"] += unfinished
  if not a.text:
    stats["empty_dropped"] += 1
    c["alive"] = False
  elif unfinished and not options.keep_unfinished:
    stats["unfinished_dropped"] += 1
    c["alive"] = False
  else:
    c["messages"] += [{"role": "user", "content": c["turns"][turn]}, {"role": "assistant", "content": a.text}]
    c["answer_tokens"].append(list(a.ids))
    stats["assistant_turns"] += 1
    stats["tokens_written"] += a.tokens


def _records(convs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """The chunk's kept conversations; `answer_tokens` (one id list per assistant turn) is stored in the chunk
  file beside them (the compact release format is built from it) and left out of the dataset."""
  return [{k: c[k] for k in ("index", "id", "group", "messages", "answer_tokens")} for c in convs
          if any(m["role"] == "assistant" for m in c["messages"])]


def answer_chunk(target: Target, prompts: Sequence[Prompt], options: DistillOptions, chunk: int,
                 log_prefix: str = "") -> tuple[list[dict[str, Any]], dict[str, Any]]:
  """Answers one chunk of conversations turn by turn in static batches; returns (conversation dicts, counts)."""
  stats = _new_stats()
  convs = [_new_conversation(p) for p in prompts]
  for turn in range(options.turns):
    active, ids = [], []
    for c, p in zip(convs, prompts):
      prompt = _turn_prompt(c, p, turn, target, options, stats)
      if prompt is not None:
        active.append(c)
        ids.append(prompt)
    if not active:
      break
    answers, counts = answer_prompts(target, ids, options, (chunk, turn),
                                     f"{log_prefix}turn {turn + 1}/{options.turns} ")
    stats["row_steps"] += counts["row_steps"]
    for c, a in zip(active, answers):
      _record_answer(c, a, turn, options, stats)
  records = _records(convs)
  stats["conversations"] = len(records)
  return records, stats


def stop_fn(target: Target, options: DistillOptions):
  """What ends a continuous-batching row before EOS: whatever `make_answer` would cut anyway (`_finished`)."""
  if not options.loop_max_period and options.chat_format != "plain":
    return None
  return lambda tokens: bool(tokens) and _finished(tokens, target, options)


def stream_chunks(target: Target, prompts: Sequence[Prompt], chunk_ids: Sequence[int], options: DistillOptions):
  """Answers chunks `chunk_ids` with continuous batching; yields `(k, records, stats)` as each chunk completes.

  Every conversation's first turn is queued in chunk order; when a turn is answered, the conversation's next
  turn goes to the front of the queue, so chunks complete roughly in order. A chunk's `seconds` and
  `row_steps` are the engine's since the previous chunk completed.
  """
  size = options.chunk_size
  engine = continuous.Engine(
      target, options.slots, options.max_new_tokens, options.max_prompt_tokens, temperature=options.temperature,
      top_k=options.top_k, top_p=options.top_p, seed=options.seed, stop_fn=stop_fn(target, options),
      chunk_steps=options.chunk_steps, log_every=60.0)
  state = {}  # k -> (convs, parts, stats, conversations left)
  for k in chunk_ids:
    part = list(prompts[k * size:(k + 1) * size])
    convs = [_new_conversation(p) for p in part]
    stats = _new_stats()
    state[k] = [convs, part, stats, len(part)]
    for i, (c, p) in enumerate(zip(convs, part)):
      engine.submit(continuous.Request(ids=p.ids, seed_index=_seed(options.seed, k, i, 0), tag=(k, i, 0)))
  last_seconds, last_steps = 0.0, 0
  while engine.busy:
    finished = engine.step()
    completed = []
    for f in finished:
      k, i, turn = f.request.tag
      convs, part, stats, _ = state[k]
      c = convs[i]
      _record_answer(c, make_answer(f.tokens, target, options), turn, options, stats)
      nxt = _turn_prompt(c, part[i], turn + 1, target, options, stats) if turn + 1 < options.turns else None
      if nxt is not None:
        engine.submit(continuous.Request(ids=nxt, seed_index=_seed(options.seed, k, i, turn + 1),
                                         tag=(k, i, turn + 1)), front=True)
        continue
      state[k][3] -= 1
      if state[k][3] == 0:
        completed.append(k)
    for k in completed:
      convs, _, stats, _ = state.pop(k)
      stats["seconds"] = engine.stats["seconds"] - last_seconds
      stats["row_steps"] = engine.stats["row_steps"] - last_steps
      last_seconds, last_steps = engine.stats["seconds"], engine.stats["row_steps"]
      records = _records(convs)
      stats["conversations"] = len(records)
      yield k, records, stats


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
    target: the target; its tokenizer formats the prompts (`options.chat_format`) and decodes the answers.
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
  if tokenizer is None:
    raise ValueError(f"{model or target.path} has no tokenizer; distillation formats prompts and decodes answers.")
  chat.check_chat_format(tokenizer, options.chat_format)  # "template" needs one: base models take "plain"
  longest = options.max_prompt_tokens + options.max_new_tokens
  if longest > target.config.max_position_embeddings:
    raise ValueError(f"distill.max_prompt_tokens + max_new_tokens = {longest} exceeds the target's "
                     f"max_position_embeddings ({target.config.max_position_embeddings}); lower one of them.")
  wall = time.perf_counter()
  model = model or str(target.path)
  identity = {"target_fingerprint": distilled.target_fingerprint(target),
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

  def answered():
    if options.slots:
      yield from stream_chunks(target, prompts, todo, options)
      return
    for k in todo:
      tic = time.perf_counter()
      conversations, stats = answer_chunk(target, prompts[k * size:(k + 1) * size], options, k,
                                          f"chunk {k + 1}/{num_chunks} ")
      stats["seconds"] = time.perf_counter() - tic
      yield k, conversations, stats

  for done, (k, conversations, stats) in enumerate(answered()):
    part = prompts[k * size:(k + 1) * size]
    chunk = {"chunk": k, "fingerprint": fingerprint, "ids": [p.record.id for p in part],
             "stats": stats, "records": conversations}
    atomic.write_json(_chunk_path(workdir, k), chunk)
    chunks[k] = chunk
    run_seconds += stats["seconds"]
    run_tokens += stats["tokens_written"]
    left = len(todo) - done - 1
    logging.info("Chunk %d/%d done: %d conversations, %d tokens kept (%d generated) in %.1f s; this run %.1f kept "
                 "tokens/s, %d loops cut so far; %d chunks left, ETA %s.", k + 1, num_chunks,
                 stats["conversations"], stats["tokens_written"], stats["generated_tokens"], stats["seconds"],
                 run_tokens / max(run_seconds, 1e-9), sum(c["stats"]["loops_cut"] for c in chunks if c), left,
                 _duration(run_seconds / (done + 1) * left))
  return _finish(workdir, chunks, counts, options, identity, fingerprint, model, target, wall)


def _duration(seconds: float) -> str:
  seconds = int(round(seconds))
  return f"{seconds // 3600}h{seconds // 60 % 60:02d}m{seconds % 60:02d}s" if seconds >= 3600 else (
      f"{seconds // 60}m{seconds % 60:02d}s")


def _finish(workdir, chunks, counts, options, identity, fingerprint, model, target, wall) -> dict[str, Any]:
  """Builds the dataset from the chunks when they changed, then writes the manifest."""
  records = [{k: v for k, v in r.items() if k != "answer_tokens"} for c in chunks for r in c["records"]]
  totals = _new_stats()
  for c in chunks:
    for k in totals:
      totals[k] += c["stats"].get(k, 0)
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
  relative = distilled.build_dataset(workdir, records)
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
      "prompts": {"source": options.source, "chat_format": options.chat_format, "num_prompts": options.num_prompts,
                  "max_prompt_tokens": options.max_prompt_tokens, "exclude": list(options.exclude_sets),
                  "exclude_min_chars": options.exclude_min_chars, **counts},
      "output": {**{k: v for k, v in totals.items() if k != "seconds"},
                 "mean_answer_tokens": totals["tokens_written"] / turns,
                 "decode_efficiency": totals["generated_tokens"] / max(totals["row_steps"], 1),
                 "loops_cut_fraction": totals["loops_cut"] / turns,
                 "turn_ends_cut_fraction": totals["turn_ends_cut"] / turns},
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
    config: the experiment config: `model`, `dtype`, `mesh`, `distributed`, the `distill` section and
      `data.chat_format` (how prompts are rendered: the format analysis and training read the data in).
    workdir: the output directory (rerun it to resume).

  Returns:
    The manifest.
  """
  if not workdir:
    raise ValueError("distill needs --workdir: the folder for the chunks, the dataset and manifest.json.")
  options = options_lib.from_section(DistillOptions, config.distill, "distill",
                                     chat_format=config.data.chat_format)
  sharding.maybe_initialize_distributed(config.distributed)
  sharding.require_single_process("Distillation")
  mesh = sharding.make_mesh(config.mesh)
  target = load_target(config.model, dtype=config.dtype, mesh=mesh)
  manifest = distill(target, options, workdir, model=config.model)
  out = manifest["output"]
  logging.info("Distilled %d conversations (%d answers, %d tokens written, mean %.1f tokens per answer; %d loops "
               "cut, %d cut at a new turn, %d ended with EOS) at %.1f generated tokens/s into %s.",
               manifest["dataset"]["num_examples"], out["assistant_turns"], out["tokens_written"],
               out["mean_answer_tokens"], out["loops_cut"], out.get("turn_ends_cut", 0), out["eos_terminated"],
               manifest["time"]["generated_tokens_per_s"], workdir)
  return manifest
