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
table. The evaluation is `layerwave.speculative.evaluate`'s.

With --config.distributed=True every process of a multi-host slice runs this same program over the global mesh
(the target and draft split over 'model', each batch's prompts over 'data'): every process holds the same
outputs and τ, timings are the slowest process's, and process 0 alone writes and prints.
"""

from __future__ import annotations

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import json
import os
from typing import Any

import jax
from absl import app
from absl import flags
from ml_collections import config_flags

from layerwave import atomic
from layerwave import layer_ids
from layerwave import sharding
from layerwave.inference import load_target
from layerwave.speculative import evaluate

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where spec_metrics.json goes.")
_PROMPT = flags.DEFINE_string("prompt", None, "One question instead of the dataset.")


def run(config, workdir: str, prompt: str | None = None) -> dict[str, Any]:
  """Decodes every prompt speculatively (paired with AR when `compare_ar`); returns the aggregate metrics."""
  sharding.use_compilation_cache(config.get("compilation_cache", ""))
  sharding.maybe_initialize_distributed(config.distributed)
  sharding.check_processes_agree(config, "Speculative decoding")
  s = config.speculate
  settings = evaluate.DecodeSettings.from_config(s)
  target = load_target(config.model, dtype=config.dtype, mesh_spec=config.mesh)
  chat_format = str(config.data.chat_format)
  evaluate.check_chat_format(target.tokenizer, chat_format)
  draft = evaluate.load_draft(config.draft, target, layer_ids.parse_layer_ids(config.get("layers", ())),
                              int(config.draft_model.vocab_size), int(config.seed))
  items = (evaluate.question_prompt(target.tokenizer, prompt, chat_format) if prompt else
           evaluate.chat_prompts(target.tokenizer, s.dataset, int(s.num_prompts), chat_format=chat_format))
  ev = evaluate.evaluate(target, draft, [p for _, p in items], settings, int(config.seed), bool(s.compare_ar))
  summary = evaluate.summary(ev)
  if jax.process_index():  # every process holds the same results; process 0 writes them
    return summary
  atomic.write_json(os.path.join(workdir, "spec_metrics.json"),
                    {"config": config.to_dict(), "spec": summary, "batches": ev.per_batch}, default=str)
  atomic.write_text(os.path.join(workdir, "spec_generations.jsonl"), "".join(
      json.dumps({"id": rid, "new_tokens": len(out), "text": target.tokenizer.decode(out)}) + "\n"
      for (rid, _), out in zip(items, ev.outputs)))
  if ev.tuning is not None:
    print(ev.tuning.table())
  print(evaluate.table(summary, settings))
  if prompt:
    print(f"\n>>> {prompt}\n{target.tokenizer.decode(ev.outputs[0], skip_special_tokens=True)}")
  return summary


def main(argv):
  del argv
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required.")
  run(_CONFIG.value, _WORKDIR.value, _PROMPT.value)


if __name__ == "__main__":
  app.run(main)
