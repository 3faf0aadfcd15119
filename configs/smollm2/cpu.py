"""The draft this repository reports (BENCHMARKS.md, "Draft training"): a training budget for a 2-core CPU.

  python experiments/train_draft.py --config=configs/smollm2/cpu.py --workdir=W --config.layers=2,15,27

(`configs/smollm2_135m.py:cpu` is the same config.) V_d is cut to 8,192: the draft's LM head dominates a step's
cost on a CPU.
"""

import os

from layerwave import options

base = options.config_module(os.path.join(os.path.dirname(os.path.abspath(__file__)), "base.py"))


def get_config(arg: str | None = None) -> options.Config:
  del arg
  c = base.get_config()
  c.data.max_length = 384
  c.draft_model.vocab_size = 8192
  c.train.num_steps = 200
  c.train.lr = 1e-3
  c.train.warmup_steps = 20
  c.train.log_every = 5
  c.train.eval_every = 50
  c.train.eval_batches = 4
  c.train.checkpoint_every = 25
  return c
