"""A CPU training recipe by measurement: learning curves of drafts trained from feature stores, side by side.

  python experiments/sweep_recipe.py --config=configs/smollm2_135m.py:recipe --workdir=W \\
      --config.train.features=STORE [--sharegpt_features=STORE2] [--cells=base,k3,k7]

Every cell is the base config with a few overrides (CELLS), trained by `layerwave.training.loop.run` into
W/<cell>: resumable, and skipped once it reached `train.num_steps`, so an interrupted sweep is re-run with the
same command. Every cell gets the same number of steps (the same training tokens); held-out acc_j and
simulated τ are logged every `train.eval_every` steps together with the tokens and seconds spent, so the
curves compare recipes per token and per CPU-minute. Writes W/curves.json and W/curves.png and prints a
markdown table (paste into BENCHMARKS.md). `--report_only` tabulates what is finished without training.
"""

from __future__ import annotations

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import dataclasses
import os

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from layerwave import atomic
from layerwave import plots
from layerwave.training import curves
from layerwave.training import features
from layerwave.training import loop

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (one subfolder per cell).")
_CELLS = flags.DEFINE_list("cells", None, "Cells to run, in order (default: all of CELLS).")
_SHAREGPT = flags.DEFINE_string("sharegpt_features", "", "A store extracted from ShareGPT's own answers "
                                "(same depths): enables the 'sharegpt' cell (data: ShareGPT vs self-distilled), "
                                "evaluated on the base store's held-out split.")
_SHAREGPT_LIKE = flags.DEFINE_string("sharegpt_like", "base", "The cell the 'sharegpt' cell copies, with "
                                     "ShareGPT's store (and its data settings) in place of the base store.")
_REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Only tabulate finished cells.")
flags.mark_flags_as_required(["config", "workdir"])

# What the sweep varies, one thing per cell, against the base config (`:recipe` and the command line's
# overrides: a cell that restates the base's own setting, e.g. `k3` over a K = 3 base, repeats `base`).
CELLS = {
    "base": {},
    "k3": {"train.ttt_steps": 3},
    "k5": {"train.ttt_steps": 5},
    "k7": {"train.ttt_steps": 7},
    "vd4k": {"draft_model.vocab_size": 4096},
    "vd8k": {"draft_model.vocab_size": 8192},
    "vd16k": {"draft_model.vocab_size": 16384},
    "head_frozen": {"train.freeze_head": True},
    "lr3e-4": {"train.lr": 3e-4},
    "lr3e-3": {"train.lr": 3e-3},
    "fc_norm": {"draft_model.fc_norm": True},
    "const_lr": {"train.end_lr_fraction": 1.0},
}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.INFO)
  cells = dict(CELLS)
  if _SHAREGPT.value:
    if _SHAREGPT_LIKE.value not in cells:
      raise app.UsageError(f"--sharegpt_like={_SHAREGPT_LIKE.value!r} is not a cell; choose from {sorted(cells)}.")
    header = features.open_store(_SHAREGPT.value).header
    base_store = _CONFIG.value.train.features
    cells["sharegpt"] = {**cells[_SHAREGPT_LIKE.value], "train.features": _SHAREGPT.value,
                         "train.eval_features": _CONFIG.value.train.eval_features or base_store,
                         **{f"data.{k}": v for k, v in header.get("data", {}).items() if k != "max_length"}}
  names = _CELLS.value or list(cells)
  unknown = [n for n in names if n not in cells]
  if unknown:
    raise app.UsageError(f"--cells: unknown {unknown}; choose from {sorted(cells)} (sharegpt needs "
                         "--sharegpt_features).")
  cells = {n: cells[n] for n in names}
  workdir = _WORKDIR.value
  if _REPORT_ONLY.value:
    result = {n: curves.read_curve(os.path.join(workdir, n)) for n in cells}
  else:
    def train(config, cell_dir):  # each cell's compiled code freed after it (loop.free_compiled)
      out = loop.run(config, cell_dir)
      loop.free_compiled()
      return out

    result = curves.sweep(_CONFIG.value, cells, workdir, train)
  as_dicts = {n: [dataclasses.asdict(p) for p in points] for n, points in result.items()}
  atomic.write_json(os.path.join(workdir, "curves.json"), {"cells": cells, "curves": as_dicts})
  plots.plot_learning_curves(os.path.join(workdir, "curves.png"), as_dicts,
                             title=f"draft learning curves ({_CONFIG.value.train.features or 'online'})")
  print(curves.table(result, cells))


if __name__ == "__main__":
  app.run(main)
