"""TPU chips and topology names: the accepted forms, the clear refusals, the accelerator types libtpu reads."""

import pytest

from layerwave.aot import chips


def test_topologies_parse_to_their_chip_and_grid():
  chip, grid = chips.parse_topology("v5e:2x4")
  assert chip.name == "v5e" and grid == (2, 4) and chip.accelerator_type(8) == "v5litepod-8"
  chip, grid = chips.parse_topology("v5p:2x2x2")
  assert grid == (2, 2, 2) and chip.accelerator_type(8) == "v5p-16"  # v5p slices count TensorCores
  assert chips.CHIPS["v5e"].hbm_bytes == int(15.75 * 2**30)


@pytest.mark.parametrize("name", ["v5e", "v5e:2", "tpu:2x4", "v5p:2x2", "v6e:2x2x2", "v5e:2x4 extra", ""])
def test_unknown_topologies_are_refused_naming_the_form(name):
  with pytest.raises(ValueError, match="GENERATION:AxB|3-D tori|2-D"):
    chips.parse_topology(name)
