"""Chat generation with the target alone (the AR baseline).

  python experiments/generate.py --config=configs/generate.py
  python experiments/generate.py --config=configs/generate.py:smoke --config.prompt="Hi!"
"""

import ml_collections

from layerwave import options


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = options.Config()
  c.model = "smollm2-135m-instruct"
  c.dtype = "float32"
  c.mesh = (("data", -1),)
  c.distributed = False  # jax.distributed.initialize() for multi-host runs
  c.prompt = ""  # one question; empty = the built-in questions below
  c.questions = (
      "What is the capital of France?",
      "Write a haiku about the sea.",
      "Explain in two sentences why the sky is blue.",
      "What is 12 times 7?",
  )
  c.max_new_tokens = 96
  c.temperature = 0.0
  c.top_k = 0
  c.top_p = 1.0
  c.seed = 0
  c.lock()  # a variant sets only keys the config holds: a misspelt one is refused, naming the nearest
  if arg == "smoke":
    c.questions = c.questions[:2]
    c.max_new_tokens = 16
  elif arg:
    raise ValueError(f"Unknown config variant {arg!r}; use ':smoke' or nothing.")
  return c
