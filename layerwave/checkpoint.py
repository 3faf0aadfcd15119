"""Checkpoints of the draft: one module wrapping orbax (params, optimizer state, vocabulary, metadata).

A checkpoint step holds three items: `state` (the `TrainState`: step, draft params, optimizer state),
`vocab` (the draft's `d2t` / `t2d` tables) and `meta` (JSON: the `DraftConfig`, the `LayerSelection`
record, the data position, the config fingerprint). Orbax commits each step atomically (a temporary
directory renamed on success), so an interrupted save leaves the previous checkpoint usable. Restores always
go into an abstract target that carries the current shardings.
"""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp

ITEMS = ("state", "vocab", "meta")


class Checkpointer:
  """Saves and restores draft checkpoints under `directory`."""

  def __init__(self, directory: str, max_to_keep: int = 2):
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
        self.directory, item_names=ITEMS,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, vocab: Any, meta: dict, *, wait: bool = True) -> None:
    self._manager.save(int(step), args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), vocab=ocp.args.StandardSave(vocab),
        meta=ocp.args.JsonSave(meta)), force=True)
    if wait:
      self._manager.wait_until_finished()

  def read_meta(self, step: int | None = None) -> dict:
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint in {self.directory}.")
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, abstract_state: Any, abstract_vocab: Any, step: int | None = None):
    """Restores `(state, vocab, meta)` onto the shardings carried by the abstract targets."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint in {self.directory}.")
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        vocab=ocp.args.StandardRestore(abstract_vocab), meta=ocp.args.JsonRestore()))
    return out["state"], out["vocab"], out["meta"]

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

