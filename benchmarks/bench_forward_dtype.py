"""Benchmark: the extraction forward of the target in float32 and bfloat16, side by side, with what bf16 changes.

  python benchmarks/bench_forward_dtype.py --shapes=8x256,8x512,16x256 --layers=2,15,27

For each [batch, width], times the jitted forward `features.extract` runs (`extraction.forward_step`: every layer,
the selected depths and the final states out, the greedy next token from chunked logits, no [B, T, V] array)
with the target loaded in float32 and in bfloat16 (weights and activations bf16, every dot bf16 x bf16 -> f32
as `layers.Linear` asks), alternating the two dtypes repeat by repeat on the same tokens (real MT-bench and
GSM8K prompts through the chat template, packed to the width); medians. Then, on those tokens, what bf16 would
change in a store: the relative error of each stored depth and of the final states against float32, and the
share of positions whose greedy next token (the draft's training target) differs.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags

from layerwave.inference import load_target
from layerwave.speculative import evaluate
from layerwave.training.features import extraction

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Target model.")
_SHAPES = flags.DEFINE_list("shapes", ["8x256", "8x512", "16x256"], "[batch]x[width] of the forwards timed.")
_LAYERS = flags.DEFINE_list("layers", ["2", "15", "27"], "Depths the store keeps.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed forwards per dtype and shape (after one untimed).")


def _tokens(tokenizer, batch: int, width: int) -> np.ndarray:
  """[batch, width] of real chat tokens: MT-bench and GSM8K prompts rendered by the chat template, packed."""
  stream = []
  for name in ("mtbench", "gsm8k"):
    for _, ids in evaluate.chat_prompts(tokenizer, name, 20, 512):
      stream.extend(int(i) for i in ids)
  need = batch * width
  stream = (stream * (need // max(len(stream), 1) + 1))[:need]
  return np.asarray(stream, np.int32).reshape(batch, width)


def main(argv):
  del argv
  layers = tuple(int(x) for x in _LAYERS.value)
  targets = {d: load_target(_MODEL.value, dtype=d) for d in ("float32", "bfloat16")}
  fns = {d: extraction.forward_step(t.mesh, t.graphdef, layers, jnp.float32)
         for d, t in targets.items()}
  for shape in _SHAPES.value:
    batch, width = map(int, shape.split("x"))
    tokens = jnp.asarray(_tokens(targets["float32"].tokenizer, batch, width))
    mask = jnp.ones_like(tokens)
    outs, times = {}, {d: [] for d in targets}
    for d, t in targets.items():
      outs[d] = jax.block_until_ready(fns[d](t.params, tokens, mask))  # compiles
    for _ in range(_REPEATS.value):
      for d, t in targets.items():
        tic = time.perf_counter()
        jax.block_until_ready(fns[d](t.params, tokens, mask))
        times[d].append(time.perf_counter() - tic)
    med = {d: float(np.median(v)) for d, v in times.items()}
    rate = {d: batch * width / med[d] for d in med}
    (h32, f32, a32), (h16, f16, a16) = (jax.device_get(outs[d]) for d in ("float32", "bfloat16"))
    rel = [float(np.linalg.norm(h16[i] - h32[i]) / np.linalg.norm(h32[i])) for i in range(len(layers))]
    rel_final = float(np.linalg.norm(f16 - f32) / np.linalg.norm(f32))
    differ = float(np.mean(a16 != a32))
    print(f"[{batch}, {width}]: float32 {med['float32'] * 1e3:.0f} ms ({rate['float32']:.0f} tokens/s), bfloat16 "
          f"{med['bfloat16'] * 1e3:.0f} ms ({rate['bfloat16']:.0f} tokens/s), bf16 / f32 speed "
          f"{med['float32'] / med['bfloat16']:.2f}x; relative error of depths {list(layers)}: "
          + ", ".join(f"{r:.4f}" for r in rel) + f", final {rel_final:.4f}; greedy next token differs at "
          f"{100 * differ:.2f}% of positions", flush=True)


if __name__ == "__main__":
  app.run(main)
