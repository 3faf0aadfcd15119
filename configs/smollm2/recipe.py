"""The recipe sweep's base cell and the campaign's draft (`make baseline`, `make campaign`, BENCHMARKS.md).

  python experiments/distill.py --config=configs/smollm2/recipe.py --workdir=D
  python experiments/train_draft.py --config=configs/smollm2/recipe.py --workdir=W \
      --config.data.source=distilled:D --config.train.features=S --config.layers=2,15,27

(`configs/smollm2_135m.py:recipe` is the same config.) Offline from a feature store of self-distilled answers
(S, extracted from that data with these data settings): prompts <= 192 tokens and answers <= 320.
"""

import os

from layerwave import options

base = options.config_module(os.path.join(os.path.dirname(os.path.abspath(__file__)), "base.py"))


def get_config(arg: str | None = None) -> options.Config:
  del arg
  c = base.get_config()
  c.draft_model.vocab_size = 8192
  c.train.num_steps = 300
  c.train.lr = 1e-3
  c.train.warmup_steps = 20
  c.train.ttt_steps = 5
  c.train.eval_ttt_steps = 5  # every cell evaluated 5 deep, whatever K it trains with
  c.train.log_every = 10
  c.train.eval_every = 50
  c.train.checkpoint_every = 50
  c.distill.max_new_tokens = 320
  c.distill.max_prompt_tokens = 192
  c.features.depths = "2,15,27"
  return c
