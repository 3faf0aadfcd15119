"""A tiny Llama target that speaks SmolLM2's tokenizer, so the real data pipeline runs in seconds."""

import importlib.util
import os
import shutil

import pytest

from layerwave.models import hub
from tests.models import hf_reference

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def tiny_chat_target_dir(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("tiny_chat_target"))
  smol = hub.resolve("smollm2-135m-instruct")
  hf_reference.save_hf_model_with(directory, vocab_size=49152, num_hidden_layers=4,
                                  eos_token_id=2, bos_token_id=1, pad_token_id=2)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(smol, name), os.path.join(directory, name))
  return directory


def load_config(variant="smoke"):
  spec = importlib.util.spec_from_file_location(
      "smollm2_config", os.path.join(REPO, "configs", "smollm2_135m.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)


@pytest.fixture
def tiny_config(tiny_chat_target_dir):
  c = load_config("smoke")
  c.model = tiny_chat_target_dir
  c.layers = "1,2,3"
  c.data.max_length = 64
  c.data.max_records = 60
  c.data.heldout_fraction = 0.2
  c.draft_model.vocab_size = 256
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
