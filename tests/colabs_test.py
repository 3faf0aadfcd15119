"""The notebooks under colabs/ run headless in smoke mode and report what they should; git holds them clean.

Each notebook runs in a fresh kernel (nbclient, kernel spec "python3", which jupyter_client starts with this
interpreter) from its own folder, with LAYERWAVE_NOTEBOOK_SMOKE=1 (the `:smoke` config) and
LAYERWAVE_NOTEBOOK_WORKDIR in tmp_path. A notebook's last cell prints one `LAYERWAVE_RESULT {json}` line,
which the test parses.
"""

import json
import os
import sys

import nbclient
import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLABS = os.path.join(ROOT, "colabs")
NOTEBOOKS = ("layer_wave.ipynb", "speculative_decoding.ipynb")
PREFIX = "LAYERWAVE_RESULT "


def _execute(nb, monkeypatch, workdir):
  monkeypatch.setenv("LAYERWAVE_NOTEBOOK_SMOKE", "1")
  monkeypatch.setenv("LAYERWAVE_NOTEBOOK_WORKDIR", str(workdir))
  # The kernel starts in colabs/ (as Jupyter would), so the notebook finds the checkout above it;
  # everything it writes goes to the workdir.
  client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                   resources={"metadata": {"path": COLABS}})
  client.execute()
  return nb


def _stdout(nb) -> str:
  return "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                 for out in cell.outputs if out.output_type == "stream" and out.name == "stdout")


def _result(nb) -> dict:
  lines = [l for l in _stdout(nb).splitlines() if l.startswith(PREFIX)]
  assert len(lines) == 1, f"expected one {PREFIX!r} line, got {len(lines)}"
  return json.loads(lines[0][len(PREFIX):])


def _count_images(nb) -> int:
  return sum("image/png" in out.get("data", {}) for cell in nb.cells if cell.cell_type == "code"
             for out in cell.outputs)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_has_no_outputs(name):
  nb = nbformat.read(os.path.join(COLABS, name), as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code
  for cell in code:
    assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]
  source = "\n".join(c.source for c in code)
  assert "LAYERWAVE_NOTEBOOK_SMOKE" in source and "LAYERWAVE_NOTEBOOK_WORKDIR" in source


def test_kernel_runs_this_interpreter(monkeypatch, tmp_path):
  nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys; print(sys.executable)")])
  _execute(nb, monkeypatch, tmp_path)
  assert os.path.realpath(_stdout(nb).strip()) == os.path.realpath(sys.executable)


# The two notebook runs re-run whole pipelines on the real SmolLM2 that the default run covers elsewhere (the
# analysis: tests/analysis/analyze_test.py; training and lossless speculation: tests/training, tests/speculative,
# tests/releases_test.py): `make test-all` runs them.
@pytest.mark.slow
def test_layer_wave_notebook(monkeypatch, tmp_path):
  nb = _execute(nbformat.read(os.path.join(COLABS, "layer_wave.ipynb"), as_version=4), monkeypatch,
                tmp_path / "wave")
  result = _result(nb)
  assert result["num_layers"] == 30 and result["kept_tokens"] > 0
  assert result["selections"]["eagle3"] == [2, 15, 27]
  assert set(result["selections"]) == {"eagle3", "entropy", "greedy", "exhaustive", "compartment", "random"}
  assert all(len(ids) == 3 and all(1 <= i <= 29 for i in ids) for ids in result["selections"].values())
  assert _count_images(nb) == 4  # token entropy, entropy wave, CKA, selections
  assert (tmp_path / "wave" / "selection.json").exists()


@pytest.mark.slow
def test_speculative_decoding_notebook(monkeypatch, tmp_path):
  nb = _execute(nbformat.read(os.path.join(COLABS, "speculative_decoding.ipynb"), as_version=4),
                monkeypatch, tmp_path / "spec")
  result = _result(nb)
  assert result["layers"] == [2, 15, 27] and result["train_steps"] == 6
  assert result["equal_fraction"] == 1.0
  assert 1.0 <= result["tau"] <= 4.0 and len(result["acceptance"]) == 3
  assert len(result["new_tokens"]) == 4 and all(n > 0 for n in result["new_tokens"])
  assert _count_images(nb) == 1  # acceptance per draft position
  assert "greedy outputs equal to autoregressive decoding: 4/4" in _stdout(nb)
