"""The analysis report: collected statistics → compartments, selections, stability → JSON files and a table.

Place in the pipeline: `collect.CollectResult` → `layer_stats_record` (written as `W/layer_stats.json`) and
`run_selections` (one `LayerSelection` per strategy, written as `W/selection.json`) → the draft-training stage
reads a record from `selection.json` by strategy name. `summary_table` prints the wave and the choices.

Pure host-side functions of small arrays (no model, no device); the caller writes the records with
`layerwave.atomic.write_json`.

Legend (`layerwave.axes`): L target layers.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats as scipy_stats

from layerwave import layer_ids
from layerwave import options as options_lib
from layerwave import selection as selection_lib
from layerwave.analysis import compartments as compartments_lib
from layerwave.analysis import stats as stats_lib

__all__ = ["SelectionOptions", "selection_options_from_config", "data_hash", "informativeness", "cka_matrix",
           "find_compartments", "run_selections", "stability_report", "layer_stats_record",
           "AnalysisRecord", "read_layer_stats", "selection_file_record", "load_selections", "read_selection",
           "summary_table"]

_GRANULARITIES = ("prompt", "dataset")
_CKA_MODES = ("minibatch", "exact")


@dataclasses.dataclass(frozen=True)
class SelectionOptions:
  """How statistics become layer choices (docs/METHOD.md §5–6 flags).

  Attributes:
    strategies: strategies to run, in order.
    k: layers per selection.
    lam: λ of the objective.
    min_gap: minimum distance between chosen ids (0 = none).
    granularity: "prompt" or "dataset" entropy as informativeness E.
    normalized_entropy: use the entropy divided by log(min(n, D)) instead of the raw one.
    cka: "minibatch" (streaming HSIC) or "exact" (token subsample) CKA as C.
    include_embeddings: candidate id 0.
    include_final: candidate id L.
    num_blocks: compartments g; 0 = chosen automatically.
    seed: seed of the `random` strategy.
  """

  strategies: tuple[str, ...] = selection_lib.STRATEGIES
  k: int = 3
  lam: float = 1.0
  min_gap: int = 0
  granularity: str = "prompt"
  normalized_entropy: bool = False
  cka: str = "minibatch"
  include_embeddings: bool = False
  include_final: bool = False
  num_blocks: int = 0
  seed: int = 0

  def __post_init__(self):
    unknown = [s for s in self.strategies if s not in selection_lib.STRATEGIES]
    if unknown or not self.strategies:
      raise ValueError(f"unknown layer-selection strategies {unknown or '(none given)'}; known: "
                       f"{', '.join(selection_lib.STRATEGIES)}")
    if self.granularity not in _GRANULARITIES:
      raise ValueError(f"granularity must be one of {_GRANULARITIES}, got {self.granularity!r}")
    if self.cka not in _CKA_MODES:
      raise ValueError(f"cka must be one of {_CKA_MODES}, got {self.cka!r}")
    if self.num_blocks < 0:
      raise ValueError(f"num_blocks must be >= 0 (0 = automatic), got {self.num_blocks}")


def selection_options_from_config(analysis: Any) -> SelectionOptions:
  """`SelectionOptions` from a config's `analysis` section (`strategies`: a tuple, or a comma string)."""
  return options_lib.from_section(SelectionOptions, analysis, "analysis")


def data_hash(*parts: Any) -> str:
  """sha256 (first 16 hex digits) of the JSON of `parts` (dataset fingerprint, model, settings)."""
  return options_lib.fingerprint(parts)


def informativeness(stats: stats_lib.LayerStats, options: SelectionOptions) -> np.ndarray:
  """E [L+1]: the entropy profile the selection reads (granularity, raw or normalised)."""
  name = f"{options.granularity}_entropy" + ("_normalized" if options.normalized_entropy else "")
  return np.asarray(getattr(stats, name), np.float64)


