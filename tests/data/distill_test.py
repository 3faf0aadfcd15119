"""Tests for layerwave/data/distill.py and its parts (answering.py, distilled.py, decontaminate.py, repetition.py): the
self-distillation stage.

On the tiny chat target (tests/conftest.py: random weights, SmolLM2's tokenizer and chat template): the loop
cutter on hand-made sequences, greedy answers equal to `layerwave.generate` on each prompt alone, resumption
after an exception and after a SIGKILL of the launcher, evaluation prompts kept out (injected and real), the
refusals (another target or tokenizer reading the data, a workdir with other settings, bad options, a source
without user turns) and reading the data back through `data.source`. Plain-text prompts for base models: on a
tiny random Gemma 3 with the real Gemma-3-270M tokenizer (BOS, no chat template), the prompts against an
independent rendering, answers cut where the model starts a new turn, a two-turn run read back in the plain
format, and the refusals across formats. One run on the real SmolLM2 (4 prompts x 16 tokens).
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import transformers

import layerwave
from layerwave import options as options_lib
from layerwave.data import answering
from layerwave.data import chat
from layerwave.data import decontaminate
from layerwave.data import distill
from layerwave.data import distilled as distilled_lib
from layerwave.data import repetition
from layerwave.data import sources
from layerwave.data.options import DataOptions, DistillOptions
from layerwave.models import hub

from tests import configs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Small budgets for the tiny target (max_position_embeddings 256); its random answers fall into loops often
# enough that a 12-token minimum makes the cutter act.
OPTIONS = DistillOptions(num_prompts=10, max_new_tokens=32, max_prompt_tokens=96, batch_size=4, chunk_size=4,
                         loop_min_tokens=12)


@pytest.fixture(scope="module")
def target(tiny_chat_target_dir):
  return layerwave.load_target(tiny_chat_target_dir)


@pytest.fixture(scope="module")
def records():
  return sources.get_source("sharegpt", limit=60)


@pytest.fixture(scope="module")
def evals():
  return decontaminate.eval_prompts(decontaminate.EVAL_SETS)


@pytest.fixture(scope="module")
def distilled(target, records, evals, tmp_path_factory):
  """An uninterrupted run of OPTIONS: (workdir, manifest)."""
  workdir = str(tmp_path_factory.mktemp("distilled"))
  return workdir, distill.distill(target, OPTIONS, workdir, records=records, eval_prompts=evals)


def _read(workdir):
  return sources.get_source(f"distilled:{workdir}")


# -- the loop cutter ---------------------------------------------------------------------------------

PREFIX = list(range(100, 120))  # 20 distinct tokens


@pytest.mark.parametrize("tokens,expected", [
    (list(range(200)), None),  # nothing repeats
    (PREFIX + [7, 8, 9] * 12, (20, 3)),  # a period-3 loop to the end: keep one block
    (PREFIX + [5] * 40, (20, 1)),  # one token repeated
    (PREFIX + [1, 2, 3, 4] * 10 + list(range(300, 330)), (20, 4)),  # a loop inside, then other text
    ([5, 6] * 15, None),  # 30 tokens: below min_tokens=32
    ([5, 6] * 16, (0, 2)),  # 32 tokens: a loop (the smallest period, not 4 or 6)
    (PREFIX + list(range(40, 60)) * 2, None),  # a 20-token block twice: below min_repeats=3
    (PREFIX + list(range(40, 60)) * 3, (20, 20)),  # three times: a loop
    (PREFIX + list(range(400, 470)) * 3, None),  # a 70-token block: longer than max_period=64
    ([9] + [1, 2, 9] * 12, (0, 3)),  # the loop starts one token earlier, as the rotation (9, 1, 2)
    (PREFIX + [7, 8] * 3 + PREFIX + [1, 2, 3] * 11, (46, 3)),  # a short repeat first: not a loop
])
def test_find_loop_on_hand_made_sequences(tokens, expected):
  assert repetition.find_loop(tokens, max_period=64, min_repeats=3, min_tokens=32) == expected


def test_cut_loop_keeps_one_block_and_loop_cutting_can_be_off():
  tokens = PREFIX + [7, 8, 9] * 12
  assert repetition.cut_loop(tokens) == (PREFIX + [7, 8, 9], True)
  assert repetition.cut_loop(tokens, max_period=0) == (tokens, False)
  assert repetition.cut_loop(PREFIX) == (PREFIX, False)
  # Partial repeats count: 3 x 11 + 2 tokens = 35 >= 32 covered.
  assert repetition.find_loop(PREFIX + [7, 8, 9] * 11 + [7, 8]) == (20, 3)


# -- batching does not change greedy answers ----------------------------------------------------------

def test_greedy_answers_equal_generate_on_each_prompt_alone(target, records, evals, distilled):
  workdir, manifest = distilled
  out = _read(workdir)
  assert manifest["output"]["conversations"] == len(out) > 0
  assert manifest["output"]["loops_cut"] > 0  # the cut answers are compared too
  by_id = {r.id: r for r in records}
  for record in out:
    source = by_id[record.id]
    system = [m for m in source.messages[:1] if m["role"] == "system"]
    ids = chat.encode_prompt(target.tokenizer, system + [source.messages[len(system)]])
    alone = layerwave.generate(target, [ids.tolist()], OPTIONS.max_new_tokens)[0]
    assert record.messages[-1] == {"role": "assistant",
                                   "content": answering.make_answer(alone, target, OPTIONS).text}
    assert record.messages[:-1] == tuple(system + [source.messages[len(system)]])


# -- resumption --------------------------------------------------------------------------------------

def test_resume_after_an_interruption_gives_the_same_records(target, records, evals, distilled,
                                                            tmp_path, monkeypatch):
  reference = _read(distilled[0])
  workdir = str(tmp_path / "killed")
  real, calls, kill = answering.answer_chunk, [], [True]

  def dies_in_the_second_chunk(*args, **kwargs):
    calls.append(args[3])
    if kill[0] and len(calls) == 2:
      raise KeyboardInterrupt("killed")
    return real(*args, **kwargs)

  monkeypatch.setattr(answering, "answer_chunk", dies_in_the_second_chunk)
  with pytest.raises(KeyboardInterrupt):
    distill.distill(target, OPTIONS, workdir, records=records, eval_prompts=evals)
  kill[0] = False
  assert sorted(os.listdir(os.path.join(workdir, "chunks"))) == ["00000.json"]
  assert not os.path.exists(os.path.join(workdir, "manifest.json"))
  # A write interrupted mid-file leaves only a hidden temporary file, which the rerun ignores.
  with open(os.path.join(workdir, "chunks", ".00001.json.x1y2.tmp"), "w") as f:
    f.write('{"chunk": 1, "recor')
  calls.clear()
  # Batching settings may change on resume: greedy answers do not depend on them.
  manifest = distill.distill(target, dataclasses.replace(OPTIONS, batch_size=3), workdir,
                             records=records, eval_prompts=evals)
  assert calls == [1, 2]  # only the unfinished chunks ran again
  again = _read(workdir)
  assert again == reference
  ids = [r.id for r in again]
  assert len(ids) == len(set(ids)) == manifest["dataset"]["num_examples"]
  prompts, _ = distill.select_prompts(records, target.tokenizer, OPTIONS, decontaminate.EvalIndex.build(evals))
  chunks = []
  for k in range(3):
    with open(os.path.join(workdir, "chunks", f"{k:05d}.json")) as f:
      chunks.append(json.load(f))
  assert sum((c["ids"] for c in chunks), []) == [p.record.id for p in prompts]  # every prompt, once
  assert ids == [r["id"] for c in chunks for r in c["records"]]
  assert manifest["output"]["tokens_written"] == distilled[1]["output"]["tokens_written"]
  # A larger num_prompts extends the finished data: the first chunks are reused, the dataset rebuilt.
  calls.clear()
  more = distill.distill(target, dataclasses.replace(OPTIONS, num_prompts=13), workdir, records=records,
                         eval_prompts=evals)
  assert calls == [2, 3] and more["dataset"]["num_examples"] == 13
  assert _read(workdir)[:10] == reference


# A real SIGKILL of the launcher; by default the resume is covered in process (above: an interrupted chunk and a
# half-written file) and by the killed continuous run below.
@pytest.mark.slow
def test_a_killed_launcher_resumes_without_duplicates_or_gaps(target, tiny_chat_target_dir, tmp_path):
  workdir = str(tmp_path / "launcher")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "distill.py"),
         "--config=" + os.path.join(ROOT, "configs", "smollm2_135m.py") + ":smoke",
         "--config.model=" + tiny_chat_target_dir, "--workdir=" + workdir]
  env = {**os.environ, "PYTHONPATH": ROOT}
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  first = os.path.join(workdir, "chunks", "00000.json")
  deadline = time.time() + 300
  while not os.path.exists(first) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert os.path.exists(first) and not os.path.exists(os.path.join(workdir, "manifest.json"))
  subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
  smoke = configs.load("smoke").distill
  options = options_lib.from_section(DistillOptions, smoke, "distill")
  reference = str(tmp_path / "reference")
  distill.distill(target, options, reference)
  resumed = _read(workdir)
  assert resumed == _read(reference) and len(resumed) == smoke.num_prompts
  assert len({r.id for r in resumed}) == len(resumed)


# -- evaluation prompts stay out -----------------------------------------------------------------------

def _injected(records, evals):
  """Training records that carry evaluation prompts in disguise: {id: the eval set it must be matched to}."""
  mtbench, humaneval, gsm8k = evals["mtbench"], evals["humaneval"], evals["gsm8k"]
  raw_humaneval = sources.get_source("humaneval")[7].meta["prompt"]
  base = records[0]
  made = {
      "inj-exact": (mtbench[0], "mtbench"),
      "inj-inside": ("Please help me with my homework:\n\n" + gsm8k[11].upper() + "\nThanks a lot!", "gsm8k"),
      "inj-whitespace": ("Complete this:\n" + raw_humaneval.replace("    ", "\t").replace("\n", "\n\n"),
                         "humaneval"),
      "inj-piece": (gsm8k[20][5:70], "gsm8k"),  # a piece of a GSM8K problem, >= 40 characters
  }
  out = [dataclasses.replace(base, id=i, group=i, messages=({"role": "user", "content": text},
                                                            {"role": "assistant", "content": "x"}),
                             turns=(text,)) for i, (text, _) in made.items()]
  # MT-bench's second turn, hidden in the second user turn of a conversation.
  second = mtbench[1]
  messages = ({"role": "user", "content": "Hi there, I have a question."}, {"role": "assistant", "content": "Sure."},
              {"role": "user", "content": "  " + second + "  "}, {"role": "assistant", "content": "ok"})
  out.append(dataclasses.replace(base, id="inj-second-turn", group="inj-second-turn", messages=messages,
                                 turns=(messages[0]["content"], messages[2]["content"])))
  expected = {i: name for i, (_, name) in made.items()} | {"inj-second-turn": "mtbench"}
  return out, expected


def test_injected_evaluation_prompts_never_come_out(target, records, evals, tmp_path):
  injected, expected = _injected(records, evals)
  mixed = []
  for k, record in enumerate(records[:12]):
    mixed.append(record)
    if k < len(injected):
      mixed.append(injected[k])
  index = decontaminate.EvalIndex.build(evals)
  assert {r.id: index.match_record(r) for r in injected} == expected
  options = dataclasses.replace(OPTIONS, num_prompts=0, max_prompt_tokens=200, max_new_tokens=8, chunk_size=8)
  prompts, counts = distill.select_prompts(mixed, target.tokenizer, options, index)
  assert not {p.record.id for p in prompts} & set(expected)
  assert counts["eval_excluded"] == {"mtbench": 2, "gsm8k": 2, "humaneval": 1}
  workdir = str(tmp_path / "mixed")
  manifest = distill.distill(target, options, workdir, records=mixed, eval_prompts=evals)
  out = _read(workdir)
  assert not {r.id for r in out} & set(expected) and len(out) == len(prompts)
  assert manifest["prompts"]["eval_excluded"] == counts["eval_excluded"]
  for record in out:
    for m in record.messages:
      assert index.match(m["content"]) is None or m["role"] == "assistant"


@pytest.mark.parametrize("stride", [10, pytest.param(1, marks=pytest.mark.slow)])
def test_real_sharegpt_prompts_against_the_real_evaluation_sets(evals, stride):
  """The ShareGPT conversations the index keeps overlap no evaluation prompt, checked by brute force on every
  `stride`-th conversation (all of them in the slow run: about a minute)."""
  index = decontaminate.EvalIndex.build(evals, min_chars=40)
  kept = [r for r in sources.get_source("sharegpt") if index.match_record(r) is None]
  assert len(kept) > 17000
  train = {decontaminate.normalize(t) for r in kept[::stride] for t in list(r.turns)}
  train.discard("")
  eval_texts = set(index.texts)
  assert not train & eval_texts
  joined_eval = "\n".join(eval_texts)
  assert not [t for t in train if len(t) >= 40 and t in joined_eval]
  joined_train = "\n".join(train)
  assert not [e for e in eval_texts if len(e) >= 40 and e in joined_train]


# -- refusals and bad inputs ---------------------------------------------------------------------------

def test_the_target_fingerprint_is_its_checkpoint_not_its_dtype(target, tiny_chat_target_dir, tmp_path):
  value = distilled_lib.target_fingerprint(target)
  assert value == distilled_lib.checkpoint_fingerprint(tiny_chat_target_dir)
  assert distilled_lib.target_fingerprint(layerwave.load_target(tiny_chat_target_dir, dtype="bfloat16")) == value
  copy = str(tmp_path / "copy")
  shutil.copytree(tiny_chat_target_dir, copy)
  assert distilled_lib.checkpoint_fingerprint(copy) == value  # identity is content, not place
  with open(os.path.join(copy, "config.json")) as f:
    config = json.load(f)
  with open(os.path.join(copy, "config.json"), "w") as f:
    json.dump({**config, "rms_norm_eps": 1e-6}, f)
  assert distilled_lib.checkpoint_fingerprint(copy) != value
  assert distilled_lib.checkpoint_fingerprint(str(tmp_path)) is None


def test_reading_back_through_data_source_and_the_target_check(target, distilled, tiny_chat_target_dir,
                                                               tmp_path):
  workdir, manifest = distilled
  for source in (f"distilled:{workdir}", workdir):
    dataset = DataOptions(source=source, max_length=256, heldout_fraction=0.0).build(target.tokenizer)
    assert dataset.num_examples["train"] == manifest["dataset"]["num_examples"]
    assert dataset.metadata["num_records"] == manifest["dataset"]["num_examples"]
  assert [r.id for r in sources.get_source("distilled", path=workdir, limit=3)] == [r.id for r in _read(workdir)[:3]]
  # The same tokenizer, other weights: another target.
  other = str(tmp_path / "other_target")
  shutil.copytree(tiny_chat_target_dir, other)
  with open(os.path.join(other, "model.safetensors"), "r+b") as f:
    f.seek(-4, os.SEEK_END)
    f.write(b"\x01\x02\x03\x04")
  tokenizer = transformers.AutoTokenizer.from_pretrained(other)
  with pytest.raises(ValueError, match="answers of another target .* Distil the data with this model"):
    DataOptions(source=f"distilled:{workdir}", max_length=128).build(tokenizer)
  tokenizer.chat_template = tokenizer.chat_template.replace("SmolLM", "OtherLM")
  with pytest.raises(ValueError, match="distilled with another tokenizer"):
    DataOptions(source=f"distilled:{workdir}", max_length=128).build(tokenizer)


def test_unfinished_and_missing_datasets_are_named(tmp_path):
  with pytest.raises(sources.SourceError, match="does not exist"):
    sources.get_source(f"distilled:{tmp_path / 'nothing'}")
  os.makedirs(tmp_path / "half" / "chunks")
  with pytest.raises(sources.SourceError, match="no finished distilled dataset .* experiments/distill.py"):
    sources.get_source(f"distilled:{tmp_path / 'half'}")


def test_a_workdir_with_other_settings_is_refused(target, records, evals, distilled):
  workdir, manifest = distilled
  with pytest.raises(ValueError, match="other settings .*differing: temperature.* new --workdir"):
    distill.distill(target, dataclasses.replace(OPTIONS, temperature=0.7), workdir, records=records,
                    eval_prompts=evals)
  # Speed settings may change: the finished data is reused as it is.
  same = distill.distill(target, dataclasses.replace(OPTIONS, batch_size=2), workdir, records=records,
                         eval_prompts=evals)
  assert same == manifest


@pytest.mark.parametrize("field,value,match", [
    ("max_new_tokens", 0, r"distill.max_new_tokens must be >= 1 .*--config.distill.max_new_tokens=512"),
    ("turns", 0, "distill.turns must be >= 1"),
    ("temperature", -1.0, "temperature must be >= 0"),
    ("exclude", "mtbench,nope", "unknown evaluation sets"),
    ("max_new_tokens", "many", "distill.max_new_tokens must be an integer"),
    ("chat_format", "chatml", r"must be one of \['template', 'plain'\], got 'chatml'.*--config\.data\.chat_format="),
])
def test_bad_options_name_the_field(field, value, match):
  section = configs.load("smoke").distill.to_dict()
  section[field] = value
  with pytest.raises(ValueError, match=match):
    options_lib.from_section(DistillOptions, section, "distill")


def test_a_source_without_user_turns_is_refused(target, evals, tmp_path):
  text = sources.get_source("text", limit=5)
  with pytest.raises(sources.SourceError, match="has no user turns .*--config.distill.source=sharegpt"):
    distill.distill(target, dataclasses.replace(OPTIONS, source="text"), str(tmp_path / "t"), records=text,
                    eval_prompts=evals)


def test_prompt_and_answer_budget_must_fit_the_target(target, tmp_path):
  with pytest.raises(ValueError, match="exceeds the target's max_position_embeddings"):
    distill.distill(target, dataclasses.replace(OPTIONS, max_prompt_tokens=200, max_new_tokens=100),
                    str(tmp_path / "w"))


# -- multi-turn -----------------------------------------------------------------------------------------

def test_later_turns_follow_the_regenerated_history(target, records, evals, tmp_path):
  options = dataclasses.replace(OPTIONS, turns=2, num_prompts=6, max_new_tokens=8, max_prompt_tokens=160)
  manifest = distill.distill(target, options, str(tmp_path / "two"), records=records, eval_prompts=evals)
  out = _read(str(tmp_path / "two"))
  by_id = {r.id: r for r in records}
  two = [r for r in out if sum(m["role"] == "assistant" for m in r.messages) == 2]
  assert two and manifest["output"]["assistant_turns"] == sum(
      sum(m["role"] == "assistant" for m in r.messages) for r in out)
  for record in two:
    user, first, second_user, second = [m for m in record.messages if m["role"] != "system"]
    assert second_user["content"] == by_id[record.id].turns[1]
    system = [m for m in record.messages[:1] if m["role"] == "system"]
    ids = chat.encode_prompt(target.tokenizer, system + [user, first, second_user])
    alone = layerwave.generate(target, [ids.tolist()], options.max_new_tokens)[0]
    assert second["content"] == answering.make_answer(alone, target, options).text


# -- continuous batching --------------------------------------------------------------------------------

CONTINUOUS = dataclasses.replace(OPTIONS, slots=3, chunk_steps=4)


def test_continuous_batching_gives_the_static_records(target, records, evals, distilled, tmp_path):
  """Rows leave at a loop, EOS or the budget and take the next prompt across chunks: the data is the same."""
  workdir = str(tmp_path / "continuous")
  manifest = distill.distill(target, CONTINUOUS, workdir, records=records, eval_prompts=evals)
  assert _read(workdir) == _read(distilled[0])
  out, ref = manifest["output"], distilled[1]["output"]
  assert out["tokens_written"] == ref["tokens_written"] and out["loops_cut"] == ref["loops_cut"] > 0
  assert out["generated_tokens"] < ref["generated_tokens"]  # looping rows stopped early
  assert manifest["settings_fingerprint"] == distilled[1]["settings_fingerprint"]  # slots are resumable


def test_continuous_later_turns_equal_static_ones(target, records, evals, tmp_path):
  options = dataclasses.replace(OPTIONS, turns=2, num_prompts=6, max_new_tokens=8, max_prompt_tokens=160)
  distill.distill(target, options, str(tmp_path / "static"), records=records, eval_prompts=evals)
  distill.distill(target, dataclasses.replace(options, slots=2, chunk_steps=3), str(tmp_path / "cont"),
                  records=records, eval_prompts=evals)
  out = _read(str(tmp_path / "cont"))
  assert out == _read(str(tmp_path / "static"))
  assert any(sum(m["role"] == "assistant" for m in r.messages) == 2 for r in out)


def test_a_killed_continuous_run_resumes_without_duplicates_or_gaps(target, records, evals, distilled, tmp_path,
                                                                   monkeypatch):
  from layerwave import continuous  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path / "killed")
  real, steps = continuous.Engine.step, []

  def dies_after_the_first_chunk_file(self):
    steps.append(1)
    if os.path.isdir(os.path.join(workdir, "chunks")) and os.listdir(os.path.join(workdir, "chunks")):
      raise KeyboardInterrupt("killed")
    return real(self)

  monkeypatch.setattr(continuous.Engine, "step", dies_after_the_first_chunk_file)
  with pytest.raises(KeyboardInterrupt):
    distill.distill(target, CONTINUOUS, workdir, records=records, eval_prompts=evals)
  written = sorted(os.listdir(os.path.join(workdir, "chunks")))
  assert "00000.json" in written and len(written) < 3 and not os.path.exists(os.path.join(workdir, "manifest.json"))
  monkeypatch.setattr(continuous.Engine, "step", real)
  manifest = distill.distill(target, CONTINUOUS, workdir, records=records, eval_prompts=evals)
  again = _read(workdir)
  assert again == _read(distilled[0])
  assert len({r.id for r in again}) == len(again) == manifest["dataset"]["num_examples"]


# -- plain-text prompts (base models) -------------------------------------------------------------------

PLAIN = dataclasses.replace(OPTIONS, chat_format="plain")


@pytest.fixture(scope="module")
def base_target(tmp_path_factory):
  """A tiny random Gemma 3 that speaks the real Gemma-3-270M tokenizer: a base model (BOS, no chat template)."""
  hf_reference = pytest.importorskip("tests.models.hf_reference")  # needs torch
  directory = hf_reference.save_tiny_gemma_with_real_tokenizer(str(tmp_path_factory.mktemp("tiny_base_target")))
  return layerwave.load_target(directory)


def _plain_prompt(tokenizer, messages):
  """The plain prompt, rendered here by hand: BOS, "Role: content" paragraphs, an open "Assistant:"."""
  text = "".join(f"{chat.PLAIN_ROLES[m['role']]}: {m['content'].strip()}\n\n" for m in messages)
  return tokenizer(tokenizer.bos_token + text + "Assistant:", add_special_tokens=False)["input_ids"]


def test_plain_prompts_are_the_plain_rendering_after_bos(base_target, records):
  tokenizer = base_target.tokenizer
  assert tokenizer.chat_template is None and tokenizer.bos_token == "<bos>"
  prompts, _ = distill.select_prompts(records, tokenizer, dataclasses.replace(PLAIN, max_prompt_tokens=160), None)
  assert len(prompts) == PLAIN.num_prompts
  for p in prompts:
    system = [m for m in p.record.messages[:1] if m["role"] == "system"]
    assert p.ids.tolist() == _plain_prompt(tokenizer, system + [{"role": "user", "content": p.record.turns[0]}])
    assert tokenizer.decode(p.ids.tolist()).startswith("<bos>User: ")


@pytest.mark.parametrize("label", ["User", "Assistant", "System"])
@pytest.mark.parametrize("model", ["target", "base_target"])
def test_plain_answers_are_cut_where_the_model_starts_a_new_turn(model, label, request):
  target = request.getfixturevalue(model)
  tokenizer, eos = target.tokenizer, [target.eos_token_ids[0]]
  answer = " Paris is the capital.\n\nIt is large."
  kept = tokenizer(answer, add_special_tokens=False)["input_ids"]
  more = tokenizer(answer + f"\n\n{label}: And of Spain?\n\nAssistant: Madrid", add_special_tokens=False)["input_ids"]
  assert more[:len(kept)] == kept and len(more) > len(kept) + 3
  assert answering.make_answer(more + eos, target, PLAIN) == answering.Answer(
      text=answer.strip(), tokens=len(kept), generated=len(more) + 1, eos=False, loop_cut=False, turn_end_cut=True,
      ids=tuple(kept))
  # Without a new turn nothing is cut; the template format never cuts at a role label.
  assert answering.make_answer(kept + eos, target, PLAIN) == answering.Answer(
      text=answer.strip(), tokens=len(kept), generated=len(kept) + 1, eos=True, loop_cut=False, ids=tuple(kept))
  assert answering.make_answer(more + eos, target, OPTIONS).text.endswith("Madrid")
  # The turn end is cut first; a loop before it is cut after.
  loop = tokenizer(" Yes" * 40 + "\n\nUser: why?", add_special_tokens=False)["input_ids"]
  got = answering.make_answer(loop, target, PLAIN)
  assert (got.text, got.tokens, got.loop_cut, got.turn_end_cut) == ("Yes", 1, True, True)


def test_a_plain_row_leaves_continuous_decoding_once_its_turn_ends(target):
  """`answering.stop_fn` ends a row as soon as `make_answer` would cut it anyway: at a new "User:" turn (plain
  format) or a repetition loop; with neither to watch for it is None (rows run to EOS or the budget)."""
  tokenizer = target.tokenizer
  script = tokenizer(" Yes.\n\nUser: and then the model rambles on", add_special_tokens=False)["input_ids"]
  stop = answering.stop_fn(target, dataclasses.replace(PLAIN, loop_max_period=0))
  ends = [n for n in range(1, len(script) + 1) if stop(script[:n])]
  assert tokenizer.convert_ids_to_tokens(script[:6]) == ["ĠYes", ".", "Ċ", "Ċ", "User", ":"]
  assert ends and ends[0] == 6 and ends == list(range(6, len(script) + 1))  # from the complete "User:" on
  assert not stop([])
  assert answering.stop_fn(target, dataclasses.replace(OPTIONS, loop_max_period=0)) is None
  loops = answering.stop_fn(target, OPTIONS)
  phrase = tokenizer(" the sea is blue and", add_special_tokens=False)["input_ids"]
  assert not loops(phrase) and loops(phrase * 8)


def test_plain_distillation_of_a_base_model_reads_back_in_the_plain_format(base_target, records, evals, tmp_path):
  tokenizer = base_target.tokenizer
  options = dataclasses.replace(PLAIN, turns=2, num_prompts=4, max_new_tokens=8, max_prompt_tokens=160)
  workdir = str(tmp_path / "plain")
  manifest = distill.distill(base_target, options, workdir, records=records, eval_prompts=evals)
  assert manifest["prompts"]["chat_format"] == "plain" and "turn_ends_cut" in manifest["output"]
  with open(os.path.join(workdir, "settings.json")) as f:
    assert json.load(f)["settings"]["chat_format"] == "plain"
  out = sources.read_distilled(workdir)
  by_id = {r.id: r for r in records}
  answered = 0
  for record in out:
    messages = list(record.messages)
    users = [m["content"] for m in messages if m["role"] == "user"]
    assert users == list(by_id[record.id].turns[:len(users)]) and len(users) <= 2
    for k, m in enumerate(messages):
      if m["role"] == "assistant":  # each answer is greedy decoding of its plain history alone, cut the same way
        alone = layerwave.generate(base_target, [_plain_prompt(tokenizer, messages[:k])], options.max_new_tokens,
                                   prompt_width=options.max_prompt_tokens)[0]  # one compilation for all
        assert m["content"] == answering.make_answer(alone, base_target, options).text
        answered += 1
  assert answered == manifest["output"]["assistant_turns"] > len(out) > 0  # second turns too
  dataset = DataOptions(source=f"distilled:{workdir}", max_length=256, heldout_fraction=0.0,
                        chat_format="plain").build(tokenizer)
  assert dataset.num_examples["train"] == len(out)
  ids = np.asarray(dataset.source("train")[0]["input_ids"])
  assert tokenizer.decode(ids[ids != 0].tolist()).startswith("<bos>User: ")
  with pytest.raises(ValueError, match=r"prompts in the 'plain' chat format.*--config\.data\.chat_format=plain"):
    DataOptions(source=f"distilled:{workdir}", max_length=256).build(tokenizer)
  # The template format needs a chat template: the error names the fix.
  with pytest.raises(ValueError, match=r"no chat template .*--config\.data\.chat_format=plain"):
    distill.distill(base_target, OPTIONS, str(tmp_path / "template"), records=records, eval_prompts=evals)


def test_a_workdir_distilled_in_one_format_is_refused_for_the_other(target, records, evals, distilled, tmp_path):
  workdir, manifest = distilled
  with open(os.path.join(workdir, "settings.json")) as f:
    assert "chat_format" not in json.load(f)["settings"]  # the template's fingerprint is the one before the option
  assert manifest["prompts"]["chat_format"] == "template"
  with pytest.raises(ValueError, match="other settings .*differing: chat_format.* new --workdir"):
    distill.distill(target, PLAIN, workdir, records=records, eval_prompts=evals)
  plain = str(tmp_path / "plain")
  distill.distill(target, dataclasses.replace(PLAIN, num_prompts=2, chunk_size=2), plain, records=records,
                  eval_prompts=evals)
  with pytest.raises(ValueError, match="other settings .*differing: chat_format"):
    distill.distill(target, dataclasses.replace(OPTIONS, num_prompts=2, chunk_size=2), plain, records=records,
                    eval_prompts=evals)
  # This tokenizer has a template, but answers to plain prompts are not read through it.
  with pytest.raises(ValueError, match=r"prompts in the 'plain' chat format.*--config\.data\.chat_format=plain"):
    DataOptions(source=f"distilled:{plain}", max_length=128).build(target.tokenizer)


def test_the_stage_renders_prompts_in_the_data_sections_format(monkeypatch, tmp_path):
  seen = []

  def stop(target, options, workdir, **kwargs):
    del target, workdir, kwargs
    seen.append(options)
    raise InterruptedError

  monkeypatch.setattr(distill, "load_target", lambda *args, **kwargs: None)
  monkeypatch.setattr(distill, "distill", stop)
  for variant in ("", "smoke"):  # the base model's config: plain data, SmolLM2's distill section
    gemma = configs.load(variant, name="gemma3_270m")
    with pytest.raises(InterruptedError):
      distill.run(gemma, str(tmp_path))
    assert seen[-1].chat_format == "plain" and gemma.distill == configs.load(variant or "demo").distill
  config = configs.load("smoke")
  with pytest.raises(InterruptedError):
    distill.run(config, str(tmp_path))
  assert seen[-1].chat_format == "template"
  config.data.chat_format = "chatml"
  with pytest.raises(ValueError, match=r"one of \['template', 'plain'\].*--config\.data\.chat_format="):
    distill.run(config, str(tmp_path))


# -- the real target ------------------------------------------------------------------------------------

def test_real_smollm2_answers_four_prompts(tmp_path):
  target = layerwave.load_target(hub.resolve("smollm2-135m-instruct"))
  asks = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?",
          "Write one sentence about the sea."]
  records = [sources.Record(id=f"q{i}", source="test", messages=({"role": "user", "content": q},), turns=(q,))
             for i, q in enumerate(asks)]
  options = DistillOptions(num_prompts=4, max_new_tokens=16, max_prompt_tokens=64, batch_size=4,
                                   chunk_size=4, exclude="")
  manifest = distill.distill(target, options, str(tmp_path / "real"), records=records, eval_prompts={})
  out = _read(str(tmp_path / "real"))
  assert [r.id for r in out] == ["q0", "q1", "q2", "q3"]
  assert "Paris" in out[0].messages[-1]["content"]
  assert manifest["target"]["num_layers"] == 30 and manifest["output"]["generated_tokens"] <= 4 * 16
  assert 0 < manifest["output"]["tokens_written"] <= manifest["output"]["generated_tokens"]
  assert np.isfinite(manifest["time"]["generated_tokens_per_s"])


# -- the compact release of the answers ------------------------------------------------------------------

def test_a_release_of_the_answers_rebuilds_the_dataset_exactly(target, records, evals, distilled, tmp_path,
                                                             monkeypatch):
  from layerwave.data import release  # pylint: disable=g-import-not-at-top
  workdir, manifest = distilled
  out = str(tmp_path / "release")
  packed = release.pack(workdir, out, commands=["distill ..."])
  assert packed["content"] == manifest["dataset"]["content"] and packed["chunks"] == manifest["dataset"]["chunks"]
  names = sorted(os.listdir(out))
  assert sorted(names) == [f"answers-{k:05d}.json.gz" for k in range(packed["chunks"])] + [
      "manifest.json", "settings.json"]
  # No prompt text in the release: only ids, positions and token ids.
  import gzip  # pylint: disable=g-import-not-at-top
  with gzip.open(os.path.join(out, "answers-00000.json.gz"), "rt") as f:
    body = json.load(f)
  assert set(body["records"][0]) == {"index", "id", "answers"}
  with open(os.path.join(out, "manifest.json"), "rb") as f:
    committed = f.read()
  # Packing again with nothing new changes nothing, not even the manifest's commands.
  release.main(["release", "pack", workdir, out, "--made-by=make campaign-distill (python experiments/distill.py)"])
  with open(os.path.join(out, "manifest.json"), "rb") as f:
    assert f.read() == committed
  # A new release records what made the answers, then the pack itself, with the home directory as ~.
  home = os.path.commonpath([workdir, str(tmp_path)])
  monkeypatch.setenv("HOME", home)
  again = str(tmp_path / "release2")
  release.main(["release", "pack", workdir, again, f"--made-by=make campaign-distill (distill.py {workdir})"])
  with open(os.path.join(again, "manifest.json")) as f:
    commands = json.load(f)["commands"]
  w, a = os.path.relpath(workdir, home), os.path.relpath(again, home)
  assert commands == [f"make campaign-distill (distill.py ~/{w})",
                      f"python -m layerwave.data.release pack ~/{w} ~/{a}"]
  with pytest.raises(SystemExit, match="usage"):
    release.main(["release", "unpack", out, workdir, "--made-by=x"])

  with pytest.raises(SystemExit, match="usage"):
    release.main(["release", "unpack", out, workdir, "--model=gemma3-270m"])

  # The manifest names the target (the finished workdir's, or --model's), and unpack loads it when given none.
  assert packed["model"] == manifest["target"]["model"] == target.path
  named = str(tmp_path / "named")
  release.main(["release", "pack", workdir, named, f"--model={target.path}"])
  with open(os.path.join(named, "manifest.json")) as f:
    assert os.path.expanduser(json.load(f)["model"]) == target.path  # as ~/... where it is under HOME
  release.unpack(named, str(tmp_path / "by-name"), records=records)
  assert ([c["records"] for c in distilled_lib.finished_chunks(str(tmp_path / "by-name"))]
          == [c["records"] for c in distilled_lib.finished_chunks(workdir)])

  rebuilt = str(tmp_path / "rebuilt")
  release.unpack(out, rebuilt, target=target, records=records)
  monkeypatch.setattr(answering, "answer_chunk", lambda *a, **k: pytest.fail("a released chunk was distilled again"))
  again = distill.distill(target, OPTIONS, rebuilt, records=records, eval_prompts=evals)
  assert again["dataset"]["content"] == manifest["dataset"]["content"]
  assert _read(rebuilt) == _read(workdir)


def test_an_altered_or_foreign_release_is_refused(target, records, evals, distilled, tmp_path,
                                                  tiny_chat_target_dir):
  from layerwave.data import release  # pylint: disable=g-import-not-at-top
  out = str(tmp_path / "release")
  release.pack(distilled[0], out)
  del tiny_chat_target_dir
  other = layerwave.load_target(hub.resolve("smollm2-135m-instruct"))  # the same tokenizer, another checkpoint
  with pytest.raises(release.ReleaseError, match="another target"):
    release.unpack(out, str(tmp_path / "w1"), target=other, records=records)
  # A prompt source whose conversations moved is named.
  with pytest.raises(release.ReleaseError, match="not at position"):
    release.unpack(out, str(tmp_path / "w2"), target=target, records=records[1:])
  # Answers edited with the manifest's checksums updated: the rebuilt records miss the content fingerprint.
  import gzip  # pylint: disable=g-import-not-at-top
  path = os.path.join(out, "answers-00001.json.gz")
  with open(path, "rb") as f:
    data = f.read()
  body = json.loads(gzip.decompress(data))
  body["records"][0]["answers"][0] = body["records"][0]["answers"][0][:-1]
  with open(path, "wb") as f:
    f.write(gzip.compress(json.dumps(body).encode()))
  with open(os.path.join(out, "manifest.json")) as f:
    manifest = json.load(f)
  manifest["sha256"]["answers-00001.json.gz"] = release.sha256(path)
  with open(os.path.join(out, "manifest.json"), "w") as f:
    json.dump(manifest, f)
  with pytest.raises(release.ReleaseError, match="do not match its content fingerprint"):
    release.unpack(out, str(tmp_path / "w3"), target=target, records=records)
  with open(path, "wb") as f:
    f.write(data[:-3])
  with pytest.raises(release.ReleaseError, match="does not match its SHA-256"):
    release.verify(out)
  os.remove(path)
  with pytest.raises(release.ReleaseError, match="is missing"):
    release.verify(out)
  with pytest.raises(release.ReleaseError, match="no manifest.json"):
    release.verify(str(tmp_path))
