"""The EAGLE-3 draft in Flax NNX: what the selected target layers feed (docs/METHOD.md §7).

    g_t   = fc(concat(h_{l1,t}, ..., h_{lk,t}))                      fuse k target layers, k*D -> d
    u_t   = concat(norm_e(embed(x_{t+1})), norm_g(g_t))              2d wide, embedding first
    a_t   = g_t + attn(u_t)                                          residual on the un-normed g
    h_t   = a_t + mlp(norm(a_t))                                     the recurrent feature
    logits = lm_head(norm(h_t))                                      over the draft vocabulary V_d

Draft position t takes (g_t, x_{t+1}) and predicts x_{t+2}; when drafting a chain, the next position reads
the draft's own h_t as its g. The token embedding is a frozen copy of the target's. `d2t` / `t2d` map the
draft vocabulary to the target's exactly as published EAGLE-3 checkpoints do:
`target_id = draft_id + d2t[draft_id]`, and `t2d[target_id]` is True for tokens in the draft vocabulary.

Two ways to run it: `__call__` against a `KVCache` (decoding, any mask among new tokens, as the target), and
`ttt_step` for the training-time test (causal over step-0 keys plus same-position keys of earlier steps).

Legend (`layerwave.axes`): B batch, T tokens, L target layers, k selected layers, D target width, d draft width,
V target vocabulary, V_d draft vocabulary, H query heads, G key/value heads, Dh head width, K draft depth.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layerwave.models import gates as gates_lib
from layerwave.models import kv_cache
from layerwave.models import layers
from layerwave.models.config import ModelConfig
from layerwave.models.kv_cache import KVCache
from layerwave.models.target import Attention, CausalKernel, DecoderLayer

Array = jax.Array


class Frozen(nnx.Variable):
  """A non-trainable array (the copied target embedding); optimizers built with wrt=nnx.Param skip it."""


class VocabMap(nnx.Variable):
  """Integer/boolean vocabulary tables (`d2t`, `t2d`)."""


@dataclasses.dataclass(frozen=True)
class DraftConfig:
  """Everything that fixes a draft's shapes and its contract with the target.

  Attributes:
    layer_ids: selected target depths (HF hidden-state convention, sorted, unique).
    target_num_layers: L of the target the draft reads.
    target_hidden_size: D.
    target_vocab_size: V.
    model: the draft decoder's own shape (hidden_size d, heads, MLP, num_layers, vocab_size = V_d).
    fc_norm: RMSNorm each selected layer's chunk before the fc (optional; EAGLE-3 has none).
    gates: a learned gate per layer and its regulariser (`layerwave.models.gates`), or None (EAGLE-3's fusion).
  """

  layer_ids: tuple[int, ...]
  target_num_layers: int
  target_hidden_size: int
  target_vocab_size: int
  model: ModelConfig
  fc_norm: bool = False
  gates: gates_lib.GateConfig | None = None

  def __post_init__(self):
    if self.gates is not None and not self.fc_norm:
      raise ValueError("A gated draft normalises every depth before its gate, so that gates compare depths at one "
                       "scale: set --config.draft_model.fc_norm=True with --config.draft_model.gates.")

  @property
  def draft_vocab_size(self) -> int:
    return self.model.vocab_size

  @classmethod
  def from_target(cls, target: ModelConfig, layer_ids, draft_vocab_size: int = 32000,
                  num_layers: int = 1, hidden_size: int | None = None,
                  intermediate_size: int | None = None, fc_norm: bool = False,
                  gates: gates_lib.GateConfig | None = None) -> "DraftConfig":
    """Default sizes: the target's width, heads and MLP, one layer, V_d capped at the target's V."""
    ids = tuple(int(i) for i in layer_ids)
    validate_layer_ids(ids, target.num_layers)
    if draft_vocab_size < 1 or draft_vocab_size > target.vocab_size:
      raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [1, {target.vocab_size}] "
                       "(the target's vocabulary size).")
    d = hidden_size or target.hidden_size
    model = dataclasses.replace(
        llama_style(target), vocab_size=int(draft_vocab_size), hidden_size=d, num_layers=int(num_layers),
        intermediate_size=intermediate_size or target.intermediate_size,
        head_dim=target.head_dim if d == target.hidden_size else d // target.num_heads,
        tie_word_embeddings=False, attention_bias=False, qk_norm=False)
    return cls(layer_ids=ids, target_num_layers=target.num_layers,
               target_hidden_size=target.hidden_size, target_vocab_size=target.vocab_size,
               model=model, fc_norm=fc_norm, gates=gates)

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["model"]["rope_scaling"] = self.model.rope_scaling_dict
    d["layer_ids"] = list(self.layer_ids)
    d["model"]["eos_token_ids"] = list(self.model.eos_token_ids)
    if self.gates is None:
      d.pop("gates")  # an ungated draft's record reads as it did before gates existed
    return d

  @classmethod
  def from_dict(cls, d: dict) -> "DraftConfig":
    m = dict(d["model"])
    scaling = m.get("rope_scaling")
    m["rope_scaling"] = None if scaling is None else tuple(sorted(scaling.items()))
    m["eos_token_ids"] = tuple(m.get("eos_token_ids") or ())
    return cls(layer_ids=tuple(d["layer_ids"]), target_num_layers=d["target_num_layers"],
               target_hidden_size=d["target_hidden_size"],
               target_vocab_size=d["target_vocab_size"], model=ModelConfig(**m),
               fc_norm=bool(d.get("fc_norm", False)),
               gates=gates_lib.GateConfig(**d["gates"]) if d.get("gates") else None)

  def check_target(self, target: ModelConfig) -> None:
    """Raises if this draft was not made for `target` (L, D, V)."""
    got = (target.num_layers, target.hidden_size, target.vocab_size)
    want = (self.target_num_layers, self.target_hidden_size, self.target_vocab_size)
    if got != want:
      raise ValueError(f"This draft was trained for a target with (L, D, V) = {want}, but the given "
                       f"target has {got}. Load the draft with the target it was trained on.")


def llama_style(target: ModelConfig) -> ModelConfig:
  """`target`'s config with its family-specific block fields reset, as the draft block's base.

  The draft block is Llama-style whatever the target's family (as published EAGLE-3 drafts for Gemma and
  Qwen): a Gemma target's (1 + w) norms, sandwich norms, sliding window and soft-capping are not copied.
  `DraftConfig.from_target` and the EAGLE-3 import (`layerwave.eagle3`) both build on it.
  """
  if not target.gemma:
    return target
  return dataclasses.replace(target, model_type="llama", sliding_window=None, layer_types=None,
                             rope_local_theta=None, query_pre_attn_scalar=None, final_logit_softcapping=None)


def validate_layer_ids(ids, num_layers: int) -> None:
  """Layer ids must be sorted, unique, within [0, L] (HF hidden-state convention)."""
  ids = list(ids)
  if not ids:
    raise ValueError("At least one layer id is needed.")
  bad = [i for i in ids if not 0 <= i <= num_layers]
  if bad:
    raise ValueError(f"Layer ids {bad} are out of range for a target with L={num_layers} "
                     f"(valid: 0..{num_layers}, HF hidden-state convention).")
  if len(set(ids)) != len(ids) or ids != sorted(ids):
    raise ValueError(f"Layer ids {ids} must be sorted and unique.")


class DraftLayer(nnx.Module):
  """The EAGLE-3 midlayer: attention over concat(norm(embedding), norm(g)), residual on g."""

  def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
    d = config.hidden_size
    self.input_layernorm = layers.RMSNorm(d, config.rms_norm_eps, dtype=dtype)
    self.hidden_norm = layers.RMSNorm(d, config.rms_norm_eps, dtype=dtype)
    self.self_attn = Attention(config, dtype=dtype, rngs=rngs, d_in=2 * d)
    self.post_attention_layernorm = layers.RMSNorm(d, config.rms_norm_eps, dtype=dtype)
    self.mlp = layers.MLP(d, config.intermediate_size, dtype=dtype, rngs=rngs)

  def attn_input(self, g, emb):
    return jnp.concatenate([self.input_layernorm(emb), self.hidden_norm(g)], axis=-1)

  def finish(self, g, attn_out):
    a = g + attn_out
    return a + self.mlp(self.post_attention_layernorm(a))


class Draft(nnx.Module):
  """EAGLE-3 draft. Attribute names follow published EAGLE-3 checkpoints (`fc`, `midlayer`, ...)."""

  def __init__(self, config: DraftConfig, embedding: Array | None = None, *, dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.config = config
    # Static (in the graphdef): the dtype of the KV cache. Not read off the parameters, whose first leaf
    # may be the int32 `d2t` table.
    self.compute_dtype = jnp.dtype(dtype)
    c = config.model
    k, big_d = len(config.layer_ids), config.target_hidden_size
    self.fc = layers.Linear(k * big_d, c.hidden_size, dtype=dtype, rngs=rngs)
    self.fc_norms = nnx.List([layers.RMSNorm(big_d, c.rms_norm_eps, dtype=dtype)
                              for _ in range(k)]) if config.fc_norm else None
    self.gates = gates_lib.LayerGates(config.gates, k) if config.gates is not None else None
    if embedding is None:
      embedding = nnx.initializers.normal(0.02)(rngs.params(), (config.target_vocab_size, big_d),
                                                dtype)
    self.embed_tokens = Frozen(jnp.asarray(embedding, dtype))
    self.midlayer = DraftLayer(c, dtype=dtype, rngs=rngs)
    self.extra_layers = nnx.List([DecoderLayer(c, dtype=dtype, rngs=rngs)
                                  for _ in range(c.num_layers - 1)])
    self.norm = layers.RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
    self.lm_head = layers.Linear(c.hidden_size, c.vocab_size, dtype=dtype, rngs=rngs)
    v_d = c.vocab_size
    self.d2t = VocabMap(jnp.zeros((v_d,), jnp.int32))  # identity map until a vocabulary is set
    self.t2d = VocabMap(jnp.arange(config.target_vocab_size) < v_d)

  # -- pieces ------------------------------------------------------------------------------------
  def inv_freq(self) -> Array:
    c = self.config.model
    return jnp.asarray(layers.rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling_dict),
                       jnp.float32)

  def fuse(self, features: Array, step: Array | None = None) -> Array:
    """`features [k, B, T, D]` (the selected target layers) → g `[B, T, d]`.

    A gated draft multiplies each normalised layer by its gate (`layerwave.models.gates`): sampled when `step`
    (the training step) is given, deterministic otherwise.
    """
    chunks = list(features)
    if self.fc_norms is not None:
      chunks = [n(x) for n, x in zip(self.fc_norms, chunks)]
    if self.gates is not None:
      z = self.gates(features.shape[1], step)  # [k, B]
      chunks = [x * z[i][:, None, None].astype(x.dtype) for i, x in enumerate(chunks)]
    return self.fc(jnp.concatenate(chunks, axis=-1))

  def gate_values(self) -> Array:
    """`[k]` the learned gate of each layer (`gates.LayerGates.values`); a gated draft only."""
    return self.gates.values(self.fc.kernel[...], self._norm_scales())

  def gate_penalty(self) -> Array:
    """The gates' regulariser (scalar, weighted); a gated draft only."""
    return self.gates.penalty(self.fc.kernel[...], self._norm_scales())

  def _norm_scales(self) -> Array:
    return jnp.stack([n.scale[...] for n in self.fc_norms])

  def embed(self, tokens: Array) -> Array:
    return jnp.take(self.embed_tokens[...], tokens, axis=0)

  def logits(self, h: Array) -> Array:
    """Pre-norm feature `[..., d]` → float32 logits over the draft vocabulary `[..., V_d]`."""
    return self.lm_head(self.norm(h)).astype(jnp.float32)

  def draft_to_target(self, draft_ids: Array) -> Array:
    return draft_ids + jnp.take(self.d2t[...], draft_ids)

  def draft_token_ids(self) -> Array:
    """Target ids of the draft vocabulary, `[V_d]` (sorted)."""
    return jnp.arange(self.config.draft_vocab_size) + self.d2t[...]

  # -- decoding against a cache -----------------------------------------------------------------
  def __call__(self, g: Array, tokens: Array, positions: Array, mask: Array, cache: KVCache,
               lengths: Array, causal: CausalKernel | None = None) -> tuple[Array, Array, KVCache]:
    """Runs new draft positions against the draft's cache (same contract as the target's forward).

    Args:
      g: `[B, T, d]` input features (fused target features, or the draft's own previous h).
      tokens: `[B, T]` the next token at each position (x_{t+1}).
      positions: `[B, T]` RoPE positions.
      mask: `[B, T, T]` mask among the new positions.
      cache: the draft's `KVCache` (one entry per draft layer); new keys at `lengths`.
      lengths: `[B]` committed draft-cache length per row.
      causal: a prefill into an empty cache (`lengths` zero, `mask` `causal_mask(causal.valid)`): the new
        positions read only each other, through the kernel `causal.impl` names (the target's; `[T, T]` never
        whole on an accelerator).

    Returns:
      (h `[B, T, d]` pre-norm features, logits `[B, T, V_d]`, updated cache).
    """
    inv_freq = self.inv_freq()
    full = kv_cache.cache_mask(mask, lengths, cache.slots)
    layer = self.midlayer
    out, kv = layer.self_attn(layer.attn_input(g, self.embed(tokens)), positions, inv_freq, full,
                              (cache.keys[0], cache.values[0]), lengths, causal=causal)
    h = layer.finish(g, out)
    keys, values = [kv[0]], [kv[1]]
    for i, extra in enumerate(self.extra_layers):
      h, kv = extra(h, positions, inv_freq, full, (cache.keys[i + 1], cache.values[i + 1]), lengths,
                    causal=causal)
      keys.append(kv[0])
      values.append(kv[1])
    return h, self.logits(h), KVCache(tuple(keys), tuple(values))

  # -- training-time test -------------------------------------------------------------------------
  def ttt_init(self, batch: int, length: int, steps: int, dtype=jnp.float32):
    """Zero buffers for the same-position keys/values of steps 1..K-1, per draft layer (K = `steps`)."""
    c = self.config.model
    shape = (max(steps - 1, 1), batch, length, c.num_kv_heads, c.head_dim)
    n = c.num_layers
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(n))

  def ttt_step(self, g: Array, tokens: Array, positions: Array, step: Array, base_kv, diag_kv,
               key_mask: Array, query_block: int | None = None, base_at_zero: bool = False):
    """One unrolled step of the training-time test over all positions at once.

    At step j a query at position t reads the step-0 keys at positions <= t (`base_kv`, computed at
    j = 0) and its own position's keys from steps 1..j (`diag_kv`, one softmax over both).

    Args:
      g: `[B, T, d]` features (step 0: fused target features; later: the previous step's h).
      tokens: `[B, T]` input tokens for this step (x_{t+1+j}).
      positions: `[B, T]` RoPE positions (t + j).
      step: scalar int, j.
      base_kv: per draft layer `(k0, v0)` `[B, T, G, Dh]`, or None at step 0 (they are computed).
      base_at_zero: every step in one loop (`step` traced): where `step` is 0 this call's own keys/values
        replace `base_kv` (a placeholder of their shape and dtype) and are returned as the new base.
      diag_kv: per draft layer `(kd, vd)` `[K-1, B, T, G, Dh]` buffers (`ttt_init`).
      key_mask: `[B, T]` real (non-padding) positions.
      query_block: attend `query_block` query rows at a time (`ttt_attend`), or all at once (None).

    Returns:
      (h `[B, T, d]`, logits `[B, T, V_d]`, base_kv, diag_kv).
    """
    inv_freq = self.inv_freq()
    t = tokens.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))[None] & key_mask.astype(bool)[:, None, :]
    all_layers = [self.midlayer, *self.extra_layers]
    new_base, new_diag = [], []
    x = g
    for i, layer in enumerate(all_layers):
      if i == 0:
        inp = layer.attn_input(x, self.embed(tokens))
      else:
        inp = layer.input_layernorm(x)
      attn = layer.self_attn
      b = inp.shape[0]
      q = attn.q_proj(inp).reshape(b, t, attn.num_heads, attn.head_dim)
      k = attn.k_proj(inp).reshape(b, t, attn.num_kv_heads, attn.head_dim)
      v = attn.v_proj(inp).reshape(b, t, attn.num_kv_heads, attn.head_dim)
      q = layers.apply_rope(q, positions, inv_freq)
      k = layers.apply_rope(k, positions, inv_freq)
      if base_kv is None:
        k0, v0 = k, v
      else:
        k0, v0 = base_kv[i]
        if base_at_zero:
          if (k0.dtype, v0.dtype) != (k.dtype, v.dtype):
            raise ValueError(f"base_kv placeholders are {k0.dtype}/{v0.dtype}, the keys/values "
                             f"{k.dtype}/{v.dtype}: make them in the draft's compute dtype.")
          k0, v0 = jnp.where(step == 0, k, k0), jnp.where(step == 0, v, v0)
      kd, vd = diag_kv[i]
      slot = jnp.maximum(step - 1, 0)
      kd = jnp.where(step > 0, kd.at[slot].set(k.astype(kd.dtype)), kd)
      vd = jnp.where(step > 0, vd.at[slot].set(v.astype(vd.dtype)), vd)
      diag_valid = jnp.arange(kd.shape[0]) < step  # steps 1..j
      out = ttt_attend(q, k0, v0, causal, kd, vd, diag_valid, query_block)
      out = attn.o_proj(out.reshape(b, t, -1))
      if i == 0:
        x = layer.finish(x, out)
      else:
        x = x + out
        x = x + layer.mlp(layer.post_attention_layernorm(x))
      new_base.append((k0, v0))
      new_diag.append((kd, vd))
    return x, self.logits(x), tuple(new_base), tuple(new_diag)


