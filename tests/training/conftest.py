"""A tiny training config on the shared tiny chat target (tests/conftest.py), so the real data pipeline runs in
seconds."""

import pytest

from tests import configs


@pytest.fixture
def tiny_config(tiny_chat_target_dir):
  c = configs.load("smoke")
  c.model = tiny_chat_target_dir
  c.layers = (1, 2, 3)
  c.data.max_length = 64
  c.data.max_records = 60
  c.data.heldout_fraction = 0.2
  # At 256 none of the random target's next tokens in the first batches falls inside the draft vocabulary: a
  # zero loss and zero gradients, and every check of what training changed would hold vacuously.
  c.draft_model.vocab_size = 4096
  c.train.batch_size = 2
  c.train.num_steps = 4
  c.train.warmup_steps = 1
  c.train.ttt_steps = 2
  c.train.log_every = 2
  c.train.eval_every = 2
  c.train.eval_batches = 1
  c.train.checkpoint_every = 2
  c.train.lr = 1e-2
  return c
