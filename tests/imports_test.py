"""The import graph of layerwave: one direction, no cycles, no hidden imports, and a light `import layerwave`.

The stages import downwards only: base utilities and layer ids → models → data → analysis /
selection / eagle3 / export → training → speculative → compare; the experiments/ launchers import the
library, never each other; the benchmarks/ scripts import the library's public names (no `module._private`)
and their shared `harness`, never a launcher or each other.
"""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "layerwave")

# Rank of each part of the library; an import may point only at an equal or lower rank.
LAYERS = (
    ("base", ("layerwave.runtime", "layerwave.atomic", "layerwave.axes", "layerwave.options", "layerwave.sharding",
              "layerwave.sampling", "layerwave.checkpoint", "layerwave.metrics", "layerwave.plots",
              "layerwave.layer_ids", "layerwave.engine_ids")),
    ("models", ("layerwave.models", "layerwave.inference", "layerwave.continuous", "layerwave.generate")),
    ("data", ("layerwave.data",)),
    ("analysis", ("layerwave.analysis", "layerwave.selection", "layerwave.eagle3", "layerwave.export")),
    ("training", ("layerwave.training",)),
    ("speculative", ("layerwave.speculative",)),
    ("compare", ("layerwave.compare",)),
    ("aot", ("layerwave.aot",)),  # compiles every stage for TPU topologies: it reads them all
)
# Optional or heavy third-party dependencies that may be imported where they are used.
DEFERRED_OK = {"torch", "transformers", "tensorboardX", "safetensors", "gguf", "tokenizers",
               "huggingface_hub", "pydoc_data", "importlib", "libtpu"}


def _modules() -> dict[str, str]:
  out = {}
  for dirpath, _, files in os.walk(PACKAGE):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
        out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
  return out


MODULES = _modules()


def _target(module: str, name: str | None) -> str:
  """The layerwave module an import statement loads: `from pkg import sub` is the submodule when it is one."""
  if name is not None and f"{module}.{name}" in MODULES:
    return f"{module}.{name}"
  return module


