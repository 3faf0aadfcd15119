"""Short drafts for layer-set comparisons on a CPU.

  python experiments/compare_layers.py --config=configs/smollm2/compare.py --workdir=W \
      --config.compare.analysis=ANALYSIS_W

(`configs/smollm2_135m.py:compare` is the same config.) Every cell trains num_steps x 8 x 256 tokens with
V_d 2,048 and K = 3 TTT steps, and drafts K = 3 tokens per verification; the comparison itself is the full
sweep of base.py.
"""

import os

from layerwave import options

base = options.config_module(os.path.join(os.path.dirname(os.path.abspath(__file__)), "base.py"))


def get_config(arg: str | None = None) -> options.Config:
  del arg
  c = base.get_config()
  c.data.max_length = 256
  c.data.max_records = 4000
  c.draft_model.vocab_size = 2048
  c.train.num_steps = 30
  c.train.lr = 1e-3
  c.train.warmup_steps = 5
  c.train.ttt_steps = 3
  c.train.vocab_examples = 2000
  c.train.log_every = 5
  c.train.eval_every = 1000
  c.train.eval_batches = 4
  c.train.checkpoint_every = 1000
  c.speculate.num_draft_tokens = 3
  return c
