"""layerwave.speculative.evaluate: prompts through the chat template, the paired evaluation, its table."""

import dataclasses

import numpy as np
import pytest
import transformers

from layerwave.models import hub
from layerwave.speculative import evaluate
from tests import configs
from tests.speculative.conftest import PROMPTS


@pytest.fixture(scope="module")
def tokenizer():
  return transformers.AutoTokenizer.from_pretrained(hub.resolve("smollm2-135m-instruct"))


def test_chat_prompts_template_the_first_turn_and_respect_the_length_limit(tokenizer):
  items = evaluate.chat_prompts(tokenizer, "gsm8k", 3)
  assert len(items) == 3 and all(isinstance(i, str) and ids for i, ids in items)
  assert tokenizer.decode(items[0][1]).rstrip().endswith("assistant")  # ends at the assistant's turn
  short = evaluate.chat_prompts(tokenizer, "gsm8k", 2, max_prompt_tokens=200)
  assert len(short) == 2 and all(len(ids) <= 200 for _, ids in short)
  with pytest.raises(ValueError, match=r"raise compare\.max_prompt_tokens or lower compare\.num_prompts"):
    evaluate.chat_prompts(tokenizer, "gsm8k", 2, max_prompt_tokens=5, section="compare")
  with pytest.raises(ValueError, match="held-out prompt sets are mtbench, humaneval, gsm8k"):
    evaluate.chat_prompts(tokenizer, "gsm9k", 2)
  (rid, ids), = evaluate.question_prompt(tokenizer, "What is 12 times 7?")
  assert rid == "prompt" and "12 times 7" in tokenizer.decode(ids)


def test_decode_settings_from_the_speculate_section():
  s = configs.load("smoke").speculate
  settings = evaluate.DecodeSettings.from_config(s, max_new_tokens=7)
  assert settings.max_new_tokens == 7 and settings.spec.method == s.method
  assert settings.spec.num_draft_tokens == s.num_draft_tokens and settings.batch_size == s.batch_size
  with pytest.raises(ValueError, match=r"speculate\.batch_size must be >= 1"):
    dataclasses.replace(settings, batch_size=0)


def test_paired_greedy_evaluation_equals_plain_decoding(llama):
  target, _, trained = llama
  settings = evaluate.DecodeSettings(max_new_tokens=6, batch_size=2, timing_repeats=1)
  ev = evaluate.evaluate(target, trained, PROMPTS, settings, seed=0, paired=True)
  summary = evaluate.summary(ev)
  assert summary["prompts"] == len(PROMPTS) and summary["equal_to_ar"] == 1.0 and summary["tau"] >= 1
  assert summary["timing_pairs"] == 2  # one pair per batch
  row = evaluate.acceptance_row(evaluate.pooled([ev, ev]), greedy=True)
  assert row["equal_to_ar"] == 1.0 and row["new_tokens"] == 2 * summary["new_tokens"]
  table = evaluate.table(summary, settings)
  assert "| chain K=5 | 0 | 4 |" in table and "speedup = spec ÷ AR tokens/s" in table
  assert row["prompt_stats"] == 2 * ev.prompt_stats()  # pooled in outputs' order
  unpaired = evaluate.evaluate(target, trained, PROMPTS, settings, seed=0, paired=False)
  assert unpaired.prompt_stats() == ev.prompt_stats() and len(ev.prompt_stats()) == len(PROMPTS)
  emitted, calls = np.asarray(ev.prompt_stats()).sum(axis=0)
  assert emitted / calls == pytest.approx(summary["tau"])
  alone = evaluate.summary(unpaired)
  assert "speedup" not in alone and alone["tau"] == summary["tau"]
  assert "| - | - | - |" in evaluate.table(alone, settings)
