"""Gemma-3-270M (base, Q4_K_M GGUF dequantized to float32; Gemma Terms of Use): the analysis stage.

  python experiments/analyze.py --config=configs/gemma3_270m.py --workdir=W   # README's Gemma wave
  python experiments/analyze.py --config=configs/gemma3_270m.py:smoke --workdir=W

The wave beside SmolLM2's: the data and budget of `configs/smollm2_135m.py:demo`'s analysis (the first
4,000 ShareGPT conversations, 256 tokens each, the same split seed and batch seed, ~16k assistant tokens).
Gemma-3-270M is a base model and its GGUF has no chat template, so conversations are rendered as plain text
(`data.chat_format = "plain"`, layerwave.data.chat): "User: ...\n\nAssistant: ..." paragraphs after Gemma's
BOS, the assistant mask on the replies' content tokens. L = 18 (HF hidden-state convention), so EAGLE-3's
rule gives [2, 9, 15].

Only the sections the analysis reads are here; what drafts on Gemma would take is in the README (the Gemma
wave).
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = "gemma3-270m"
  c.dtype = "float32"
  c.mesh = (("data", -1),)
  c.distributed = False
  c.seed = 0

  c.data = ml_collections.ConfigDict()
  c.data.source = "sharegpt"
  c.data.max_length = 256
  c.data.max_records = 4000
  c.data.heldout_fraction = 0.05
  c.data.split_seed = 0
  c.data.chat_format = "plain"  # a base model: no chat template

  # shared/METHOD.md §2-§6, the settings of configs/smollm2_135m.py's analysis on a ~16k-token budget.
  c.analysis = ml_collections.ConfigDict()
  c.analysis.split = "train"
  c.analysis.batch_size = 8
  c.analysis.num_batches = 0
  c.analysis.max_tokens = 16_000  # eligible (assistant) tokens read
  c.analysis.seed = 0
  c.analysis.log_every = 5
  c.analysis.temperature = 1.0
  c.analysis.filter = "percentile"
  c.analysis.percentile = 50.0
  c.analysis.threshold = 0.0
  c.analysis.calibration_batches = 2
  c.analysis.assistant_only = True
  c.analysis.unfiltered = "matched"
  c.analysis.alpha = 1.0
  c.analysis.normalize = "skean"
  c.analysis.granularity = "prompt"
  c.analysis.normalized_entropy = False
  c.analysis.cka = "minibatch"
  c.analysis.hsic_batch_size = 256
  c.analysis.exact_cka_tokens = 2048
  c.analysis.include_embeddings = False
  c.analysis.include_final = False
  c.analysis.k = 3
  c.analysis.lam = 1.0
  c.analysis.min_gap = 0
  c.analysis.strategies = ("eagle3", "entropy", "greedy", "exhaustive", "compartment", "random")
  c.analysis.num_blocks = 0
  c.analysis.stability = True

  if arg == "smoke":
    c.data.max_length = 128
    c.data.max_records = 200
    c.analysis.batch_size = 4
    c.analysis.num_batches = 4
    c.analysis.max_tokens = 0
    c.analysis.calibration_batches = 1
    c.analysis.hsic_batch_size = 64
    c.analysis.exact_cka_tokens = 256
    c.analysis.log_every = 2
  elif arg:
    raise ValueError(f"Unknown config variant {arg!r}; use ':smoke' or nothing.")
  return c
