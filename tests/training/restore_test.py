"""layerwave.training.restore: workdir resolution (load_draft and export_workdir are tested end to end in
tests/training/loop_test.py and tests/export_test.py)."""

import pytest

from layerwave.training import restore


def test_checkpoint_dir_accepts_a_workdir_or_its_checkpoints(tmp_path):
  (tmp_path / "w" / "checkpoints").mkdir(parents=True)
  assert restore.checkpoint_dir(str(tmp_path / "w")) == str(tmp_path / "w" / "checkpoints")
  assert restore.checkpoint_dir(str(tmp_path / "w" / "checkpoints")) == str(tmp_path / "w" / "checkpoints")
  with pytest.raises(FileNotFoundError, match="No draft at"):
    restore.checkpoint_dir(str(tmp_path / "nothing"))

