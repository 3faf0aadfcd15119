"""The artifacts committed under releases/: every file matches its manifest, and each rebuilds what it claims."""

import glob
import json
import os

import pytest

from layerwave.data import release

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANSWERS = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(ROOT, "releases", "*", release.MANIFEST))
                 if json.load(open(p, encoding="utf-8")).get("format") == release.FORMAT)


def test_the_releases_folder_fits_its_budget():
  total = sum(os.path.getsize(p) for p in glob.glob(os.path.join(ROOT, "releases", "**", "*"), recursive=True)
              if os.path.isfile(p))
  assert total <= 64 * 2 ** 20


@pytest.mark.parametrize("directory", ANSWERS, ids=os.path.basename)
def test_released_answers_rebuild_their_distilled_conversations(directory, tmp_path):
  """Checksums first; then the workdir rebuilt from the installed ShareGPT and the real target's tokenizer has
  the release's content fingerprint (unpack checks it), and every chunk's ids are the prompt selection's."""
  import layerwave  # pylint: disable=g-import-not-at-top
  from layerwave.data import decontaminate, distill, sources  # pylint: disable=g-import-not-at-top
  from layerwave.data.options import DistillOptions  # pylint: disable=g-import-not-at-top
  manifest = release.verify(directory)
  target = layerwave.load_target(manifest.get("model", release.DEFAULT_MODEL))  # the target the release names
  workdir = str(tmp_path / "rebuilt")
  release.unpack(directory, workdir, target=target)
  chunks = sorted(glob.glob(os.path.join(workdir, "chunks", "*.json")))
  assert len(chunks) == manifest["chunks"]
  # The chunks hold exactly the first prompts that distillation selects with the release's settings.
  values = manifest["settings"]
  options = DistillOptions(**{k: v for k, v in values.items() if k in DistillOptions.__dataclass_fields__},
                           num_prompts=manifest["prompts_covered"])
  index = decontaminate.EvalIndex.build(decontaminate.eval_prompts(options.exclude_sets), options.exclude_min_chars)
  prompts, _ = distill.select_prompts(sources.get_source(options.source), target.tokenizer, options, index)
  ids = []
  for path in chunks:
    with open(path, encoding="utf-8") as f:
      ids += json.load(f)["ids"]
  assert ids == [p.record.id for p in prompts]


def _drafts():
  from layerwave.training import release as draft_release  # pylint: disable=g-import-not-at-top
  return [os.path.join(ROOT, "releases", n) for n in sorted(os.listdir(os.path.join(ROOT, "releases")))
          if draft_release.is_release_dir(os.path.join(ROOT, "releases", n))] if os.path.isdir(
              os.path.join(ROOT, "releases")) else []


@pytest.mark.parametrize("directory", _drafts(), ids=os.path.basename)
def test_released_drafts_load_by_name_and_decode_as_plain_greedy(directory):
  """Checksums and target verified on load; on MT-bench prompts, greedy speculative decoding with the released
  draft equals plain decoding, and the draft accepts more than one token per verification."""
  import layerwave  # pylint: disable=g-import-not-at-top
  from layerwave.speculative import evaluate  # pylint: disable=g-import-not-at-top
  with open(os.path.join(directory, release.MANIFEST), encoding="utf-8") as f:
    manifest = json.load(f)
  target = layerwave.load_target(manifest["target"]["model"])
  draft = layerwave.load_draft(os.path.basename(directory), target)
  assert list(draft.config.layer_ids) == manifest["layer_ids"]
  training = manifest.get("training")
  if training:  # the run it came from, as `train.init_from` continues it: self-consistent
    from layerwave import options  # pylint: disable=g-import-not-at-top
    assert options.fingerprint(training["settings"]) == training["config_fingerprint"]
    assert training["settings"]["layers"] == manifest["layer_ids"]
    assert manifest["metrics"]["step"] == training["step"] <= training["num_steps"]
    assert manifest["metrics"]["interim"] == (training["step"] < training["num_steps"])
  prompts = [ids for _, ids in evaluate.chat_prompts(target.tokenizer, "mtbench", 2, 256)]
  plain = layerwave.generate(target, prompts, 48)
  spec, stats = layerwave.speculative.generate(target, draft, prompts, 48, num_draft_tokens=3)
  assert [list(map(int, r)) for r in spec] == [list(map(int, r)) for r in plain]
  assert stats["tau"] > 1.2


def _sweeps():
  from layerwave.compare import release as compare_release  # pylint: disable=g-import-not-at-top
  return sorted(os.path.dirname(p) for p in glob.glob(os.path.join(ROOT, "releases", "*", release.MANIFEST))
                if json.load(open(p, encoding="utf-8")).get("format") == compare_release.FORMAT)


@pytest.mark.parametrize("directory", _sweeps(), ids=os.path.basename)
def test_released_sweeps_are_what_their_command_runs_now(directory):
  """Checksums; then the config the manifest's command builds (`--config...` flags, as the launcher parses
  them) has the released settings' fingerprint, so `make paper-compare` resumes the released cells rather than
  refusing them; and every released cell records the recipe that config gives its seed and budget."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from layerwave import compare  # pylint: disable=g-import-not-at-top
  from layerwave.compare import release as compare_release  # pylint: disable=g-import-not-at-top
  from layerwave.training.options import Recipe, expand_home  # pylint: disable=g-import-not-at-top
  manifest = compare_release.verify(directory)
  command = next(c for c in manifest["commands"] if "compare_layers.py" in c)
  args = [expand_home(a) for a in command.rstrip(")").split() if a.startswith("--config")]
  fv = flags.FlagValues()
  argv = ["compare_layers.py"] + args
  config_flags.DEFINE_config_file("config", None, flag_values=fv, sys_argv=argv)  # it defines the overrides
  cwd = os.getcwd()
  os.chdir(ROOT)  # the command names configs/ relative to the repository
  try:
    fv(argv)
  finally:
    os.chdir(cwd)
  config = fv.config
  with open(os.path.join(directory, compare_release.SETTINGS), encoding="utf-8") as f:
    recorded = json.load(f)
  assert compare.fingerprint(config)[0] == recorded["fingerprint"]
  with open(os.path.join(directory, compare_release.RESULTS), encoding="utf-8") as f:
    results = json.load(f)
  recipe = Recipe.from_config(config)
  cells = {k: v for k, v in results.items() if k.startswith("cells/")}
  assert len(cells) == manifest["cells"] > 0
  for path, cell in cells.items():
    assert cell["recipe"] == compare.recipe_key(compare.cell_recipe(recipe, cell["seed"], cell["budget"])), path
    assert path.startswith(f"cells/L{'-'.join(map(str, cell['ids']))}/")
