"""Atomic directory writes: build under a temporary name beside the target, then rename into place.

Used by everything that writes a whole model directory (GGUF conversion, EAGLE-3 export), so an interrupted
write never leaves a half-written directory where a complete one is expected.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator


@contextlib.contextmanager
def atomic_directory(out_dir: str, prefix: str = ".tmp-") -> Iterator[str]:
  """Yields a fresh temporary directory; on success it replaces `out_dir`, on error it is removed.

  The new directory is complete before an existing `out_dir` (directory, file or link) is removed. Its
  permissions are opened to 0755 / 0644 like any model directory (mkdtemp makes it private).
  """
  out_dir = os.path.abspath(os.fspath(out_dir))
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
  try:
    yield tmp
    os.chmod(tmp, 0o755)
    for name in os.listdir(tmp):
      os.chmod(os.path.join(tmp, name), 0o644)
    if os.path.lexists(out_dir):
      if os.path.isdir(out_dir) and not os.path.islink(out_dir):
        shutil.rmtree(out_dir)
      else:
        os.remove(out_dir)
    os.replace(tmp, out_dir)
  finally:
    if os.path.exists(tmp):
      shutil.rmtree(tmp, ignore_errors=True)
