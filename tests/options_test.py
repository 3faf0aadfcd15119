"""layerwave.options: config sections become typed options, and a wrong kind names its field."""

import dataclasses
import hashlib
import json
import os

import ml_collections
import pytest

from layerwave import options


@dataclasses.dataclass(frozen=True)
class _Opts:
  n: int
  x: float = 1.0
  flag: bool = False
  name: str = "a"


def test_fields_are_converted_to_their_types_and_defaults_fill_gaps():
  got = options.from_section(_Opts, ml_collections.ConfigDict({"n": 3.0, "x": 2}), "sec")
  assert got == _Opts(3, 2.0) and isinstance(got.n, int) and isinstance(got.x, float)
  assert options.from_section(_Opts, {"n": 1, "x": 5}, "sec", x=0.5).x == 0.5  # overrides win


@pytest.mark.parametrize("section, message", [
    ({"n": 2.5}, r"sec\.n must be an integer, got 2\.5"),
    ({"n": "3"}, r"sec\.n must be an integer, got '3'"),
    ({"n": True}, r"sec\.n must be an integer, got True"),
    ({"n": 1, "x": "fast"}, r"sec\.x must be a number"),
    ({"n": 1, "flag": 1}, r"sec\.flag must be True or False"),
    ({"n": 1, "name": 3}, r"sec\.name must be a string"),
    ({}, r"lacks the field sec\.n"),
])
def test_a_wrong_kind_is_one_error_naming_the_field(section, message):
  with pytest.raises(ValueError, match=message):
    options.from_section(_Opts, section, "sec")


def test_convert_one_value():
  assert options.convert(4.0, int, "seed") == 4
  with pytest.raises(ValueError, match="seed must be an integer"):
    options.convert("x", int, "seed")


def test_fingerprint_is_the_hash_workdirs_already_record():
  d = {"train": {"lr": 3e-4, "batch_size": 8}, "model": "m", "mesh": [["data", -1]]}
  old = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]  # training's, compare's
  assert options.fingerprint(d) == old == options.fingerprint(dict(reversed(list(d.items()))))
  assert options.fingerprint(d) != options.fingerprint({**d, "model": "n"})


@dataclasses.dataclass(frozen=True)
class _Lists:
  ids: tuple[int, ...] = ()
  lams: tuple[float, ...] = ()
  names: tuple[str, ...] = ()
  sets: tuple[tuple[int, ...], ...] = ()
  on: bool = True


@pytest.mark.parametrize("value", [(2, 15, 27), [2, 15, 27], "2,15,27", " 2, 15 ,27", ("2,15,27",), (2.0, "15", 27)])
def test_a_tuple_field_takes_a_tuple_or_a_command_line_form(value):
  # ml_collections turns --config.x=2,15,27 and --config.x='(2,15,27)' into (2, 15, 27); an old config's
  # comma string stays a string.
  assert options.convert(value, tuple[int, ...], "x") == (2, 15, 27)


def test_tuple_fields_of_each_kind():
  got = options.from_section(_Lists, {"lams": ("0.25,4",), "names": ("eagle3,greedy",), "sets": "1,2;3, 4"},
                             "sec")
  assert got == _Lists(lams=(0.25, 4.0), names=("eagle3", "greedy"), sets=((1, 2), (3, 4)))
  assert options.from_section(_Lists, {"ids": ("",), "lams": "", "sets": ""}, "sec") == _Lists()  # emptied
  assert options.convert(((1, 2), (3, 4)), tuple[tuple[int, ...], ...], "s") == ((1, 2), (3, 4))
  assert options.convert((5, 6, 7), tuple[tuple[int, ...], ...], "s") == ((5, 6, 7),)  # one set, flat
  assert options.convert(("1,2", "3,4"), tuple[tuple[int, ...], ...], "s") == ((1, 2), (3, 4))


@pytest.mark.parametrize("section, message", [
    ({"ids": "2,x"}, r"sec\.ids must be comma-separated integers like 2,15,27 \(or a tuple"),
    ({"ids": (2.5,)}, r"sec\.ids must be comma-separated integers"),
    ({"ids": None}, r"sec\.ids must be comma-separated integers"),
    ({"lams": "fast"}, r"sec\.lams must be comma-separated numbers"),
    ({"names": (1, 2)}, r"sec\.names must be comma-separated names"),
    ({"sets": "1,a;2"}, r"sec\.sets must be ';'-separated id lists"),
])
def test_a_bad_tuple_is_one_error_naming_the_field_and_the_form(section, message):
  with pytest.raises(ValueError, match=message):
    options.from_section(_Lists, section, "sec")


def test_aliases_read_a_field_under_its_config_name():
  assert options.from_section(_Lists, {"enabled": False}, "sec", aliases={"on": "enabled"}).on is False
  with pytest.raises(ValueError, match=r"sec\.enabled must be True or False"):
    options.from_section(_Lists, {"enabled": 1}, "sec", aliases={"on": "enabled"})


def test_differing_fields_name_what_changed_between_two_records():
  recorded = {"seed": 0, "train": {"lr": 0.1, "widths": [128, 256]}, "data": {"source": "a"}}
  assert options.differing_fields(recorded, {"seed": 0, "train": {"lr": 0.1, "widths": (128, 256)},
                                             "data": {"source": "a"}}) == "none recorded"
  assert options.differing_fields(recorded, {"seed": 1, "train": {"lr": 0.2, "widths": (128,)},
                                             "data": {}}) == "data.source, seed, train.lr, train.widths"
  many = {f"f{i}": i for i in range(10)}
  assert options.differing_fields({}, many, limit=3) == "f0, f1, f2 ..."


