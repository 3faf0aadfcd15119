"""layerwave.metrics: the naming scheme, the JSONL file notebooks read, TensorBoard events, quiet orbax logs."""

import json
import logging as std_logging
import os

import numpy as np
import pytest
from absl import logging

from layerwave import metrics


def test_flatten_names_per_step_arrays():
  out = metrics.flatten("draft", {"acc_j": np.array([0.5, 0.25]), "loss": np.float32(1.5), "grid": [[1, 2]]})
  assert out == {"draft/acc_0": 0.5, "draft/acc_1": 0.25, "draft/loss": 1.5, "draft/grid_0": 1.0,
                 "draft/grid_1": 2.0}
  assert all(type(v) is float for v in out.values())  # pylint: disable=unidiomatic-typecheck


def test_writer_appends_one_json_line_per_write(tmp_path):
  workdir = str(tmp_path / "w")
  writer = metrics.MetricWriter(workdir, just_logging=False)
  writer.write_scalars(1, {"train/loss": np.float32(2.5)})
  writer.write_scalars(2, {"train/loss": 1.25, "spec/tau": 1.5})
  writer.close()
  again = metrics.MetricWriter(workdir, just_logging=False)  # a resumed run appends
  again.write_scalars(3, {"train/loss": 1.0})
  again.close()
  lines = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert [line["step"] for line in lines] == [1, 2, 3]
  assert lines[1]["spec/tau"] == 1.5 and lines[0]["train/loss"] == 2.5
  assert lines[0]["time"] <= lines[2]["time"]
  assert any(name.startswith("events.") for name in os.listdir(os.path.join(workdir, "tensorboard")))


def test_just_logging_writes_no_file(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path / "w"), just_logging=True)
  writer.write_scalars(1, {"train/loss": 1.0})
  writer.close()
  assert not os.path.exists(tmp_path / "w")


@pytest.fixture
def handler_filters():
  handler = logging.get_absl_handler()
  before = list(handler.filters)
  yield handler
  handler.filters[:] = before


def test_quiet_library_logs_drops_orbax_info_only(handler_filters):
  metrics.quiet_library_logs()
  metrics.quiet_library_logs()  # idempotent
  drop = metrics._DropLibraryInfo  # pylint: disable=protected-access
  added = [f for f in handler_filters.filters if isinstance(f, drop)]
  assert len(added) == 1

  def record(level, path):
    return std_logging.LogRecord("x", level, path, 1, "message", None, None)

  assert not added[0].filter(record(std_logging.INFO, "/site-packages/orbax/checkpoint/manager.py"))
  assert added[0].filter(record(std_logging.WARNING, "/site-packages/orbax/checkpoint/manager.py"))
  own = os.path.join(os.path.dirname(metrics.__file__), "training", "loop.py")  # layerwave's own INFO stays
  assert added[0].filter(record(std_logging.INFO, own))


def test_fixed_vs_buckets_times_every_mode_on_its_own_batches():
  from layerwave import data  # pylint: disable=g-import-not-at-top
  source = [{"input_ids": np.arange(1, 2 + i % 16)} for i in range(64)]  # lengths 2..17, cut to 16
  its = {mode: data.BatchIterator(source, batch_size=4, seq_len=16, pad_id=0, process_index=0, process_count=1,
                                  widths=w) for mode, w in (("fixed", ()), ("bucketed", (4, 8)))}
  seen = {"fixed": [], "bucketed": []}

  def step(mode, batch):
    seen[mode].append(batch.input_ids.shape)
    return np.float32(batch.attention_mask.sum())

  rows, ratio = metrics.fixed_vs_buckets(its, step, 3, 16)
  assert set(seen["fixed"]) == {(4, 16)} and len(seen["fixed"]) == 1 + 3  # warm-up, then the timed steps
  assert {(16, 4), (8, 8)} <= set(seen["bucketed"])  # every width warmed up
  assert rows["fixed"]["widths"] == [16] and rows["bucketed"]["widths"] == [4, 8, 16]
  assert rows["bucketed"]["slot_share_epoch"] > rows["fixed"]["slot_share_epoch"]
  assert len(rows["fixed"]["times"]) == 3 and ratio > 0
  assert "| bucketed | 4,8,16 |" in metrics.buckets_table(rows, ratio)
  assert metrics.machine()["cpus"] == os.cpu_count()
