"""Two variants of one training cell, paired by seed: held-out sim τ, Δ with its 95 % CI, and the step rate.

  python experiments/paired_runs.py --root=~/layerwave-runs/campaign/dtype --a=float32 --b=bfloat16 \
      --seeds=0,1,2 --out=~/layerwave-runs/campaign/dtype/summary

Reads the workdirs ROOT/{variant}-seed{seed} (`--pattern`) that experiments/train_draft.py wrote: each run's
last held-out evaluation (`metrics.jsonl`: eval/sim_tau, eval/draft/acc_j at the final step) and its training
rate (real tokens / seconds of training steps, evaluation excluded, from the final checkpoint's record). The two
runs of a seed must have finished the same number of steps and may differ in `--field` only (read off their
checkpoints' settings): a pair that differs elsewhere measures something else and is refused. Prints a markdown
table and, as its last line, `held-out sim tau: A X, B Y, paired delta D +- CI (n seeds)`; writes OUT/paired.json
and OUT/paired.md. `make dtype-check` ends with it (BENCHMARKS.md, issue 21: bf16 training becomes the
default only if Δ is within seed noise).
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import json
import os

from absl import app
from absl import flags

from layerwave import atomic
from layerwave import checkpoint as ckpt_lib
from layerwave import options as options_lib
from layerwave.compare.summary import mean_ci

_ROOT = flags.DEFINE_string("root", None, "Folder holding the runs' workdirs.")
_A = flags.DEFINE_string("a", None, "The reference variant (e.g. float32).")
_B = flags.DEFINE_string("b", None, "The variant compared with it (e.g. bfloat16).")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds: one run of each variant per seed.")
_PATTERN = flags.DEFINE_string("pattern", "{variant}-seed{seed}", "A run's workdir under --root.")
_FIELD = flags.DEFINE_string("field", "train.compute_dtype",
                             "The one setting (dotted) in which a pair's runs may differ, besides the seed.")
_OUT = flags.DEFINE_string("out", None, "Output folder (default: ROOT/summary).")
flags.mark_flags_as_required(["root", "a", "b"])


def read_run(workdir: str) -> dict:
  """A finished run's final held-out metrics, its rate and its settings; a clear error when there is none."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    raise app.UsageError(f"{workdir} holds no training run (no metrics.jsonl): run experiments/train_draft.py "
                         f"--workdir={workdir} first (make dtype-check trains them).")
  evals = []
  with open(path) as f:
    for line in f:
      record = json.loads(line)
      if "eval/sim_tau" in record:
        evals.append(record)
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"))
  step = ckpt.latest_step()
  if step is None:
    raise app.UsageError(f"{workdir} has no checkpoint: its run never reached one; rerun it.")
  meta = ckpt.read_meta(step)
  ckpt.close()
  final = [r for r in evals if int(r["step"]) == int(step)]
  if not final:
    raise app.UsageError(f"{workdir}: no held-out evaluation at its last step {step} (the run stopped early or "
                         "has no held-out split); finish it with the same command.")
  last = final[-1]
  acc = [last[k] for k in sorted((k for k in last if k.startswith("eval/draft/acc_")
                                  and not k.startswith("eval/draft/acc_in_vocab")),
                                 key=lambda k: int(k.rsplit("_", 1)[1]))]
  seconds = float(meta.get("train_seconds") or 0.0)
  tokens = float(meta.get("tokens_trained") or 0.0)
  return {"workdir": workdir, "step": int(step), "sim_tau": float(last["eval/sim_tau"]), "acc_j": acc,
          "tokens_per_s": tokens / seconds if seconds else float("nan"),
          "seconds_per_step": seconds / max(int(step), 1), "settings": meta.get("settings", {})}


def pair(a: dict, b: dict, field: str) -> None:
  """Refuses a pair whose runs are not one cell twice (other settings, or other lengths)."""
  if a["step"] != b["step"]:
    raise app.UsageError(f"{a['workdir']} ran {a['step']} steps and {b['workdir']} {b['step']}: finish both to "
                         "the same train.num_steps.")
  diff = options_lib.differing_fields(a["settings"], b["settings"], limit=100)
  extra = [d for d in diff.split(", ") if d and d not in (field, "none recorded")]
  if extra:
    raise app.UsageError(f"{a['workdir']} and {b['workdir']} differ in {', '.join(extra)}, not only in {field}: "
                         "they are not one cell trained two ways; retrain one with the other's settings.")


