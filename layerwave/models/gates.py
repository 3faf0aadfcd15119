"""Learned layer gates: a draft whose fusion reads every candidate depth, each through a gate it learns.

Place in the pipeline: an alternative to choosing the draft's layers from statistics (`layerwave.selection`).
A gated draft (`DraftConfig.gates`) reads every candidate depth; its fusion is

    g_t = fc(concat(z_1 * norm_1(h_{l1,t}), ..., z_n * norm_n(h_{ln,t})))

with one gate z_l per depth, and its training loss adds a regulariser that leaves about k depths in use. The
k largest gate values (`LayerGates.values`) are then a selection (`layerwave.training.learned`). Every depth
enters through its RMSNorm (`draft_model.fc_norm`, required), so the gates compare depths at one scale: the
residual stream's norm grows with depth, and without the norms a deep layer would need smaller weights for the
same effect.

Three kinds (`GateConfig.kind`):

- `hard_concrete` — L0 gates (Louizos, Welling, Kingma 2018): per depth a log α; in training z is a stretched,
  clipped binary-concrete sample (β = 2/3, stretch to (−0.1, 1.1)), so a gate is exactly 0 or 1 with positive
  probability; at evaluation z = clip(sigmoid(log α)·1.2 − 0.1, 0, 1). Regulariser λ · max(0, Σ P(z_l ≠ 0) − k):
  the expected number of open gates pushed down to k. Value: P(z_l ≠ 0).
- `softmax` — one distribution p over the depths, z_l = k_d · p_l (k_d the depths read) (every z = 1 at initialisation). Regulariser
  λ · max(0, H(p) − log k): p's entropy pushed down to that of k equal depths. Value: p_l.
- `group_lasso` — no gate parameter (z = 1); the regulariser is a group lasso on fc's per-depth blocks,
  λ · Σ_{l outside the k largest} ‖W_l diag(s_l)‖_F (W_l the block of fc reading depth l, s_l its norm's
  scale), which drives all but k blocks towards zero. Value: ‖W_l diag(s_l)‖_F.

With every gate open (z = 1: hard_concrete at large log α, group_lasso always, softmax at initialisation) the
fusion is the ungated draft's on the same depths with `fc_norm`, exactly.

Gate logits learn `GateConfig.lr_scale` times faster than the rest of the draft (they are stored divided by it:
under Adam a parameter multiplied by c moves c times as far per step), since a short CPU budget at the draft's
learning rate would barely move them.

Legend (`layerwave.axes`): k selected layers (a gated draft's: every candidate depth), B batch, D target
width, d draft width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array

__all__ = ["KINDS", "GateConfig", "LayerGates"]

KINDS = ("hard_concrete", "softmax", "group_lasso")

# The hard-concrete distribution's temperature and stretch (Louizos et al. 2018's values).
BETA, GAMMA, ZETA = 2.0 / 3.0, -0.1, 1.1
# Initial log α: every gate open with probability 0.97 (nearly the all-depth draft at first).
INIT_LOG_ALPHA = 2.0
# The hard-concrete noise's base key; each training step folds its step number in.
NOISE_SEED = 0


@dataclasses.dataclass(frozen=True)
class GateConfig:
  """How a gated draft's depths are gated and regularised (static: part of the draft's config).

  Attributes:
    kind: one of `KINDS`.
    k: the number of depths the regulariser leaves in use (the selection's size).
    strength: λ, the regulariser's weight in the loss.
    lr_scale: the gate logits' learning rate relative to the draft's (hard_concrete, softmax).
  """

  kind: str
  k: int = 3
  strength: float = 0.1
  lr_scale: float = 100.0

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"gates must be one of {list(KINDS)} (or '' for an ungated draft), got {self.kind!r}; "
                       "set e.g. --config.draft_model.gates=softmax.")
    if self.k < 1:
      raise ValueError(f"gate k must be >= 1, got {self.k}; set --config.draft_model.gate_k=3.")
    if self.strength < 0 or self.lr_scale <= 0:
      raise ValueError(f"gate strength must be >= 0 and lr_scale > 0, got {self.strength} and {self.lr_scale}.")


class LayerGates(nnx.Module):
  """One gate per candidate depth, and the regulariser that leaves `config.k` of them in use."""

  def __init__(self, config: GateConfig, num_depths: int):
    if config.k > num_depths:
      raise ValueError(f"gate k={config.k} is larger than the {num_depths} candidate depths the draft reads; "
                       f"set --config.draft_model.gate_k to at most {num_depths}.")
    self.config = config
    self.num_depths = num_depths
    if config.kind == "hard_concrete":
      self.logits = nnx.Param(jnp.full((num_depths,), INIT_LOG_ALPHA / config.lr_scale, jnp.float32))
    elif config.kind == "softmax":
      self.logits = nnx.Param(jnp.zeros((num_depths,), jnp.float32))
    else:
      self.logits = None

  def _logits(self) -> Array:
    return self.logits[...].astype(jnp.float32) * self.config.lr_scale

  def __call__(self, batch: int, step: Array | None = None) -> Array:
    """The gates `[k, B]` the fusion multiplies each depth by: sampled per sequence in training (`step`, the
    training step that seeds the hard-concrete noise), deterministic at evaluation (`step` None)."""
    kind, n = self.config.kind, self.num_depths
    if kind == "group_lasso":
      return jnp.ones((n, batch), jnp.float32)
    logits = self._logits()
    if kind == "softmax":
      z = n * jax.nn.softmax(logits)
      return jnp.broadcast_to(z[:, None], (n, batch))
    if step is None:
      z = jnp.clip(jax.nn.sigmoid(logits) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)
      return jnp.broadcast_to(z[:, None], (n, batch))
    key = jax.random.fold_in(jax.random.key(NOISE_SEED), step)
    u = jax.random.uniform(key, (n, batch), jnp.float32, 1e-6, 1.0 - 1e-6)
    s = jax.nn.sigmoid((jnp.log(u) - jnp.log1p(-u) + logits[:, None]) / BETA)
    return jnp.clip(s * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)

  def values(self, fc_kernel: Array, norm_scales: Array) -> Array:
    """`[k]` float32: each depth's gate value, whose ranking is the learned selection.

    Args:
      fc_kernel: `[k * D, d]` the fusion's kernel (rows of depth l: l*D .. (l+1)*D).
      norm_scales: `[k, D]` the per-depth RMSNorm scales.
    """
    kind = self.config.kind
    if kind == "hard_concrete":
      return jax.nn.sigmoid(self._logits() - BETA * jnp.log(-GAMMA / ZETA))
    if kind == "softmax":
      return jax.nn.softmax(self._logits())
    return block_norms(fc_kernel, norm_scales)

  def penalty(self, fc_kernel: Array, norm_scales: Array) -> Array:
    """The regulariser (a float32 scalar, already weighted by λ) that leaves about k depths in use."""
    c = self.config
    values = self.values(fc_kernel, norm_scales)
    if c.kind == "hard_concrete":
      excess = jnp.sum(values) - c.k
    elif c.kind == "softmax":
      entropy = -jnp.sum(values * jnp.log(jnp.maximum(values, 1e-30)))
      excess = entropy - jnp.log(float(c.k))
    else:
      kept = jax.lax.stop_gradient(jnp.zeros_like(values).at[jax.lax.top_k(values, c.k)[1]].set(1.0))
      return c.strength * jnp.sum(values * (1.0 - kept))
    return c.strength * jnp.maximum(excess, 0.0)


def block_norms(fc_kernel: Array, norm_scales: Array) -> Array:
  """`[k]` ‖W_l diag(s_l)‖_F: how strongly fc reads each (normalised) depth."""
  n, big_d = norm_scales.shape
  blocks = fc_kernel.astype(jnp.float32).reshape(n, big_d, -1) * norm_scales.astype(jnp.float32)[:, :, None]
  return jnp.sqrt(jnp.sum(blocks * blocks, axis=(1, 2)) + 1e-12)  # finite gradient at a zero block
