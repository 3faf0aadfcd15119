"""Target-model configuration: the first thing read from a checkpoint.

`ModelConfig` is the one description of a Llama-family decoder that the Flax target, the weight loaders,
the analysis and the draft agree on. It is built from a checkpoint's `config.json` through transformers'
`AutoConfig` (no torch needed), normalising the two ways rope settings are written: transformers 5's
`rope_parameters` and the older `rope_theta` + `rope_scaling`.
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
}


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

  @property
  def rope_scaling_dict(self) -> dict[str, Any] | None:
    return None if self.rope_scaling is None else dict(self.rope_scaling)

  @classmethod
  def from_hf(cls, hf_config: Any) -> "ModelConfig":
    """Builds a config from a transformers `PretrainedConfig` (or its dict), validating support."""
    get = hf_config.get if isinstance(hf_config, Mapping) else (
        lambda k, d=None: getattr(hf_config, k, d))
    model_type = get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
          f"Unsupported model_type {model_type!r}: layerwave's target supports "
          f"{sorted(SUPPORTED_MODEL_TYPES)} (Llama-family decoders). Convert the checkpoint to one "
          "of these or add the family to layerwave/models/config.py.")
    for moe_key in ("num_local_experts", "num_experts", "n_routed_experts"):
      if get(moe_key):
        raise ValueError(f"Unsupported feature: mixture-of-experts ({moe_key}={get(moe_key)}); "
                         "layerwave's target is a dense decoder.")
    bias, qk_norm = SUPPORTED_MODEL_TYPES[model_type]
    num_heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    head_dim = get("head_dim") or hidden // num_heads
    theta, scaling = _rope_settings(get)
    sliding = get("sliding_window")
    use_sliding = get("use_sliding_window", model_type == "mistral")
    max_pos = int(get("max_position_embeddings") or 4096)
    if sliding and use_sliding and int(sliding) < max_pos:
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
    )

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike[str]) -> "ModelConfig":
    """Reads `config.json` from a checkpoint directory via transformers' AutoConfig."""
    import transformers  # pylint: disable=g-import-not-at-top
    return cls.from_hf(transformers.AutoConfig.from_pretrained(os.fspath(path)))


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
