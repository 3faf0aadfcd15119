"""One online training step of the draft: frozen target forward → TTT loss → optax update, all jitted.

The target runs inside the step (no gradient) to produce the selected layers' hidden states and its
logits, so no hidden state is ever stored (SpecForge's offline recipe needs terabytes for this). The batch
is sharded over the mesh's `'data'` axis and the parameters replicated; XLA inserts the gradient all-reduce.

The draft is split into three pytrees at the jit boundary: trainable `Param`s (in `TrainState`), the
vocabulary tables (`VocabMap`, saved with the draft) and the frozen target embedding (`Frozen`, never saved:
it is the target's).

The optimizer enters the jitted step as its hyperparameters (`OptimizerSettings`, hashable and compared by
value), and the step builds the optax chain inside the trace: equal settings share one compilation, where an
optax transformation, a new object per call, would compile the step anew every time one is built.
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
    end_lr_fraction: the learning rate at `total_steps`, as a fraction of `lr`.
  """

  lr: float
  warmup_steps: int
  total_steps: int
  clip_norm: float = 0.5
  b1: float = 0.9
  b2: float = 0.95
  weight_decay: float = 0.0
  end_lr_fraction: float = 0.0

  def build(self) -> optax.GradientTransformation:
    """The optax transformation (a new object per call; its state's structure is always the same)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=self.lr, warmup_steps=max(int(self.warmup_steps), 1),
        decay_steps=max(int(self.total_steps), int(self.warmup_steps) + 1),
        end_value=self.lr * self.end_lr_fraction)
    return optax.chain(optax.clip_by_global_norm(self.clip_norm),
                       optax.adamw(schedule, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay))


def init_state(params, optimizer: OptimizerSettings) -> TrainState:
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.build().init(params))


def _loss_fn(params, draft_graphdef, vocab, embed, target_graphdef, target_params, batch, steps,
             decay, assistant_only):
  tokens, attn = batch["input_ids"], batch["attention_mask"]
  draft = nnx.merge(draft_graphdef, params, vocab, embed)
  target = nnx.merge(target_graphdef, target_params)
  positions = jnp.maximum(jnp.cumsum(attn, axis=-1) - 1, 0)
  out = target(tokens, positions, causal_mask(attn), return_hidden_states=True,
               hidden_layers=draft.config.layer_ids)
  features = jax.lax.stop_gradient(out.hidden_states)
  logits = jax.lax.stop_gradient(out.logits)
  loss_mask = batch["assistant_mask"] if assistant_only else attn
  logp, in_vocab = losses.target_targets(logits, draft)
  return losses.ttt_loss(draft, features, logp, in_vocab, tokens, attn, loss_mask, steps=steps,
                         decay=decay)


def _metrics(loss, aux):
  """Step metrics; the counts `hits_j`, `tokens_j`, `in_vocab_j` let an evaluation pool batches."""
  return {"loss": loss, "loss_j": aux["loss_j"], "acc_j": aux["acc_j"],
          "acc_in_vocab_j": aux["acc_in_vocab_j"], "hits_j": aux["hits_j"],
          "tokens_j": aux["tokens_j"], "in_vocab_j": aux["in_vocab_j"], "tokens": aux["tokens_j"][0],
          "sim_tau": losses.simulated_tau(aux["acc_j"])}


TRAIN_STEP_STATIC = ("draft_graphdef", "target_graphdef", "optimizer", "steps", "decay", "assistant_only")


@functools.partial(jax.jit, static_argnames=TRAIN_STEP_STATIC, donate_argnames=("state",))
def train_step(state: TrainState, vocab, embed, target_params, batch, *, draft_graphdef,
               target_graphdef, optimizer: OptimizerSettings, steps, decay, assistant_only):
  """One optimisation step. Returns `(new_state, metrics)`; metrics stay on device."""
  grad_fn = jax.value_and_grad(_loss_fn, has_aux=True)
  (loss, aux), grads = grad_fn(state.params, draft_graphdef, vocab, embed, target_graphdef,
                               target_params, batch, steps, decay, assistant_only)
  updates, opt_state = optimizer.build().update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = _metrics(loss, aux)
  metrics["grad_norm"] = optax.global_norm(grads)
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


@functools.partial(jax.jit, static_argnames=("draft_graphdef", "target_graphdef", "steps", "decay",
                                             "assistant_only"))
def eval_step(params, vocab, embed, target_params, batch, *, draft_graphdef, target_graphdef,
              steps, decay, assistant_only):
  """Held-out loss and per-step top-1 agreement (no update)."""
  loss, aux = _loss_fn(params, draft_graphdef, vocab, embed, target_graphdef, target_params, batch,
                       steps, decay, assistant_only)
  return _metrics(loss, aux)
