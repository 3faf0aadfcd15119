"""Every stage of the pipeline as the call its launcher jits, on abstract inputs placed as the launcher places them.

Place in the pipeline: the second half of `layerwave.aot`. Each builder returns a `StageCall`: the very jitted
function a launcher calls (`inference.forward_fn`, `collect.stats_step`'s jit, the extraction forward,
`step.train_step` / `train_step_offline`, `generate._generate`, `continuous._insert` / `decode_steps`,
`decode._speculate`), its arguments as `jax.ShapeDtypeStruct`s carrying the shardings the launcher gives them
(`sharding.param_spec` for the target, `step.state_shardings` for the draft's training state, `'data'` for
batches), and its static settings from the same typed options the launcher builds from its config. Nothing is
allocated: the target, the draft and the optimizer state are shapes (`nnx.eval_shape`, `jax.eval_shape`).

Legend (`layerwave.axes`): B batch, T tokens.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from layerwave import continuous
from layerwave import inference
from layerwave import sharding
from layerwave.analysis import collect
from layerwave.models import attention
from layerwave.models.config import ModelConfig
from layerwave.models.draft import Draft, DraftConfig
from layerwave.models.target import Transformer
from layerwave.sampling import SamplingParams
from layerwave.layer_ids import eagle3_layer_ids
from layerwave.speculative import decode
from layerwave.training import step as step_lib
from layerwave.training.features import batches as feature_batches
from layerwave.training.features import extraction
from layerwave.training.options import Recipe

# `layerwave.generate` the module (the package exports a function of that name).
generate_lib = importlib.import_module("layerwave.generate")


@dataclasses.dataclass
class StageCall:
  """One stage ready to lower: `fn.lower(*args, **kwargs)`.

  Attributes:
    name: the stage's row name ("train_offline", "speculate_chain_b64", ...).
    fn: the jitted function its launcher calls.
    args, kwargs: abstract arguments (shapes, dtypes, shardings) and static settings.
    tokens: tokens one call processes (for tokens/s); for a decode loop, the tokens it emits.
    shape: a short description of the call's size ("B 16 x T 2048").
    kind: "train", "analysis" or "inference" (what to change when it does not fit).
    loop_steps: a decode loop's iterations (XLA's cost analysis counts a loop body once); 0 for one pass.
  """

  name: str
  fn: Callable
  args: tuple
  kwargs: dict
  tokens: int
  shape: str
  kind: str
  loop_steps: int = 0


@dataclasses.dataclass
class Context:
  """What every builder reads: the config, the target's shapes, the mesh and the abstract target."""

  config: Any
  model: ModelConfig
  mesh: Mesh
  dtype: Any
  graphdef: Any = None
  params: Any = None

  def __post_init__(self):
    self.graphdef, self.params = abstract_target(self.model, self.dtype, self.mesh)

  def layers(self) -> tuple[int, ...]:
    ids = tuple(int(i) for i in (self.config.get("layers") or ()))
    return ids or eagle3_layer_ids(self.model.num_layers)

  def recipe(self) -> Recipe:
    return Recipe.from_config(self.config)


def spec(shape, dtype, mesh: Mesh, pspec: P = P()) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=NamedSharding(mesh, pspec))


