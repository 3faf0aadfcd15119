"""layerwave.axes: every module that writes shapes cites the one legend, with the same letters and names."""

import io
import pathlib
import re
import tokenize

import pytest

import layerwave
from layerwave import axes

PACKAGE = pathlib.Path(layerwave.__file__).parent
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "axes.py")
LEGEND = re.compile(r"Legend \(`layerwave\.axes`\): (.*?)\.?\s*(?:\n\s*\n|\"\"\"|\Z)", re.S)
ITEM = re.compile(r"(\S+) ([^()]+?)(?: \([^()]*\))?")
_DIM = r"(?:L1|V_d|Dh|[A-Za-z])(?:\s*[-+*/]\s*(?:\d+|[A-Za-z_]+))*"
SHAPE = re.compile(r"\[\s*(" + _DIM + r"(?:\s*,\s*(?:" + _DIM + r"|\.\.\.))*)\s*\]")
# Lowercase letters (d, k, n, m) are also loop indices (`lengths[b]`), so only these are found automatically.
DETECTED = {letter for letter in axes.LETTERS if letter[0].isupper()}


def _prose(path) -> str:
  """The module's docstrings and comments: where shapes are written."""
  parts = []
  for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
    if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.string.startswith('"""')):
      parts.append(tok.string)
  return "\n".join(parts)


def _legend(text) -> dict[str, str]:
  found = LEGEND.findall(text)
  assert len(found) <= 1, "one Legend line per module"
  if not found:
    return {}
  items = [i.strip() for i in " ".join(found[0].split()).split(", ")]
  legend = {}
  for item in items:
    match = ITEM.fullmatch(item)
    assert match, f"legend item {item!r} is not 'LETTER name'"
    legend[match.group(1)] = match.group(2)
  return legend


def _used(text) -> set[str]:
  used = set()
  for shape in SHAPE.finditer(text):
    used |= set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", shape.group(1))) & DETECTED
  return used


def test_the_legend_documents_every_letter():
  for letter in axes.LETTERS:
    assert re.search(rf"^  {re.escape(letter)} ", axes.__doc__, re.M), letter


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_legend_agrees_with_layerwave_axes(path):
  text = _prose(path)
  legend = _legend(text)
  for letter, name in legend.items():
    assert letter in axes.LETTERS, f"{letter} is not in layerwave.axes"
    assert name == axes.LETTERS[letter], f"{letter} is '{axes.LETTERS[letter]}' in layerwave.axes, not '{name}'"
  missing = _used(text) - set(legend)
  assert not missing, f"shapes use {sorted(missing)}, which the Legend line does not list"
  rest = LEGEND.sub("", text)
  unused = [letter for letter in legend if not re.search(rf"(?<![\w']){re.escape(letter)}(?![\w'])", rest)]
  assert not unused, f"the Legend line lists {unused}, which the module does not use"
