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
  manifest = release.verify(directory)
  target = layerwave.load_target("smollm2-135m-instruct")
  workdir = str(tmp_path / "rebuilt")
  release.unpack(directory, workdir, target=target)
  chunks = sorted(glob.glob(os.path.join(workdir, "chunks", "*.json")))
  assert len(chunks) == manifest["chunks"]
  # The chunks hold exactly the first prompts that distillation selects with the release's settings.
  values = manifest["settings"]
  options = distill.DistillOptions(**{k: v for k, v in values.items() if k in distill.DistillOptions.__dataclass_fields__},
                                   num_prompts=manifest["prompts_covered"])
  index = decontaminate.EvalIndex.build(decontaminate.eval_prompts(options.exclude_sets), options.exclude_min_chars)
  prompts, _ = distill.select_prompts(sources.get_source(options.source), target.tokenizer, options, index)
  ids = []
  for path in chunks:
    with open(path, encoding="utf-8") as f:
      ids += json.load(f)["ids"]
  assert ids == [p.record.id for p in prompts]
