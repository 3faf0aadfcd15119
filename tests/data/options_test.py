"""layerwave.data.options: the data section read one way by the analysis and training stages."""

import dataclasses

import pytest

from layerwave import options as options_lib
from layerwave.data.options import DataOptions
from tests import configs


def test_the_data_section_builds_typed_options():
  config = configs.load("smoke")
  data = options_lib.from_section(DataOptions, config.data, "data")
  assert data.max_length == config.data.max_length and data.source == config.data.source
  assert {f.name for f in dataclasses.fields(data)} == set(config.data.keys())


@pytest.mark.parametrize("field, value, message", [
    ("max_length", 1, r"data\.max_length must be >= 2 tokens, got 1; set --config\.data\.max_length=512"),
    ("max_records", -1, r"data\.max_records must be >= 0"),
    ("heldout_fraction", 1.0, r"data\.heldout_fraction must be in \[0, 1\), got 1\.0"),
    ("max_length", 2.5, r"data\.max_length must be an integer, got 2\.5"),
    ("chat_format", "chatml", r"data\.chat_format must be one of \['template', 'plain'\], got 'chatml'"),
])
def test_bad_data_values_are_refused_naming_the_field(field, value, message):
  config = configs.load("smoke").data.to_dict()
  config[field] = value
  with pytest.raises(ValueError, match=message):
    options_lib.from_section(DataOptions, config, "data")


def test_the_record_holds_every_field():
  data = options_lib.from_section(DataOptions, configs.load("smoke").data, "data")
  assert data.record() == dataclasses.asdict(data) and data.record()["chat_format"] == "template"
  assert dataclasses.replace(data, chat_format="plain").record()["chat_format"] == "plain"


def test_the_gemma_config_reads_as_plain_text_data():
  for variant in ("", "smoke"):
    config = configs.load(variant, name="gemma3_270m")
    data = options_lib.from_section(DataOptions, config.data, "data")
    assert data.chat_format == "plain" and config.model == "gemma3-270m"
