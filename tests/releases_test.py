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
  target = layerwave.load_target("smollm2-135m-instruct")
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
