"""The select_layers stage: a layer selection, from wherever it was saved, in every engine's numbering.

Place in the pipeline: after the analysis (or a draft's training, or by hand), before serving.
`experiments/select_layers.py` parses flags and calls `run`, which finds the record (`resolve_selection`),
prints `layerwave.engine_ids.report` for it (the lines to paste into vLLM, SGLang, SpecForge, speculators,
TensorRT-LLM, Model Optimizer and tpu-inference) and writes the report as JSON on request.

Where the record comes from, first match wins: explicit ids (`layers`); a path (`selection`): a
`LayerSelection` JSON, an analysis' `selection.json` or its workdir, a training workdir (the record its
checkpoints carry) or an EAGLE-3 directory exported by layerwave; the config's `layers`, then its
`selection.path`; else EAGLE-3's rule for the target. `k` re-runs an analysis strategy at another k from the
workdir's `layer_stats.json`, or sets the k of the default rule. The target's L is the record's, or, for ids
alone, that of `model` (a short name, a checkpoint directory or its config.json; default `config.model`).

Legend (`layerwave.axes`): L target layers, k selected layers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from layerwave import atomic
from layerwave import checkpoint as ckpt_lib
from layerwave import engine_ids
from layerwave import layer_ids
from layerwave import selection as selection_lib
from layerwave.analysis import compartments as compartments_lib
from layerwave.analysis import report as report_lib
from layerwave.models import hub

__all__ = ["load_records", "num_layers_of", "resolve_selection", "run"]


def num_layers_of(model: str) -> int:
  """L of a target: a config.json file, a directory holding one, or anything `hub.resolve` accepts.

  Raises:
    FileNotFoundError / ValueError: no such model, or a config.json without num_hidden_layers.
  """
  path = os.fspath(model)
  if not (os.path.isfile(path) and path.endswith(".json")):
    directory = path if os.path.isdir(path) else hub.resolve(path)
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{directory} holds no config.json: give --model as a checkpoint directory, its "
                              "config.json or a short name (smollm2-135m-instruct).")
  with open(path) as f:
    config = json.load(f)
  config = config.get("text_config") or config
  if "num_hidden_layers" not in config:
    raise ValueError(f"{path} has no num_hidden_layers: not the config.json of a decoder LM.")
  return layer_ids.as_layer_id(config["num_hidden_layers"])


def _read_json(path: str) -> Any:
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path} is not JSON: {e}") from e


def _is_eagle3(raw: Any) -> bool:
  """Whether a config.json describes an EAGLE-3 draft (ours carries a `layerwave` block)."""
  return isinstance(raw, dict) and ("layerwave" in raw or any(
      "eagle3" in str(a).lower() for a in raw.get("architectures") or ()))


def _from_eagle3_config(path: str) -> dict[str, layer_ids.LayerSelection]:
  config = _read_json(path)
  record = (config.get("layerwave") or {}).get("selection")
  if record is None:
    key = "eagle_aux_hidden_state_layer_ids"
    written = config.get(key) or (config.get("eagle_config") or {}).get(key)
    raise ValueError(
        f"{path} is an EAGLE-3 config.json that layerwave did not export: its {key} {written} "
        "are in whichever numbering its writer used (layerwave/eagle3.py). Give them in hf_hidden_states "
        "numbering with --layers=... (--model=TARGET for L).")
  sel = layer_ids.LayerSelection.from_dict(record)
  return {sel.strategy: sel}


def load_records(path: str) -> dict[str, layer_ids.LayerSelection]:
  """{strategy: record} saved at `path` (see the module docstring for what it may be).

  Raises:
    FileNotFoundError: nothing there holds a selection (the message lists what would).
    ValueError: a file that is not a valid selection.
  """
  path = os.fspath(path)
  if os.path.isdir(path):
    if os.path.isfile(os.path.join(path, "selection.json")):
      return load_records(os.path.join(path, "selection.json"))
    config = os.path.join(path, "config.json")
    if os.path.isfile(config) and _is_eagle3(_read_json(config)):
      return _from_eagle3_config(config)
    checkpoints = os.path.join(path, "checkpoints")
    if os.path.isdir(checkpoints):  # a training workdir: the record its latest checkpoint carries
      ckpt = ckpt_lib.Checkpointer(checkpoints)
      try:
        sel = layer_ids.LayerSelection.from_dict(ckpt.read_meta()["selection"])
      finally:
        ckpt.close()
      return {sel.strategy: sel}
    raise FileNotFoundError(f"{path} holds no selection.json (an analysis workdir), config.json (an EAGLE-3 "
                            "export) or checkpoints/ (a training workdir).")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"No selection at {path}: give a selection.json, a LayerSelection JSON or an "
                            "analysis, training or EAGLE-3 directory.")
  raw = _read_json(path)
  if _is_eagle3(raw):
    return _from_eagle3_config(path)
  if not isinstance(raw, dict) or not raw or not ("ids" in raw or all(
      isinstance(v, dict) and "ids" in v for v in raw.values())):
    raise ValueError(f"{path} is not a layer selection: expected a LayerSelection record ({{\"ids\": ..., "
                     "\"num_layers\": ...}}), a selection.json ({strategy: record}) or an EAGLE-3 config.json.")
  return report_lib.load_selections(path)


def _reselect(workdir: str, record: layer_ids.LayerSelection, k: int) -> layer_ids.LayerSelection:
  """`record`'s strategy run again at `k` on the analysis statistics of `workdir`."""
  stats_path = os.path.join(workdir, "layer_stats.json")
  if record.strategy not in selection_lib.STRATEGIES or not os.path.isfile(stats_path):
    raise ValueError(f"--k={k} differs from the record's k={record.k} ({record.strategy}: {list(record.ids)}), "
                     "and only an analysis strategy with its workdir's layer_stats.json can be selected again. "
                     f"Leave --k out, pick the record of that k with --strategy (a learned selection.json holds "
                     f"one per k), or give an analysis workdir and one of {', '.join(selection_lib.STRATEGIES)}.")
  analysis = report_lib.read_layer_stats(stats_path)
  candidates = analysis.candidates
  if k > len(candidates):
    raise ValueError(f"k={k} is larger than the {len(candidates)} candidate layers {candidates[0]}..{candidates[-1]} "
                     f"of this analysis (L={analysis.num_layers}): choose k <= {len(candidates)}.")
  e, c = analysis.arrays("filtered")
  opts = analysis.selection
  blocks = None
  if record.strategy == "compartment":
    blocks = (list(analysis.blocks) if len(analysis.blocks) >= k
              else compartments_lib.selection_blocks(c, candidates, k))
  return selection_lib.select_layers(
      record.strategy, e, c, k=k, lam=opts.lam, min_gap=opts.min_gap, candidates=candidates, seed=opts.seed,
      compartments=blocks, num_layers=analysis.num_layers, hidden_size=analysis.hidden_size,
      include_embeddings=opts.include_embeddings, include_final=opts.include_final, data_hash=record.data_hash,
      config={"reselected_from": stats_path})