# Queries per block of the training-time-test attention on the memory-saving path (`train.remat`): the [B, H, T, T]
# scores of one draft step (0.5 GiB a sequence at T 2048 with 32 heads, in float32) then exist one block of rows
# at a time, each block recomputed in the backward pass (`jax.checkpoint`).
TTT_QUERY_BLOCK = 512


def ttt_attend(q, k0, v0, causal, kd, vd, diag_valid, block: int | None = None):
  """Attention over causal step-0 keys plus same-position keys of earlier steps, one softmax.

  Each query row's softmax is independent of the others', so with `block` set queries are taken `block` rows at
  a time (`jax.lax.map`, each block rematerialised in the backward pass) when T is longer than `block` and a
  multiple of it: the same values without the full [T, T] scores. Otherwise all rows form one block.

  Args:
    q: `[B, T, H, Dh]`; k0, v0: `[B, T, G, Dh]`; causal: `[B, T, T]`.
    kd, vd: `[K-1, B, T, G, Dh]` same-position keys/values of steps 1..K-1; diag_valid: `[K-1]`.
    block: query rows per block (`TTT_QUERY_BLOCK`), or None for one block.

  Returns:
    `[B, T, H, Dh]`.
  """
  t = q.shape[1]
  if block is None or t <= block or t % block:
    return _ttt_attend_block(q, k0, v0, causal, kd, vd, diag_valid)
  n = t // block
  rows = lambda x, axis: jnp.moveaxis(x.reshape(*x.shape[:axis], n, block, *x.shape[axis + 1:]), axis, 0)  # noqa: E731
  one = jax.checkpoint(lambda xs: _ttt_attend_block(xs[0], k0, v0, xs[1], xs[2], xs[3], diag_valid))
  out = jax.lax.map(one, (rows(q, 1), rows(causal, 1), rows(kd, 2), rows(vd, 2)))  # [n, B, block, H, Dh]
  return jnp.moveaxis(out, 0, 1).reshape(q.shape)


