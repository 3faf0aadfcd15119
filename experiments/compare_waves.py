"""Does the wave depend on the text? Two analyses of one target side by side.

  python experiments/compare_waves.py --a=out/paper/analysis --b=out/paper/analysis-sharegpt \
      --names=distilled,sharegpt --out=out/paper/waves

Reads each workdir's layer_stats.json and selection.json (experiments/analyze.py), writes OUT/waves.md,
OUT/waves.json and OUT/waves.png (`layerwave.analysis.waves`), and prints the markdown.
"""

from layerwave import runtime  # pylint: disable=g-bad-import-order

runtime.configure_host()  # first: numpy and jax read the thread settings when they load

# pylint: disable=g-import-not-at-top,wrong-import-position,g-bad-import-order
import os

from absl import app
from absl import flags

from layerwave import atomic
from layerwave import plots
from layerwave.analysis import report
from layerwave.analysis import waves

_A = flags.DEFINE_string("a", None, "First analysis workdir (layer_stats.json, selection.json).")
_B = flags.DEFINE_string("b", None, "Second analysis workdir, same target.")
_NAMES = flags.DEFINE_list("names", ["A", "B"], "Names of the two texts, in the order of --a, --b.")
_OUT = flags.DEFINE_string("out", None, "Output folder.")
flags.mark_flags_as_required(["a", "b", "out"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if len(_NAMES.value) != 2:
    raise app.UsageError(f"--names takes two names (one per analysis), got {_NAMES.value}.")
  records, selections = [], []
  for workdir in (_A.value, _B.value):
    stats_path = os.path.join(workdir, "layer_stats.json")
    if not os.path.exists(stats_path):
      raise app.UsageError(f"{workdir} has no layer_stats.json: run experiments/analyze.py --workdir={workdir} "
                           "first.")
    record = report.read_layer_stats(stats_path)
    records.append(record)
    selections.append(report.load_selections(os.path.join(workdir, "selection.json"), record.num_layers,
                                             record.hidden_size))
  result = waves.compare_records(records[0], records[1], selections[0], selections[1])
  name_a, name_b = _NAMES.value
  text = waves.markdown(result, name_a, name_b)
  os.makedirs(_OUT.value, exist_ok=True)
  atomic.write_json(os.path.join(_OUT.value, "waves.json"), result)
  atomic.write_text(os.path.join(_OUT.value, "waves.md"), text)
  plots.plot_two_waves(os.path.join(_OUT.value, "waves.png"), result, name_a, name_b)
  print(text)


if __name__ == "__main__":
  app.run(main)
