"""Self-distilled training data: the target answers the training prompts itself.

Place in the pipeline: before draft training. A draft learns to predict the target, so it should be trained
on the target's own answers rather than on ChatGPT's: `run(config, workdir)` (launcher
`experiments/distill.py`) takes the user turns of the prompt source (ShareGPT by default), lets the target
answer them (`layerwave.data.answering`), and writes the regenerated conversations as a tfds array_record
dataset with the source's record schema (id, group, messages) plus `manifest.json` (the workdir's layout:
`layerwave.data.distilled`). Analysis and training read it unchanged through `data.source=distilled:DIR`
(`sources.read_distilled`).

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
and counted (`turn_ends_cut`). The format enters the settings fingerprint and the manifest;
`DataOptions.build` refuses to read the data in the other format.

Batching. With `slots` > 0 (the configs' default) conversations stream through that many continuous-batching
rows (`answering.stream_chunks`); with `slots` = 0 each chunk is answered turn by turn in static batches of
`batch_size` (`answering.answer_chunk`). Greedy answers do not depend on the batching (tested against
`layerwave.generate` on each prompt alone), so `batch_size`, `slots` and `chunk_steps` may change between
runs of one workdir.

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

Across processes (`distributed`, a multi-host slice) every process runs the same decoding over the global mesh
(`layerwave.generate` and continuous batching decide from values gathered from every device), and process 0
alone reads and writes the workdir (`sharding.on_process_0`): it checks the settings, says which chunks are
left, writes each chunk as it completes and builds the dataset, and every process follows its word, so a workdir
only process 0 sees still works. A process that dies stops the others (JAX's distributed runtime ends them when
its heartbeats stop: within the heartbeat timeout, 100 s by default); the chunks written so far are whole, and a
restart of every process resumes from them.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Sequence

import numpy as np
from absl import logging

from layerwave import atomic
from layerwave import options as options_lib
from layerwave import sharding
from layerwave.data import answering
from layerwave.data import chat
from layerwave.data import decontaminate
from layerwave.data import distilled
from layerwave.data import sources
from layerwave.data import tfds_builders
from layerwave.data.options import DistillOptions
from layerwave.inference import Target, load_target

__all__ = ["distill", "run", "select_prompts"]

FORMAT_VERSION = 1


# -- prompt selection --------------------------------------------------------------------------------

def select_prompts(records: Sequence[sources.Record], tokenizer: Any, options: DistillOptions,
                   index: decontaminate.EvalIndex | None) -> tuple[list[answering.Prompt], dict[str, Any]]:
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
    turns = answering.user_turns(record)
    if not turns:
      no_user += 1
      continue
    ids = chat.encode_prompt(tokenizer, answering.system_messages(record) + [{"role": "user", "content": turns[0]}],
                             chat_format=options.chat_format)
    if len(ids) > options.max_prompt_tokens:
      too_long += 1
      continue
    prompts.append(answering.Prompt(index=n, record=record, ids=ids))
  name = options.source
  if not any(answering.user_turns(r) for r in records):
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


# -- the stage ---------------------------------------------------------------------------------------

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
  sharding.on_process_0(lambda: distilled.check_settings(workdir, settings, fingerprint))

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
  chunks: list[dict[str, Any] | None] = [None] * num_chunks  # on process 0: the workdir's finished chunks

  def chunks_left() -> list[int]:
    for k in range(num_chunks):
      chunks[k] = distilled.read_chunk(workdir, k, [p.record.id for p in prompts[k * size:(k + 1) * size]],
                                       fingerprint)
    return [k for k in range(num_chunks) if chunks[k] is None]

  todo = sharding.on_process_0(chunks_left)
  if len(todo) < num_chunks:
    logging.info("Resuming: %d of %d chunks already done.", num_chunks - len(todo), num_chunks)
  run_seconds, run_tokens = 0.0, 0

  def answered():
    if options.slots:
      yield from answering.stream_chunks(target, prompts, todo, options)
      return
    for k in todo:
      tic = time.perf_counter()
      conversations, stats = answering.answer_chunk(target, prompts[k * size:(k + 1) * size], options, k,
                                          f"chunk {k + 1}/{num_chunks} ")
      stats["seconds"] = time.perf_counter() - tic
      yield k, conversations, stats

  for done, (k, conversations, stats) in enumerate(answered()):
    part = prompts[k * size:(k + 1) * size]
    chunk = {"chunk": k, "fingerprint": fingerprint, "ids": [p.record.id for p in part],
             "stats": stats, "records": conversations}
    sharding.on_process_0(lambda: distilled.write_chunk(workdir, chunk))  # pylint: disable=cell-var-from-loop
    chunks[k] = chunk
    run_seconds += stats["seconds"]
    run_tokens += stats["tokens_written"]
    left = len(todo) - done - 1
    logging.info("Chunk %d/%d done: %d conversations, %d tokens kept (%d generated) in %.1f s; this run %.1f kept "
                 "tokens/s, %d loops cut so far; %d chunks left, ETA %s.", k + 1, num_chunks,
                 stats["conversations"], stats["tokens_written"], stats["generated_tokens"], stats["seconds"],
                 run_tokens / max(run_seconds, 1e-9), sum(c["stats"]["loops_cut"] for c in chunks if c), left,
                 _duration(run_seconds / (done + 1) * left))
  return sharding.on_process_0(
      lambda: _finish(workdir, chunks, counts, options, identity, fingerprint, model, target, wall))


def _duration(seconds: float) -> str:
  seconds = int(round(seconds))
  return f"{seconds // 3600}h{seconds // 60 % 60:02d}m{seconds % 60:02d}s" if seconds >= 3600 else (
      f"{seconds // 60}m{seconds % 60:02d}s")


def _finish(workdir, chunks, counts, options, identity, fingerprint, model, target, wall) -> dict[str, Any]:
  """Builds the dataset from the chunks when they changed, then writes the manifest."""
  records = distilled.dataset_records(chunks)
  totals = answering.new_stats()
  for c in chunks:
    for k in totals:
      totals[k] += c["stats"].get(k, 0)
  content = distilled.content_fingerprint(records)
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
  sharding.use_compilation_cache(config.get("compilation_cache", ""))
  sharding.maybe_initialize_distributed(config.distributed)
  sharding.check_processes_agree(config, "Distillation")
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
