"""Target-model configuration: the first thing read from a checkpoint.

`ModelConfig` is the one description of a decoder that the Flax target, the weight loaders, the analysis and
the draft agree on: a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) or Gemma 3's text decoder. It is
built from a checkpoint's `config.json` through transformers' `AutoConfig` (no torch needed), normalising the
two ways rope settings are written: transformers 5's `rope_parameters` and the older `rope_theta` +
`rope_scaling`.

Gemma 3 (`model_type` "gemma3_text", `Gemma3ForCausalLM`) differs from the Llama block in ways the config
carries: (1 + w) RMSNorms, norms before and after attention and the MLP, q/k RMSNorm, a GELU-tanh MLP,
embeddings scaled by sqrt(D), attention scaled by `query_pre_attn_scalar`, sliding-window attention on the
layers `layer_types` marks `sliding_attention` (their RoPE base `rope_local_theta`), global attention on the
others (base `rope_theta`), and optional tanh soft-capping of the final logits. Gemma 1/2 and the multimodal
Gemma 3 checkpoint are refused by name.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

# model_type -> (q/k/v bias, q/k RMSNorm). Every family here is the same pre-norm decoder with RoPE,
# grouped-query attention and a SwiGLU MLP; they differ only in these two switches.
SUPPORTED_MODEL_TYPES = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
    "gemma3_text": (False, True),
}
GEMMA3 = "gemma3_text"
# Families that look close enough to be tried, with the reason each is refused.
_REFUSED = {
    "gemma": "Gemma 1 (no q/k norm, no sliding window) is not supported; layerwave supports Gemma 3 text "
             "checkpoints (model_type 'gemma3_text').",
    "gemma2": "Gemma 2 (attention-logit soft-capping, alternating sliding windows without q/k norm) is not "
              "supported; layerwave supports Gemma 3 text checkpoints (model_type 'gemma3_text').",
    "gemma3": "this is a Gemma 3 multimodal checkpoint (Gemma3ForConditionalGeneration, a vision tower plus "
              "a text decoder); layerwave's target is the text decoder only. Use a text-only Gemma 3 "
              "checkpoint (model_type 'gemma3_text', Gemma3ForCausalLM, e.g. gemma-3-270m or gemma-3-1b).",
    "gemma3n": "Gemma 3n (per-layer embeddings, AltUp) is not supported; layerwave supports Gemma 3 text "
               "checkpoints (model_type 'gemma3_text').",
}
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a Llama-family decoder.

  Attributes:
    model_type: one of `SUPPORTED_MODEL_TYPES`.
    vocab_size: V.
    hidden_size: D.
    intermediate_size: MLP width.
    num_layers: L, the number of decoder blocks; hidden states have L + 1 entries.
    num_heads: query heads.
    num_kv_heads: key/value heads (grouped-query attention when fewer than num_heads).
    head_dim: per-head width (explicit: not always hidden_size // num_heads).
    rms_norm_eps: epsilon of every RMSNorm.
    rope_theta: RoPE base.
    rope_scaling: None, or a dict with `rope_type` ("llama3" or "linear") and its parameters.
    max_position_embeddings: longest supported sequence.
    tie_word_embeddings: lm_head shares the embedding matrix.
    attention_bias: q/k/v projections carry a bias (Qwen2).
    qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3).
    bos_token_id: beginning-of-sequence id, if any.
    eos_token_ids: every id that ends generation.
    sliding_window: Gemma 3: how many keys (the query's own included) a sliding layer reads.
    layer_types: Gemma 3: per block, "sliding_attention" or "full_attention".
    rope_local_theta: Gemma 3: RoPE base of the sliding layers (`rope_theta` is the global layers').
    query_pre_attn_scalar: Gemma 3: attention scores are scaled by its -1/2 power (not head_dim's).
    final_logit_softcapping: Gemma 3: logits = c * tanh(logits / c) when set.

  The Gemma fields are None for every other family, and `identity()` leaves them out then, so configs of
  the Llama family fingerprint as they did before Gemma was added.
  """

  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  qk_norm: bool = False
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  sliding_window: int | None = None
  layer_types: tuple[str, ...] | None = None
  rope_local_theta: float | None = None
  query_pre_attn_scalar: float | None = None
  final_logit_softcapping: float | None = None

  @property
  def gemma(self) -> bool:
    """Gemma 3's block: (1 + w) norms, sandwich norms, GELU-tanh MLP, scaled embeddings."""
    return self.model_type == GEMMA3

  def is_sliding(self, layer: int) -> bool:
    """Whether block `layer` (0-based) attends through the sliding window."""
    return self.layer_types is not None and self.layer_types[layer] == SLIDING

  def identity(self) -> dict[str, Any]:
    """The config as a dict for fingerprints: every field, less the Gemma fields when they are unset."""
    d = dataclasses.asdict(self)
    for name in _GEMMA_FIELDS:
      if d[name] is None:
        del d[name]
    return d

  @property
  def rope_scaling_dict(self) -> dict[str, Any] | None:
    return None if self.rope_scaling is None else dict(self.rope_scaling)

  @classmethod
  def from_hf(cls, hf_config: Any) -> "ModelConfig":
    """Builds a config from a transformers `PretrainedConfig` (or its dict), validating support."""
    get = hf_config.get if isinstance(hf_config, Mapping) else (
        lambda k, d=None: getattr(hf_config, k, d))
    model_type = get("model_type")
    if model_type in _REFUSED:
      raise ValueError(f"Unsupported model_type {model_type!r}: {_REFUSED[model_type]}")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
          f"Unsupported model_type {model_type!r}: layerwave's target supports "
          f"{sorted(SUPPORTED_MODEL_TYPES)} (Llama-family decoders and Gemma 3 text). Convert the checkpoint to one "
          "of these or add the family to layerwave/models/config.py.")
    for moe_key in ("num_local_experts", "num_experts", "n_routed_experts"):
      if get(moe_key):
        raise ValueError(f"Unsupported feature: mixture-of-experts ({moe_key}={get(moe_key)}); "
                         "layerwave's target is a dense decoder.")
    bias, qk_norm = SUPPORTED_MODEL_TYPES[model_type]
    num_heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    head_dim = get("head_dim") or hidden // num_heads
    max_pos = int(get("max_position_embeddings") or 4096)
    gemma = _gemma_fields(get, max_pos) if model_type == GEMMA3 else {}
    theta, scaling = _rope_settings(get)
    sliding = get("sliding_window")
    use_sliding = get("use_sliding_window", model_type == "mistral")
    if not gemma and sliding and use_sliding and int(sliding) < max_pos:
      raise ValueError(
          f"Unsupported feature: sliding-window attention (sliding_window={sliding} < "
          f"max_position_embeddings={max_pos}); layerwave's cache is full attention. Set "
          "sliding_window to null in config.json if the model was trained without it.")
    eos = get("eos_token_id")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])
                    if e is not None)
    return cls(
        model_type=model_type,
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_layers=int(get("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(get("rms_norm_eps") or 1e-6),
        rope_theta=float(theta),
        rope_scaling=None if scaling is None else tuple(sorted(scaling.items())),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        attention_bias=bool(get("attention_bias", False)) or bias,
        qk_norm=qk_norm,
        bos_token_id=get("bos_token_id"),
        eos_token_ids=eos_ids,
        **gemma,
    )

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike[str]) -> "ModelConfig":
    """Reads `config.json` from a checkpoint directory via transformers' AutoConfig."""
    import transformers  # pylint: disable=g-import-not-at-top
    return cls.from_hf(transformers.AutoConfig.from_pretrained(os.fspath(path)))


_GEMMA_FIELDS = ("sliding_window", "layer_types", "rope_local_theta", "query_pre_attn_scalar",
                 "final_logit_softcapping")


def _gemma_fields(get, max_pos: int) -> dict[str, Any]:
  """Gemma 3's extra settings, validated; the global layers' RoPE is read by `_rope_settings`."""
  num_layers = int(get("num_hidden_layers"))
  act = get("hidden_activation") or get("hidden_act") or "gelu_pytorch_tanh"
  if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
    raise ValueError(f"Unsupported feature: Gemma 3 with hidden_activation {act!r}; layerwave's Gemma MLP "
                     "is GELU with the tanh approximation ('gelu_pytorch_tanh').")
  if get("use_bidirectional_attention"):
    raise ValueError("Unsupported feature: use_bidirectional_attention (an embedding model, not a causal "
                     "LM); layerwave's target is causal.")
  if get("attn_logit_softcapping") is not None:
    # Gemma 2 capped attention scores; Gemma 3 releases set null, and transformers' Gemma 3 ignores the
    # field, so there is no reference to match a capped forward against.
    raise ValueError(f"Unsupported feature: attn_logit_softcapping={get('attn_logit_softcapping')} (Gemma 3 "
                     "checkpoints set it to null; transformers' Gemma 3 does not apply it).")
  types = get("layer_types")
  if types is None:  # older configs: every `sliding_window_pattern`-th block is global
    pattern = int(get("sliding_window_pattern") or 6)
    types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
  types = tuple(str(t) for t in types)
  if len(types) != num_layers or set(types) - {SLIDING, FULL}:
    raise ValueError(f"layer_types must name {num_layers} blocks, each {SLIDING!r} or {FULL!r}; got "
                     f"{list(types)}.")
  window = get("sliding_window")
  if SLIDING in types:
    if window is None or int(window) < 1:
      raise ValueError(f"Gemma 3 config has sliding layers but sliding_window={window!r}.")
    if int(window) > max_pos:
      raise ValueError(
          f"sliding_window {int(window)} is longer than the longest sequence the model's cache can hold "
          f"(max_position_embeddings {max_pos}): the config is inconsistent. Fix sliding_window or "
          "max_position_embeddings in config.json.")
  params = get("rope_parameters") or {}
  local = dict(params.get(SLIDING) or {}) if isinstance(params, Mapping) else {}
  if local.get("rope_type", "default") not in (None, "default"):
    raise ValueError(f"Unsupported feature: rope scaling {local.get('rope_type')!r} on the sliding layers.")
  local_theta = local.get("rope_theta", get("rope_local_base_freq") or 10000.0)
  head_dim = get("head_dim") or int(get("hidden_size")) // int(get("num_attention_heads"))

  def opt(key):
    value = get(key)
    return None if value is None else float(value)

  return dict(sliding_window=None if SLIDING not in types else int(window), layer_types=types,
              rope_local_theta=float(local_theta),
              query_pre_attn_scalar=float(get("query_pre_attn_scalar") or head_dim),
              final_logit_softcapping=opt("final_logit_softcapping"))


def _rope_settings(get) -> tuple[float, dict[str, Any] | None]:
  """Returns (theta, scaling) from either `rope_parameters` (transformers 5) or the older fields."""
  params = get("rope_parameters")
  if params:
    params = dict(params)
    if "rope_theta" not in params and "full_attention" in params:  # per-layer-type layouts
      params = dict(params["full_attention"])
    theta = params.get("rope_theta", get("rope_theta") or 10000.0)
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
  else:
    theta = get("rope_theta") or 10000.0
    scaling = dict(get("rope_scaling") or {})
  rope_type = scaling.get("rope_type", scaling.get("type", "default"))
  if rope_type in (None, "default"):
    return theta, None
  if rope_type not in ("llama3", "linear"):
    raise ValueError(f"Unsupported feature: rope_scaling of type {rope_type!r}; layerwave supports "
                     "'default', 'linear' and 'llama3'.")
  scaling["rope_type"] = rope_type
  scaling.pop("type", None)
  return theta, scaling