def cka_matrix(stats: stats_lib.LayerStats, options: SelectionOptions) -> np.ndarray:
  """C [L+1, L+1]: minibatch or exact CKA (exact needs an exact-CKA token subsample)."""
  if options.cka == "exact":
    if stats.cka_exact is None:
      raise ValueError("cka='exact' needs the exact-CKA token subsample: set analysis.exact_cka_tokens > 0")
    return np.asarray(stats.cka_exact, np.float64)
  return np.asarray(stats.cka_minibatch, np.float64)


def find_compartments(cka: np.ndarray, candidates: Sequence[int], num_blocks: int = 0
                      ) -> compartments_lib.Segmentation:
  """Contiguous segmentation of the candidates' CKA (g = num_blocks, or automatic when 0)."""
  cands = list(candidates)
  if cands != list(range(cands[0], cands[-1] + 1)):
    raise ValueError(f"compartments need contiguous candidate ids, got {cands}")
  sub = np.asarray(cka)[np.ix_(cands, cands)]
  return compartments_lib.segment(sub, num_blocks or None, offset=cands[0])


def run_selections(stats: stats_lib.LayerStats, options: SelectionOptions, *, num_layers: int,
                   hidden_size: int, data_hash_value: str | None = None, config: dict | None = None,
                   segmentation: compartments_lib.Segmentation | None = None
                   ) -> dict[str, layer_ids.LayerSelection]:
  """One `LayerSelection` per strategy, from one set of statistics.

  Args:
    stats: finalised statistics (usually the filtered ones).
    options: selection settings.
    num_layers: L.
    hidden_size: D.
    data_hash_value: stored in every record.
    config: extra settings stored in every record.
    segmentation: compartments for the `compartment` strategy; when it has fewer than k blocks (or is None)
      the strategy segments again with at least k blocks.

  Returns:
    {strategy: LayerSelection}, in `options.strategies` order.
  """
  e = informativeness(stats, options)
  c = cka_matrix(stats, options)
  blocks = None
  if "compartment" in options.strategies:
    cands = layer_ids.default_candidates(num_layers, options.include_embeddings, options.include_final)
    blocks = compartments_lib.selection_blocks(c, cands, options.k, segmentation)
  extra = {"granularity": options.granularity, "normalized_entropy": options.normalized_entropy,
           "cka": options.cka, "alpha": stats.alpha, "normalize": stats.normalize,
           "num_tokens": stats.num_tokens, **(config or {})}
  out = {}
  for strategy in options.strategies:
    out[strategy] = selection_lib.select_layers(
        strategy, e, c, k=options.k, lam=options.lam, min_gap=options.min_gap, seed=options.seed,
        compartments=blocks if strategy == "compartment" else None, num_layers=num_layers,
        hidden_size=hidden_size, include_embeddings=options.include_embeddings,
        include_final=options.include_final, data_hash=data_hash_value, config=extra)
  return out


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
  return float(scipy_stats.spearmanr(a, b).statistic)


def stability_report(halves: tuple[stats_lib.LayerStats | None, stats_lib.LayerStats | None],
                     full: dict[str, layer_ids.LayerSelection], options: SelectionOptions, *,
                     num_layers: int, hidden_size: int) -> dict:
  """Agreement of two disjoint halves of the data (even / odd batches).

  Args:
    halves: filtered statistics of each half (None if a half is empty).
    full: the selections made from all the data.
    options: selection settings (the same strategies are re-run on each half).
    num_layers, hidden_size: L, D.

  Returns:
    JSON-friendly dict: tokens per half; Spearman and max |Δ| of the entropy profiles over the candidates;
    max and mean |ΔCKA| over candidate pairs; each half's selections and whether they equal the full-data
    ones; each half's compartments.
  """
  if halves is None or any(h is None for h in halves):
    return {"available": False, "reason": "needs at least two batches with kept tokens"}
  cands = list(layer_ids.default_candidates(num_layers, options.include_embeddings, options.include_final))
  a, b = halves
  ea, eb = informativeness(a, options)[cands], informativeness(b, options)[cands]
  ca = cka_matrix(a, options)[np.ix_(cands, cands)]
  cb = cka_matrix(b, options)[np.ix_(cands, cands)]
  diff = np.abs(ca - cb)[~np.eye(len(cands), dtype=bool)]
  segs = [find_compartments(cka_matrix(h, options), cands, options.num_blocks) for h in halves]
  sel = [run_selections(h, options, num_layers=num_layers, hidden_size=hidden_size, segmentation=s)
         for h, s in zip(halves, segs)]
  per_strategy = {}
  for name, record in full.items():
    ids_a, ids_b = list(sel[0][name].ids), list(sel[1][name].ids)
    per_strategy[name] = {"half_a": ids_a, "half_b": ids_b, "halves_agree": ids_a == ids_b,
                          "match_full": [ids_a == list(record.ids), ids_b == list(record.ids)]}
  return {
      "available": True,
      "split": "even / odd batches of each shape (disjoint sequences)",
      "tokens": [a.num_tokens, b.num_tokens],
      "entropy_spearman": _spearman(ea, eb),
      "entropy_max_abs_diff": float(np.max(np.abs(ea - eb))),
      "entropy_range": float(np.ptp(np.concatenate([ea, eb]))),
      "cka_max_abs_diff": float(diff.max()) if diff.size else 0.0,
      "cka_mean_abs_diff": float(diff.mean()) if diff.size else 0.0,
      "compartments": [[list(blk) for blk in s.blocks] for s in segs],
      "selections": per_strategy,
      "all_selections_agree": all(v["halves_agree"] for v in per_strategy.values()),
  }


