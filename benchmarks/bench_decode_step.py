"""Benchmark: one continuous-batching decode step of the target, per slot count and compute dtype.

  python benchmarks/bench_decode_step.py --slots=16,32,64 --dtypes=float32,bfloat16

Fills every row of a `layerwave.continuous.Engine` with a random 150-token prompt, then times jitted
`--steps`-step decode chunks (attention over `--read_slots` cache slots, EOS ignored; the median of
`--repeats` chunks after one untimed). Prints ms per step and row-tokens/s (slots / step time): the ceiling
continuous batching reaches when every row is busy, which is what sets distillation's `distill.slots`.
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

from layerwave import continuous
from layerwave.inference import load_target

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Target model.")
_SLOTS = flags.DEFINE_list("slots", ["16", "32", "64"], "Slot counts.")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Target compute dtypes.")
_STEPS = flags.DEFINE_integer("steps", 16, "Decode steps per jitted chunk.")
_READ = flags.DEFINE_integer("read_slots", 256, "Cache slots attention reads.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed chunks (median).")
_DOTS = flags.DEFINE_bool("dots", True, "Also time the decode step's float32 dot shapes alone (GFLOP/s).")


def _time_dots(rows: int) -> None:
  """The dots of one decode step at `rows` rows, jitted one at a time: XLA:CPU's throughput at those shapes."""
  for m, k, n in ((rows, 576, 49152), (rows, 576, 1536), (rows, 1536, 576), (512, 576, 1536)):
    a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    times = []
    for _ in range(20):
      tic = time.perf_counter()
      f(a, b).block_until_ready()
      times.append(time.perf_counter() - tic)
    t = float(np.median(times))
    print(f"dot [{m}, {k}] x [{k}, {n}]: {t * 1e3:.2f} ms, {2 * m * k * n / t / 1e9:.1f} GFLOP/s", flush=True)


def main(argv):
  del argv
  for dtype in _DTYPES.value:
    target = load_target(_MODEL.value, dtype=dtype)
    for slots in map(int, _SLOTS.value):
      engine = continuous.Engine(target, slots, 320, 192, chunk_steps=_STEPS.value, ignore_eos=True)
      rng = np.random.default_rng(0)
      for _ in range(slots):
        engine.submit(continuous.Request(ids=rng.integers(100, 40000, 150).tolist()))
      engine.refill()
      kw = dict(sampling=engine.sampling, eos_ids=engine.eos_ids, steps=_STEPS.value, read_slots=_READ.value)
      state = continuous.decode_steps(target.graphdef, target.params, engine.state, engine.base_key, **kw)
      jax.block_until_ready(state)
      times = []
      for _ in range(_REPEATS.value):
        tic = time.perf_counter()
        state = continuous.decode_steps(target.graphdef, target.params, state, engine.base_key, **kw)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - tic)
      ms = 1000 * float(np.median(times)) / _STEPS.value
      print(f"{dtype} slots {slots}: {ms:.1f} ms/step, {slots / ms * 1000:.0f} row-tokens/s", flush=True)
  if _DOTS.value:
    _time_dots(max(map(int, _SLOTS.value)))


if __name__ == "__main__":
  app.run(main)
