"""Host memory and time of loading a sharded safetensors checkpoint: the whole-checkpoint path against the
slice-by-slice loader that `load_target` uses.

  python benchmarks/bench_loading.py                        # Llama-3.2-1B shapes (1.24B parameters), 4 shards
  python benchmarks/bench_loading.py --layers=2 --vocab=32000 --runs=whole:float32,slices:bfloat16  # quick
  python benchmarks/bench_loading.py --dir=/big/disk/ckpt --keep   # write once, measure again later

Writes a random Llama-shaped model as bf16 safetensors shards with their index (by default into a new folder
under $LAYERWAVE_CACHE, removed at the end unless --keep), then loads it once per run, each in a fresh
subprocess with 8 simulated CPU devices and the mesh data=1 x model=8 (parameters placed by
`sharding.param_spec`):
  whole:DTYPE   `weights.read_safetensors` + `weights.params_from_hf(..., sharding_fn=place_param(mesh))` (the
                whole checkpoint in float32 host memory, then placed);
  slices:DTYPE  `safetensors_loading.load_params` (each device's block read straight from the shard file).
Each child reports its peak RSS (VmHWM: `ru_maxrss` would also count the parent's RSS at the fork; on CPU the
devices' buffers are host memory too), the bytes its devices hold (the sum of every parameter's addressable
shards), their difference (the loader's own overhead), and the load's wall time. The goal for the slice loader: overhead < largest shard file + 2 GB. Last, the
parameters of every run are compared bit for bit: the same dtype across loaders, and bfloat16 against float32
rounded to bfloat16 (`jnp.asarray(x, jnp.bfloat16)`).
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np
from absl import app
from absl import flags

from layerwave.models import hub

_HIDDEN = flags.DEFINE_integer("hidden", 2048, "Model width D.")
_LAYERS = flags.DEFINE_integer("layers", 16, "Decoder layers.")
_MLP = flags.DEFINE_integer("intermediate", 8192, "MLP width.")
_VOCAB = flags.DEFINE_integer("vocab", 128256, "Vocabulary size.")
_HEADS = flags.DEFINE_integer("heads", 32, "Query heads.")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 8, "Key/value heads.")
_TIED = flags.DEFINE_boolean("tied", True, "Tie the LM head to the embedding (as Llama 3.2 1B).")
_SHARDS = flags.DEFINE_integer("shards", 4, "Safetensors shard files.")
_DIR = flags.DEFINE_string("dir", "", "Checkpoint folder: reused if it holds one, else written ('' = a new "
                           "folder under $LAYERWAVE_CACHE).")
_KEEP = flags.DEFINE_boolean("keep", False, "Keep the checkpoint written into a new folder.")
_MODEL_AXIS = flags.DEFINE_integer("model_axis", 8, "The mesh's 'model' axis (of 8 simulated devices).")
_RUNS = flags.DEFINE_list("runs", ["whole:float32", "whole:bfloat16", "slices:float32", "slices:bfloat16"],
                          "Loads measured, LOADER:DTYPE, each in a fresh process.")
_CHILD = flags.DEFINE_string("child", "", "Internal: run one load (LOADER:DTYPE) on --dir and print its numbers.")

DEVICES = 8
GIB = 2 ** 30


def _tensor_shapes() -> list[tuple[str, tuple[int, ...]]]:
  """HF names and `[out, in]` shapes of the Llama checkpoint, in file order."""
  d, f, v = _HIDDEN.value, _MLP.value, _VOCAB.value
  hd = d // _HEADS.value
  kv = _KV_HEADS.value * hd
  out = [("model.embed_tokens.weight", (v, d))]
  for i in range(_LAYERS.value):
    p = f"model.layers.{i}."
    out += [(p + "input_layernorm.weight", (d,)), (p + "post_attention_layernorm.weight", (d,)),
            (p + "self_attn.q_proj.weight", (d, d)), (p + "self_attn.k_proj.weight", (kv, d)),
            (p + "self_attn.v_proj.weight", (kv, d)), (p + "self_attn.o_proj.weight", (d, d)),
            (p + "mlp.gate_proj.weight", (f, d)), (p + "mlp.up_proj.weight", (f, d)),
            (p + "mlp.down_proj.weight", (d, f))]
  out.append(("model.norm.weight", (d,)))
  if not _TIED.value:
    out.append(("lm_head.weight", (v, d)))
  return out


def write_checkpoint(directory: str) -> None:
  """A random bf16 Llama as `--shards` files of about equal size, written one shard at a time."""
  from safetensors.numpy import save_file
  os.makedirs(directory, exist_ok=True)
  shapes = _tensor_shapes()
  config = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": _VOCAB.value,
      "hidden_size": _HIDDEN.value, "intermediate_size": _MLP.value, "num_hidden_layers": _LAYERS.value,
      "num_attention_heads": _HEADS.value, "num_key_value_heads": _KV_HEADS.value,
      "head_dim": _HIDDEN.value // _HEADS.value, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
      "max_position_embeddings": 8192, "tie_word_embeddings": _TIED.value, "hidden_act": "silu",
      "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  total = sum(2 * int(np.prod(s)) for _, s in shapes)
  groups, size = [[]], 0
  for name, shape in shapes:
    if size >= total * len(groups) / _SHARDS.value and len(groups) < _SHARDS.value:
      groups.append([])
    groups[-1].append((name, shape))
    size += 2 * int(np.prod(shape))
  rng = np.random.default_rng(0)
  weight_map = {}
  for i, group in enumerate(groups):
    file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
    tensors = {n: (rng.standard_normal(s, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16) for n, s in group}
    save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
    weight_map.update({n: file for n, _ in group})
    del tensors
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _status_bytes(field: str) -> int:
  """A `/proc/self/status` memory field (VmHWM: this process' peak RSS, VmRSS: its RSS now) in bytes."""
  with open("/proc/self/status") as f:
    line = next(ln for ln in f if ln.startswith(field + ":"))
  return int(line.split()[1]) * 1024


def _child(run: str, directory: str) -> None:
  """One load in this process; prints `RESULT {json}` with its memory, time and parameter digests."""
  import hashlib
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from layerwave import sharding
  from layerwave.models import safetensors_loading, weights
  from layerwave.models.config import ModelConfig

  loader, dtype = run.split(":")
  dtype = jnp.dtype(dtype)
  mesh = sharding.make_mesh((("data", -1), ("model", _MODEL_AXIS.value)))
  config = ModelConfig.from_pretrained(directory)
  jax.block_until_ready(jnp.zeros(8) + 1)  # the backend up before the baseline
  before = _status_bytes("VmRSS")
  tic = time.perf_counter()
  if loader == "whole":
    model = weights.params_from_hf(config, weights.read_safetensors(directory), dtype,
                                   sharding_fn=sharding.place_param(mesh))
  elif loader == "slices":
    model = safetensors_loading.load_params(config, directory, mesh, dtype)
  else:
    raise ValueError(f"Unknown loader {loader!r}: 'whole' or 'slices'.")
  params = nnx.state(model)
  jax.block_until_ready(params)
  seconds = time.perf_counter() - tic
  peak = _status_bytes("VmHWM")  # read before the digests below add to it
  leaves = jax.tree.leaves(params)
  device_bytes = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
  digests = {}
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    host = np.asarray(x)
    key = jax.tree_util.keystr(path)
    digests[key] = {dtype.name: hashlib.sha256(host.tobytes()).hexdigest()}
    if dtype == jnp.float32:
      digests[key]["bfloat16"] = hashlib.sha256(np.asarray(jnp.asarray(host, jnp.bfloat16)).tobytes()).hexdigest()
    del host
  print("RESULT " + json.dumps(dict(run=run, before=before, peak=peak, device_bytes=device_bytes, seconds=seconds,
                                    digests=digests, parameters=sum(x.size for x in leaves),
                                    devices=len(jax.devices()))), flush=True)


def _measure(run: str, directory: str) -> dict:
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}", JAX_PLATFORMS="cpu")
  tic = time.perf_counter()
  proc = subprocess.run([sys.executable, __file__, f"--child={run}", f"--dir={directory}",
                         f"--model_axis={_MODEL_AXIS.value}"], capture_output=True, text=True, env=env)
  if proc.returncode:
    sys.stderr.write(proc.stderr[-4000:])
    raise RuntimeError(f"The {run} load failed (exit {proc.returncode}).")
  line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
  out = json.loads(line[len("RESULT "):])
  out["process_seconds"] = time.perf_counter() - tic
  return out