def _stats_dict(stats: stats_lib.LayerStats | None) -> dict | None:
  return None if stats is None else stats.as_dict()


def layer_stats_record(result, *, model: dict, data: dict, options: SelectionOptions,
                       segmentation: compartments_lib.Segmentation, stability: dict | None,
                       data_hash_value: str, config: dict | None = None) -> dict:
  """The content of `layer_stats.json` (JSON-friendly).

  Args:
    result: `collect.CollectResult`.
    model: {"name", "num_layers", "hidden_size", "vocab_size"}.
    data: dataset description (name, split, fingerprint fields).
    options: selection settings (recorded; say which E and C the selections read).
    segmentation: compartments of the candidates' CKA (filtered statistics).
    stability: `stability_report` output, or None.
    data_hash_value: the statistics' data hash.
    config: the full run config (dict).

  Returns:
    dict with the layer-id convention, filter and counts, token-entropy summary, "filtered" and "unfiltered"
    statistics (per-layer prompt / dataset entropy raw and normalised, CKA matrices [L+1, L+1], counts),
    compartments, stability, and the settings.
  """
  o = result.options
  return {
      "convention": layer_ids.CONVENTION,
      "layer_ids": list(range(model["num_layers"] + 1)),
      "model": model,
      "data": data,
      "data_hash": data_hash_value,
      "filter": {"mode": o.filter_mode, "percentile": o.percentile if o.filter_mode == "percentile" else None,
                 "threshold_nats": result.threshold, "temperature": o.temperature,
                 "assistant_only": o.assistant_only, "calibration_batches":
                     o.calibration_batches if o.filter_mode == "percentile" else 0,
                 "unfiltered_control": o.unfiltered},
      "counts": result.counts,
      "token_entropy": result.token_entropy,
      "throughput": {"seconds": result.seconds,
                     "tokens_per_s": (result.counts["positions"] / result.seconds
                                      if result.seconds and np.isfinite(result.seconds) else None)},
      "filtered": _stats_dict(result.filtered),
      "unfiltered": _stats_dict(result.unfiltered),
      "compartments": {"candidates": list(layer_ids.default_candidates(
                           model["num_layers"], options.include_embeddings, options.include_final)),
                       "blocks": [list(b) for b in segmentation.blocks],
                       "boundaries": list(segmentation.boundaries), "score": segmentation.score,
                       "baseline": segmentation.baseline, "cka": options.cka,
                       "num_blocks": segmentation.num_blocks},
      "selection_inputs": {"granularity": options.granularity, "normalized_entropy": options.normalized_entropy,
                           "cka": options.cka},
      "stability": stability,
      "settings": {"collect": dataclasses.asdict(o), "selection": dataclasses.asdict(options)},
      "config": config or {},
  }


