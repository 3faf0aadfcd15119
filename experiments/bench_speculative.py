"""Speculative decoding benchmark: τ, acceptance by depth, tok/s and speedup over AR, in one process.

For each dataset and temperature, AR decoding (`layerwave.generate`) and every drafting method (chain
K ∈ {3, 5, 7} and the EAGLE-2 tree of `config.speculate`) decode the same prompts; speedup = spec tok/s ÷
AR tok/s. Compilation is excluded (each shape is warmed up first). Writes `W/bench_speculative.json` and
prints a markdown table (paste into BENCHMARKS.md).

  python experiments/bench_speculative.py --config=configs/smollm2_135m.py --config.draft=W --workdir=W
  python experiments/bench_speculative.py --config=configs/smollm2_135m.py:smoke --config.draft=random \\
      --workdir=out/bench --datasets=gsm8k --methods=chain3,tree --temperatures=0
"""

from __future__ import annotations

import json
import os
import platform

from absl import app
from absl import flags

import layerwave
import speculate  # experiments/speculate.py (run from the repository root)

# --config and --workdir are speculate.py's flags (defined on import).
_CONFIG, _WORKDIR = speculate._CONFIG, speculate._WORKDIR  # pylint: disable=protected-access
_DATASETS = flags.DEFINE_list("datasets", ["mtbench", "humaneval", "gsm8k"], "Prompt sets.")
_NUM = flags.DEFINE_list("num_prompts", ["80", "40", "40"], "Prompts per dataset (0 = all).")
_METHODS = flags.DEFINE_list("methods", ["chain3", "chain5", "chain7", "tree"],
                             "chainK (K drafted tokens) or tree (config.speculate's budget).")
_TEMPS = flags.DEFINE_list("temperatures", ["0", "1"], "Sampling temperatures.")


def main(argv):
  del argv
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required.")
  config = _CONFIG.value
  s = config.speculate
  target = layerwave.load_target(config.model, dtype=config.dtype, mesh_spec=config.mesh)
  draft = speculate.load_draft(config, target)
  counts = dict(zip(_DATASETS.value, (int(n) for n in _NUM.value)))
  results = []
  for dataset in _DATASETS.value:
    s.dataset, s.num_prompts = dataset, counts.get(dataset, s.num_prompts)
    items = speculate.prompts_for(config, target.tokenizer, None)
    for temp in (float(t) for t in _TEMPS.value):
      s.temperature = temp
      ar_outs, _, ar_seconds, _ = speculate.decode_all(target, None, items, s, config.seed,
                                                       speculative=False)
      for method in _METHODS.value:
        if method == "tree":
          s.method = "tree"
        else:
          s.method, s.num_draft_tokens = "chain", int(method.removeprefix("chain"))
        summary, _, _ = speculate.evaluate(target, draft, items, s, config.seed,
                                           (ar_outs, ar_seconds))
        summary.update(dataset=dataset, temperature=temp, name=method)
        results.append(summary)
        print(f"{dataset} T={temp:g} {method}: tau={summary['tau']:.2f} "
              f"spec={summary['tokens_per_s']:.1f} tok/s ar={summary['ar_tokens_per_s']:.1f} tok/s "
              f"speedup={summary['speedup']:.2f}x", flush=True)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  with open(os.path.join(_WORKDIR.value, "bench_speculative.json"), "w") as f:
    json.dump({"config": config.to_dict(), "machine": platform.machine(), "results": results}, f,
              indent=1, default=str)
  print(f"\ndraft: {config.draft}; max_new_tokens {s.max_new_tokens}; batch {s.batch_size}; tree "
        f"d={s.tree_depth} k={s.tree_top_k} n={s.tree_tokens}; machine {platform.machine()}")
  print("| dataset | T | method | τ | acceptance by depth | spec tok/s | AR tok/s | speedup | =AR |")
  print("|" + "---|" * 9)
  for r in results:
    acc = " ".join(f"{a:.2f}" for a in r["acceptance"])
    print(f"| {r['dataset']} | {r['temperature']:g} | {r['name']} | {r['tau']:.2f} | {acc} | "
          f"{r['tokens_per_s']:.1f} | {r['ar_tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
          f"{r['equal_to_ar']:.0%} |")


if __name__ == "__main__":
  app.run(main)
