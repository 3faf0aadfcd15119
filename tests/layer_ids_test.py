"""Tests for layerwave.layer_ids: the hf_hidden_states convention, its conversions, the record, the parser."""

import json
import os

import pytest

from layerwave import layer_ids
from layerwave.layer_ids import LayerSelection

L = 12


def test_conventions_round_trip_and_eagle3():
  assert layer_ids.eagle3_layer_ids(30) == (2, 15, 27)  # SmolLM2-135M baseline
  assert layer_ids.to_block_outputs((2, 15, 27)) == (1, 14, 26)  # SpecForge / TensorRT-LLM numbers
  assert layer_ids.from_block_outputs((1, 14, 26)) == (2, 15, 27)
  assert layer_ids.from_block_outputs(layer_ids.to_block_outputs((1, 5, 11), L), L) == (1, 5, 11)
  with pytest.raises(ValueError, match="block-output"):
    layer_ids.to_block_outputs((0, 3))
  with pytest.raises(ValueError, match="no hf_hidden_states"):
    layer_ids.from_block_outputs((L - 1,), L)
  assert layer_ids.eagle3_layer_ids(30, k=1) == (15,)
  assert layer_ids.eagle3_layer_ids(30, k=5) == (2, 8, 14, 21, 27)
  with pytest.raises(ValueError, match="eagle3"):
    layer_ids.eagle3_layer_ids(4)


def test_default_candidates():
  assert layer_ids.default_candidates(L) == tuple(range(1, L))
  assert layer_ids.default_candidates(L, include_embeddings=True, include_final=True) == tuple(range(L + 1))


def test_block_output_ids_of_a_record():
  assert LayerSelection(ids=(2, 15, 27), num_layers=30, strategy="eagle3").block_output_ids() == (1, 14, 26)


def test_record_save_load_round_trip(tmp_path):
  sel = LayerSelection(ids=(2, 6, 9), num_layers=L, hidden_size=64, strategy="greedy", lam=0.5,
                       scores={"objective": 1.25, "entropy_normalized": {"2": 0.5}}, data_hash="abc123",
                       config={"alpha": 1.0}, seed=3)
  path = tmp_path / "layers.json"
  sel.save(path)
  assert [p.name for p in tmp_path.iterdir()] == ["layers.json"]  # no temp file left behind
  loaded = LayerSelection.load(path, num_layers=L, hidden_size=64)
  assert loaded == sel
  assert LayerSelection.from_json(sel.to_json()) == sel
  assert json.loads(path.read_text())["convention"] == "hf_hidden_states"


def _write(tmp_path, **kw):
  d = {"ids": [2, 6, 9], "num_layers": L, "hidden_size": 64, "strategy": "manual"}
  d.update(kw)
  path = tmp_path / "sel.json"
  path.write_text(json.dumps(d))
  return path


@pytest.mark.parametrize("kw,match", [
    ({"ids": [2, 2, 9]}, "duplicate"),
    ({"ids": [-1, 3]}, "negative"),
    ({"ids": [3, L + 1]}, "out of range"),
    ({"ids": []}, "at least one"),
    ({"ids": [1.5]}, "not an integer"),
    ({"convention": "block_outputs"}, "from_block_outputs"),
    ({"strategy": "eagle3", "ids": [2, 7, 9]}, "rule"),
    ({"strategy": "eagle3", "ids": [1, 5, 8]}, "block-output convention"),
    ({"bogus": 1}, "unknown fields"),
])
def test_load_validation_errors(tmp_path, kw, match):
  with pytest.raises(ValueError, match=match):
    LayerSelection.load(_write(tmp_path, **kw))


def test_load_for_another_model(tmp_path):
  path = _write(tmp_path)
  with pytest.raises(ValueError, match=f"L={L} vs L=30"):
    LayerSelection.load(path, num_layers=30, hidden_size=64)
  with pytest.raises(ValueError, match="D=64 vs D=576"):
    LayerSelection.load(path, num_layers=L, hidden_size=576)
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match="not a JSON"):
    LayerSelection.load(bad)
  assert os.path.exists(path)


def test_record_sorts_ids():
  assert LayerSelection(ids=(9, 2, 5), num_layers=L).ids == (2, 5, 9)


def test_parse_layer_ids_is_the_one_parser_of_hand_given_ids():
  assert layer_ids.parse_layer_ids((2, 15, 27)) == layer_ids.parse_layer_ids([2.0, 15, 27]) == (2, 15, 27)
  # What the command line gives: --config.layers=2,15,27 and '(2,15,27)' both parse to (2, 15, 27) in
  # ml_collections; an old comma string stays a string.
  assert layer_ids.parse_layer_ids("2, 15,27") == layer_ids.parse_layer_ids(("2,15,27",)) == (2, 15, 27)
  assert layer_ids.parse_layer_ids("") == layer_ids.parse_layer_ids(()) == layer_ids.parse_layer_ids(("",)) == ()
  with pytest.raises(ValueError, match=r"--config\.layers must be comma-separated integers like 2,15,27"):
    layer_ids.parse_layer_ids("2,x,27")
  with pytest.raises(ValueError, match=r"--config\.manual must be"):
    layer_ids.parse_layer_ids("2.5", "manual")