@dataclasses.dataclass(frozen=True)
class AnalysisRecord:
  """`layer_stats.json` read back (`read_layer_stats`): what later stages select from, typed.

  Attributes:
    model: {"name", "num_layers", "hidden_size", "vocab_size"} of the analysed target.
    selection: the selection settings the analysis ran with (k, λ, min_gap, candidates, E and C kinds).
    filtered: statistics over the tokens the filter kept.
    unfiltered: the matched control without the filter, or None when the analysis skipped it.
    blocks: the compartments of the filtered CKA, as [start, end) id ranges.
    content: the whole record (plots and tables read it as written).
    path: the file it was read from.
  """

  model: dict
  selection: SelectionOptions
  filtered: stats_lib.LayerStats
  unfiltered: stats_lib.LayerStats | None
  blocks: tuple[tuple[int, int], ...]
  content: dict
  path: str = ""

  @property
  def num_layers(self) -> int:
    return int(self.model["num_layers"])

  @property
  def hidden_size(self) -> int:
    return int(self.model["hidden_size"])

  @property
  def candidates(self) -> tuple[int, ...]:
    """The ids a selection may choose (the analysis' candidates)."""
    return tuple(layer_ids.default_candidates(self.num_layers, self.selection.include_embeddings,
                                              self.selection.include_final))

  def arrays(self, which: str = "filtered") -> tuple[np.ndarray, np.ndarray]:
    """(E [L+1], C [L+1, L+1]) of the filtered or unfiltered statistics, as the selection reads them."""
    stats = self.filtered if which == "filtered" else self.unfiltered
    if stats is None:
      raise ValueError(f"{self.path or 'layer_stats.json'} has no {which!r} statistics; for the 'nofilter' "
                       "ablation run the analysis with analysis.unfiltered='matched' (the default).")
    return informativeness(stats, self.selection), cka_matrix(stats, self.selection)

  @classmethod
  def from_content(cls, content: dict, path: str = "") -> AnalysisRecord:
    """From `layer_stats_record`'s dict."""
    unfiltered = content.get("unfiltered")
    return cls(model=dict(content["model"]),
               selection=options_lib.from_section(SelectionOptions, content["settings"]["selection"],
                                                  "layer_stats.settings.selection"),
               filtered=stats_lib.LayerStats.from_dict(content["filtered"]),
               unfiltered=stats_lib.LayerStats.from_dict(unfiltered) if unfiltered else None,
               blocks=tuple(tuple(int(i) for i in b) for b in content["compartments"]["blocks"]),
               content=content, path=str(path))


def read_layer_stats(path: str | os.PathLike) -> AnalysisRecord:
  """Reads `layer_stats.json` (a file, or the analysis workdir holding it).

  Raises:
    FileNotFoundError: no such file (with the command that writes one).
    ValueError: a file that is not an analysis record.
  """
  path = str(path)
  if os.path.isdir(path):
    path = os.path.join(path, "layer_stats.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist; run experiments/analyze.py --workdir=W first (it writes "
                            "W/layer_stats.json).")
  with open(path) as f:
    content = json.load(f)
  missing = [k for k in ("model", "settings", "filtered", "compartments") if k not in content]
  if missing:
    raise ValueError(f"{path} is not a layer_stats.json written by experiments/analyze.py: it lacks "
                     f"{', '.join(missing)}.")
  return AnalysisRecord.from_content(content, path)


def selection_file_record(selections: dict[str, layer_ids.LayerSelection]) -> dict:
  """The content of `selection.json`: {strategy: LayerSelection.to_dict()}."""
  return {name: sel.to_dict() for name, sel in selections.items()}


