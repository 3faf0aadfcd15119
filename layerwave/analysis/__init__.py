"""Layer statistics: token filter → matrix entropy (informativeness) and CKA (diversity) → compartments.

Place in the pipeline: target hidden states [L+1, B, T, D] and logits → `stats` (streaming, one jitted
update per batch, driven by `collect.collect_stats` over a stream of batches) → `LayerStats` →
`layerwave.selection`; `report` and `analyze` (the analysis stage's `run`) write the results. The modules
hold small, pure, mask-aware jnp functions; this package re-exports the public names.

The Gram-entropy functions live in `entropy.py`; `layerwave.analysis.matrix_entropy` is the function.

Legend (`layerwave.axes`): L target layers, B batch, T tokens, D target width.
"""

from layerwave.analysis import cka
from layerwave.analysis import collect
from layerwave.analysis import compartments
from layerwave.analysis import entropy
from layerwave.analysis import stats
from layerwave.analysis import token_filter
from layerwave.analysis.cka import all_pairs_cka
from layerwave.analysis.cka import cka_from_hsic
from layerwave.analysis.cka import linear_cka
from layerwave.analysis.cka import unbiased_hsic_all_pairs
from layerwave.analysis.collect import CollectOptions
from layerwave.analysis.collect import CollectResult
from layerwave.analysis.collect import collect_stats
from layerwave.analysis.compartments import Segmentation
from layerwave.analysis.compartments import labels_from_blocks
from layerwave.analysis.compartments import segment
from layerwave.analysis.compartments import segment_fixed
from layerwave.analysis.entropy import check_finite
from layerwave.analysis.entropy import covariance_entropy
from layerwave.analysis.entropy import entropy_from_gram
from layerwave.analysis.entropy import masked_matrix_entropy
from layerwave.analysis.entropy import matrix_entropy
from layerwave.analysis.entropy import nonfinite_layers
from layerwave.analysis.entropy import prompt_entropy
from layerwave.analysis.stats import LayerStats
from layerwave.analysis.stats import LayerStatsAccumulator
from layerwave.analysis.token_filter import check_kept
from layerwave.analysis.token_filter import entropy_filter_mask
from layerwave.analysis.token_filter import masked_percentile
from layerwave.analysis.token_filter import percentile_threshold
from layerwave.analysis.token_filter import token_entropy

__all__ = [
    "CollectOptions",
    "CollectResult",
    "LayerStats",
    "LayerStatsAccumulator",
    "Segmentation",
    "all_pairs_cka",
    "cka",
    "check_finite",
    "check_kept",
    "compartments",
    "cka_from_hsic",
    "collect",
    "collect_stats",
    "covariance_entropy",
    "entropy",
    "entropy_filter_mask",
    "entropy_from_gram",
    "labels_from_blocks",
    "linear_cka",
    "masked_matrix_entropy",
    "masked_percentile",
    "matrix_entropy",
    "nonfinite_layers",
    "percentile_threshold",
    "prompt_entropy",
    "segment",
    "segment_fixed",
    "stats",
    "token_filter",
    "token_entropy",
    "unbiased_hsic_all_pairs",
]
