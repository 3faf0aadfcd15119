"""Fixtures for the data tests: the real SmolLM2 tokenizer (ChatML template), loaded once."""

import pytest
import transformers

from layerwave.models import hub


@pytest.fixture(scope="session")
def tokenizer():
  return transformers.AutoTokenizer.from_pretrained(hub.resolve("smollm2-135m-instruct"))
