"""Speculative decoding benchmark: τ, acceptance by depth, tok/s and speedup over AR, in one process.

For each dataset, temperature and drafting method (chain K ∈ {3, 5, 7} and the EAGLE-2 tree of
`config.speculate`), AR decoding (`layerwave.generate`) and speculation decode the same batches in
alternation (`timing.paired_speedup`: `speculate.timing_repeats` ABBA pairs per batch, so a machine whose
speed drifts during the run slows both sides of a pair alike); speedup = the median over the pairs of spec
tok/s ÷ AR tok/s, with the pairs' [p25, p75]. Compilation is excluded (each shape is warmed up first).
Writes `W/bench_speculative.json` and prints a markdown table (paste into BENCHMARKS.md). The evaluation is
`layerwave.speculative.evaluate`'s, as in experiments/speculate.py.

Resumable: each finished row (dataset, temperature, method) is kept in `W/rows/` at once, and a rerun with the
same settings into the same workdir decodes only the rows still missing (an evaluation of all 240 prompts
spans hours on a CPU). Settings that change what a row measures (the config, --paired, a dataset's prompt
count) are recorded in `W/bench_settings.json`; a rerun with others is refused, naming them. Adding datasets,
temperatures or methods to a workdir is fine.

  python benchmarks/bench_speculative.py --config=configs/smollm2_135m.py --config.draft=W --workdir=W
  python benchmarks/bench_speculative.py --config=configs/smollm2_135m.py:smoke --config.draft=random \\
      --workdir=out/bench --datasets=gsm8k --methods=chain3,tree --temperatures=0
"""

from __future__ import annotations

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import dataclasses
import json
import os
import platform

from absl import app
from absl import flags
from ml_collections import config_flags

from layerwave import atomic
from layerwave import layer_ids
from layerwave import options
from layerwave.inference import load_target
from layerwave.speculative import evaluate
from layerwave.training.options import TrainOptions

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where bench_speculative.json goes.")
_DATASETS = flags.DEFINE_list("datasets", ["mtbench", "humaneval", "gsm8k"], "Prompt sets.")
_NUM = flags.DEFINE_list("num_prompts", ["80", "40", "40"], "Prompts per dataset (0 = all).")
_METHODS = flags.DEFINE_list("methods", ["chain3", "chain5", "chain7", "tree"],
                             "chainK (K drafted tokens), tree (config.speculate's budget), or auto (the "
                             "tuner's choice among chains up to speculate.num_draft_tokens and small trees).")
_TEMPS = flags.DEFINE_list("temperatures", ["0", "1"], "Sampling temperatures.")
_PAIRED = flags.DEFINE_boolean("paired", True, "Decode every batch with plain decoding too, timed in alternation "
                               "(speedup, equality); --nopaired measures τ and acceptance only (a fraction of the "
                               "time: for all prompts, with the speedup measured on a subset).")


def _settings(config) -> dict:
  """What a row's numbers depend on besides its (dataset, count, temperature, method)."""
  return {"config": json.loads(json.dumps(config.to_dict(), default=str)), "paired": bool(_PAIRED.value)}


def _comparable(settings: dict) -> dict:
  """Settings as rows must agree on them: training fields added since a workdir was recorded count only when
  set (`TrainOptions.drop_unset_later`), whether the record lacks them or holds their defaults."""
  train = settings.get("config", {}).get("train")
  if isinstance(train, dict):
    settings["config"]["train"] = TrainOptions.drop_unset_later(train)
  return settings


def _row_path(workdir: str, dataset: str, count: int, temp: float, method: str) -> str:
  return os.path.join(workdir, "rows", f"{dataset}-n{count}-T{temp:g}-{method}.json")


