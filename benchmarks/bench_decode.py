"""Prefill and decode throughput of layerwave's AR decoding vs transformers' PyTorch `generate`.

Same weights (the embedded SmolLM2-135M-Instruct, converted float32), same prompts, same process, greedy,
fixed lengths (EOS ignored). Prints medians over --repeats runs and the layerwave/PyTorch ratios.

  python benchmarks/bench_decode.py [--batch_sizes=1,8] [--prompt_len=128] [--new_tokens=128]
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import platform
import statistics
import time

from absl import app
from absl import flags
import numpy as np

import layerwave

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Target spec.")
_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes.")
_PROMPT = flags.DEFINE_integer("prompt_len", 128, "Prompt tokens per row.")
_NEW = flags.DEFINE_integer("new_tokens", 128, "New tokens per row.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repeats (median reported).")
_TORCH = flags.DEFINE_bool("torch", True, "Also time transformers' PyTorch generate.")


def _median_time(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv):
  del argv
  target = layerwave.load_target(_MODEL.value)
  rng = np.random.default_rng(0)
  hf = None
  if _TORCH.value:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    hf = transformers.AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32)
    hf.eval()
    print(f"torch {torch.__version__} threads={torch.get_num_threads()}")
  print(f"machine: {platform.processor() or platform.machine()}, devices: {target.mesh.devices.size}")
  rows = []
  for b in (int(x) for x in _BATCHES.value):
    prompts = rng.integers(100, 40000, size=(b, _PROMPT.value)).tolist()
    run = lambda n: layerwave.generate(target, prompts, n, ignore_eos=True)  # noqa: E731
    run(1), run(_NEW.value)  # compile both shapes
    t_prefill = _median_time(lambda: run(1), _REPEATS.value)
    t_full = _median_time(lambda: run(_NEW.value), _REPEATS.value)
    ours_prefill = b * _PROMPT.value / t_prefill
    ours_decode = b * (_NEW.value - 1) / (t_full - t_prefill)
    row = dict(batch=b, lw_prefill=ours_prefill, lw_decode=ours_decode, lw_e2e=b * _NEW.value / t_full)
    if hf is not None:
      ids = torch.tensor(prompts)

      def hf_run(n):
        with torch.no_grad():
          hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, pad_token_id=0)
      hf_run(2)
      h_prefill = _median_time(lambda: hf_run(1), _REPEATS.value)
      h_full = _median_time(lambda: hf_run(_NEW.value), _REPEATS.value)
      row.update(pt_prefill=b * _PROMPT.value / h_prefill,
                 pt_decode=b * (_NEW.value - 1) / (h_full - h_prefill),
                 pt_e2e=b * _NEW.value / h_full)
    rows.append(row)
  print(f"\nprompt {_PROMPT.value} tokens, {_NEW.value} new tokens, float32, greedy, "
        f"median of {_REPEATS.value}; tokens/s")
  print("| batch | layerwave prefill | layerwave decode | PyTorch prefill | PyTorch decode | "
        "decode ratio | end-to-end ratio |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    if "pt_decode" in r:
      print(f"| {r['batch']} | {r['lw_prefill']:.0f} | {r['lw_decode']:.1f} | {r['pt_prefill']:.0f} | "
            f"{r['pt_decode']:.1f} | {r['lw_decode'] / r['pt_decode']:.2f}x | "
            f"{r['lw_e2e'] / r['pt_e2e']:.2f}x |")
    else:
      print(f"| {r['batch']} | {r['lw_prefill']:.0f} | {r['lw_decode']:.1f} | - | - | - | - |")


if __name__ == "__main__":
  app.run(main)
