"""Compile every stage for a TPU topology and report, per chip, whether it fits and what it would cost.

Place in the pipeline: before anyone books hardware. `check(config, topology)` builds the mesh of the config on
the topology's devices (`chips.topology_devices`), the stages' calls on abstract inputs (`stages`), compiles
each with libtpu and reads the compiled program's `memory_analysis()` (per chip: arguments, outputs, temporaries,
the donated bytes that outputs reuse) and `cost_analysis()` (FLOPs and HBM bytes of one chip's program). A
stage that does not fit is a row that says by how much and what to change, never a traceback: libtpu refuses
to compile a program larger than HBM, and its message gives the size, which the row reports.

The roofline time of a call is max(FLOPs / peak FLOP/s, bytes / HBM bandwidth) with the chip's published
constants (`chips.CHIPS`): a lower bound on what the hardware would take, not a measurement. XLA counts a
`while` loop's body once, so for decode loops the row's FLOPs and bytes are one prefill plus one iteration,
and its tokens/s are left blank rather than guessed. Everything here is compiled, not run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from layerwave import atomic
from layerwave import sharding
from layerwave.aot import chips as chips_lib
from layerwave.aot import stages as stages_lib
from layerwave.models.config import ModelConfig

GiB = chips_lib.GiB
HEADROOM = 0.10  # a stage "fits" with at least this share of usable HBM left over


@dataclasses.dataclass
class Row:
  """One compiled stage (bytes per chip; FLOPs and bytes accessed of one chip's program)."""

  stage: str
  shape: str
  fits: bool | None = None
  verdict: str = ""
  argument_bytes: int = 0
  output_bytes: int = 0
  alias_bytes: int = 0
  temp_bytes: int = 0
  code_bytes: int = 0
  peak_bytes: int = 0
  hbm_bytes: int = 0
  compile_seconds: float = 0.0
  compile_cpu_seconds: float = 0.0  # this process's CPU time in the compile (every thread): wall time less the load
  load_average: float = 0.0  # the machine's 1-minute load when the compile ended (2 cores here: > 2 is contention)
  host_peak_bytes: int = 0  # this process's peak resident host RAM so far (the largest compile's, in effect)
  flops: float = 0.0
  bytes_accessed: float = 0.0
  roofline_seconds: float = 0.0
  tokens_per_s: float | None = None
  note: str = ""

  @property
  def headroom(self) -> float:
    return 1.0 - self.peak_bytes / self.hbm_bytes if self.hbm_bytes else float("nan")


def _advice(kind: str, over: bool) -> str:
  if kind == "train":
    return ("split the draft state over more chips or shorten the step: lower train.batch_size or data.max_length, "
            "or add chips to the mesh" if over else "")
  if kind == "analysis":
    return "lower analysis.batch_size or data.max_length, or turn analysis.stability off" if over else ""
  return "split the target over more chips (a larger 'model' axis) or lower the batch / prompt length" if over else ""


# libtpu's refusals: "the total memory required for HLO temporaries (31.54G) exceeds available HBM (15.75G)", or
# "Used 17.2G of 15.75G hbm".
_HBM_MESSAGES = (re.compile(r"required for ([\w ]+?) \(([\d.]+)([KMGT]?)\) exceeds", re.I),
                 re.compile(r"Used\s+([\d.]+)([KMGT]?)\s+of\s+[\d.]+[KMGT]?\s+hbm", re.I))
_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _oom_bytes(message: str) -> tuple[int, str] | None:
  """(bytes, what) libtpu says a program needs, from its out-of-memory compile error; None if not given."""
  m = _HBM_MESSAGES[0].search(message)
  if m:
    return int(float(m.group(2)) * _UNITS[m.group(3).upper()]), m.group(1)
  m = _HBM_MESSAGES[1].search(message)
  return None if m is None else (int(float(m.group(1)) * _UNITS[m.group(2).upper()]), "the program")


def compile_call(call: stages_lib.StageCall, chip: chips_lib.Chip) -> Row:
  """Lowers and compiles one stage; a program libtpu finds too large becomes a row saying so."""
  row = Row(call.name, call.shape, hbm_bytes=chip.hbm_bytes)
  start, cpu_start = time.perf_counter(), time.process_time()

  def timed():
    row.compile_seconds = time.perf_counter() - start
    row.compile_cpu_seconds = time.process_time() - cpu_start
    row.load_average = os.getloadavg()[0]
    row.host_peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

  try:
    compiled = call.fn.lower(*call.args, **call.kwargs).compile()
  except Exception as e:  # pylint: disable=broad-except
    timed()
    text = str(e)
    if "RESOURCE_EXHAUSTED" in text or ("hbm" in text.lower() and "memory" in text.lower()):
      found = _oom_bytes(text)
      row.fits = False
      if found:
        need, what = found
        row.peak_bytes = need if what == "the program" else 0
        row.temp_bytes = need if "temporar" in what else 0
        row.verdict = f"does not fit: {what} alone need {need / GiB:.2f} GiB"
      else:
        row.verdict = "does not fit (libtpu refused the program for HBM)"
      row.note = _advice(call.kind, True)
      return row
    raise
  timed()
  mem = compiled.memory_analysis()
  row.argument_bytes = int(mem.argument_size_in_bytes)
  row.output_bytes = int(mem.output_size_in_bytes)
  row.alias_bytes = int(mem.alias_size_in_bytes)
  row.temp_bytes = int(mem.temp_size_in_bytes)
  row.code_bytes = int(getattr(mem, "generated_code_size_in_bytes", 0))
  row.peak_bytes = row.argument_bytes + row.output_bytes - row.alias_bytes + row.temp_bytes + row.code_bytes
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
  row.flops = float(cost.get("flops", 0.0))
  row.bytes_accessed = float(cost.get("bytes accessed", 0.0))
  row.roofline_seconds = max(row.flops / chip.peak_flops, row.bytes_accessed / chip.hbm_bandwidth)
  if call.loop_steps:
    row.note = f"decode loop: FLOPs / bytes are the prefill + one iteration (XLA counts a loop body once)"
  elif row.roofline_seconds > 0:
    row.tokens_per_s = call.tokens / row.roofline_seconds
  headroom = row.headroom
  row.fits = headroom >= HEADROOM
  if headroom >= HEADROOM:
    row.verdict = f"fits, {100 * headroom:.0f}% free"
  elif headroom >= 0:
    row.verdict = f"fits with only {100 * headroom:.0f}% free (< {100 * HEADROOM:.0f}%)"
    row.note = _advice(call.kind, True)
  else:
    row.verdict = f"does not fit by {-headroom * chip.hbm_bytes / GiB:.2f} GiB"
    row.note = _advice(call.kind, True)
  return row


def mesh_for(config, devices: Sequence) -> jax.sharding.Mesh:
  """The config's mesh on the topology's devices, with its divisibility checked as the launchers would."""
  return sharding.make_mesh(tuple(tuple(a) for a in config.mesh), devices=devices)


def check_model(model: ModelConfig, mesh) -> None:
  """Refuses a mesh whose 'model' axis does not divide the heads (the projections could not split)."""
  n = mesh.shape.get("model", 1)
  bad = [f"{name} {value}" for name, value in (("query heads", model.num_heads), ("KV heads", model.num_kv_heads))
         if value % n]
  if bad:
    raise ValueError(f"The mesh's 'model' axis ({n}) does not divide the model's {', '.join(bad)}: attention heads "
                     "would stay whole on every chip. Choose a 'model' size that divides "
                     f"{np.gcd(model.num_heads, model.num_kv_heads)} (and put the rest of the chips on 'data').")


def check(config, model: ModelConfig, topology: str, names: Sequence[str] = ("all",), log=print) -> dict[str, Any]:
  """Compiles the named stages of `config` for `topology`; returns {"rows": [...], ...} (JSON-ready).

  Args:
    config: a layerwave ConfigDict with an `aot` section (prompt_len, new_tokens, decode_batches).
    model: the target's shapes (`ModelConfig.from_pretrained` of a `config.json` directory).
    topology: e.g. "v5e:2x4".
    names: stages (`stages.STAGES`) or "all".
    log: prints one line per compiled row.
  """
  chip, devices = chips_lib.topology_devices(topology)
  mesh = mesh_for(config, devices)
  check_model(model, mesh)
  ctx = stages_lib.Context(config=config, model=model, mesh=mesh, dtype=jnp.dtype(config.dtype))
  for name, b in (("analysis.batch_size", config.analysis.batch_size), ("train.batch_size", config.train.batch_size),
                  ("features.batch_size", config.features.batch_size)):
    if int(b) % sharding.data_size(mesh):
      raise ValueError(f"{name}={b} is not divisible by the mesh's 'data' axis ({sharding.data_size(mesh)}): "
                       "choose a multiple of it, or a smaller 'data' axis.")
  rows = []
  for _, build in stages_lib.build(ctx, tuple(names)):
    for call in build():
      row = compile_call(call, chip)
      rows.append(row)
      log(format_row(row))
  context = int(config.aot.prompt_len) + int(config.aot.new_tokens)
  spec = {method: speculative_iteration(ctx, chip, k, context) for method, k in
          (("chain", int(config.speculate.num_draft_tokens)), ("tree", int(config.speculate.tree_depth)))}
  for method, s in spec.items():
    log(f"Batch-1 {method} iteration ({s['draft_tokens']} draft steps, context {context}), roofline: a plain step "
        f"reads {s['target_step_bytes'] / GiB:.2f} GiB a chip ({s['target_step_ms']:.2f} ms), a draft step "
        f"{s['draft_over_target']:.3f} of it; an iteration = {s['iteration_in_steps']:.2f} plain steps, so tau "
        f"{s['tau_for_2x']:.2f} gives 2x and {s['tau_for_3x']:.2f} gives 3x.")
  return {"topology": topology, "chip": dataclasses.asdict(chip), "mesh": dict(mesh.shape),
          "devices": len(devices), "dtype": str(config.dtype), "model": dataclasses.asdict(model),
          "rows": [dataclasses.asdict(r) for r in rows], "speculative_iteration": spec, "compiled_not_run": True}


def format_row(row: Row) -> str:
  tps = "" if row.tokens_per_s is None else f"{row.tokens_per_s:,.0f}"
  return (f"| {row.stage} | {row.shape} | {row.argument_bytes / GiB:.2f} | {row.output_bytes / GiB:.2f} | "
          f"{row.temp_bytes / GiB:.2f} | {row.peak_bytes / GiB:.2f} / {row.hbm_bytes / GiB:.2f} | {row.verdict} | "
          f"{row.compile_seconds:.0f} ({row.compile_cpu_seconds:.0f} CPU, load {row.load_average:.1f}, "
          f"{row.host_peak_bytes / 2 ** 30:.1f} GiB host) | {row.flops / 1e12:.2f} | {row.bytes_accessed / 1e9:.2f} | "
          f"{row.roofline_seconds * 1e3:.1f} | {tps} | {row.note} |")


HEADER = ("| stage | call | args GiB | out GiB | temp GiB | peak / HBM GiB | verdict | compile s (CPU s, load, host RAM) | TFLOP | GB moved | "
          "roofline ms | tokens/s | note |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def write_json(result: dict, path: str) -> None:
  atomic.write_text(path, json.dumps(result, indent=1, default=str))


def per_chip_bytes(tree) -> int:
  """Bytes one chip holds of a tree of sharded `ShapeDtypeStruct`s (the largest shard of each leaf)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += int(np.prod(shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize
  return total


def speculative_iteration(ctx, chip: chips_lib.Chip, draft_tokens: int, context: int) -> dict[str, float]:
  """The batch-1 cost of one speculative iteration in plain decode steps, from the same roofline.

  At batch 1 a decode step reads every weight a chip holds and its KV cache once, and its FLOPs are negligible
  beside those bytes, so a step's time is bytes / bandwidth. Verifying K + 1 tokens reads the same bytes as one
  plain step (the K extra tokens add FLOPs, not bytes); drafting K tokens reads the draft's weights (split over
  'model' as `decode.as_loaded_draft` places them; its frozen embedding only by the rows it looks up) and its
  cache K times. Returns the draft step's cost in target steps, the iteration's, and the τ (tokens per
  iteration) at which speculative decoding would run 2x and 3x plain decoding. A model, not a measurement.
  """
  m, mesh = ctx.model, ctx.mesh
  model_axis = mesh.shape.get("model", 1)
  itemsize = jnp.dtype(ctx.dtype).itemsize
  kv_heads = m.num_kv_heads // model_axis if m.num_kv_heads % model_axis == 0 else m.num_kv_heads
  target_kv = 2 * m.num_layers * context * kv_heads * m.head_dim * itemsize
  target_step = per_chip_bytes(ctx.params) + target_kv
  dcfg = stages_lib.draft_config(ctx)
  draft = stages_lib.abstract_draft(ctx, dcfg)
  frozen = dcfg.target_vocab_size * dcfg.target_hidden_size * itemsize // model_axis
  draft_kv = 2 * dcfg.model.num_layers * context * kv_heads * dcfg.model.head_dim * itemsize
  draft_step = per_chip_bytes(draft) - frozen + draft_kv
  ratio = draft_step / target_step
  iteration = 1.0 + draft_tokens * ratio
  return {"target_step_bytes": target_step, "draft_step_bytes": draft_step,
          "target_step_ms": 1e3 * target_step / chip.hbm_bandwidth, "draft_over_target": ratio,
          "draft_tokens": draft_tokens, "iteration_in_steps": iteration, "tau_for_2x": 2 * iteration,
          "tau_for_3x": 3 * iteration, "context": context}
