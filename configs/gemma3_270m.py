"""Gemma-3-270M (base, Q4_K_M GGUF dequantized to float32; Gemma Terms of Use): analysis and self-distillation.

  python experiments/analyze.py --config=configs/gemma3_270m.py --workdir=W   # README's Gemma wave
  python experiments/analyze.py --config=configs/gemma3_270m.py:smoke --workdir=W
  python experiments/distill.py --config=configs/gemma3_270m.py --workdir=D --config.distill.num_prompts=512
  make paper-gemma   # :paper, the paper's experiment in small on Gemma's own answers

The wave beside SmolLM2's: the data and analysis sections are read from `configs/smollm2_135m.py:demo`
(`:smoke` for `:smoke`), so the two waves share one budget (the first 4,000 ShareGPT conversations, 256 tokens
each, the same split seed and batch seed, ~16k assistant tokens) and cannot drift apart.
Gemma-3-270M is a base model and its GGUF has no chat template, so conversations are rendered as plain text
(`data.chat_format = "plain"`, layerwave.data.chat): "User: ...\n\nAssistant: ..." paragraphs after Gemma's
BOS, the assistant mask on the replies' content tokens. L = 18 (HF hidden-state convention), so EAGLE-3's
rule gives [2, 9, 15]. experiments/distill.py renders its prompts the same way (plain, ending with an open
"Assistant:") and cuts each answer where the base model starts the next "\n\nUser:" turn; its `distill`
section is SmolLM2's.

Only the sections analysis and distillation read are here, except in `:paper`, which is SmolLM2's `:paper`
with Gemma's model and plain format.
"""

import os

import ml_collections

from layerwave import options


def _smollm2_config(variant: str) -> ml_collections.ConfigDict:
  """`configs/smollm2_135m.py:<variant>` (this file's sibling; launchers load configs by path, not package)."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_135m.py")
  return options.config_module(path).get_config(variant)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg not in (None, "", "smoke", "paper"):
    raise ValueError(f"Unknown config variant {arg!r}; use ':smoke', ':paper' or nothing.")
  if arg == "paper":
    # The paper's experiment, small, on a second family (`make paper-gemma`): every section of SmolLM2's
    # `:paper` (one recipe, one budget), on Gemma's own plain-format distilled answers; eagle3's [2, 9, 15]
    # against the exhaustive selection and one random set, 3 seeds.
    c = _smollm2_config("paper")
    c.model = "gemma3-270m"
    c.data.chat_format = "plain"
    c.data.max_records = 1500
    c.compare.sets = ("eagle3", "exhaustive")
    c.compare.lams = ()
    c.compare.num_random = 1
    c.compare.manual = ""
    c.compare.ks = ()
    c.compare.finalists = 1
    c.compare.budgets = ()  # no dynamics in the small version
    c.compare.budget_sets = ()
    return c
  # The data, distill and analysis sections of SmolLM2's `:demo` (or `:smoke`), so the two waves share one budget.
  base = _smollm2_config(arg or "demo")
  c = options.Config()
  c.model = "gemma3-270m"
  for key in ("dtype", "mesh", "distributed", "seed", "data", "distill", "analysis"):
    c[key] = base[key]
  c.data.chat_format = "plain"  # a base model: no chat template
  return c
