"""The experiment configs under configs/: defaults live in the options dataclasses, each experiment states only
what it changes, and the old `configs/smollm2_135m.py:<experiment>` spelling names the same config."""

import glob
import os
import re

import pytest

from layerwave import options
from tests import configs

SMOLLM2 = os.path.join(configs.CONFIGS, "smollm2")
# The files these rules hold for (the scale configs state a slice's sizes over SmolLM2's sections).
FILES = sorted(glob.glob(os.path.join(SMOLLM2, "*.py"))) + [
    os.path.join(configs.CONFIGS, f) for f in ("smollm2_135m.py", "gemma3_270m.py", "generate.py")]
ALIAS = options.config_module(os.path.join(configs.CONFIGS, "smollm2_135m.py"))
SPECS = ([(os.path.join(SMOLLM2, f"{e}.py"), None) for e in ("base",) + ALIAS.EXPERIMENTS]
         + [(os.path.join(configs.CONFIGS, "smollm2_135m.py"), arg) for arg in (None,) + ALIAS.EXPERIMENTS]
         + [(os.path.join(configs.CONFIGS, "gemma3_270m.py"), arg) for arg in (None, "smoke", "paper")]
         + [(os.path.join(configs.CONFIGS, "generate.py"), arg) for arg in (None, "smoke")])


def _restated(path, arg, monkeypatch) -> list[str]:
  """The assignments loading `path:arg` makes that leave a value as it was."""
  restated = []
  setitem = options.Config.__setitem__

  def watch(self, key, value):
    if key in self and type(self[key]) is type(value) and self[key] == value:
      restated.append(f"{self.__dict__.get('_name') or 'config'}.{key} = {value!r}")
    setitem(self, key, value)

  monkeypatch.setattr(options.Config, "__setitem__", watch)
  options.config_module(path).get_config(arg)
  return restated


@pytest.mark.parametrize("path, arg", SPECS, ids=lambda x: os.path.relpath(x, configs.CONFIGS) if x else "-")
def test_a_config_restates_no_default(path, arg, monkeypatch):
  """No assignment in a config leaves a value as it was (a dataclass default, or what the config it builds
  on already says); `options.section` refuses a base that restates a dataclass default."""
  assert not _restated(path, arg, monkeypatch)


def test_a_restated_default_is_found(tmp_path, monkeypatch):
  path = tmp_path / "restates.py"
  path.write_text("from layerwave import options\n"
                  f"base = options.config_module({os.path.join(SMOLLM2, 'base.py')!r})\n"
                  "def get_config(arg=None):\n"
                  "  c = base.get_config()\n"
                  "  c.train.lr = 3e-4\n"
                  "  c.train.num_steps = 20\n"
                  "  return c\n")
  assert _restated(str(path), None, monkeypatch) == ["train.lr = 0.0003"]


def test_the_old_spelling_names_each_experiment_file():
  alias = ALIAS
  for experiment in (None,) + alias.EXPERIMENTS:
    own = options.config_module(os.path.join(SMOLLM2, f"{experiment or 'base'}.py")).get_config()
    assert alias.get_config(experiment).to_dict() == own.to_dict()
  assert sorted(alias.EXPERIMENTS + ("base",)) == sorted(
      os.path.basename(p)[:-3] for p in glob.glob(os.path.join(SMOLLM2, "*.py")))
  with pytest.raises(ValueError, match="Unknown config variant 'demo2'; use one of :smoke, :demo"):
    alias.get_config("demo2")


@pytest.mark.parametrize("path", FILES, ids=lambda p: os.path.relpath(p, configs.CONFIGS))
def test_config_files_are_short_and_undated(path):
  with open(path) as f:
    text = f.read()
  assert len(text.splitlines()) <= 150
  assert not re.search(r"\b20\d\d-\d\d-\d\d\b|\bissue #?\d+|\bsession\b", text, re.IGNORECASE)


def test_a_typo_in_an_experiment_file_is_refused_naming_the_nearest_key(tmp_path):
  path = tmp_path / "typo.py"
  path.write_text("import os\nfrom layerwave import options\n"
                  f"base = options.config_module({os.path.join(SMOLLM2, 'base.py')!r})\n"
                  "def get_config(arg=None):\n"
                  "  c = base.get_config()\n"
                  "  c.train.num_step = 3\n"
                  "  return c\n")
  with pytest.raises(AttributeError, match=r"config has no key train\.num_step; the nearest known key is "
                                           r"train\.num_steps"):
    options.config_module(str(path)).get_config()


def test_a_section_holds_its_dataclass_defaults_and_refuses_restating_one():
  from layerwave.training.options import TrainOptions
  train = options.section(TrainOptions, "train", batch_size=8, num_steps=10)
  assert train.lr == TrainOptions.__dataclass_fields__["lr"].default and train.num_steps == 10
  with pytest.raises(ValueError, match=r"train\.lr = 0\.0003 restates the default of TrainOptions"):
    options.section(TrainOptions, "train", batch_size=8, num_steps=10, lr=3e-4)
