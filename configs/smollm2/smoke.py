"""Every stage in seconds to a minute on a laptop CPU: the tests' config.

  python experiments/analyze.py --config=configs/smollm2/smoke.py --workdir=W
  python experiments/compare_layers.py --config=configs/smollm2/smoke.py --workdir=W   # tiny sets, 2 prompts

(`configs/smollm2_135m.py:smoke` is the same config.) Training and extraction stay in float32: the tests'
equalities (offline == online, 8 devices == 1) are float32's.
"""

import os

from layerwave import options

base = options.config_module(os.path.join(os.path.dirname(os.path.abspath(__file__)), "base.py"))


def get_config(arg: str | None = None) -> options.Config:
  del arg
  c = base.get_config()
  c.data.max_length = 128
  c.data.max_records = 200
  c.distill.num_prompts = 8
  c.distill.max_new_tokens = 32
  c.distill.max_prompt_tokens = 128
  c.distill.batch_size = 4
  c.distill.slots = 4
  c.distill.chunk_size = 4
  c.analysis.batch_size = 4
  c.analysis.num_batches = 4
  c.analysis.max_tokens = 0
  c.analysis.calibration_batches = 1
  c.analysis.hsic_batch_size = 64
  c.analysis.exact_cka_tokens = 256
  c.analysis.log_every = 2
  c.train.batch_size = 2
  c.train.num_steps = 6
  c.train.warmup_steps = 2
  c.train.ttt_steps = 3
  c.train.compute_dtype = "float32"
  c.features.compute_dtype = ""  # the smoke stores are the float32 target's own features
  c.train.log_every = 2
  c.train.eval_every = 3
  c.train.eval_batches = 1
  c.train.checkpoint_every = 3
  c.speculate.num_prompts = 2
  c.speculate.batch_size = 2
  c.speculate.max_new_tokens = 32
  c.speculate.num_draft_tokens = 3
  base.selected_vs_baseline(c)
  c.compare.num_prompts = 2
  c.compare.max_new_tokens = 16
  return c