def _ttt_attend_block(q, k0, v0, causal, kd, vd, diag_valid):
  """`ttt_attend` for queries `[B, Tq, H, Dh]` (a block of rows) against every step-0 key: causal `[B, Tq, T]`,
  kd / vd `[K-1, B, Tq, G, Dh]` the block's same-position keys."""
  b, t, h, dh = q.shape
  g = k0.shape[2]
  q = q.reshape(b, t, g, h // g, dh)  # r = H / G query heads per key/value head; j indexes steps
  scale = 1.0 / np.sqrt(dh)
  # Float32 accumulation; in bfloat16 the backward einsums read bf16 operands too (`layers.einsum_low`).
  s0 = layers.einsum_low("btgrd,bsgd->bgrts", q, k0) * scale
  s0 = jnp.where(causal[:, None, None], s0, jnp.finfo(jnp.float32).min)
  sd = layers.einsum_low("btgrd,jbtgd->bgrtj", q, kd) * scale
  sd = jnp.where(diag_valid, sd, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(jnp.concatenate([s0, sd], axis=-1), axis=-1)
  s = k0.shape[1]
  p0, pd = probs[..., :s].astype(v0.dtype), probs[..., s:].astype(vd.dtype)
  out = (layers.einsum_low("bgrts,bsgd->btgrd", p0, v0)
         + layers.einsum_low("bgrtj,jbtgd->btgrd", pd, vd)).astype(v0.dtype)
  return out.reshape(b, t, h, dh)


def ttt_reference_mask(t: int, steps: int) -> np.ndarray:
  """Explicit boolean mask of the training-time test over the flattened (step, position) grid.

  Row (j, t) may read column (i, s) iff (i == 0 and s <= t) or (1 <= i <= j and s == t). Used by tests to
  check `ttt_attend` against a plain masked attention over all steps' keys.
  """
  m = np.zeros((steps, t, steps, t), bool)
  for j in range(steps):
    for pos in range(t):
      m[j, pos, 0, :pos + 1] = True
      for i in range(1, j + 1):
        m[j, pos, i, pos] = True
  return m.reshape(steps * t, steps * t)