def _imports(path: str):
  """(top-level layerwave imports, deferred imports as (module, line)) of one file."""
  tree = ast.parse(open(path, encoding="utf-8").read())
  top, deferred = set(), []
  nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f) if n is not f}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [(a.name, None) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = [(node.module, a.name) for a in node.names]
    else:
      continue
    for module, name in names:
      if id(node) in nested:
        deferred.append((module, node.lineno))
      elif module == "layerwave" or module.startswith("layerwave."):
        top.add(_target(module, name))
  return top, deferred


def _rank(module: str) -> int:
  for i, (_, prefixes) in enumerate(LAYERS):
    if any(module == p or module.startswith(p + ".") for p in prefixes):
      return i
  raise AssertionError(f"{module} belongs to no layer of tests/imports_test.py: add it to LAYERS.")


GRAPH = {m: _imports(p)[0] - {m} for m, p in MODULES.items() if m != "layerwave"}


def test_every_module_has_a_layer():
  for module in GRAPH:
    _rank(module)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_down_the_pipeline(module):
  up = sorted(t for t in GRAPH[module] if t != "layerwave" and _rank(t) > _rank(module))
  assert not up, (f"{module} ({LAYERS[_rank(module)][0]}) imports {up} from a later stage "
                  f"({', '.join(LAYERS[_rank(t)][0] for t in up)}).")
  assert "layerwave" not in GRAPH[module], f"{module} imports the package root (the public API) from inside"


def test_the_graph_is_acyclic():
  # A package's __init__ re-exports its own submodules; an edge from a module to its own package's
  # __init__ is what `from layerwave.pkg import sibling` looks like, not a cycle of meaning.
  state, path = {}, []

  def visit(m):
    state[m] = "open"
    path.append(m)
    for t in sorted(GRAPH.get(m, ())):
      if t not in GRAPH or t == m.rpartition(".")[0]:
        continue
      if state.get(t) == "open":
        raise AssertionError("import cycle: " + " -> ".join(path[path.index(t):] + [t]))
      if t not in state:
        visit(t)
    path.pop()
    state[m] = "done"

  for m in sorted(GRAPH):
    if m not in state:
      visit(m)


def _unit(module: str) -> str:
  return ".".join(module.split(".")[:2])


def test_packages_and_modules_import_each_other_one_way():
  """No two parts (`layerwave.analysis`, `layerwave.selection`, ...) import each other, even indirectly."""
  units = {}
  for m, targets in GRAPH.items():
    units.setdefault(_unit(m), set()).update(_unit(t) for t in targets if _unit(t) != _unit(m))
  closure = {u: set(v) for u, v in units.items()}
  changed = True
  while changed:
    changed = False
    for u, reach in closure.items():
      more = set().union(*(closure.get(v, set()) for v in reach)) - reach
      if more:
        reach |= more
        changed = True
  both = sorted({tuple(sorted((u, v))) for u, reach in closure.items() for v in reach if u in closure.get(v, ())})
  assert not both, f"parts that import each other (directly or through others): {both}"


def test_no_hidden_imports_inside_functions():
  hidden = [f"{m}:{line} imports {mod}" for m, p in MODULES.items() for mod, line in _imports(p)[1]
            if mod.split(".")[0] not in DEFERRED_OK]
  assert not hidden, "imports inside functions (move them to the top): " + "; ".join(hidden)


def test_launchers_do_not_import_each_other():
  experiments = os.path.join(ROOT, "experiments")
  scripts = {f[:-3] for f in os.listdir(experiments) if f.endswith(".py")}
  for f in sorted(scripts):
    tree = ast.parse(open(os.path.join(experiments, f + ".py"), encoding="utf-8").read())
    for node in ast.walk(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
      assert not set(names) & scripts, f"experiments/{f}.py imports launcher {set(names) & scripts}"


def _script_imports(path: str) -> set[str]:
  tree = ast.parse(open(path, encoding="utf-8").read())
  names = set()
  for node in ast.walk(tree):
    names.update([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
  return names


def test_benchmarks_import_only_the_library_and_their_harness():
  benchmarks = os.path.join(ROOT, "benchmarks")
  experiments = os.path.join(ROOT, "experiments")
  scripts = {f[:-3] for d in (benchmarks, experiments) for f in os.listdir(d) if f.endswith(".py")} - {"harness"}
  for f in sorted(os.listdir(benchmarks)):
    if f.endswith(".py"):
      wrong = _script_imports(os.path.join(benchmarks, f)) & scripts
      assert not wrong, f"benchmarks/{f} imports script {wrong}: shared code goes in the library or the harness"


def test_benchmarks_use_public_names_only():
  """A benchmark reads no `_private` name of the library: what it measures is what a user can call."""
  benchmarks = os.path.join(ROOT, "benchmarks")
  private = []
  for f in sorted(os.listdir(benchmarks)):
    if not f.endswith(".py"):
      continue
    tree = ast.parse(open(os.path.join(benchmarks, f), encoding="utf-8").read())
    private += [f"benchmarks/{f}:{n.lineno} {n.value.id}.{n.attr}" for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                and isinstance(n.value, ast.Name)]
    private += [f"benchmarks/{f}:{n.lineno} imports {a.name}" for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("layerwave")
                for a in n.names if a.name.startswith("_")]
  assert not private, "benchmarks use private names: " + "; ".join(private)


def test_import_layerwave_stays_light():
  code = ("import sys, layerwave\n"
          "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('orbax', 'tensorflow_datasets', "
          "'tensorflow'))\n"
          "print(','.join(heavy))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                       env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
  assert out.stdout.strip() == "", f"import layerwave loads {out.stdout.strip()}"
  out = subprocess.run([sys.executable, "-c", "import layerwave; print(layerwave.load_draft.__module__)"],
                       capture_output=True, text=True, cwd=ROOT, check=True,
                       env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
  assert out.stdout.strip() == "layerwave.training.restore"

