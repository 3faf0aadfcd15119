"""Tests for layerwave/data/chat.py on the real SmolLM2 tokenizer (ChatML, no {% generation %})."""

import numpy as np
import pytest

from layerwave.data import chat
from layerwave.data import sources

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4.  Anything else?"},
    {"role": "user", "content": "Say hi in French."},
    {"role": "assistant", "content": "Bonjour !\n\n```python\nprint('salut')\n```"},
]


def _assistant_text(tokenizer, encoded):
  return tokenizer.decode(encoded.input_ids[encoded.assistant_mask == 1].tolist())


def test_ids_match_apply_chat_template(tokenizer):
  encoded = chat.encode_chat(tokenizer, CONVERSATION)
  reference = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
  np.testing.assert_array_equal(encoded.input_ids, reference)
  assert encoded.input_ids.dtype == np.int32 and encoded.assistant_mask.dtype == np.uint8


def test_mask_covers_exactly_assistant_content_and_end_of_turn(tokenizer):
  encoded = chat.encode_chat(tokenizer, CONVERSATION)
  eot = tokenizer.eos_token
  expected = "".join(m["content"] + eot for m in CONVERSATION if m["role"] == "assistant")
  assert _assistant_text(tokenizer, encoded) == expected
  # The mask is two contiguous runs, each ending on <|im_end|> (id 2).
  mask = encoded.assistant_mask.astype(int)
  ends = np.flatnonzero(np.diff(np.append(mask, 0)) == -1)
  assert len(ends) == 2 and all(encoded.input_ids[e] == tokenizer.eos_token_id == 2 for e in ends)


def test_mask_on_real_sharegpt_conversations(tokenizer):
  for record in sources.get_source("sharegpt", limit=30):
    encoded = chat.encode_record(tokenizer, record)
    expected = "".join(m["content"] + tokenizer.eos_token
                       for m in record.messages if m["role"] == "assistant")
    assert _assistant_text(tokenizer, encoded) == expected, record.id


def test_search_fallback_agrees_with_prefix_rendering(tokenizer):
  text, spans = chat.assistant_spans(tokenizer, CONVERSATION)
  assert chat._spans_by_search(tokenizer, text, CONVERSATION) == spans
  assert tokenizer.eos_token in chat.end_of_turn_tokens(tokenizer)


def test_truncation(tokenizer):
  full = chat.encode_chat(tokenizer, CONVERSATION)
  cut = chat.encode_chat(tokenizer, CONVERSATION, max_length=20)
  assert cut.truncated and not full.truncated and cut.length == 20
  np.testing.assert_array_equal(cut.input_ids, full.input_ids[:20])
  np.testing.assert_array_equal(cut.assistant_mask, full.assistant_mask[:20])
  with pytest.raises(ValueError, match="max_length"):
    chat.encode_chat(tokenizer, CONVERSATION, max_length=0)


def test_prompt_ends_with_generation_header(tokenizer):
  ids = chat.encode_prompt(tokenizer, CONVERSATION[:2])
  assert tokenizer.decode(ids.tolist()).endswith("<|im_start|>assistant\n")
  assert ids.dtype == np.int32
  np.testing.assert_array_equal(chat.encode_prompt(tokenizer, CONVERSATION[:2], max_length=5),
                                ids[-5:])


def test_tokenize_text_and_records(tokenizer):
  encoded = chat.tokenize_text(tokenizer, "The quick brown fox.", max_length=3)
  assert encoded.length == 3 and encoded.assistant_mask.tolist() == [1, 1, 1]
  text = sources.Record(id="t", source="text", text="Hello world")
  assert chat.encode_record(tokenizer, text).assistant_mask.all()
  with pytest.raises(ValueError, match="neither text nor messages"):
    chat.encode_record(tokenizer, sources.Record(id="x", source="y"))


# -- plain text for base models (no chat template) -------------------------------------------------


