"""How the target answers prompts: one row's tokens → an `Answer`, static batches and continuous batching.

Place in the pipeline: `layerwave.data.distill` selects the prompts and keeps the chunks; this module answers
them. Both paths share the conversation bookkeeping (`answer_chunk` in static batches of `batch_size`,
`stream_chunks` through `layerwave.continuous.Engine`'s `slots` decoding rows), so a conversation's k-th user
turn is sent after the target's own earlier answers either way, and greedy answers do not depend on the path
(tested against `layerwave.generate` on each prompt alone).

An answer ends at EOS or `max_new_tokens`; `make_answer` then cuts what a small model appends: in the plain
format (base models) the start of a new "User:" turn (`chat.cut_turn_end`), and a repetition loop
(`repetition.cut_loop`). With continuous batching a row leaves as soon as either would be cut anyway
(`stop_fn`, checked every `chunk_steps` tokens), and the next prompt takes it.
"""

from __future__ import annotations

import dataclasses
import json
import time
import zlib
from typing import Any, Sequence

import numpy as np
from absl import logging

from layerwave import continuous
from layerwave import sharding
from layerwave.data import chat
from layerwave.data import repetition
from layerwave.data import sources
from layerwave.data.options import DistillOptions
from layerwave.generate import generate
from layerwave.inference import Target

__all__ = ["Answer", "MIN_WIDTH", "Prompt", "answer_chunk", "answer_prompts", "make_answer", "new_stats",
           "stop_fn", "stream_chunks", "system_messages", "user_turns"]

MIN_WIDTH = 64


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One selected conversation: its position in the source, the record and its first prompt's token ids."""

  index: int
  record: sources.Record
  ids: np.ndarray


def user_turns(record: sources.Record) -> list[str]:
  """The user turns of a source record, in order."""
  return list(record.turns) or [m["content"] for m in record.messages if m["role"] == "user"]


def system_messages(record: sources.Record) -> list[dict[str, str]]:
  """The record's system message as a one-message list, or [] when it has none."""
  return [dict(m) for m in record.messages[:1] if m["role"] == "system"]



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
  """Answers prompts in length-sorted static batches, one `generate` call per batch; answers come in input order.

  A batch decodes until its longest answer ends. Batches are padded to a few fixed widths (powers of two from
  `MIN_WIDTH`) and row counts (powers of two up to `batch_size`), so decoding compiles a few times only.
  Greedy answers are those of one `generate` call per prompt.

  Args:
    target: the target (its tokenizer decodes the answers).
    prompt_ids: one int array of token ids per prompt.
    options: sampling, budgets, batch size, loop settings.
    seed_parts: distinguishes this call's sampling seeds from other calls' (chunk, turn).
    log_prefix: prepended to the per-batch log line.

  Returns:
    (answers, counts): counts has `seconds` (in `generate`) and `row_steps` (rows x decode steps run,
    padding rows included: generated tokens / row_steps is the batches' efficiency).
  """
  cap = -(-(options.max_prompt_tokens + options.max_new_tokens) // 16) * 16
  multiple = sharding.data_size(target.mesh)
  prompts = [list(map(int, p)) for p in prompt_ids]
  tokens: list[list[int]] = [[] for _ in prompts]
  counts = {"seconds": 0.0, "row_steps": 0}
  order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
  num_batches = -(-len(order) // options.batch_size)
  for b in range(num_batches):
    rows = order[b * options.batch_size:(b + 1) * options.batch_size]
    batch = [prompts[i] for i in rows]
    width = min(max(MIN_WIDTH, _pow2_at_least(max(len(p) for p in batch))), cap)
    padded = -(-min(_pow2_at_least(len(batch)), options.batch_size) // multiple) * multiple
    batch += [batch[0]] * (padded - len(batch))  # a few fixed row counts and widths: few compilations
    tic = time.perf_counter()
    # (chunk, turn, 0, batch): the seed layout sampled workdirs were written with, so they resume identically.
    out, stats = generate(target, batch, options.max_new_tokens, temperature=options.temperature,
                          top_k=options.top_k, top_p=options.top_p, seed=_seed(options.seed, *seed_parts, 0, b),
                          prompt_width=width, return_stats=True)
    elapsed = time.perf_counter() - tic
    counts["seconds"] += elapsed
    counts["row_steps"] += padded * stats["steps"]
    for i, new in zip(rows, out):
      tokens[i] = list(new)
    written = sum(len(x) for x in out[:len(rows)])
    logging.info("%sbatch %d/%d: %d prompts (width %d, %d rows), %d tokens in %.1f s (%.1f tokens/s).", log_prefix,
                 b + 1, num_batches, len(rows), width, padded, written, elapsed, written / max(elapsed, 1e-9))
  return [make_answer(t, target, options) for t in tokens], counts


def _finished(tokens: list[int], target: Target, options: DistillOptions) -> bool:
  if len(tokens) >= options.max_new_tokens or (tokens and tokens[-1] in target.eos_token_ids):
    return True
  if options.chat_format == "plain" and chat.plain_turn_end(
      target.tokenizer.decode(tokens, skip_special_tokens=True)) is not None:
    return True
  return bool(options.loop_max_period) and repetition.find_loop(
      tokens, options.loop_max_period, options.loop_min_repeats, options.loop_min_tokens) is not None


def new_stats() -> dict[str, Any]:
  """A chunk's counters at zero (summed over chunks into the manifest's `output`)."""
  keys = ("conversations", "assistant_turns", "tokens_written", "generated_tokens", "row_steps", "loops_cut",
          "turn_ends_cut", "eos_terminated", "unfinished", "unfinished_dropped", "empty_dropped", "turns_too_long",
          "seconds")
  return {k: 0 for k in keys}


def _new_conversation(p: Prompt) -> dict[str, Any]:
  return {"index": p.index, "id": p.record.id, "group": p.record.split_key, "messages": system_messages(p.record),
          "turns": user_turns(p.record), "alive": True, "answer_tokens": []}


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
  stats = new_stats()
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
    stats = new_stats()
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