def load_selections(path: str | os.PathLike, num_layers: int | None = None,
                    hidden_size: int | None = None) -> dict[str, layer_ids.LayerSelection]:
  """Reads `selection.json` back into validated `LayerSelection`s (checked against L, D when given).

  The file is what `selection_file_record` writes ({strategy: record}); a single record (a hand-written
  `{"ids": [...], ...}`) reads as {its strategy, or "manual": record}.

  Raises:
    FileNotFoundError: no such file (with the command that writes one).
    ValueError: a record that is not a valid selection for this target.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"Selection file {path} does not exist; run experiments/analyze.py first "
                            "(it writes W/selection.json) or give the layers: --config.layers=2,15,27.")
  with open(path) as f:
    raw = json.load(f)
  if isinstance(raw, dict) and "ids" in raw:
    raw = {raw.get("strategy", "manual"): raw}
  if not isinstance(raw, dict):
    raise ValueError(f"{path} is not a selection file: it holds a {type(raw).__name__}, not "
                     "{strategy: record} as experiments/analyze.py writes it.")
  out = {}
  for name, d in raw.items():
    sel = layer_ids.LayerSelection.from_dict(d)
    sel.validate_for(num_layers, hidden_size)
    out[name] = sel
  return out


def read_selection(path: str | os.PathLike, strategy: str, num_layers: int | None = None,
                   hidden_size: int | None = None) -> layer_ids.LayerSelection:
  """One strategy's record of a selection file (`load_selections`), or an error listing the strategies."""
  selections = load_selections(path, num_layers, hidden_size)
  if strategy not in selections:
    raise ValueError(f"Selection file {path} has no strategy {strategy!r}; it has {sorted(selections)}.")
  return selections[strategy]


def _batch_shapes(counts: dict) -> str:
  """"8×512; 43% of the slots real", or with length buckets "64×64 (12), 8×512 (3); 81% of the slots real"."""
  shapes = counts.get("shapes") or [[counts["batch_size"], counts["seq_len"], counts["batches"]]]
  fill = f"; {counts['positions'] / max(counts['padded_positions'], 1):.0%} of the slots real"
  if len(shapes) == 1:
    return f"{shapes[0][0]}×{shapes[0][1]}" + fill
  return ", ".join(f"{b}×{t} ({n})" for b, t, n in shapes) + fill


def summary_table(record: dict, selections: dict[str, layer_ids.LayerSelection]) -> str:
  """Markdown table of the wave: per layer, entropy with / without the filter, compartment, strategies.

  Args:
    record: `layer_stats_record` output.
    selections: {strategy: LayerSelection}.

  Returns:
    The table and a few lines of counts, as one string.
  """
  f, u = record["filtered"], record["unfiltered"]
  n = len(record["layer_ids"])
  block_of = {}
  for i, (s, e) in enumerate(record["compartments"]["blocks"]):
    for layer in range(s, e):
      block_of[layer] = i
  names = list(selections)
  head = ["layer", "prompt H (filtered)", "prompt H (no filter)", "dataset H (filtered)", "block"] + names
  rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for layer in range(n):
    cells = [str(layer), f"{f['prompt_entropy'][layer]:.3f}",
             "-" if u is None else f"{u['prompt_entropy'][layer]:.3f}",
             f"{f['dataset_entropy'][layer]:.3f}", str(block_of.get(layer, "-"))]
    cells += ["●" if layer in selections[s].ids else "" for s in names]
    rows.append("| " + " | ".join(cells) + " |")
  c = record["counts"]
  lines = ["\n".join(rows), "",
           f"tokens: {c['positions']} real, {c['eligible']} eligible, {c['kept']} kept "
           f"({c['kept_fraction']:.1%}); threshold {record['filter']['threshold_nats']:.3f} nats; "
           f"{c['batches']} batches of " + _batch_shapes(c),
           "compartments: " + ", ".join(f"[{s}, {e})" for s, e in record["compartments"]["blocks"])]
  for name, sel in selections.items():
    lines.append(f"{name:12s} {list(sel.ids)}  objective {sel.scores.get('objective', float('nan')):.3f}")
  st = record.get("stability") or {}
  if st.get("available"):
    lines.append(f"stability (two halves, {st['tokens']} kept tokens): entropy Spearman "
                 f"{st['entropy_spearman']:.3f}, max |ΔE| {st['entropy_max_abs_diff']:.4f}, max |ΔCKA| "
                 f"{st['cka_max_abs_diff']:.4f}, selections agree: "
                 + ", ".join(f"{k}={'yes' if v['halves_agree'] else 'no'}" for k, v in st["selections"].items()))
  return "\n".join(lines)