def summarize(runs_a: list[dict], runs_b: list[dict], seeds: list[str], name_a: str, name_b: str) -> dict:
  delta = [b["sim_tau"] - a["sim_tau"] for a, b in zip(runs_a, runs_b)]
  ratio = [a["seconds_per_step"] / b["seconds_per_step"] for a, b in zip(runs_a, runs_b)]
  return {"a": name_a, "b": name_b, "seeds": seeds, "step": runs_a[0]["step"],
          "sim_tau": {name_a: mean_ci([r["sim_tau"] for r in runs_a]),
                      name_b: mean_ci([r["sim_tau"] for r in runs_b])},
          "delta_sim_tau": mean_ci(delta),
          "tokens_per_s": {name_a: mean_ci([r["tokens_per_s"] for r in runs_a]),
                           name_b: mean_ci([r["tokens_per_s"] for r in runs_b])},
          "step_time_ratio": mean_ci(ratio),
          "runs": {name_a: [{k: v for k, v in r.items() if k != "settings"} for r in runs_a],
                   name_b: [{k: v for k, v in r.items() if k != "settings"} for r in runs_b]}}


def markdown(s: dict) -> str:
  a, b = s["a"], s["b"]
  lines = [f"| seed | {a}: sim τ | {b}: sim τ | Δ ({b} − {a}) | {a}: s/step | {b}: s/step |",
           "|---|---|---|---|---|---|"]
  for seed, ra, rb in zip(s["seeds"], s["runs"][a], s["runs"][b]):
    lines.append(f"| {seed} | {ra['sim_tau']:.3f} | {rb['sim_tau']:.3f} | {rb['sim_tau'] - ra['sim_tau']:+.3f} | "
                 f"{ra['seconds_per_step']:.2f} | {rb['seconds_per_step']:.2f} |")
  d, ta, tb = s["delta_sim_tau"], s["sim_tau"][a], s["sim_tau"][b]
  lines.append(f"| mean ± 95 % CI | {ta['mean']:.3f} ± {ta['ci95']:.3f} | {tb['mean']:.3f} ± {tb['ci95']:.3f} | "
               f"{d['mean']:+.3f} ± {d['ci95']:.3f} | | |")
  r = s["step_time_ratio"]
  lines += ["", f"After {s['step']} steps. Step time {a} / {b}: {r['mean']:.2f} ± {r['ci95']:.2f} (per seed: "
            + ", ".join(f"{v:.2f}" for v in r["values"]) + ")."]
  return "\n".join(lines) + "\n"


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  root = os.path.expanduser(_ROOT.value)
  seeds = [s.strip() for s in _SEEDS.value if s.strip()]
  if len(seeds) < 2:
    raise app.UsageError(f"--seeds needs at least two seeds for a confidence interval, got {seeds}.")
  runs = {}
  for variant in (_A.value, _B.value):
    runs[variant] = [read_run(os.path.join(root, _PATTERN.value.format(variant=variant, seed=seed)))
                     for seed in seeds]
  for ra, rb in zip(runs[_A.value], runs[_B.value]):
    pair(ra, rb, _FIELD.value)
  summary = summarize(runs[_A.value], runs[_B.value], seeds, _A.value, _B.value)
  text = markdown(summary)
  out = os.path.expanduser(_OUT.value) if _OUT.value else os.path.join(root, "summary")
  os.makedirs(out, exist_ok=True)
  atomic.write_json(os.path.join(out, "paired.json"), summary)
  atomic.write_text(os.path.join(out, "paired.md"), text)
  print(text)
  d, ta, tb = summary["delta_sim_tau"], summary["sim_tau"][_A.value], summary["sim_tau"][_B.value]
  print(f"held-out sim tau: {_A.value} {ta['mean']:.3f}, {_B.value} {tb['mean']:.3f}, paired delta "
        f"{d['mean']:+.3f} +- {d['ci95']:.3f} ({d['n']} seeds)")


if __name__ == "__main__":
  app.run(main)