def main(argv):
  del argv
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required.")
  config = _CONFIG.value
  s = config.speculate
  base = evaluate.DecodeSettings.from_config(s)
  target = load_target(config.model, dtype=config.dtype, mesh_spec=config.mesh)
  draft = evaluate.load_draft(config.draft, target, layer_ids.parse_layer_ids(config.get("layers", ())),
                              int(config.draft_model.vocab_size), int(config.seed))
  counts = dict(zip(_DATASETS.value, (int(n) for n in _NUM.value)))
  # After the target and the draft loaded (a bad path records nothing): rows of other settings are refused.
  options.record_settings(os.path.join(_WORKDIR.value, "bench_settings.json"), _settings(config),
                          "benchmark rows", normalize=_comparable)
  results = []
  for dataset in _DATASETS.value:
    count = counts.get(dataset, int(s.num_prompts))
    items = None
    for temp in (float(t) for t in _TEMPS.value):
      for method in _METHODS.value:
        if method != "auto" and method != "tree" and not (
            method.startswith("chain") and method.removeprefix("chain").isdigit()):
          raise app.UsageError(f"--methods: {method!r} is not chainK, tree or auto.")
        path = _row_path(_WORKDIR.value, dataset, count, temp, method)
        if os.path.exists(path):
          with open(path) as f:
            summary = json.load(f)
          results.append(summary)
          print(f"{dataset} T={temp:g} {method}: kept from {path}", flush=True)
          continue
        if items is None:
          items = evaluate.chat_prompts(target.tokenizer, dataset, count, chat_format=str(config.data.chat_format))
        settings = dataclasses.replace(base, temperature=temp, auto=method == "auto")
        if method == "tree":
          settings = dataclasses.replace(settings, spec=dataclasses.replace(base.spec, method="tree"))
        elif method.startswith("chain"):
          settings = dataclasses.replace(settings, spec=dataclasses.replace(
              base.spec, method="chain", num_draft_tokens=int(method.removeprefix("chain"))))
        ev = evaluate.evaluate(target, draft, [p for _, p in items], settings, int(config.seed),
                               paired=_PAIRED.value)
        summary = evaluate.summary(ev)
        summary.update(dataset=dataset, temperature=temp,
                       name=f"auto: {summary['setting']}" if method == "auto" else method)
        if ev.tuning is not None:
          print(ev.tuning.table(), flush=True)
        atomic.write_json(path, summary, default=str)
        results.append(summary)
        print(f"{dataset} T={temp:g} {method}: tau={summary['tau']:.2f} "
              f"spec={summary['tokens_per_s']:.1f} tok/s" + (
                  f" ar={summary['ar_tokens_per_s']:.1f} tok/s speedup={evaluate.speedup_cell(summary)} "
                  f"({summary['timing']})" if _PAIRED.value else "") + (
                  f" = effective tau {summary['effective_tau']:.2f} / iteration cost "
                  f"{summary['iteration_cost']:.2f}" if "iteration_cost" in summary else ""), flush=True)
  atomic.write_json(os.path.join(_WORKDIR.value, "bench_speculative.json"),
                    {"config": config.to_dict(), "machine": platform.machine(), "results": results},
                    default=str)
  print(f"\ndraft: {config.draft}; max_new_tokens {s.max_new_tokens}; batch {s.batch_size}; tree "
        f"d={s.tree_depth} k={s.tree_top_k} n={s.tree_tokens}; machine {platform.machine()}")
  print(f"speedup: spec ÷ AR tokens/s of the same batch decoded back to back in alternation (ABBA), "
        f"{s.timing_repeats} pairs per batch after a warm-up; the median over a row's pairs, [p25, p75] of "
        "them; the tok/s columns are medians over the same pairs.")
  print("iteration cost: seconds per speculative iteration ÷ seconds per plain decode step, pooled over the "
        "row's batches (speedup ≈ effective τ ÷ iteration cost; at batch 1 the cost is the break-even τ).")
  print("| dataset | T | method | τ | acceptance by depth | spec tok/s | AR tok/s | speedup [p25, p75] "
        "| =AR | iteration cost |")
  print("|" + "---|" * 10)
  for r in results:
    acc = " ".join(f"{a:.2f}" for a in r["acceptance"])
    ar = (f"{r['ar_tokens_per_s']:.1f} | {evaluate.speedup_cell(r)} | {r['equal_to_ar']:.0%}" if "speedup" in r
          else "– | – | –")
    cost = f"{r['iteration_cost']:.2f}" if "iteration_cost" in r else "–"
    print(f"| {r['dataset']} | {r['temperature']:g} | {r['name']} | {r['tau']:.2f} | {acc} | "
          f"{r['tokens_per_s']:.1f} | {ar} | {cost} |")


if __name__ == "__main__":
  app.run(main)
