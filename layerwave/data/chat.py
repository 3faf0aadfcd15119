"""Chat formatting and tokenisation: the second stage of the data pipeline (records → tokens + masks).

`encode_chat` renders a conversation with the tokenizer's own chat template and returns `input_ids`
with an `assistant_mask` (METHOD.md §2): 1 on the tokens of assistant replies, including the template's
end-of-turn token, 0 on everything else (system prompt, user turns, role headers, separators). The
statistics of the analysis stage and the draft's training loss read only masked positions.

The mask does not depend on `{% generation %}` support in the template (SmolLM2's ChatML template has
none). Each assistant reply k is located by rendering the template twice per reply: once for the
messages before it with `add_generation_prompt=True`, once for the messages up to and including it;
the text between the two renderings is the reply as the template writes it (content plus end-of-turn
marker plus any trailing separator). Trailing whitespace after the end-of-turn marker is dropped from
the span, then character spans map to tokens through the fast tokenizer's offset mapping. This works
for any template whose renderings of growing prefixes are prefixes of each other (ChatML, Llama-3,
Gemma, Mistral, ...); for templates that rewrite earlier turns (e.g. ones that drop past reasoning)
it falls back to finding each reply's content in order in the full rendering and extending it over
the special tokens that follow.

A base model has no chat template (Gemma-3-270M's GGUF carries none). `encode_plain` renders a conversation
as plain text instead, one turn per paragraph: "User: ...\n\nAssistant: ...", after the tokenizer's own BOS.
The assistant mask covers each reply's content (no role label; no end-of-turn token exists in this format).
`CHAT_FORMATS` names the two renderings; `config.data.chat_format` picks one.

`encode_prompt` formats the prompt for generation: the template's generation prompt, or in the plain format the
rendering followed by an open "Assistant:" paragraph. A base model does not end its answer with EOS but goes on
with the next "\n\nUser:" paragraph; `plain_turn_end` finds where, `cut_turn_end` cuts the generated tokens
there. `tokenize_text` handles plain text (all-ones mask); `encode_record` dispatches on a `sources.Record`.

Legend (`layerwave.axes`): T tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from layerwave.data import sources

# How a conversation becomes text: "template" = the tokenizer's chat template (`encode_chat`), "plain" = role-
# labelled paragraphs for base models without one (`encode_plain`).
CHAT_FORMATS = ("template", "plain")
PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


@dataclasses.dataclass(frozen=True)
class Encoded:
  """A tokenised example.

  Attributes:
    input_ids: int32 [T] token ids.
    assistant_mask: uint8 [T], 1 on tokens the analysis and the draft loss should read.
    truncated: whether the example was cut to `max_length`.
  """
  input_ids: np.ndarray
  assistant_mask: np.ndarray
  truncated: bool = False

  @property
  def length(self) -> int:
    return int(self.input_ids.shape[0])


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], generation_prompt: bool,
            **template_kwargs: Any) -> str:
  return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                       add_generation_prompt=generation_prompt, **template_kwargs)


def assistant_spans(tokenizer: Any, messages: Sequence[dict[str, str]],
                    **template_kwargs: Any) -> tuple[str, list[tuple[int, int]]]:
  """Renders a conversation and finds the character span of every assistant reply.

  Args:
    tokenizer: a transformers tokenizer with a chat template.
    messages: `[{"role", "content"}, ...]`.
    **template_kwargs: extra variables for the template.

  Returns:
    `(text, spans)`: the full rendering and one `(start, end)` character span per assistant message,
    covering its content and end-of-turn marker (not the whitespace after the marker).

  Raises:
    ValueError: an assistant reply cannot be located in the rendering.
  """
  messages = list(messages)
  text = _render(tokenizer, messages, False, **template_kwargs)
  spans = []
  for k, message in enumerate(messages):
    if message["role"] != "assistant":
      continue
    before = _render(tokenizer, messages[:k], True, **template_kwargs) if k else ""
    upto = _render(tokenizer, messages[:k + 1], False, **template_kwargs)
    if not (upto.startswith(before) and text.startswith(upto)):
      return text, _spans_by_search(tokenizer, text, messages)
    spans.append((len(before), len(upto.rstrip())))
  return text, spans


def _spans_by_search(tokenizer: Any, text: str,
                     messages: Sequence[dict[str, str]]) -> list[tuple[int, int]]:
  """Fallback: finds each assistant content in order, then extends it over one end-of-turn marker."""
  markers = sorted(end_of_turn_tokens(tokenizer), key=len, reverse=True)
  spans, cursor = [], 0
  for message in messages:
    needle = message["content"].strip()
    if message["role"] != "assistant":
      found = text.find(needle, cursor) if needle else -1
      cursor = found + len(needle) if found >= 0 else cursor
      continue
    start = text.find(needle, cursor)
    if not needle or start < 0:
      raise ValueError(
          "Cannot locate an assistant reply in the chat-template rendering: the template neither "
          "renders growing prefixes consistently nor keeps the reply text verbatim. Compute the mask "
          "with a template that supports `{% generation %}` or pass messages the template keeps.")
    end = start + len(needle)
    gap = len(text[end:]) - len(text[end:].lstrip())
    for marker in markers:
      if text.startswith(marker, end + gap):
        end += gap + len(marker)
        break
    spans.append((start, end))
    cursor = end
  return spans


def end_of_turn_tokens(tokenizer: Any) -> list[str]:
  """Special tokens that may close a turn: EOS and specials named like `<|im_end|>`, `<|eot_id|>`,
  `<end_of_turn>`, `</s>`."""
  names = {t for t in tokenizer.all_special_tokens if t}
  names |= {str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
            if getattr(t, "special", False)}
  found = {t for t in names if "end" in t.lower() or "eot" in t.lower() or t.startswith("</")}
  if tokenizer.eos_token:
    found.add(tokenizer.eos_token)
  return sorted(found)


def _mask_from_spans(offsets: Sequence[tuple[int, int]],
                     spans: Sequence[tuple[int, int]]) -> np.ndarray:
  """uint8 [T]: 1 for tokens whose character interval overlaps any span."""
  mask = np.zeros(len(offsets), np.uint8)
  if not spans or not len(offsets):
    return mask
  starts = np.array([o[0] for o in offsets])
  ends = np.array([o[1] for o in offsets])
  for a, b in spans:
    mask |= ((starts < b) & (ends > a)).astype(np.uint8)
  return mask


def _truncate(ids: np.ndarray, mask: np.ndarray, max_length: int | None) -> Encoded:
  if max_length is not None and max_length <= 0:
    raise ValueError(f"max_length must be positive, got {max_length}")
  if max_length is not None and ids.shape[0] > max_length:
    return Encoded(ids[:max_length], mask[:max_length], truncated=True)
  return Encoded(ids, mask)


def _check_fast(tokenizer: Any) -> None:
  if not getattr(tokenizer, "is_fast", False):
    raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer; assistant masks need "
                    "character offsets. Load it with `AutoTokenizer.from_pretrained(..., use_fast=True)`.")


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, str]], *,
                max_length: int | None = None, **template_kwargs: Any) -> Encoded:
  """Tokenises a conversation with its chat template and builds the assistant mask.

  Args:
    tokenizer: a fast transformers tokenizer with a chat template.
    messages: `[{"role", "content"}, ...]` with roles system / user / assistant.
    max_length: keep only the first `max_length` tokens (right truncation).
    **template_kwargs: extra variables for the template.

  Returns:
    `Encoded` with input_ids int32 [T] exactly as `apply_chat_template(messages, tokenize=True)` gives
    them, and assistant_mask uint8 [T].
  """
  _check_fast(tokenizer)
  text, spans = assistant_spans(tokenizer, messages, **template_kwargs)
  # apply_chat_template(tokenize=True) tokenises the rendering with add_special_tokens=False too.
  enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
  ids = np.asarray(enc["input_ids"], np.int32)
  mask = _mask_from_spans(enc["offset_mapping"], spans)
  return _truncate(ids, mask, max_length)


def render_plain(messages: Sequence[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
  """A conversation as plain text, "User: ...\n\nAssistant: ...", and the span of every assistant reply.

  Args:
    messages: `[{"role", "content"}, ...]` with roles system / user / assistant.

  Returns:
    `(text, spans)`: turns as "<Role>: <content>" (content stripped) joined by a blank line, and one
    `(start, end)` character span per assistant message covering its content only.

  Raises:
    ValueError: a role outside system / user / assistant.
  """
  text, spans = "", []
  for k, message in enumerate(messages):
    role = message["role"]
    if role not in PLAIN_ROLES:
      raise ValueError(f"Cannot render role {role!r} as plain text; roles are {sorted(PLAIN_ROLES)}.")
    text += ("\n\n" if k else "") + PLAIN_ROLES[role] + ": "
    start = len(text)
    text += message["content"].strip()
    if role == "assistant":
      spans.append((start, len(text)))
  return text, spans


def encode_plain(tokenizer: Any, messages: Sequence[dict[str, str]], *,
                 max_length: int | None = None) -> Encoded:
  """Tokenises a conversation rendered by `render_plain` (for base models) and builds the assistant mask.

  The tokenizer adds its usual special tokens (Gemma: BOS; SmolLM2: none); a reply's first token carries the
  space after "Assistant:" and counts as the reply's.

  Args:
    tokenizer: a fast transformers tokenizer (no chat template needed).
    messages: `[{"role", "content"}, ...]`.
    max_length: keep only the first `max_length` tokens (right truncation).

  Returns:
    `Encoded` with input_ids int32 [T] and assistant_mask uint8 [T] (1 on the replies' content tokens).
  """
  _check_fast(tokenizer)
  text, spans = render_plain(messages)
  enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
  ids = np.asarray(enc["input_ids"], np.int32)
  # Special tokens the tokenizer adds (BOS) have empty (0, 0) offsets and so never count.
  mask = _mask_from_spans(enc["offset_mapping"], spans)
  return _truncate(ids, mask, max_length)


def plain_turn_end(text: str) -> int | None:
  """Where a new turn starts in text a model wrote after a plain-format prompt, or None.

  A new turn is a blank line followed by a role label of `PLAIN_ROLES` and a colon ("\n\nUser:",
  "\n\nAssistant:", "\n\nSystem:"): how `render_plain` separates turns. A label without a blank line before
  it (say at the very start of the text) does not count.

  Returns:
    The character index of that blank line (the text before it is the answer), or None.
  """
  found = [i for i in (text.find(f"\n\n{label}:") for label in PLAIN_ROLES.values()) if i >= 0]
  return min(found) if found else None


def cut_turn_end(tokens: Sequence[int], tokenizer: Any) -> tuple[list[int], bool]:
  """Cuts tokens a model generated after a plain-format prompt where it starts a new turn (`plain_turn_end`).

  Args:
    tokens: generated token ids (without EOS).
    tokenizer: the target's tokenizer.

  Returns:
    (kept, cut): if a new turn starts, the fewest leading tokens whose decoding spells the text before it
    (trailing whitespace dropped, so the blank line goes too) and True; otherwise `tokens` and False.
  """
  tokens = list(tokens)
  text = tokenizer.decode(tokens, skip_special_tokens=True)
  end = plain_turn_end(text)
  if end is None:
    return tokens, False
  keep = text[:end].rstrip()
  # The shortest prefix whose decoding starts with `keep` (all of `tokens` does; decoded prefixes only grow).
  lo, hi = 0, len(tokens)
  while lo < hi:
    mid = (lo + hi) // 2
    if tokenizer.decode(tokens[:mid], skip_special_tokens=True).startswith(keep):
      hi = mid
    else:
      lo = mid + 1
  return tokens[:lo], True


def encode_prompt(tokenizer: Any, messages: Sequence[dict[str, str]], *,
                  max_length: int | None = None, chat_format: str = "template",
                  **template_kwargs: Any) -> np.ndarray:
  """Tokenises a prompt for generation.

  "template": the chat template with `add_generation_prompt=True`. "plain": `render_plain(messages)` then an
  open "Assistant:" paragraph, after the tokenizer's usual special tokens (Gemma: BOS), as `encode_plain`
  tokenises conversations. The prompt ends at the colon, without the space: in `encode_plain`'s rendering the
  space belongs to the reply's first token ("▁Paris"), so the prompt's tokens are a prefix of the tokens of
  the conversation with its answer (a prompt ending in a lone space token would not be).

  Args:
    tokenizer: a transformers tokenizer (with a chat template for "template").
    messages: the conversation so far, normally ending with a user message.
    max_length: keep only the last `max_length` tokens (left truncation keeps the generation prompt;
      it can cut the system prompt, so choose a length that fits the prompts).
    chat_format: one of `CHAT_FORMATS`.
    **template_kwargs: extra variables for the template ("template" only).

  Returns:
    int32 [T] token ids, ending with the assistant header the model continues from.
  """
  check_chat_format(tokenizer, chat_format)
  if chat_format == "plain":
    text, _ = render_plain(messages)
    text += ("\n\n" if text else "") + PLAIN_ROLES["assistant"] + ":"
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
  else:
    ids = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True,
                                        return_dict=False, **template_kwargs)
  ids = np.asarray(ids, np.int32).reshape(-1)
  if max_length is not None:
    if max_length <= 0:
      raise ValueError(f"max_length must be positive, got {max_length}")
    ids = ids[-max_length:]
  return ids


def tokenize_text(tokenizer: Any, text: str, *, max_length: int | None = None,
                  add_special_tokens: bool = True) -> Encoded:
  """Tokenises plain text; every token counts (all-ones mask).

  Args:
    tokenizer: a transformers tokenizer.
    text: any text.
    max_length: keep only the first `max_length` tokens.
    add_special_tokens: let the tokenizer add its usual BOS/EOS (SmolLM2 adds none).

  Returns:
    `Encoded` with input_ids int32 [T] and assistant_mask all ones uint8 [T].
  """
  ids = np.asarray(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"], np.int32)
  return _truncate(ids, np.ones_like(ids, np.uint8), max_length)


def check_chat_format(tokenizer: Any, chat_format: str) -> None:
  """Refuses an unknown format, or "template" with a tokenizer that has no chat template (a base model)."""
  if chat_format not in CHAT_FORMATS:
    raise ValueError(f"Unknown chat format {chat_format!r}; set --config.data.chat_format to one of "
                     f"{list(CHAT_FORMATS)}.")
  if chat_format == "template" and not getattr(tokenizer, "chat_template", None):
    raise ValueError(f"The tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template (a base "
                     "model): render conversations as plain text with --config.data.chat_format=plain.")


def encode_record(tokenizer: Any, record: sources.Record, *,
                  max_length: int | None = None, chat_format: str = "template") -> Encoded:
  """Tokenises a source record: `tokenize_text` for text chunks, `encode_chat` or `encode_plain` for
  conversations.

  Args:
    tokenizer: a fast transformers tokenizer (with a chat template for `chat_format="template"`).
    record: a `sources.Record`.
    max_length: right-truncate to this many tokens.
    chat_format: one of `CHAT_FORMATS`.

  Returns:
    The `Encoded` example.
  """
  if record.text:
    return tokenize_text(tokenizer, record.text, max_length=max_length)
  if not record.messages:
    raise ValueError(f"Record {record.id!r} from {record.source!r} has neither text nor messages.")
  check_chat_format(tokenizer, chat_format)
  if chat_format == "plain":
    return encode_plain(tokenizer, record.messages, max_length=max_length)
  return encode_chat(tokenizer, record.messages, max_length=max_length)
