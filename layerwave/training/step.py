"""One training step of the draft, online or offline: TTT loss → optax update, all jitted.

Online (`train_step`, `eval_step`): the frozen target runs inside the step (no gradient) to produce the
selected layers' hidden states and its logits, so no hidden state is ever stored. Offline
(`train_step_offline`, `eval_step_offline`): no target in the step; the batch carries what a feature store
(`layerwave.training.features`) holds: the selected layers' hidden states, the target's final-norm hidden
state h_L and its full-vocabulary argmax, from which `losses.offline_targets` recomputes the draft-vocabulary
targets with the target's LM-head rows of the draft vocabulary (`head_rows`). On identical data both steps
compute the same loss and gradients. The batch is sharded over the mesh's `'data'` axis and the parameters
replicated; XLA inserts the gradient all-reduce.

The draft is split into three pytrees at the jit boundary: trainable `Param`s (in `TrainState`), the
vocabulary tables (`VocabMap`, saved with the draft) and the frozen target embedding (`Frozen`, never saved:
it is the target's).

A step's static settings travel as one `StepProgram` (the graphdefs, the mesh, the loss's `LossSettings` and
the optimizer's hyperparameters, `OptimizerSettings`), hashable and compared by value; the step builds the
optax chain inside the trace: equal settings share one compilation, where an optax transformation, a new
object per call, would compile the step anew every time one is built.

Legend (`layerwave.axes`): B batch, T tokens, k selected layers, D target width, V_d draft vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from layerwave import sharding
from layerwave.models.draft import Draft, Frozen, VocabMap
from layerwave.models.kv_cache import causal_mask
from layerwave.training import losses


@struct.dataclass
class TrainState:
  """Everything that changes during training (checkpointed)."""

  step: jax.Array
  params: Any  # nnx.State of the draft's Params
  opt_state: Any


def split_draft(draft: Draft):
  """`Draft` → (graphdef, params, vocab tables, frozen embedding)."""
  return nnx.split(draft, nnx.Param, VocabMap, Frozen)


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
  """AdamW with linear warmup and cosine decay, after global-norm clipping (METHOD §7).

  Hashable and compared by value: a static argument of `train_step`.

  Attributes:
    lr: peak learning rate.
    warmup_steps: linear warmup from 0 to `lr`.
    total_steps: the cosine decay ends here.
    clip_norm: global gradient-norm clip.
    b1, b2, weight_decay: AdamW's.
    end_lr_fraction: the learning rate at `total_steps`, as a fraction of `lr` (1 = constant after warmup).
    freeze_head: leave the draft's LM head as initialised (from the target's rows): its updates are zero and
      it does not count towards the clipped gradient norm.
  """

  lr: float
  warmup_steps: int
  total_steps: int
  clip_norm: float = 0.5
  b1: float = 0.9
  b2: float = 0.95
  weight_decay: float = 0.0
  end_lr_fraction: float = 0.0
  freeze_head: bool = False

  def build(self) -> optax.GradientTransformation:
    """The optax transformation (a new object per call; its state's structure is always the same)."""
    warmup = max(int(self.warmup_steps), 1)
    # At least one decay step after the warm-up (optax refuses none): a 1-step run (e.g. a ¼× dynamics cell of a
    # short budget) warms up in its one step.
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=self.lr, warmup_steps=warmup, decay_steps=max(int(self.total_steps), warmup + 1),
        end_value=self.lr * self.end_lr_fraction)
    tx = optax.chain(optax.clip_by_global_norm(self.clip_norm),
                     optax.adamw(schedule, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay))
    if not self.freeze_head:
      return tx
    return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, _head_labels)


def _head_labels(params):
  """"frozen" for the draft's LM head (`lm_head.*`), "train" for every other parameter."""
  def label(path, _):
    first = path[0]
    name = getattr(first, "key", getattr(first, "name", first))
    return "frozen" if str(name) == "lm_head" else "train"
  return jax.tree_util.tree_map_with_path(label, params)


def state_shardings(tree, mesh):
  """Where the draft's training arrays live: every leaf split over all the mesh's devices (`sharding.fsdp_spec`).

  The draft's parameters and AdamW moments are the largest arrays training owns (4.75 GiB for an 8B target's
  draft in float32); split over N chips each holds 1/N and XLA gathers a weight where the step reads it. On
  one device this is plain replication. Vocabulary tables and scalars too small to split stay replicated.
  The training loop places the state with it, the restore target carries it, and `layerwave.aot` compiles
  with it.
  """
  return sharding.fsdp_shardings(tree, mesh)


def init_state(params, optimizer: OptimizerSettings) -> TrainState:
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.build().init(params))


