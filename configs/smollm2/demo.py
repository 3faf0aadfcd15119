"""The README's main job: analysis on ~16k tokens, then one short draft on the selected (exhaustive) layers and
one on EAGLE-3's, compared on 8 MT-bench prompts with the speedup against plain decoding (`make demo`).

  python experiments/compare_layers.py --config=configs/smollm2/demo.py --workdir=out/demo

(`configs/smollm2_135m.py:demo` is the same config; its time on 2 CPU cores: README.) The short drafts of
compare.py, trained for 80 steps.
"""

import os

from layerwave import options

here = os.path.dirname(os.path.abspath(__file__))
base = options.config_module(os.path.join(here, "base.py"))
compare = options.config_module(os.path.join(here, "compare.py"))


def get_config(arg: str | None = None) -> options.Config:
  del arg
  c = compare.get_config()
  c.analysis.max_tokens = 16_000
  c.analysis.calibration_batches = 2
  c.analysis.log_every = 5
  c.train.num_steps = 80
  # The cells train online: the target's forward in bfloat16 (held-out evaluation in float32) makes a step
  # 1.26x faster (`bench_train_dtype.py --online`, BENCHMARKS.md "Throughput").
  c.train.target_dtype = "bfloat16"
  base.selected_vs_baseline(c)
  # First line of the table: the draft released in this repository, on the same prompts and timing.
  c.compare.release = "smollm2-135m-instruct-eagle3"
  return c
