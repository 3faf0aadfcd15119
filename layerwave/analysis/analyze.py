"""The analysis stage: `run(config, workdir)` — data → target → statistics → selections → files and plots.

Place in the pipeline: first stage. `experiments/analyze.py` parses flags and calls `run`; it writes
`W/layer_stats.json` (the wave: per-layer entropies with and without the token filter, CKA [L+1, L+1], kept-token
counts, threshold, compartments, two-half stability), `W/selection.json` (one `LayerSelection` per strategy,
which the draft-training stage reads by path) and `W/plots/*.png`, and prints a summary table.

Legend (`layerwave.axes`): L target layers.
"""

from __future__ import annotations

import os
import time

import jax
from absl import logging

from layerwave import atomic
from layerwave import data as data_lib
from layerwave import inference
from layerwave import layer_ids
from layerwave import options as options_lib
from layerwave import plots
from layerwave import sharding
from layerwave.analysis import collect
from layerwave.analysis import report
from layerwave.data.options import DataOptions

__all__ = ["run"]


def run(config, workdir: str) -> dict:
  """Runs the analysis stage.

  Args:
    config: the experiment config (configs/smollm2_135m.py): `model`, `dtype`, `mesh`, `distributed`,
      `data` (source, max_length, max_records, heldout_fraction, split_seed) and `analysis`.
    workdir: output folder (created).

  Returns:
    {"layer_stats": record dict, "selections": {strategy: LayerSelection}, "summary": table string,
     "paths": written files}.
  """
  if not workdir:
    raise ValueError("analysis needs --workdir: the folder for layer_stats.json, selection.json and plots/")
  a = config.analysis
  collect_options = collect.options_from_config(a)
  selection_options = report.selection_options_from_config(a)
  data_options = options_lib.from_section(DataOptions, config.data, "data")
  split = options_lib.convert(a.split, str, "analysis.split")
  batch_size = options_lib.convert(a.batch_size, int, "analysis.batch_size")
  widths = options_lib.convert(a.get("bucket_widths", ()), tuple[int, ...], "analysis.bucket_widths")
  if any(w <= 0 for w in widths):
    raise ValueError(f"analysis.bucket_widths={widths} must be positive; e.g. "
                     "--config.analysis.bucket_widths=64,128,256 (max_length is always added), or () for "
                     "fixed-shape batches.")
  widths = tuple(w for w in widths if w < data_options.max_length)  # wider ones hold nothing max_length does not
  sharding.use_compilation_cache(config.get("compilation_cache", ""))
  sharding.maybe_initialize_distributed(config.distributed)
  sharding.check_processes_agree(config, "The analysis")
  mesh = sharding.make_mesh(config.mesh)
  start = time.perf_counter()
  target = inference.load_target(config.model, dtype=config.dtype, mesh=mesh)
  tok = target.tokenizer
  if tok is None:
    raise ValueError(f"{config.model} has no tokenizer; the analysis tokenises chat data")
  ds = data_options.build(tok)
  pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
  process_index, process_count = sharding.data_position(mesh)
  batches = data_lib.BatchIterator(ds.source(split), batch_size=batch_size, seq_len=data_options.max_length,
                                   pad_id=pad_id, seed=collect_options.seed, num_epochs=1,
                                   process_index=process_index, process_count=process_count, widths=widths,
                                   row_multiple=sharding.data_size(mesh))  # every bucket splits over the devices
  logging.info("Analysis of %s on %s[%s] (%d examples), batches of %s.", config.model, ds.name, split,
               ds.num_examples.get(split, 0), f"{batch_size} x {data_options.max_length}" if not batches.widths
               else ", ".join(f"{batches.rows(w)} x {w}" for w in batches.widths)
               + f" ({batches.epoch_fill():.0%} of an epoch's token slots real)")
  result = collect.collect_stats(target, batches, collect_options, mesh)
  fill = result.counts["positions"] / result.counts["padded_positions"]
  if not batches.widths and fill < 0.6:
    logging.warning("Only %.0f%% of the batches' token slots held real tokens: --config.analysis.bucket_widths="
                    "64,128,256 reads the same sequences in length buckets, with less padding (a compilation a "
                    "width).", 100 * fill)

  cfg = target.config
  model = {"name": config.model, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
           "vocab_size": cfg.vocab_size, "dtype": config.dtype}
  data = {"dataset": ds.name, "split": split, "num_examples": dict(ds.num_examples),
          "source": data_options.source, "max_length": data_options.max_length,
          "fingerprint": {k: ds.metadata.get(k) for k in ("tokenizer_fingerprint", "records_fingerprint",
                                                          "num_records", "split_seed", "heldout_fraction")}}
  data["chat_format"] = data_options.chat_format
  config_dict = config.to_dict()
  hash_value = report.data_hash(data, model, config_dict["analysis"])
  candidates = layer_ids.default_candidates(cfg.num_layers, selection_options.include_embeddings,
                                            selection_options.include_final)
  segmentation = report.find_compartments(report.cka_matrix(result.filtered, selection_options), candidates,
                                          selection_options.num_blocks)
  selections = report.run_selections(result.filtered, selection_options, num_layers=cfg.num_layers,
                                     hidden_size=cfg.hidden_size, data_hash_value=hash_value,
                                     segmentation=segmentation)
  stability = None
  if result.halves is not None:
    stability = report.stability_report(result.halves["filtered"], selections, selection_options,
                                        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size)
  record = report.layer_stats_record(result, model=model, data=data, options=selection_options,
                                     segmentation=segmentation, stability=stability, data_hash_value=hash_value,
                                     config=config_dict)
  record["wall_seconds"] = time.perf_counter() - start
  summary = report.summary_table(record, selections)
  paths = []
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    stats_path = os.path.join(workdir, "layer_stats.json")
    selection_path = os.path.join(workdir, "selection.json")
    atomic.write_json(stats_path, record)
    atomic.write_json(selection_path, report.selection_file_record(selections))
    paths = [stats_path, selection_path]
    paths += plots.plot_all(os.path.join(workdir, "plots"), record,
                            {name: sel.ids for name, sel in selections.items()})
    print(summary)
    print("\nwrote " + ", ".join(paths))
  return {"layer_stats": record, "selections": selections, "summary": summary, "paths": paths}
