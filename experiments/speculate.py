"""Speculative decoding with a trained draft over MT-bench, HumanEval or GSM8K prompts (the last stage).

  python experiments/speculate.py --config=configs/smollm2_135m.py --config.draft=W --workdir=W
  python experiments/speculate.py --config=configs/smollm2_135m.py:smoke --config.draft=random \\
      --workdir=out/spec --prompt="What is 12 times 7?"

Reads `config.speculate` (dataset, sampling, chain or tree) and `config.draft` (a training workdir, or
`random` for an untrained draft reading `config.layers` or EAGLE-3's default layers: a smoke run, τ ≈ 1).
Prompts go through the target's chat template. With `compare_ar`, `layerwave.generate` decodes the same
batches in alternation with speculation (`timing.paired_speedup`: `speculate.timing_repeats` ABBA pairs per
batch), giving the speedup as the median pair ratio and (greedy) a token-for-token equality check. Writes
`W/spec_metrics.json` (config, aggregate and per-batch metrics) and `W/spec_generations.jsonl`, and prints a
table.
"""

from __future__ import annotations

import json
import os
from typing import Any

from absl import app
from absl import flags
import numpy as np
from flax import nnx
from ml_collections import config_flags

import layerwave
from layerwave import atomic
from layerwave import selection
from layerwave import sharding
from layerwave.data import chat
from layerwave.data import sources
from layerwave.models.draft import Draft, DraftConfig
from layerwave.speculative import decode
from layerwave.speculative import timing

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where spec_metrics.json goes.")
_PROMPT = flags.DEFINE_string("prompt", None, "One question instead of the dataset.")


def load_draft(config, target) -> Any:
  """`config.draft`: a training workdir, or "random" (untrained, for smoke runs)."""
  if not config.draft:
    raise ValueError("Set --config.draft to a draft training workdir (or 'random' for a smoke run).")
  if config.draft != "random":
    return layerwave.load_draft(config.draft, target)
  ids = (tuple(int(x) for x in config.layers.split(",")) if config.get("layers")
         else selection.eagle3_layer_ids(target.config.num_layers))
  dcfg = DraftConfig.from_target(target.config, ids, draft_vocab_size=min(
      config.draft_model.vocab_size, target.config.vocab_size))
  return Draft(dcfg, embedding=target.params["embed_tokens"]["embedding"][...],
               rngs=nnx.Rngs(config.seed))


def prompts_for(config, tokenizer, prompt: str | None) -> list[tuple[str, list[int]]]:
  """(id, token ids) per prompt: the chat-templated first user turn."""
  s = config.speculate
  if prompt:
    records = [sources.Record(id="prompt", source="prompt",
                              messages=({"role": "user", "content": prompt},))]
  else:
    records = sources.get_source(s.dataset, limit=s.num_prompts or None)
  return [(r.id, chat.encode_prompt(tokenizer, r.messages[:1]).tolist()) for r in records]


def spec_options(s) -> dict[str, Any]:
  return dict(method=s.method, num_draft_tokens=s.num_draft_tokens, tree_depth=s.tree_depth,
              tree_top_k=s.tree_top_k, tree_tokens=s.tree_tokens, draft_sample=s.draft_sample)


def decode_fns(target, draft, s, seed: int):
  """(plain, speculative) decode functions, batch -> (outputs, metrics), with `s`'s sampling settings."""
  sampling = dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=seed)
  plain = lambda ids: layerwave.generate(  # noqa: E731
      target, ids, s.max_new_tokens, **sampling, return_stats=True)
  spec = lambda ids: layerwave.speculative.generate(  # noqa: E731
      target, draft, ids, s.max_new_tokens, **sampling, **spec_options(s))
  return plain, spec


