"""Does the wave depend on the text? Two analyses of one target on different text, side by side.

Place in the pipeline: after two `experiments/analyze.py` runs (e.g. the target's own distilled answers and
ShareGPT, `make paper-analysis`); `experiments/compare_waves.py` writes the markdown and the plot. Pure
functions of the two records and their selections: no model.

What moves, per the design's quantities (METHOD.md): the filtered informativeness profile E over depth
(Spearman across the candidates, and the largest change of Ê), the filtered CKA (mean and largest |ΔC| over
candidate pairs), the compartments, and every strategy's selection (shared layers, and the objective each set
reaches under the other text's statistics, so a moved selection is also priced).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
from scipy import stats as scipy_stats

from layerwave import layer_ids
from layerwave import selection as selection_lib
from layerwave.analysis import report as report_lib

__all__ = ["compare_records", "markdown"]


def compare_records(a: report_lib.AnalysisRecord, b: report_lib.AnalysisRecord,
                    selections_a: Mapping[str, layer_ids.LayerSelection],
                    selections_b: Mapping[str, layer_ids.LayerSelection]) -> dict[str, Any]:
  """The two analyses' differences (same target: same depth axis, same candidates).

  Raises:
    ValueError: analyses of different targets (layer counts or hidden sizes) or selection settings.
  """
  if (a.num_layers, a.hidden_size) != (b.num_layers, b.hidden_size):
    raise ValueError(f"The analyses are of different targets ({a.model.get('name')}: L={a.num_layers}, "
                     f"D={a.hidden_size}; {b.model.get('name')}: L={b.num_layers}, D={b.hidden_size}); "
                     "compare two analyses of one target on different text.")
  if a.candidates != b.candidates:
    raise ValueError(f"The analyses select among different candidates ({list(a.candidates)} vs "
                     f"{list(b.candidates)}); run both with the same analysis.include_embeddings / include_final.")
  cands = list(a.candidates)
  ea, ca = a.arrays("filtered")
  eb, cb = b.arrays("filtered")
  ha = selection_lib.normalize_informativeness(ea, cands)
  hb = selection_lib.normalize_informativeness(eb, cands)
  sub = np.ix_(cands, cands)
  off = ~np.eye(len(cands), dtype=bool)
  dc = np.abs(ca[sub] - cb[sub])[off]
  lam_a, lam_b = a.selection.lam, b.selection.lam
  strategies = []
  for name in sorted(set(selections_a) & set(selections_b)):
    ia, ib = tuple(selections_a[name].ids), tuple(selections_b[name].ids)
    objective = lambda ids, h, c, lam: float(selection_lib.subset_objective(np.array([ids]), h, c, lam)[0])  # noqa: E731
    strategies.append({
        "strategy": name, "a": list(ia), "b": list(ib), "shared": sorted(set(ia) & set(ib)),
        "same": ia == ib,
        # Under b's statistics: what a's choice reaches against b's own (≤ 0 when b's is exhaustive-optimal).
        "a_under_b": objective(ia, hb, cb, lam_b), "b_under_b": objective(ib, hb, cb, lam_b),
        "b_under_a": objective(ib, ha, ca, lam_a), "a_under_a": objective(ia, ha, ca, lam_a)})
  return {
      "a": {"name": a.model.get("name"), "path": a.path, "tokens": int(a.filtered.num_tokens)},
      "b": {"name": b.model.get("name"), "path": b.path, "tokens": int(b.filtered.num_tokens)},
      "candidates": cands,
      "entropy": {"a": ea[cands].tolist(), "b": eb[cands].tolist(),
                  "spearman": float(scipy_stats.spearmanr(ea[cands], eb[cands]).statistic),
                  "max_abs_delta_e_hat": float(np.max(np.abs(ha[cands] - hb[cands]))),
                  "argmax": [int(cands[int(np.argmax(ea[cands]))]), int(cands[int(np.argmax(eb[cands]))])]},
      "cka": {"mean_abs_delta": float(dc.mean()) if dc.size else 0.0,
              "max_abs_delta": float(dc.max()) if dc.size else 0.0},
      "compartments": {"a": [list(x) for x in a.blocks], "b": [list(x) for x in b.blocks],
                       "same": a.blocks == b.blocks},
      "selections": strategies}


def markdown(result: Mapping[str, Any], name_a: str = "A", name_b: str = "B") -> str:
  """`compare_records`' result as a short markdown report."""
  e, c, comp = result["entropy"], result["cka"], result["compartments"]
  lines = [f"# The wave on two texts: {name_a} ({result['a']['tokens']:,} kept tokens) vs {name_b} "
           f"({result['b']['tokens']:,})", "",
           f"- Informativeness E over the {len(result['candidates'])} candidate depths: Spearman "
           f"{e['spearman']:+.3f}; largest |ΔÊ| {e['max_abs_delta_e_hat']:.3f}; peak at layer {e['argmax'][0]} vs "
           f"{e['argmax'][1]}.",
           f"- Filtered linear CKA between candidates: mean |ΔC| {c['mean_abs_delta']:.3f}, largest "
           f"{c['max_abs_delta']:.3f}.",
           f"- Compartments: {comp['a']} vs {comp['b']}" + (" (the same)." if comp["same"] else "."), "",
           f"| strategy | {name_a} | {name_b} | shared | objective of {name_a}'s set on {name_b}'s statistics "
           f"(vs {name_b}'s own) |", "|---|---|---|---|---|"]
  for s in result["selections"]:
    lines.append(f"| {s['strategy']} | {','.join(map(str, s['a']))} | {','.join(map(str, s['b']))} | "
                 f"{len(s['shared'])} of {len(s['a'])} | {s['a_under_b']:+.3f} ({s['b_under_b']:+.3f}) |")
  return "\n".join(lines) + "\n"
