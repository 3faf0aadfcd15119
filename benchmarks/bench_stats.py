"""Throughput of the layer statistics (all 31 depths of SmolLM2-135M, D = 576) against the forward and numpy.

  python benchmarks/bench_stats.py                       # one real ShareGPT batch of 8 x 512, α = 1
  python benchmarks/bench_stats.py --batch_size=4 --seq_len=256 --repeats=2

In one process, on the same batch (assistant tokens, 50 % kept by the token-entropy filter):
  (a) statistics alone on device: token entropy + filter + both accumulators (filtered and the matched
      no-filter control), fed hidden states and logits computed once; also the filtered side alone;
  (b) the full analysis step: target forward + (a), one jit (what experiments/analyze.py runs per batch);
  (c) the bare forward (logits only);
  (d) a straightforward numpy float64 version of the filtered statistics: per sequence and layer, Skean
      normalisation + `eigvalsh` of the smaller Gram for prompt entropy; per layer pair, exact linear CKA.
Then peak host memory (ru_maxrss) of the streaming accumulators over 1x and 10x the batches, each in a fresh
subprocess. Prints a markdown table; tokens/s counts real (attention-mask) tokens of the batch.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import functools
import os
import resource
import subprocess
import sys
import time

from absl import app
from absl import flags
import jax
import numpy as np

import layerwave

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Target.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Sequences per batch.")
_SEQ = flags.DEFINE_integer("seq_len", 512, "Tokens per sequence.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repeats (the minimum is reported).")
_MEMORY = flags.DEFINE_list("memory_batches", ["2", "20"], "Batch counts of the memory check ('' = skip).")
_MEMORY_CHILD = flags.DEFINE_integer("memory_child", 0, "Internal: run the memory check with N batches.")


def _time(fn, *args, repeats: int) -> tuple[float, float]:
  """(seconds of the first call incl. compilation, min seconds of `repeats` calls)."""
  t = time.perf_counter()
  jax.block_until_ready(fn(*args))
  first = time.perf_counter() - t
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t)
  return first, best


def numpy_statistics(hidden: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Straightforward float64 reference: prompt entropy [L1, B] (α = 1, Skean) and exact CKA [L1, L1]."""
  l1, b, _, d = hidden.shape
  entropy = np.zeros((l1, b))
  for layer in range(l1):
    for seq in range(b):
      z = hidden[layer, seq][keep[seq]].astype(np.float64)
      if z.shape[0] < 2:
        continue
      z = z - z.mean(0)
      z = z / np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-30)
      k = z @ z.T if z.shape[0] <= d else z.T @ z
      lam = np.clip(np.linalg.eigvalsh(k / np.trace(k)), 0, None)
      lam = lam[lam > 1e-12]
      entropy[layer, seq] = -np.sum(lam * np.log(lam))
  flat = keep.reshape(-1)
  x = [hidden[layer].reshape(-1, d)[flat].astype(np.float64) for layer in range(l1)]
  x = [v - v.mean(0) for v in x]
  cka = np.eye(l1)
  self_norm = [np.linalg.norm(v.T @ v) for v in x]
  for a in range(l1):
    for c in range(a + 1, l1):
      cka[a, c] = cka[c, a] = np.linalg.norm(x[c].T @ x[a]) ** 2 / (self_norm[a] * self_norm[c])
  return entropy, cka


def _memory_child(num_batches: int) -> None:
  """Streams `num_batches` random batches through the accumulators; prints peak RSS in MiB."""
  from layerwave.analysis import stats  # pylint: disable=g-import-not-at-top
  l1, b, t, d = 31, _BATCH.value, _SEQ.value, 576
  acc = stats.init(l1, d, buffer_size=2048)
  update = jax.jit(stats.update, donate_argnums=(0,))
  gen = jax.jit(lambda key: (jax.random.normal(key, (l1, b, t, d)), jax.random.uniform(key, (b, t)) < 0.35))
  for i in range(num_batches):
    hidden, keep = gen(jax.random.key(i))
    acc = update(acc, hidden, keep, jax.random.key(i))
  jax.block_until_ready(acc)
  print(f"MAXRSS_MIB {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} TOKENS {int(acc.num_tokens)}")