def test_record_settings_records_once_and_refuses_other_settings(tmp_path):
  path = str(tmp_path / "w" / "settings.json")
  settings = {"config": {"lr": 0.1, "widths": (128, 256)}, "paired": True}
  options.record_settings(path, settings, "benchmark rows")
  with open(path) as f:
    recorded = json.load(f)
  # The recorded file holds the JSON form; its fingerprint is the one hash workdirs record.
  assert recorded["settings"] == {"config": {"lr": 0.1, "widths": [128, 256]}, "paired": True}
  assert recorded["fingerprint"] == options.fingerprint(settings)
  before = (tmp_path / "w" / "settings.json").stat().st_mtime_ns
  options.record_settings(path, {"paired": True, "config": {"widths": [128, 256], "lr": 0.1}}, "benchmark rows")
  assert (tmp_path / "w" / "settings.json").stat().st_mtime_ns == before  # the same settings: a resume
  with pytest.raises(ValueError, match=r"holds benchmark rows of a different config .*differing fields: "
                                       r"config\.lr, paired\). Resume with the same config or use a new"):
    options.record_settings(path, {"config": {"lr": 0.2, "widths": (128, 256)}, "paired": False}, "benchmark rows")
  with open(path) as f:
    assert json.load(f) == recorded  # a refusal writes nothing


def test_record_settings_normalizes_both_sides_before_comparing(tmp_path):
  path = str(tmp_path / "w" / "settings.json")
  drop_unset_new = lambda s: {k: v for k, v in s.items() if not (k == "new" and not v)}  # noqa: E731
  options.record_settings(path, {"lr": 0.1}, "benchmark rows")  # recorded before "new" existed
  options.record_settings(path, {"lr": 0.1, "new": ""}, "benchmark rows", normalize=drop_unset_new)
  with pytest.raises(ValueError, match=r"differing fields: new\)"):
    options.record_settings(path, {"lr": 0.1, "new": "x"}, "benchmark rows", normalize=drop_unset_new)
  with pytest.raises(ValueError, match=r"differing fields: new\)"):  # without the rule: another config
    options.record_settings(path, {"lr": 0.1, "new": ""}, "benchmark rows")
  other = str(tmp_path / "v" / "settings.json")
  options.record_settings(other, {"lr": 0.1, "new": ""}, "benchmark rows")  # recorded with it at its default
  options.record_settings(other, {"lr": 0.1}, "benchmark rows", normalize=drop_unset_new)
  with open(other) as f:
    assert json.load(f)["settings"] == {"lr": 0.1, "new": ""}  # an accepted resume rewrites nothing


CONFIG = "configs/smollm2_135m.py"


def test_a_config_refuses_an_unknown_key_naming_the_nearest_known_one():
  c = options.Config({"lr": 0.1, "warmup_steps": 5}, name="train")
  with pytest.raises(AttributeError, match=r"config has no key train\.warmup_step; the nearest known key is "
                                           r"train\.warmup_steps \(train holds: lr, warmup_steps\)"):
    c.warmup_step  # noqa: B018
  assert c.get("warmup_step", 3) == 3 and "warmup_step" not in c  # .get and `in` still answer
  c.lock()
  with pytest.raises(AttributeError, match=r"no key train\.l; the nearest known key is train\.lr"):
    c.l = 0.2  # a typo in a config file: locked sections take no new key
  c.lr = 0.2
  assert c.lr == 0.2


def test_a_config_survives_copy_and_pickle():
  import copy
  import pickle
  c = options.Config({"a": 1}, name="s")
  for other in (copy.deepcopy(c), pickle.loads(pickle.dumps(c))):
    assert other.to_dict() == {"a": 1}


def _parse(monkeypatch, path, *argv):
  """`--config` as a launcher parses it (config_flags reads the overrides from sys.argv)."""
  from absl import flags
  from ml_collections import config_flags
  values = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", CONFIG, flag_values=values, lock_config=True)
  monkeypatch.setattr("sys.argv", ["prog", f"--config={path}", *argv])
  values(["prog", f"--config={path}", *argv])
  return holder.value


@pytest.mark.parametrize("flag, message", [
    ("--config.train.lerning_rate=0.1", r"config has no key train\.lerning_rate; the nearest known key is train\."),
    ("--config.analysis.percentil=40", r"config has no key analysis\.percentil; the nearest known key is "
                                       r"analysis\.percentile"),
    ("--config.sed=1", r"config has no key sed; the nearest known key is seed"),
])
def test_an_unknown_command_line_key_is_refused_before_any_work(flag, message, monkeypatch):
  with pytest.raises(AttributeError, match=message):
    _parse(monkeypatch, f"{CONFIG}:smoke", flag)
  assert _parse(monkeypatch, f"{CONFIG}:smoke", "--config.analysis.percentile=40").analysis.percentile == 40.0


def test_a_typo_in_a_config_file_is_refused(tmp_path, monkeypatch):
  path = tmp_path / "typo.py"
  path.write_text("import importlib.util, os\n"
                  f"spec = importlib.util.spec_from_file_location('base', {os.path.abspath(CONFIG)!r})\n"
                  "base = importlib.util.module_from_spec(spec)\n"
                  "spec.loader.exec_module(base)\n"
                  "def get_config(arg=None):\n"
                  "  c = base.get_config(arg).lock()\n"
                  "  c.train.num_step = 3\n"
                  "  return c\n")
  with pytest.raises(AttributeError, match=r"config has no key train\.num_step; the nearest known key is "
                                           r"train\.num_steps"):
    _parse(monkeypatch, f"{path}:smoke")