def main(argv):
  del argv
  if _CHILD.value:
    _child(_CHILD.value, _DIR.value)
    return
  fresh = not (_DIR.value and os.path.exists(os.path.join(_DIR.value, "model.safetensors.index.json")))
  if _DIR.value:
    directory = _DIR.value
  else:
    os.makedirs(hub.cache_root(), exist_ok=True)
    directory = tempfile.mkdtemp(prefix="bench-loading-", dir=hub.cache_root())
  try:
    if fresh:
      tic = time.perf_counter()
      write_checkpoint(directory)
      print(f"Wrote {directory} in {time.perf_counter() - tic:.0f} s")
    files = [os.path.join(directory, f) for f in sorted(os.listdir(directory)) if f.endswith(".safetensors")]
    sizes = [os.path.getsize(f) for f in files]
    largest = max(sizes)
    results = [_measure(run, directory) for run in _RUNS.value]
    n = results[0]["parameters"]
    print(f"\nCheckpoint: {n / 1e9:.2f}B parameters, {len(files)} bf16 shards, {sum(sizes) / GIB:.2f} GiB (largest "
          f"{largest / GIB:.2f} GiB); {results[0]['devices']} CPU devices, mesh data=1 x model={_MODEL_AXIS.value}; "
          f"{os.cpu_count()} CPUs\n")
    print("| loader:dtype | peak RSS GiB | devices hold GiB | peak - devices GiB | peak - devices - start GiB "
          "| load s | process s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
      over = r["peak"] - r["device_bytes"]
      print(f"| {r['run']} | {r['peak'] / GIB:.2f} | {r['device_bytes'] / GIB:.2f} | {over / GIB:.2f} | "
            f"{(over - r['before']) / GIB:.2f} | {r['seconds']:.1f} | {r['process_seconds']:.1f} |")
    print(f"\n(start: RSS of the child just before the load, with jax, transformers and the 8 devices up: "
          + ", ".join(f"{r['run']} {r['before'] / GIB:.2f} GiB" for r in results) + ")")
    for r in results:
      if r["run"].startswith("slices"):
        over = r["peak"] - r["device_bytes"]
        goal = largest + 2e9
        print(f"{r['run']}: peak - devices {over / GIB:.2f} GiB against the goal < largest shard + 2 GB = "
              f"{goal / GIB:.2f} GiB: {'met' if over < goal else 'NOT met'}")
    # Bit for bit: every dtype against every other run's value of it (float32 runs also give theirs rounded).
    by_dtype = {}
    for r in results:
      for key, d in r["digests"].items():
        for dtype, digest in d.items():
          by_dtype.setdefault(dtype, {}).setdefault(key, {})[r["run"]] = digest
    for dtype, per_key in by_dtype.items():
      runs = sorted({run for d in per_key.values() for run in d})
      if len(runs) < 2:
        continue
      differ = [k for k, d in per_key.items() if len(set(d.values())) > 1]
      print(f"{dtype} parameters of {', '.join(runs)}"
            + (" (float32 runs rounded with jnp.asarray)" if dtype == "bfloat16" else "") + ": "
            + ("identical bit for bit" if not differ else f"DIFFER in {len(differ)} parameters: {differ[:4]}"))
  finally:
    if fresh and not _KEEP.value and not _DIR.value:
      shutil.rmtree(directory, ignore_errors=True)
    elif fresh:
      print(f"Kept {directory}")


if __name__ == "__main__":
  app.run(main)