def main(argv):
  del argv
  if _MEMORY_CHILD.value:
    _memory_child(_MEMORY_CHILD.value)
    return
  from layerwave import data as data_lib  # pylint: disable=g-import-not-at-top
  from layerwave import inference  # pylint: disable=g-import-not-at-top
  from layerwave import sharding  # pylint: disable=g-import-not-at-top
  from layerwave.analysis import collect  # pylint: disable=g-import-not-at-top

  target = layerwave.load_target(_MODEL.value)
  cfg = target.config
  ds = data_lib.build_chat_dataset(target.tokenizer, "sharegpt", max_length=_SEQ.value)
  batch = next(iter(data_lib.BatchIterator(ds.source("train"), batch_size=_BATCH.value, seq_len=_SEQ.value,
                                           pad_id=target.tokenizer.pad_token_id, seed=0)))
  mesh = target.mesh
  tokens, attention, assistant = jax.device_put(
      [np.asarray(a, np.int32) for a in (batch.input_ids, batch.attention_mask, batch.assistant_mask)],
      sharding.batch_sharding(mesh))
  real = int(np.asarray(batch.attention_mask).sum())
  out = inference.forward_fn(target.graphdef, target.params, tokens, attention, return_hidden_states=True)
  eligible = np.asarray(batch.attention_mask, bool) & np.asarray(batch.assistant_mask, bool)
  from layerwave.analysis import token_filter  # pylint: disable=g-import-not-at-top
  entropy = np.asarray(token_filter.token_entropy(out.logits))
  threshold = np.float32(np.percentile(entropy[eligible], 50))
  keep = eligible & (entropy >= threshold)
  reps = _REPEATS.value
  rows = []

  def stats_fn(unfiltered):
    options = collect.CollectOptions(unfiltered=unfiltered, exact_cka_tokens=2048)
    state = collect.init_state(target, options, mesh)
    fn = jax.jit(functools.partial(collect.update_from_outputs, options=options))
    return lambda: fn(state, out.hidden_states, out.logits, attention, assistant, threshold, np.int32(0))

  def full_fn():
    options = collect.CollectOptions(exact_cka_tokens=2048)
    state = collect.init_state(target, options, mesh)
    fn = jax.jit(functools.partial(collect.stats_step, target.graphdef, options=options))
    return lambda: fn(target.params, state, tokens, attention, assistant, threshold, np.int32(0))

  bare = jax.jit(functools.partial(inference.forward_fn, target.graphdef))
  timings = {
      "(c) bare forward (logits)": _time(lambda: bare(target.params, tokens, attention), repeats=reps),
      "(a) statistics alone, filtered + matched control": _time(stats_fn("matched"), repeats=reps),
      "(a') statistics alone, filtered only": _time(stats_fn("none"), repeats=reps),
      "(b) full analysis step (forward + (a))": _time(full_fn(), repeats=reps),
  }
  hidden_np = np.asarray(out.hidden_states)
  t = time.perf_counter()
  numpy_statistics(hidden_np, keep)
  numpy_s = time.perf_counter() - t
  timings["(d) numpy float64 (prompt entropy + exact CKA, filtered)"] = (numpy_s, numpy_s)

  print(f"\nSmolLM2 statistics benchmark: {cfg.num_layers + 1} depths, D={cfg.hidden_size}, batch "
        f"{_BATCH.value}x{_SEQ.value} ({real} real tokens, {int(eligible.sum())} assistant, {int(keep.sum())} "
        f"kept), alpha=1, {jax.devices()[0].platform} x{len(jax.devices())}, {os.cpu_count()} CPUs\n")
  print("| what | seconds / batch | tokens/s | first call (compile) s |")
  print("|---|---|---|---|")
  for name, (first, best) in timings.items():
    rows.append((name, best))
    print(f"| {name} | {best:.3f} | {real / best:,.0f} | {first:.1f} |")
  fwd = timings["(c) bare forward (logits)"][1]
  full = timings["(b) full analysis step (forward + (a))"][1]
  st = timings["(a) statistics alone, filtered + matched control"][1]
  st1 = timings["(a') statistics alone, filtered only"][1]
  print(f"\nfull analysis / bare forward (tokens/s ratio): {fwd / full:.2f}  (goal >= 0.6)")
  print(f"statistics alone vs numpy: {numpy_s / st1:.1f}x (filtered only, same work as numpy), "
        f"{numpy_s / st:.1f}x (with the control)  (goal >= 10x)")

  counts = [int(c) for c in _MEMORY.value if c]
  if counts:
    print("\n| batches streamed | tokens kept | peak RSS (MiB) |\n|---|---|---|")
    for n in counts:
      env = dict(os.environ)
      proc = subprocess.run([sys.executable, __file__, f"--memory_child={n}", f"--batch_size={_BATCH.value}",
                             f"--seq_len={_SEQ.value}"], capture_output=True, text=True, env=env, check=True)
      line = [ln for ln in proc.stdout.splitlines() if ln.startswith("MAXRSS_MIB")][-1].split()
      print(f"| {n} | {line[3]} | {line[1]} |")


if __name__ == "__main__":
  app.run(main)