def test_plain_rendering_labels_turns_and_spans_the_replies():
  text, spans = chat.render_plain(CONVERSATION)
  assert text == ("System: You answer briefly.\n\nUser: What is 2 + 2?\n\nAssistant: 4.  Anything else?\n\n"
                  "User: Say hi in French.\n\nAssistant: Bonjour !\n\n```python\nprint('salut')\n```")
  assert [text[a:b] for a, b in spans] == [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
  with pytest.raises(ValueError, match="role 'tool'"):
    chat.render_plain([{"role": "tool", "content": "x"}])


def test_plain_mask_covers_exactly_the_reply_content(tokenizer):
  encoded = chat.encode_plain(tokenizer, CONVERSATION)
  text, _ = chat.render_plain(CONVERSATION)
  np.testing.assert_array_equal(encoded.input_ids, tokenizer(text)["input_ids"])
  # The replies' tokens (each reply's first one may carry the space after "Assistant:"), nothing else.
  assert _assistant_text(tokenizer, encoded).lstrip() == "4.  Anything else? Bonjour !\n\n```python\nprint('salut')\n```"
  mask = encoded.assistant_mask.astype(int)
  assert np.sum(np.diff(np.append(0, mask)) == 1) == 2
  cut = chat.encode_plain(tokenizer, CONVERSATION, max_length=20)
  assert cut.truncated and cut.length == 20
  np.testing.assert_array_equal(cut.assistant_mask, encoded.assistant_mask[:20])


def test_plain_records_of_real_sharegpt_and_the_template_refusal(tokenizer):
  for record in sources.get_source("sharegpt", limit=20):
    encoded = chat.encode_record(tokenizer, record, chat_format="plain")
    replies = [m["content"].strip() for m in record.messages if m["role"] == "assistant"]
    got = _assistant_text(tokenizer, encoded)
    assert got.replace(" ", "") == "".join(replies).replace(" ", ""), record.id
  record = sources.Record(id="c", source="s", messages=tuple(CONVERSATION))
  with pytest.raises(ValueError, match="one of"):
    chat.encode_record(tokenizer, record, chat_format="chatml")
  template = tokenizer.chat_template
  try:
    tokenizer.chat_template = None  # a base model's tokenizer
    with pytest.raises(ValueError, match=r"no chat template .* --config\.data\.chat_format=plain"):
      chat.encode_record(tokenizer, record)
    assert chat.encode_record(tokenizer, record, chat_format="plain").assistant_mask.any()
  finally:
    tokenizer.chat_template = template


def test_plain_prompt_is_the_plain_rendering_with_an_open_assistant_turn(tokenizer):
  ids = chat.encode_prompt(tokenizer, CONVERSATION[:4], chat_format="plain")
  expected = ("System: You answer briefly.\n\nUser: What is 2 + 2?\n\nAssistant: 4.  Anything else?\n\n"
              "User: Say hi in French.\n\nAssistant:")
  np.testing.assert_array_equal(ids, tokenizer(expected)["input_ids"])
  assert ids.dtype == np.int32
  # The prompt's tokens begin the conversation's plain tokens: the answer continues it as training reads it.
  full = chat.encode_plain(tokenizer, CONVERSATION)
  np.testing.assert_array_equal(full.input_ids[:len(ids)], ids)
  assert full.assistant_mask[len(ids):].all()  # and the rest is the reply (its first token carries the space)
  with pytest.raises(ValueError, match=r"one of \['template', 'plain'\]"):
    chat.encode_prompt(tokenizer, CONVERSATION[:2], chat_format="chatml")
  template = tokenizer.chat_template
  try:
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match=r"no chat template .* --config\.data\.chat_format=plain"):
      chat.encode_prompt(tokenizer, CONVERSATION[:2])
    np.testing.assert_array_equal(chat.encode_prompt(tokenizer, CONVERSATION[:4], chat_format="plain"), ids)
  finally:
    tokenizer.chat_template = template


@pytest.mark.parametrize("text,expected", [
    ("Paris.", None),
    ("Paris.\n\nUser: And Spain?", 6),
    ("Paris.\n\nSystem: x\n\nUser: y", 6),
    ("A\n\nB.\n\nAssistant: more", 5),  # paragraphs inside an answer are kept
    ("User: a label at the start", None),
    ("Paris.\nUser: one newline", None),
    ("Paris.\n\nUser without a colon", None),
    ("Paris.\n\nuser: lower case", None),
])
def test_plain_turn_end(text, expected):
  assert chat.plain_turn_end(text) == expected