def continue_state(state: TrainState, step: int) -> TrainState:
  """A fresh `init_state` moved to `step` of its schedule: the learning rate continues where a run stood,
  while AdamW's moments (and their bias-correction count) start afresh (`train.init_from`)."""
  def move(x):
    if isinstance(x, optax.ScaleByScheduleState):
      return x._replace(count=jnp.full_like(x.count, step))
    return x
  opt_state = jax.tree.map(move, state.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
  return TrainState(step=jnp.full_like(state.step, step), params=state.params, opt_state=opt_state)


COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """How the TTT loss is computed (`losses.ttt_loss`, METHOD §7): hashable and compared by value, so equal
  settings share one compilation of a step.

  Attributes:
    steps: K, the unrolled steps.
    decay: step j weighs decay**j.
    assistant_only: predict assistant tokens only (else every real token).
    compute_dtype: the draft's forward and backward passes (`COMPUTE_DTYPES`); the parameters and optimizer
      state stay float32 (`_compute_inputs`).
    remat: the memory-saving path for long sequences (`losses.ttt_loss`).
  """

  steps: int
  decay: float
  assistant_only: bool
  compute_dtype: str = "float32"
  remat: bool = False


@dataclasses.dataclass(frozen=True)
class StepProgram:
  """What a jitted step compiles for, as one static argument (as gemma's `SamplerLoop` is one).

  Attributes:
    draft_graphdef: the draft's structure (`split_draft`).
    loss: the loss settings.
    optimizer: the update's hyperparameters (training steps; None for an evaluation).
    target_graphdef: the target's structure (online steps, whose forward runs inside the step).
    mesh: the training mesh; the draft's part of a step then runs with its batch over every device
      (`spread_batch`). None: as the batch arrives (evaluation).
  """

  draft_graphdef: Any
  loss: LossSettings
  optimizer: OptimizerSettings | None = None
  target_graphdef: Any = None
  mesh: Any = None


def _compute_inputs(features, embed, compute_dtype: str):
  """The draft's inputs in its compute dtype: the selected layers' features and the frozen embedding.

  Every draft matmul computes in its input's dtype (`layers.Linear` casts the kernel to it), so bfloat16
  inputs run the forward and backward passes in bfloat16 while the parameters, their gradients and the
  optimizer state stay float32 (the cast's gradient is cast back); norms, attention scores and the logits
  stay float32 as at inference.
  """
  dtype = jnp.dtype(compute_dtype)
  return features.astype(dtype), jax.tree.map(lambda x: x.astype(dtype), embed)


def spread_batch(mesh, *trees, axis: int = 0):
  """The draft's inputs with their batch axis split over every device of `mesh`, not only over `'data'`.

  On a mesh with a `'model'` axis (the target split over chips) the batch arrives split over `'data'` alone,
  and every chip of a model group would run the same draft step on the same rows, each holding all of their
  activations. The draft is small and its state already split over every device (`state_shardings`), so its
  step runs data-parallel over all of them instead. A batch the device count does not divide, one device, or
  no mesh: unchanged. Each tree's leaves have their batch at `axis` (the features' batch is axis 1).
  """
  n = 1 if mesh is None else mesh.devices.size
  out = []
  for tree in trees:
    def put(x):
      if n == 1 or x.ndim <= axis or x.shape[axis] % n:
        return x
      parts = [None] * x.ndim
      parts[axis] = tuple(mesh.axis_names)
      return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*parts)))
    out.append(jax.tree.map(put, tree))
  return out[0] if len(out) == 1 else tuple(out)


def _loss_fn(params, vocab, embed, target_params, batch, program: StepProgram, gate_step=None):
  tokens, attn = batch["input_ids"], batch["attention_mask"]
  loss_settings = program.loss
  target = nnx.merge(program.target_graphdef, target_params)
  positions = jnp.maximum(jnp.cumsum(attn, axis=-1) - 1, 0)
  layer_ids = nnx.merge(program.draft_graphdef, params, vocab, embed).config.layer_ids
  out = target(tokens, positions, causal_mask(attn), return_hidden_states=True, hidden_layers=layer_ids,
               compute_logits=False, valid=attn)
  features, draft_embed = _compute_inputs(jax.lax.stop_gradient(out.hidden_states), embed,
                                          loss_settings.compute_dtype)
  draft = nnx.merge(program.draft_graphdef, params, vocab, draft_embed)
  final = jax.lax.stop_gradient(out.last_hidden).astype(jnp.float32)
  loss_mask = batch["assistant_mask"] if loss_settings.assistant_only else attn
  # The offline step's targets, from the fields a feature store would hold (one path: offline == online).
  logp, in_vocab = losses.online_targets(target, final, draft)
  features = spread_batch(program.mesh, features, axis=1)
  logp, in_vocab, tokens, attn, loss_mask = spread_batch(program.mesh, logp, in_vocab, tokens, attn, loss_mask)
  return losses.ttt_loss(draft, features, logp, in_vocab, tokens, attn, loss_mask, steps=loss_settings.steps,
                         decay=loss_settings.decay, remat=loss_settings.remat, gate_step=gate_step)