def _pick(records: dict[str, layer_ids.LayerSelection], strategy: str, where: str) -> layer_ids.LayerSelection:
  if strategy:
    if strategy not in records:
      raise ValueError(f"{where} has no strategy {strategy!r}; it has {', '.join(sorted(records))}.")
    return records[strategy]
  if len(records) > 1:
    raise ValueError(f"{where} holds {len(records)} selections ({', '.join(records)}): pick one with "
                     "--strategy=NAME.")
  return next(iter(records.values()))


def resolve_selection(config, *, selection: str = "", strategy: str = "", layers: Any = (), model: str = "",
                      k: int = 0) -> layer_ids.LayerSelection:
  """The record to print: explicit ids, a saved record, the config's, or EAGLE-3's rule (module docstring).

  Raises:
    ValueError / FileNotFoundError: conflicting or invalid inputs, each naming the problem and the fix.
  """
  k = int(k or 0)
  if k < 0:
    raise ValueError(f"--k={k}: k is a number of layers, >= 1 (0 keeps the record's).")
  ids = layer_ids.parse_layer_ids(layers, "layers")
  if ids and selection:
    raise ValueError(f"Give the layers one way: --layers={','.join(map(str, ids))} or --selection={selection}.")
  if not ids and not selection:
    ids = layer_ids.parse_layer_ids(config.get("layers", ()), "layers")
    if not ids and config.get("selection") and config.selection.get("path"):
      selection, strategy = config.selection.path, strategy or config.selection.get("strategy", "")
  if ids:
    num_layers = num_layers_of(model or config.model)
    if k and k != len(ids):
      raise ValueError(f"--k={k} but {len(ids)} ids were given ({list(ids)}); leave --k out.")
    try:
      return layer_ids.LayerSelection(ids=ids, num_layers=num_layers, strategy="manual")
    except ValueError as e:
      raise ValueError(f"{e}. Give hf_hidden_states ids of this target (1..{num_layers - 1}), or name "
                       "another target with --model.") from e
  if selection:
    record = _pick(load_records(selection), strategy, selection)
    if k and k != record.k:
      workdir = selection if os.path.isdir(selection) else os.path.dirname(os.path.abspath(selection))
      record = _reselect(workdir, record, k)
    if model:
      record.validate_for(num_layers_of(model))
    return record
  num_layers = num_layers_of(model or config.model)
  k = k or 3
  candidates = layer_ids.default_candidates(num_layers)
  if k > len(candidates):
    raise ValueError(f"k={k} is larger than the {len(candidates)} candidate layers 1..{num_layers - 1} of this "
                     f"target (L={num_layers}): choose k <= {len(candidates)}.")
  return layer_ids.LayerSelection(ids=layer_ids.eagle3_layer_ids(num_layers, k), num_layers=num_layers,
                                  strategy="eagle3")


def run(config, *, selection: str = "", strategy: str = "", layers: Any = (), model: str = "", k: int = 0,
        engines: Sequence[str] = (), json_path: str = "", allow_ignored_selection: bool = False,
        show_sources: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
  """The select_layers launcher's adapter: resolve the record, print the engines' lines, write the JSON.

  Returns:
    `engine_ids.report`'s dict.
  """
  record = resolve_selection(config, selection=selection, strategy=strategy, layers=layers, model=model, k=k)
  rep = engine_ids.report(record, engines, allow_ignored_selection=allow_ignored_selection)
  log(engine_ids.format_report(rep, show_sources))
  if json_path:
    atomic.write_json(json_path, rep)
  return rep
