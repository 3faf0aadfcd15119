"""Benchmark: distillation's static batches vs continuous batching, useful tokens/s side by side.

  python benchmarks/bench_generation.py --num_prompts=256 --slots=16
  python benchmarks/bench_generation.py --config=configs/smollm2_135m.py:recipe --num_prompts=32  # quick

On the first `--num_prompts` ShareGPT prompts that distillation would answer (`distill.select_prompts` with
the config's `distill` section: by default `make baseline`'s, prompts <= 192 tokens, answers <= 320, greedy,
loops cut), both paths answer the same prompts in one process:

* static: `answering.answer_prompts` with `slots=0`, length-sorted batches of `distill.batch_size`, each
  decoding until its longest row ends (today's default);
* continuous: `layerwave.continuous.Engine` with `--slots` rows, rows leaving at EOS, the budget, or as soon as
  a repetition loop shows (`answering.stop_fn`), attention bounded by the live rows' length.

Useful tokens are the tokens each answer keeps after the loop cut (what enters the training data). Both
paths compile first on a few prompts (compilation excluded), then run in the order static, continuous,
static, continuous over halves of the prompts (ABBA over the machine's drift). Prints a table, the share of
answers identical between the paths, and as its last line
`useful tokens/s: static X, continuous Y, ratio R`. Writes `W/bench_generation.json`.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import dataclasses
import os
import platform
import time

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

import harness
from layerwave import continuous
from layerwave import options as options_lib
from layerwave import sharding
from layerwave.data import answering
from layerwave.data import decontaminate
from layerwave.data import distill
from layerwave.data import sources
from layerwave.data.options import DistillOptions
from layerwave.inference import load_target

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2_135m.py:recipe", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "out/bench_generation", "Where the JSON result goes.")
_NUM = flags.DEFINE_integer("num_prompts", 256, "Prompts answered by each path.")
_SLOTS = flags.DEFINE_integer("slots", 16, "Continuous batching rows.")
_CHUNK = flags.DEFINE_integer("chunk_steps", 16, "Continuous batching decode steps between refills.")
_BATCH = flags.DEFINE_integer("batch", 0, "Static batch size (0 = the config's distill.batch_size).")
_DTYPE = flags.DEFINE_string("also_dtype", "", "Also run the continuous path with the target in this dtype "
                             "(e.g. bfloat16), alternated with the float32 one: tokens/s and identical answers.")
_SKIP_STATIC = flags.DEFINE_bool("skip_static", False, "Only the continuous path (with --also_dtype).")


def _static(target, prompts, options):
  tic = time.perf_counter()
  answers, counts = answering.answer_prompts(target, [p.ids for p in prompts], options, (0, 0))
  return answers, time.perf_counter() - tic, counts["row_steps"]


def _continuous(target, prompts, options):
  engine = continuous.Engine(target, options.slots, options.max_new_tokens, options.max_prompt_tokens,
                             stop_fn=answering.stop_fn(target, options), chunk_steps=options.chunk_steps)
  engine.warmup()  # every prefill width and read bound compiles here, untimed (once per process)
  tic = time.perf_counter()
  for i, p in enumerate(prompts):
    engine.submit(continuous.Request(ids=p.ids, tag=i))
  rows = [None] * len(prompts)
  for f in engine.run():
    rows[f.request.tag] = answering.make_answer(f.tokens, target, options)
  return rows, time.perf_counter() - tic, engine.stats["row_steps"]


def main(argv):
  config = _CONFIG.value
  options = options_lib.from_section(DistillOptions, config.distill, "distill",
                                     chat_format=config.data.chat_format)
  options = dataclasses.replace(options, num_prompts=_NUM.value + 8, slots=_SLOTS.value,
                                chunk_steps=_CHUNK.value, batch_size=_BATCH.value or options.batch_size)
  sharding.use_compilation_cache(config.get("compilation_cache", ""))
  sharding.maybe_initialize_distributed(config.distributed)
  sharding.require_single_process("bench_generation")
  target = harness.start(argv, config)
  index = decontaminate.EvalIndex.build(decontaminate.eval_prompts(options.exclude_sets), options.exclude_min_chars)
  selected, _ = distill.select_prompts(sources.get_source(options.source), target.tokenizer, options, index)
  warm, prompts = selected[:8], selected[8:8 + _NUM.value]
  logging.info("Compiling both paths on %d prompts.", len(warm))
  _static(target, warm, options)
  _continuous(target, warm, options)
  half = len(prompts) // 2
  parts = [prompts[:half], prompts[half:]]
  if _DTYPE.value:
    _compare_dtypes(config, target, parts, options)
    if _SKIP_STATIC.value:
      return
  static, cont = [None] * len(prompts), [None] * len(prompts)
  seconds = {"static": 0.0, "continuous": 0.0}
  row_steps = {"static": 0, "continuous": 0}
  for h, order in ((0, ("static", "continuous")), (1, ("continuous", "static"))):
    for mode in order:
      fn = _static if mode == "static" else _continuous
      answers, elapsed, steps = fn(target, parts[h], options)
      seconds[mode] += elapsed
      row_steps[mode] += steps
      out = static if mode == "static" else cont
      out[h * half:h * half + len(parts[h])] = answers
      logging.info("%s, half %d: %d prompts in %.1f s (%.1f useful tokens/s).", mode, h + 1, len(parts[h]),
                   elapsed, sum(a.tokens for a in answers) / elapsed)
  useful = {"static": sum(a.tokens for a in static), "continuous": sum(a.tokens for a in cont)}
  rates = {m: useful[m] / seconds[m] for m in seconds}
  identical = sum(a.text == b.text for a, b in zip(static, cont)) / len(prompts)
  result = {
      "prompts": len(prompts), "slots": options.slots, "chunk_steps": options.chunk_steps,
      "static_batch": options.batch_size, "max_new_tokens": options.max_new_tokens,
      "max_prompt_tokens": options.max_prompt_tokens, "seconds": seconds, "useful_tokens": useful,
      "row_steps": row_steps, "useful_tokens_per_s": rates, "ratio": rates["continuous"] / rates["static"],
      "identical_answers": identical, "loops_cut": {"static": sum(a.loop_cut for a in static),
                                                    "continuous": sum(a.loop_cut for a in cont)},
      "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
  }
  harness.write_result(_WORKDIR.value, "bench_generation.json", result)
  print("| path | seconds | useful tokens | useful tokens/s | row steps | useful / row steps |")
  print("|---|---|---|---|---|---|")
  for m in ("static", "continuous"):
    print(f"| {m} | {seconds[m]:.1f} | {useful[m]} | {rates[m]:.1f} | {row_steps[m]} | "
          f"{useful[m] / max(row_steps[m], 1):.2f} |")
  print(f"identical answers: {100 * identical:.1f}% of {len(prompts)}")
  print(f"useful tokens/s: static {rates['static']:.1f}, continuous {rates['continuous']:.1f}, "
        f"ratio {result['ratio']:.2f}")


def _compare_dtypes(config, target, parts, options):
  """Continuous batching with the float32 target and with it in `--also_dtype`, ABBA over the halves."""
  other = load_target(config.model, dtype=_DTYPE.value, mesh=target.mesh)
  _continuous(other, parts[0][:8], options)  # compile
  models = {"float32": target, _DTYPE.value: other}
  seconds, answers = {m: 0.0 for m in models}, {m: [[], []] for m in models}
  for h, order in ((0, ("float32", _DTYPE.value)), (1, (_DTYPE.value, "float32"))):
    for m in order:
      answers[m][h], elapsed, _ = _continuous(models[m], parts[h], options)
      seconds[m] += elapsed
  answers = {m: a[0] + a[1] for m, a in answers.items()}
  useful = {m: sum(a.tokens for a in answers[m]) for m in models}
  identical = sum(a.text == b.text for a, b in zip(answers["float32"], answers[_DTYPE.value])) / len(
      answers["float32"])
  print(f"| dtype | seconds | useful tokens | useful tokens/s |\n|---|---|---|---|")
  for m in models:
    print(f"| {m} | {seconds[m]:.1f} | {useful[m]} | {useful[m] / seconds[m]:.1f} |")
  print(f"identical answers {_DTYPE.value} vs float32: {100 * identical:.1f}% of {len(answers['float32'])}")
  print(f"continuous useful tokens/s: float32 {useful['float32'] / seconds['float32']:.1f}, {_DTYPE.value} "
        f"{useful[_DTYPE.value] / seconds[_DTYPE.value]:.1f}, ratio "
        f"{(useful[_DTYPE.value] / seconds[_DTYPE.value]) / (useful['float32'] / seconds['float32']):.2f}")


if __name__ == "__main__":
  app.run(main)
