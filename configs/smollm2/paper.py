"""The paper's experiment at a CPU budget (`make paper`, RESULTS.md): which layers an EAGLE-3 draft should read.

  python experiments/compare_layers.py --config=configs/smollm2/paper.py --workdir=W \
      --config.data.source=distilled:D --config.train.features=S --config.train.eval_features=H \
      --config.compare.analysis=A

(`configs/smollm2_135m.py:paper` is the same config.) Offline cells on one store of every depth of the first
2,000 distilled conversations (S; H is the held-out split in float32, as at inference). Every cell trains the
campaign draft's recipe for train.num_steps and is scored by held-out sim τ 5 deep; the finalists decode. 40
steps is the most for which the sweep (18 distinct sets x 3 seeds, plus the dynamics' 6 sets x 3 seeds at 1/4x
and 4x) fits in 6 CPU-hours (RESULTS.md gives the rates); a 1x cell sees ~0.37 epochs of the training split.
"""

import os

from layerwave import options

base = options.config_module(os.path.join(os.path.dirname(os.path.abspath(__file__)), "base.py"))


def get_config(arg: str | None = None) -> options.Config:
  del arg
  c = base.get_config()
  c.data.max_records = 2000
  c.data.heldout_fraction = 0.1  # ~200 conversations (a superset of the 5% split) for a tighter metric
  c.analysis.bucket_widths = (64, 128, 256)  # the answers fill 43% of 512-token slots; 71% in these buckets
  c.draft_model.vocab_size = 4096
  c.train.num_steps = 40
  c.train.lr = 3e-3
  c.train.warmup_steps = 5
  c.train.ttt_steps = 3
  c.train.eval_ttt_steps = 5
  c.train.bucket_widths = (64, 128, 192, 256, 320, 384, 448)  # the campaign's (Makefile CAMPAIGN_WIDTHS)
  c.train.log_every = 8
  c.train.eval_every = 1000
  c.train.eval_batches = 1000  # every held-out conversation (one pass), the same for every cell
  c.train.checkpoint_every = 1000
  c.distill.max_new_tokens = 320
  c.distill.max_prompt_tokens = 192
  c.features.depths = "all"
  # eagle3's one-shallower twin (a tool confusing the index conventions) and a late contiguous foil.
  c.compare.manual = "1,14,26;25,26,27"
  c.compare.ks = (1, 5, 9)
  # Cells are scored by held-out sim τ alone (τ on a few prompts a dataset is noise beside it, and costs a
  # decoding run a cell); the 3 finalists decode 80 prompts a dataset at both temperatures.
  c.compare.num_prompts = 0
  c.compare.temperatures = (0.0,)
  c.compare.finalists = 3
  c.compare.finalist_temperatures = (0.0, 1.0)
  c.compare.finalist_max_prompt_tokens = 512  # all 80 of each dataset (MT-bench's longest first turn: 402)
  c.compare.probe_tokens = 20000
  c.compare.budgets = (0.25, 4.0)
  c.compare.budget_sets = ("auto", "exhaustive")  # and the paper's own choice, wherever it ranks at 1x
  c.compare.sort_by = "sim_tau"  # the primary metric
  return c
