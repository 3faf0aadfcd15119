"""Does the speculative loop accept what the draft was trained to predict? A real-model equivalence check.

  python benchmarks/check_acceptance.py --config=configs/smollm2_135m.py:cpu --config.draft=W \\
      --workdir=OUT --datasets=mtbench,humaneval,gsm8k --num_prompts=8

For each prompt: the target's greedy continuation (`layerwave.generate`), the greedy chain loop
(`layerwave.speculative.generate`, K = `speculate.num_draft_tokens`) and, independently, the draft's
teacher-forced predictions along that continuation (`speculative.acceptance`: the draft run as training runs
it, no cache). Prints, per dataset, how many verifications accepted a different number of drafts than the
teacher-forced prediction says (0 is the pass), the loop's τ, and the τ predicted on the same text
(`positional` = mean of 1 + m over every start, `marginal` = training's simulated τ from per-step
accuracies). Writes `OUT/acceptance_check.json`. Exits non-zero on any mismatch.
"""

from __future__ import annotations

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
from absl import app
from absl import flags
from ml_collections import config_flags
import numpy as np

import harness
import layerwave
from layerwave import metrics as metrics_lib
from layerwave.data import chat
from layerwave.data import sources
from layerwave.speculative import acceptance

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where acceptance_check.json goes.")
_DATASETS = flags.DEFINE_list("datasets", ["mtbench"], "Prompt sets (mtbench, humaneval, gsm8k).")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "Prompts per dataset.")


def check_dataset(target, draft, prompts: list[list[int]], k: int, max_new: int,
                  batch_size: int) -> dict:
  """Loop vs teacher-forced acceptance on `prompts`; returns counts and τ figures."""
  continuations = layerwave.generate(target, prompts, max_new + 2 * k + 2, ignore_eos=True)
  sequences = [np.asarray(p + c, np.int32) for p, c in zip(prompts, continuations)]
  preds = acceptance.teacher_forced_predictions(target, draft, sequences, k, batch_size=batch_size)
  rows = {"verifications": 0, "mismatched": 0, "emitted": 0, "output_differs": 0}
  positional, marginal_acc = [], []
  for i in range(0, len(prompts), batch_size):
    batch = prompts[i:i + batch_size]
    out, m = layerwave.speculative.generate(target, draft, batch, max_new, ignore_eos=True,
                                            method="chain", num_draft_tokens=k)
    for j, (prompt, got, accepted) in enumerate(zip(batch, out, m["accept_lengths"])):
      seq, p = sequences[i + j], preds[i + j]
      rows["output_differs"] += got != list(seq[len(prompt):len(prompt) + max_new])
      want = acceptance.predicted_chain_acceptance(p, seq, len(prompt), k, max_new)
      rows["verifications"] += len(accepted)
      rows["mismatched"] += sum(a != b for a, b in zip(accepted, want)) + abs(len(accepted) - len(want))
      rows["emitted"] += 1 + sum(a + 1 for a in accepted)
      est = acceptance.tau_estimates(p, seq, len(prompt), k, max_new)
      positional.append(est["positional_tau"])
      marginal_acc.append(est["acc"])
  acc = np.mean(marginal_acc, axis=0)
  rows.update(loop_tau=(rows["emitted"] - len(prompts)) / rows["verifications"],
              positional_tau=float(np.mean(positional)),
              marginal_tau=float(1 + np.cumprod(acc).sum()), acc=acc.tolist())
  return rows


def main(argv):
  config = _CONFIG.value
  target = harness.start(argv, config)
  metrics_lib.quiet_library_logs()
  s = config.speculate
  draft = layerwave.load_draft(config.draft, target)
  k, max_new = int(s.num_draft_tokens), int(s.max_new_tokens)
  results = {}
  for name in _DATASETS.value:
    records = sources.get_source(name, limit=_NUM_PROMPTS.value)
    prompts = [chat.encode_prompt(target.tokenizer, r.messages[:1], chat_format=str(config.data.chat_format)).tolist()
               for r in records]
    results[name] = check_dataset(target, draft, prompts, k, max_new, int(s.batch_size))
  print(f"\nK = {k}, {max_new} new tokens per prompt, greedy; draft {config.draft}\n")
  print("| dataset | prompts | verifications | mismatched | loop τ | positional τ | marginal (sim) τ |"
        " acc_j (teacher-forced) |")
  print("|---|---|---|---|---|---|---|---|")
  for name, r in results.items():
    print(f"| {name} | {_NUM_PROMPTS.value} | {r['verifications']} | {r['mismatched']} | "
          f"{r['loop_tau']:.3f} | {r['positional_tau']:.3f} | {r['marginal_tau']:.3f} | "
          f"{' '.join(f'{a:.2f}' for a in r['acc'])} |")
  if _WORKDIR.value:
    harness.write_result(_WORKDIR.value, "acceptance_check.json",
                         {"draft": config.draft, "k": k, "max_new_tokens": max_new, "results": results})
  bad = sum(r["mismatched"] + r["output_differs"] for r in results.values())
  if bad:
    raise SystemExit(f"{bad} verifications (or outputs) differ from the teacher-forced prediction.")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main)
