"""layerwave.options: config sections become typed options, and a wrong kind names its field."""

import dataclasses
import hashlib
import json

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
