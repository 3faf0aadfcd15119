"""Chat with the target LLM: load it, apply its chat template, decode, print (the AR baseline).

  python experiments/generate.py --config=configs/generate.py [--config.prompt="..."]

With --config.distributed=True every process of a multi-host slice runs this same program over the global mesh
(the target split over 'model', the questions over 'data'); each returns the same answers, and process 0 alone
prints and writes them.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import json
import os
import time

import jax
from absl import app
from absl import flags
from ml_collections import config_flags

import layerwave
from layerwave import atomic
from layerwave import sharding

_CONFIG = config_flags.DEFINE_config_file("config", "configs/generate.py", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Optional directory for generations.jsonl.")


def run(config, workdir=None) -> list[dict]:
  """Loads `config.model`, answers each question greedily (or sampled), prints and returns them."""
  sharding.use_compilation_cache(config.get("compilation_cache", ""))
  sharding.maybe_initialize_distributed(config.distributed)
  sharding.check_processes_agree(config, "Generation")
  target = layerwave.load_target(config.model, dtype=config.dtype, mesh_spec=config.mesh)
  tok = target.tokenizer
  if tok is None or tok.chat_template is None:
    raise ValueError(f"{config.model} has no tokenizer chat template; cannot build chat prompts.")
  questions = [config.prompt] if config.prompt else list(config.questions)
  prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False) for q in questions]
  start = time.perf_counter()
  outs, stats = layerwave.generate(target, prompts, config.max_new_tokens, config.temperature,
                                   config.top_k, config.top_p, config.seed, return_stats=True)
  seconds = time.perf_counter() - start
  records = [{"question": q, "answer": tok.decode(out, skip_special_tokens=True), "new_tokens": len(out)}
             for q, out in zip(questions, outs)]
  if jax.process_index():  # every process holds the same answers; process 0 reports them
    return records
  for r in records:
    print(f"\n>>> {r['question']}\n{r['answer']}")
  total = sum(r["new_tokens"] for r in records)
  print(f"\n{total} new tokens for {len(questions)} prompts in {seconds:.1f}s "
        f"(includes compilation; {stats['steps']} decode steps).")
  if workdir:
    atomic.write_text(os.path.join(workdir, "generations.jsonl"),
                      "".join(json.dumps(r) + "\n" for r in records))
  return records


def main(argv):
  del argv
  run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
