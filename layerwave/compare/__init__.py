"""The paper's experiment: drafts trained on different layer sets, compared by acceptance length τ.

`run(config, workdir)` (`experiments/compare_layers.py`) is the stage; its parts, in pipeline order:

- `sets`: `CompareOptions` (`config.compare`) and the `LayerSet`s chosen from an analysis record;
- `cells`: one draft trained and decoded per (set, seed, budget), a frozen `Sweep` of what they share, the
  workdir's fingerprint and resumption;
- `finalists`: the finalists decoded on more prompts, the released draft's row, the linear probes;
- `summary`: the typed table (`Summary` of `SetRow`s with `Stat`s over seeds, `Correlation`s) from the cells'
  results; `Summary.to_json` is `W/results.json`;
- `table`: the summary as markdown (`W/results.md`);
- `stage`: `run`, which calls them in order;
- `release` (imported on its own: `python -m layerwave.compare.release pack|unpack|verify`): a sweep's finished
  results kept in the repository.
"""

from layerwave.compare.cells import (Sweep, budget_key, budget_of, cell_dir, cell_recipe, check_store_layers,
                                     check_workdir, dynamics_cells, eval_prompts, evaluate_draft, finalist_prompts,
                                     fingerprint, fingerprint_settings, recipe_key, train_cells)
from layerwave.compare.finalists import choose_finalists, probe_scores, release_row, run_finalists
from layerwave.compare.sets import (SET_ITEMS, CompareOptions, LayerSet, auto_dynamics_sets, dynamics_sets,
                                    layer_sets, set_predictors)
from layerwave.compare.stage import dynamics_summary, run
from layerwave.compare.summary import (Budget, Correlation, DynamicsRow, SetRow, Stat, Summary, finalist_summary,
                                       mean_ci, paired_bootstrap, spearman, summarize, temperature_key)
from layerwave.compare.table import markdown_table

__all__ = ["Budget", "CompareOptions", "Correlation", "DynamicsRow", "LayerSet", "SET_ITEMS", "SetRow", "Stat",
           "Summary", "Sweep", "auto_dynamics_sets", "budget_key", "budget_of", "cell_dir", "cell_recipe",
           "check_store_layers", "check_workdir", "choose_finalists", "dynamics_cells", "dynamics_sets",
           "dynamics_summary", "eval_prompts", "evaluate_draft", "finalist_prompts", "finalist_summary",
           "fingerprint", "fingerprint_settings", "layer_sets", "markdown_table", "mean_ci", "paired_bootstrap",
           "probe_scores", "recipe_key", "release_row", "run", "run_finalists", "set_predictors", "spearman",
           "summarize", "temperature_key", "train_cells"]