def _metrics(loss, aux):
  """Step metrics; the counts `hits_j`, `tokens_j`, `in_vocab_j` let an evaluation pool batches (and compute
  its simulated τ from the pooled accuracies: `training.loop`)."""
  return {"loss": loss, "loss_j": aux["loss_j"], "acc_j": aux["acc_j"],
          "acc_in_vocab_j": aux["acc_in_vocab_j"], "hits_j": aux["hits_j"],
          "tokens_j": aux["tokens_j"], "in_vocab_j": aux["in_vocab_j"], "tokens": aux["tokens_j"][0]}


def _offline_loss_fn(params, vocab, embed, head_rows, batch, program: StepProgram, gate_step=None):
  tokens, attn = batch["input_ids"], batch["attention_mask"]
  loss_settings = program.loss
  # Stored features may be bfloat16 on the host and in transfer; the draft reads them in its compute dtype.
  features, embed = _compute_inputs(batch["features"], embed, loss_settings.compute_dtype)
  draft = nnx.merge(program.draft_graphdef, params, vocab, embed)
  logp, in_vocab = losses.offline_targets(batch["final"].astype(jnp.float32), head_rows, batch["argmax"],
                                          draft)
  loss_mask = batch["assistant_mask"] if loss_settings.assistant_only else attn
  features = spread_batch(program.mesh, features, axis=1)
  logp, in_vocab, tokens, attn, loss_mask = spread_batch(program.mesh, logp, in_vocab, tokens, attn, loss_mask)
  return losses.ttt_loss(draft, features, logp, in_vocab, tokens, attn, loss_mask, steps=loss_settings.steps,
                         decay=loss_settings.decay, remat=loss_settings.remat, gate_step=gate_step)


def _update(state: TrainState, optimizer: OptimizerSettings, loss, aux, grads):
  updates, opt_state = optimizer.build().update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = _metrics(loss, aux)
  metrics["grad_norm"] = optax.global_norm(grads)
  metrics["sim_tau"] = losses.simulated_tau(aux["acc_j"])  # this batch's, for train logging
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


@functools.partial(jax.jit, static_argnames=("program",), donate_argnames=("state",))
def train_step(state: TrainState, vocab, embed, target_params, batch, *, program: StepProgram):
  """One optimisation step. Returns `(new_state, metrics)`; metrics stay on device (`sim_tau`: this batch's).

  A gated draft (`layerwave.models.gates`) samples its gates from the state's step; evaluation reads them
  deterministically.

  Args:
    state: the trainable parameters and optimizer state (donated).
    vocab, embed: the draft's vocabulary tables and the frozen target embedding (`split_draft`).
    target_params: the target's parameters (its forward runs inside the step, without gradient).
    batch: `input_ids`, `attention_mask`, `assistant_mask` `[B, T]`.
    program: what the step compiles for (static): both graphdefs, the optimizer, the loss and the mesh.
  """
  grad_fn = jax.value_and_grad(_loss_fn, has_aux=True)
  (loss, aux), grads = grad_fn(state.params, vocab, embed, target_params, batch, program, state.step)
  return _update(state, program.optimizer, loss, aux, grads)


@functools.partial(jax.jit, static_argnames=("program",), donate_argnames=("state",))
def train_step_offline(state: TrainState, vocab, embed, head_rows, batch, *, program: StepProgram):
  """One optimisation step from stored features (no target). Returns `(new_state, metrics)` (as `train_step`'s).

  Args:
    state, vocab, embed: as `train_step`.
    head_rows: `[D, V_d]` the target's LM head restricted to the draft vocabulary.
    batch: `input_ids`, `attention_mask`, `assistant_mask` `[B, T]`; `features` `[k, B, T, D]` (the draft's
      layers, any float dtype); `final` `[B, T, D]` h_L; `argmax` `[B, T]` int32 (a `FeatureBatch`).
    program: as `train_step` (its `target_graphdef` unused).
  """
  grad_fn = jax.value_and_grad(_offline_loss_fn, has_aux=True)
  (loss, aux), grads = grad_fn(state.params, vocab, embed, head_rows, batch, program, state.step)
  return _update(state, program.optimizer, loss, aux, grads)


@functools.partial(jax.jit, static_argnames=("program",))
def eval_step(params, vocab, embed, target_params, batch, *, program: StepProgram):
  """Held-out loss, per-step top-1 agreement and its counts (no update; `program.optimizer` unused)."""
  return _metrics(*_loss_fn(params, vocab, embed, target_params, batch, program))


@functools.partial(jax.jit, static_argnames=("program",))
def eval_step_offline(params, vocab, embed, head_rows, batch, *, program: StepProgram):
  """`eval_step` from stored features (the batch and `head_rows` as `train_step_offline`'s)."""
  return _metrics(*_offline_loss_fn(params, vocab, embed, head_rows, batch, program))
