"""Learning curves of draft training: held-out acceptance and simulated τ against training tokens and CPU time.

Place in the pipeline: after `training.loop.run`, which logs `eval/*` scalars to `W/metrics.jsonl` every
`train.eval_every` steps, with the cumulative real tokens trained on (`train/tokens`) and seconds spent in the
training loop (`train/seconds`, evaluation and checkpointing excluded; both carried across resumptions). A
recipe is judged by draft quality per CPU-hour, so both axes are kept.

`read_curve(W)` turns a workdir's log into `Point`s; `sweep` trains one draft per cell (a named set of config
overrides over one base config), resumable and skipping finished cells; `table` prints every cell's curve
side by side and `layerwave.plots.plot_learning_curves` draws them (experiments/sweep_recipe.py).

Legend (`layerwave.axes`): K draft depth.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Mapping, Sequence

__all__ = ["Point", "apply_overrides", "read_curve", "sweep", "table"]


@dataclasses.dataclass(frozen=True)
class Point:
  """One held-out evaluation of a run.

  Attributes:
    step: optimiser steps so far.
    tokens: real (non-padding) tokens trained on so far.
    seconds: seconds spent in training steps so far.
    sim_tau: simulated τ of the evaluation's per-depth agreement (1 + Σ_j Π_{i≤j} acc_i).
    acc: held-out acc_j for j < K (out-of-vocabulary targets count as misses).
    loss: held-out TTT loss.
  """

  step: int
  tokens: float
  seconds: float
  sim_tau: float
  acc: tuple[float, ...]
  loss: float


def read_curve(workdir: str) -> list[Point]:
  """The held-out evaluations logged in `workdir/metrics.jsonl`, by step (a resumed step's last row wins)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  train, evals = {}, {}
  with open(path) as f:
    for line in f:
      row = json.loads(line)
      if "train/tokens" in row:
        train[row["step"]] = row
      if "eval/sim_tau" in row:
        evals[row["step"]] = row
  points = []
  for step, row in sorted(evals.items()):
    t = train.get(step, {})
    acc = []
    while f"eval/draft/acc_{len(acc)}" in row:
      acc.append(row[f"eval/draft/acc_{len(acc)}"])
    points.append(Point(step=step, tokens=float(t.get("train/tokens", float("nan"))),
                        seconds=float(t.get("train/seconds", float("nan"))), sim_tau=float(row["eval/sim_tau"]),
                        acc=tuple(acc), loss=float(row.get("eval/loss", float("nan")))))
  return points


def apply_overrides(config, overrides: Mapping[str, Any]):
  """A copy of `config` with dotted-key overrides (`{"train.lr": 1e-3}`); an unknown key is refused."""
  config = config.copy_and_resolve_references()
  with config.unlocked():
    for key, value in overrides.items():
      *parents, name = key.split(".")
      section = config
      for p in parents:
        if p not in section:
          raise KeyError(f"Override {key!r}: the config has no section {p!r}.")
        section = section[p]
      if name not in section:
        raise KeyError(f"Override {key!r}: the config has no field {name!r} in {'.'.join(parents) or 'top'}.")
      section[name] = value
  return config


def sweep(config, cells: Mapping[str, Mapping[str, Any]], workdir: str,
          train: Callable[[Any, str], dict]) -> dict[str, list[Point]]:
  """Trains every cell (the base `config` with its overrides) into `workdir/<cell>`; returns the curves.

  A cell whose run reached `train.num_steps` is skipped; an interrupted one resumes (`train` is
  `training.loop.run`, which refuses a workdir holding a different config).
  """
  curves = {}
  for name, overrides in cells.items():
    cell_config = apply_overrides(config, overrides)
    cell_dir = os.path.join(workdir, name)
    points = read_curve(cell_dir)
    if not points or points[-1].step < int(cell_config.train.num_steps):
      train(cell_config, cell_dir)
      points = read_curve(cell_dir)
    curves[name] = points
  return curves


def table(curves: Mapping[str, Sequence[Point]], cells: Mapping[str, Mapping[str, Any]] | None = None) -> str:
  """Markdown: per cell, its overrides, sim τ at each evaluation (tokens in thousands), the final acc_j."""
  lines = ["| cell | overrides | sim τ at k tokens (k = thousands) | final acc_j | tokens/s |", "|---|---|---|---|---|"]
  for name, points in curves.items():
    if not points:
      lines.append(f"| {name} | | (not run) | | |")
      continue
    over = ", ".join(f"{k}={v}" for k, v in (cells or {}).get(name, {}).items()) or "(base)"
    curve = " ".join(f"{p.sim_tau:.3f}@{p.tokens / 1e3:.0f}k" for p in points)
    last = points[-1]
    rate = last.tokens / last.seconds if last.seconds and last.seconds == last.seconds else float("nan")
    lines.append(f"| {name} | {over} | {curve} | {' '.join(f'{a:.3f}' for a in last.acc)} | {rate:.0f} |")
  return "\n".join(lines)