def _like(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def abstract_target(config: ModelConfig, dtype, mesh: Mesh):
  """(graphdef, params) of a target with no weights: each parameter a `ShapeDtypeStruct` placed as
  `inference.load_target` places it (`sharding.param_spec`), its attention kernel the one `load_target` picks
  for the mesh's platform (splash on TPU)."""
  impl = attention.default_impl(mesh.devices.flat[0].platform)  # as `inference.with_attention("auto")`
  model = nnx.eval_shape(lambda: Transformer(config, dtype=dtype, rngs=nnx.Rngs(0), attention_impl=impl,
                                             mesh=None if impl == "xla" else mesh))
  graphdef, state = nnx.split(model)
  values = []
  for path, var in nnx.to_flat_state(state):
    x = var.get_value() if hasattr(var, "get_value") else var.value
    values.append((path, var.replace(spec(x.shape, x.dtype, mesh, sharding.param_spec(path, x.shape, mesh)))))
  return graphdef, nnx.from_flat_state(values)


def _batch(mesh: Mesh, b: int, t: int, names=("input_ids", "attention_mask", "assistant_mask")) -> dict:
  return {k: spec((b, t), jnp.int32, mesh, P("data")) for k in names}


def draft_config(ctx: Context) -> DraftConfig:
  m = ctx.recipe().draft_model
  return DraftConfig.from_target(ctx.model, ctx.layers(), draft_vocab_size=min(m.vocab_size, ctx.model.vocab_size),
                                 num_layers=m.num_layers, fc_norm=m.fc_norm)


def _train_parts(ctx: Context):
  """The draft's training state, vocabulary tables and frozen embedding as `train` places them."""
  recipe = ctx.recipe()
  dcfg = draft_config(ctx)
  draft = nnx.eval_shape(lambda: Draft(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
  graphdef, params, vocab, frozen = step_lib.split_draft(draft)
  state = jax.eval_shape(lambda p: step_lib.init_state(p, recipe.train.optimizer), params)
  state = _like(state, step_lib.state_shardings(state, ctx.mesh))
  vocab = _like(vocab, jax.tree.map(lambda _: sharding.replicated(ctx.mesh), vocab))
  embedding = ctx.params["embed_tokens"]["embedding"]
  emb = embedding.get_value() if hasattr(embedding, "get_value") else embedding.value
  embed = jax.tree.map(lambda _: emb, frozen)
  return recipe, dcfg, graphdef, state, vocab, embed


def train_offline(ctx: Context) -> StageCall:
  """`step.train_step_offline` on a feature-store batch of `train.batch_size` × `data.max_length`."""
  recipe, dcfg, graphdef, state, vocab, embed = _train_parts(ctx)
  b, t, k, d = recipe.train.batch_size, recipe.data.max_length, len(dcfg.layer_ids), ctx.model.hidden_size
  store = jnp.dtype(ctx.config.features.dtype)
  rows = feature_batches.shardings(ctx.mesh)
  batch = _batch(ctx.mesh, b, t)
  batch.update(features=jax.ShapeDtypeStruct((k, b, t, d), store, sharding=rows["features"]),
               final=jax.ShapeDtypeStruct((b, t, d), store, sharding=rows["final"]),
               argmax=jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rows["argmax"]))
  head_rows = spec((d, dcfg.draft_vocab_size), ctx.dtype, ctx.mesh)  # replicated, as train places it
  program = step_lib.StepProgram(graphdef, recipe.train.loss, optimizer=recipe.train.optimizer, mesh=ctx.mesh)
  return StageCall("train_offline", step_lib.train_step_offline, (state, vocab, embed, head_rows, batch),
                   dict(program=program),
                   b * t, f"B {b} x T {t}, K {recipe.train.ttt_steps}, V_d {dcfg.draft_vocab_size}", "train")


def train_online(ctx: Context) -> StageCall:
  """`step.train_step`: the frozen target's forward inside the step (in `train.target_dtype` if set)."""
  recipe, dcfg, graphdef, state, vocab, embed = _train_parts(ctx)
  b, t = recipe.train.batch_size, recipe.data.max_length
  target_dtype = recipe.train.target_dtype or ctx.dtype
  graph, params = (ctx.graphdef, ctx.params) if jnp.dtype(target_dtype) == jnp.dtype(ctx.dtype) else \
      abstract_target(ctx.model, target_dtype, ctx.mesh)
  program = step_lib.StepProgram(graphdef, recipe.train.loss, optimizer=recipe.train.optimizer, target_graphdef=graph,
                                 mesh=ctx.mesh)
  return StageCall("train_online", step_lib.train_step, (state, vocab, embed, params, _batch(ctx.mesh, b, t)),
                   dict(program=program),
                   b * t, f"B {b} x T {t}, K {recipe.train.ttt_steps}, V_d {dcfg.draft_vocab_size}", "train")


def forward(ctx: Context) -> StageCall:
  """`inference.forward_fn` returning every depth's hidden states, `analysis.batch_size` × `data.max_length`."""
  b, t = int(ctx.config.analysis.batch_size), int(ctx.config.data.max_length)
  batch = _batch(ctx.mesh, b, t, ("input_ids", "attention_mask"))
  return StageCall("forward", inference.forward_fn, (ctx.graphdef, ctx.params, batch["input_ids"],
                                                      batch["attention_mask"]),
                   dict(return_hidden_states=True, compute_logits=False), b * t, f"B {b} x T {t}, all depths",
                   "inference")


def analysis(ctx: Context) -> StageCall:
  """One step of the layer statistics (`collect.stats_step`, jitted as `collect_stats` jits it)."""
  options = collect.options_from_config(ctx.config.analysis)
  b, t = int(ctx.config.analysis.batch_size), int(ctx.config.data.max_length)
  fn = collect.stats_step_jit(ctx.graphdef, ctx.model, options, ctx.mesh)
  layout = collect.state_shardings(ctx.model, options, ctx.mesh)
  state = _like(jax.eval_shape(lambda: collect.empty_state(ctx.model, options, ctx.mesh)), layout)
  ids, attn, assistant = (spec((b, t), jnp.int32, ctx.mesh, P("data")) for _ in range(3))
  return StageCall("analysis", fn, (ctx.params, state, ids, attn, assistant, spec((), jnp.float32, ctx.mesh),
                                    spec((), jnp.int32, ctx.mesh)), {}, b * t, f"B {b} x T {t}", "analysis")


def extract(ctx: Context) -> StageCall:
  """The feature-store forward (`extraction.forward_step`): the draft's layers, h_L and the argmax."""
  f = ctx.config.features
  b, t = int(f.batch_size), int(ctx.config.data.max_length)
  dtype = jnp.dtype(f.compute_dtype) if f.compute_dtype else jnp.dtype(ctx.dtype)
  graphdef, params = (ctx.graphdef, ctx.params) if dtype == jnp.dtype(ctx.dtype) else \
      abstract_target(ctx.model, dtype, ctx.mesh)
  fn = extraction.forward_step(ctx.mesh, graphdef, ctx.layers(), jnp.dtype(f.dtype))
  batch = _batch(ctx.mesh, b, t, ("input_ids", "attention_mask"))
  return StageCall("extract", fn, (params, batch["input_ids"], batch["attention_mask"]), {}, b * t,
                   f"B {b} x T {t}, {len(ctx.layers())} depths", "inference")


def _prompts(ctx: Context, b: int):
  """Prompt tokens and lengths of `b` rows, padded up to the 'data' axis as `inference.pad_prompts` pads them."""
  p = int(ctx.config.aot.prompt_len)
  n = sharding.data_size(ctx.mesh)
  b = -(-b // n) * n
  return (spec((b, p), jnp.int32, ctx.mesh, P("data")), spec((b,), jnp.int32, ctx.mesh, P("data")), p)


def generate(ctx: Context, b: int) -> StageCall:
  """Plain decoding (`generate._generate`): prefill + `aot.new_tokens` steps, batch `b`."""
  tokens, lengths, p = _prompts(ctx, b)
  n = int(ctx.config.aot.new_tokens)
  return StageCall(f"generate_b{b}", generate_lib._generate,  # pylint: disable=protected-access
                   (ctx.graphdef, ctx.params, tokens, lengths, jax.random.key(0)),
                   dict(config=ctx.model, mesh=ctx.mesh, max_new_tokens=n, slots=generate_lib.cache_slots(p, n),
                        sampling=SamplingParams(0.0, 0, 1.0), eos_ids=()), b * n, f"B {b}, prompt {p} + {n} new",
                   "inference", loop_steps=n)


def distill(ctx: Context) -> tuple[StageCall, StageCall]:
  """Continuous batching as distillation runs it: one prompt's prefill into a slot, and a chunk of decode steps
  over every slot (`distill.slots`, `distill.chunk_steps`), reading the whole cache."""
  d = ctx.config.distill
  slots, p, n, steps = int(d.slots), int(d.max_prompt_tokens), int(d.max_new_tokens), int(d.chunk_steps)
  cache = generate_lib.cache_slots(p, n)
  init = continuous._init.lower(  # pylint: disable=protected-access
      config=ctx.model, mesh=ctx.mesh, slots=slots, cache_slots=cache, max_new_tokens=n,
      dtype=jnp.dtype(ctx.dtype)).compile()
  state = _like(jax.eval_shape(lambda: continuous._init(  # pylint: disable=protected-access
      config=ctx.model, mesh=ctx.mesh, slots=slots, cache_slots=cache, max_new_tokens=n, dtype=jnp.dtype(ctx.dtype))),
      init.output_shardings)
  sampling = SamplingParams(float(d.temperature), int(d.top_k), float(d.top_p))
  key = jax.random.key(0)
  rep = lambda shape, dt: spec(shape, dt, ctx.mesh)  # noqa: E731
  insert = StageCall("distill_prefill", continuous._insert,  # pylint: disable=protected-access
                     (ctx.graphdef, ctx.params, state, rep((1,), jnp.int32), rep((1, p), jnp.int32),
                      rep((1,), jnp.int32), rep((1,), jnp.uint32), key),
                     dict(sampling=sampling, eos_ids=(), max_new_tokens=n), p, f"1 prompt of {p} into {slots} slots",
                     "inference")
  decode_chunk = StageCall("distill_decode", continuous.decode_steps,
                           (ctx.graphdef, ctx.params, state, key),
                           dict(sampling=sampling, eos_ids=(), steps=steps, read_slots=cache), slots * steps,
                           f"{slots} slots x {steps} steps, cache {cache}", "inference", loop_steps=steps)
  return insert, decode_chunk


def abstract_draft(ctx: Context, dcfg: DraftConfig):
  """A draft's parameters at inference, in the target's dtype, placed as `decode.as_loaded_draft` places them."""
  _, params = nnx.split(nnx.eval_shape(lambda: Draft(dcfg, dtype=ctx.dtype, rngs=nnx.Rngs(0))))
  return _like(params, sharding.param_shardings(params, ctx.mesh))


def speculate(ctx: Context, b: int, method: str) -> StageCall:
  """The speculative loop (`decode._speculate`): prefill + loop until `aot.new_tokens`, chain or tree."""
  s = ctx.config.speculate
  tokens, lengths, p = _prompts(ctx, b)
  n = int(ctx.config.aot.new_tokens)
  options = decode.SpecOptions(method=method, num_draft_tokens=int(s.num_draft_tokens), tree_depth=int(s.tree_depth),
                               tree_top_k=int(s.tree_top_k), tree_tokens=int(s.tree_tokens))
  dcfg = draft_config(ctx)
  dgraph, dparams = nnx.split(nnx.eval_shape(lambda: Draft(dcfg, dtype=ctx.dtype, rngs=nnx.Rngs(0))))
  dparams = abstract_draft(ctx, dcfg)
  budget = options.num_draft_tokens if method == "chain" else options.tree_tokens
  return StageCall(f"speculate_{method}_b{b}", decode._speculate,  # pylint: disable=protected-access
                   (ctx.graphdef, ctx.params, dgraph, dparams, tokens, lengths, jax.random.key(0)),
                   dict(config=ctx.model, mesh=ctx.mesh, layer_ids=dcfg.layer_ids, max_new_tokens=n,
                        slots=generate_lib.cache_slots(p, n + options.scratch_slots),
                        sampling=SamplingParams(0.0, 0, 1.0), options=options, eos_ids=()),
                   b * n, f"B {b}, prompt {p} + {n} new, {method} of {budget}", "inference", loop_steps=n)


def build(ctx: Context, names: tuple[str, ...]) -> list[tuple[str, Callable[[], Any]]]:
  """Builders for the named stages, in pipeline order: (name, thunk returning StageCalls)."""
  batches = tuple(int(b) for b in ctx.config.aot.decode_batches)
  table: list[tuple[str, Callable[[], Any]]] = [
      ("forward", lambda: [forward(ctx)]),
      ("analysis", lambda: [analysis(ctx)]),
      ("extract", lambda: [extract(ctx)]),
      ("train_offline", lambda: [train_offline(ctx)]),
      ("train_online", lambda: [train_online(ctx)]),
      ("distill", lambda: list(distill(ctx))),
      ("generate", lambda: [generate(ctx, b) for b in batches]),
      ("speculate_chain", lambda: [speculate(ctx, b, "chain") for b in batches]),
      ("speculate_tree", lambda: [speculate(ctx, b, "tree") for b in batches]),
  ]
  known = [n for n, _ in table]
  unknown = [n for n in names if n not in known and n != "all"]
  if unknown:
    raise ValueError(f"Unknown stages {unknown}: choose among {known} or 'all'.")
  return [(n, f) for n, f in table if "all" in names or n in names]


STAGES = ("forward", "analysis", "extract", "train_offline", "train_online", "distill", "generate",
          "speculate_chain", "speculate_tree")