def evaluate(target, draft, items, s, seed: int, paired: bool) -> tuple[dict[str, Any], list, list]:
  """Speculative metrics over `items` in batches of `s.batch_size`.

  Args:
    target, draft: the loaded target and draft.
    items: (id, token ids) per prompt.
    s: `config.speculate`.
    seed: sampling seed.
    paired: also decode every batch with `layerwave.generate`, timed in alternation with speculation
      (`timing.paired_speedup`, `s.timing_repeats` pairs per batch): speedup (median pair ratio and its
      spread), both tokens/s (medians over the pairs) and the share of outputs equal to plain decoding's.
      Otherwise one warm-up, then one timed speculative call per batch.

  Returns:
    (summary, speculative outputs per prompt, per-batch metrics).
  """
  plain, spec = decode_fns(target, draft, s, seed)
  prompts = [p for _, p in items]
  if paired:
    timed = timing.paired_speedup(plain, spec, prompts, int(s.batch_size), int(s.timing_repeats))
    outs, hist, per_batch = timed.spec_outputs, timed.accept_length_hist, timed.per_batch
  else:
    outs, hist, _, per_batch = decode.run_batches(spec, prompts, int(s.batch_size))
  summary = decode.acceptance_metrics(hist[None])
  seconds = sum(r["seconds"] for r in per_batch)
  summary.update(prompts=len(outs), new_tokens=sum(len(o) for o in outs), seconds=seconds,
                 tokens_per_s=sum(len(o) for o in outs) / seconds)
  if paired:
    summary.update(timed.summary(), ar_seconds=sum(r["plain_seconds"] for r in per_batch),
                   equal_to_ar=float(np.mean([a == b for a, b in zip(outs, timed.plain_outputs)])))
  return summary, outs, per_batch


def run(config, workdir: str, prompt: str | None = None) -> dict[str, Any]:
  """Decodes every prompt speculatively (paired with AR when `compare_ar`); returns the aggregate metrics."""
  sharding.maybe_initialize_distributed(config.distributed)
  s = config.speculate
  target = layerwave.load_target(config.model, dtype=config.dtype, mesh_spec=config.mesh)
  if target.tokenizer is None or target.tokenizer.chat_template is None:
    raise ValueError(f"{config.model} has no tokenizer chat template; cannot build chat prompts.")
  draft = load_draft(config, target)
  items = prompts_for(config, target.tokenizer, prompt)
  summary, outs, per_batch = evaluate(target, draft, items, s, config.seed, bool(s.compare_ar))
  atomic.write_json(os.path.join(workdir, "spec_metrics.json"),
                    {"config": config.to_dict(), "spec": summary, "batches": per_batch}, default=str)
  atomic.write_text(os.path.join(workdir, "spec_generations.jsonl"), "".join(
      json.dumps({"id": rid, "new_tokens": len(out), "text": target.tokenizer.decode(out)}) + "\n"
      for (rid, _), out in zip(items, outs)))
  print(table(summary, s))
  if prompt:
    print(f"\n>>> {prompt}\n{target.tokenizer.decode(outs[0], skip_special_tokens=True)}")
  return summary


def speedup_cell(m: dict[str, Any]) -> str:
  """The speedup as a table cell: the median pair ratio and [p25, p75] of the pairs."""
  return f"{m['speedup']:.2f}x [{m['speedup_p25']:.2f}, {m['speedup_p75']:.2f}]"


def table(m: dict[str, Any], s) -> str:
  """A one-row markdown table of the aggregate metrics, with how the speedup was timed below it."""
  name = s.method + (f" K={s.num_draft_tokens}" if s.method == "chain" else
                     f" d={s.tree_depth} k={s.tree_top_k} n={s.tree_tokens}")
  acc = " ".join(f"{a:.2f}" for a in m["acceptance"])
  head = ("| method | T | prompts | τ | acceptance by depth | spec tok/s | AR tok/s | speedup [p25, p75] "
          "| =AR |")
  ar = (f"{m['ar_tokens_per_s']:.1f} | {speedup_cell(m)} | {m['equal_to_ar']:.0%}"
        if "speedup" in m else "- | - | -")
  lines = [head, "|" + "---|" * 9,
           f"| {name} | {s.temperature:g} | {m['prompts']} | {m['tau']:.2f} | {acc} | "
           f"{m['tokens_per_s']:.1f} | {ar} |"]
  if "speedup" in m:
    lines.append(f"\nspeedup = spec ÷ AR tokens/s, {m['timing'].removeprefix('paired: ')}; the tok/s columns "
                 "are medians over the same pairs.")
  return "\n".join(lines)


def main(argv):
  del argv
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required.")
  run(_CONFIG.value, _WORKDIR.value, _PROMPT.value)


if __name__ == "__main__":
  app.run(main)
