"""layerwave.training.options: the train / draft_model sections, validated once with the fix in the error."""

import dataclasses

import pytest

from layerwave import options as options_lib
from layerwave.training import options
from layerwave.training import step as step_lib
from tests import configs


def test_the_configs_sections_build_typed_options():
  for variant in ("smoke", None):
    config = configs.load(variant)
    t = options_lib.from_section(options.TrainOptions, config.train, "train")
    m = options_lib.from_section(options.DraftModelOptions, config.draft_model, "draft_model")
    assert t.batch_size == config.train.batch_size and m.vocab_size == config.draft_model.vocab_size
    assert set(f.name for f in dataclasses.fields(t)) == set(config.train.keys())  # the section, all of it
    assert set(f.name for f in dataclasses.fields(m)) == set(config.draft_model.keys())


def test_derived_settings():
  t = options.TrainOptions(batch_size=2, num_steps=10, stop_after=3, lr=1e-3, warmup_steps=2)
  assert (t.optimizer.lr, t.optimizer.warmup_steps, t.optimizer.total_steps) == (1e-3, 2, 10)
  assert t.loss == step_lib.LossSettings(steps=7, decay=0.8, assistant_only=True)
  assert dataclasses.replace(t, eval_ttt_steps=3, compute_dtype="bfloat16", remat=True).eval_loss == \
      step_lib.LossSettings(steps=3, decay=0.8, assistant_only=True)  # evaluation: float32, no remat
  assert t.stop_step(0) == 3 and t.stop_step(9) == 10
  assert dataclasses.replace(t, stop_after=0).stop_step(4) == 10
  assert set(options.TrainOptions.RESUMABLE) <= {f.name for f in dataclasses.fields(t)}


@pytest.mark.parametrize("field, value, message", [
    ("batch_size", 0, r"train\.batch_size must be >= 1, got 0; set --config\.train\.batch_size=N"),
    ("num_steps", -1, r"train\.num_steps must be >= 1"),
    ("stop_after", -2, r"train\.stop_after must be >= 0, got -2; set --config\.train\.stop_after=0"),
    ("lr", 0.0, r"train\.lr must be > 0, got 0\.0; set e\.g\. --config\.train\.lr=3e-4"),
    ("b2", 1.0, r"train\.b2 must be in \[0, 1\), got 1\.0"),
    ("decay", 0.0, r"train\.decay must be in \(0, 1\]"),
    ("clip_norm", -1.0, r"train\.clip_norm must be > 0"),
    ("target_dtype", "float16", r"train\.target_dtype must be '' \(the target's own dtype\) or one of "
     r"\['float32', 'bfloat16'\], got 'float16'; set --config\.train\.target_dtype=bfloat16 or leave it empty"),
])
def test_bad_train_values_are_refused_naming_the_field_and_the_fix(field, value, message):
  config = configs.load("smoke")
  config.train[field] = value
  with pytest.raises(ValueError, match=message):
    options_lib.from_section(options.TrainOptions, config.train, "train")


def test_target_dtype_is_online_only():
  config = configs.load("smoke")
  config.train.target_dtype, config.train.features = "bfloat16", "runs/features"
  with pytest.raises(ValueError, match=r"train\.target_dtype='bfloat16' sets the online forward's dtype, but this "
                     r"run reads the store train\.features.*Set --config\.train\.target_dtype='' for an offline run"):
    options_lib.from_section(options.TrainOptions, config.train, "train")
  config.train.features = ""
  assert options_lib.from_section(options.TrainOptions, config.train, "train").target_dtype == "bfloat16"


def test_bad_draft_model_values_are_refused():
  with pytest.raises(ValueError, match=r"draft_model\.vocab_size \(V_d\) must be >= 1.*--config\.draft_model"):
    options.DraftModelOptions(vocab_size=0)
  with pytest.raises(ValueError, match=r"draft_model\.num_layers must be >= 1"):
    options.DraftModelOptions(num_layers=0)
  with pytest.raises(ValueError, match=r"draft_model\.fc_norm must be True or False"):
    options_lib.from_section(options.DraftModelOptions, {"fc_norm": "yes"}, "draft_model")


def test_precision_is_not_recipe():
  recorded = {"seed": 0, "layers": [2, 15, 27], "train": {"lr": 3e-3, "compute_dtype": "float32"}}
  assert options.same_recipe(recorded, {**recorded, "train": {"lr": 3e-3, "compute_dtype": "bfloat16"}})
  assert not options.same_recipe(recorded, {**recorded, "train": {"lr": 1e-3, "compute_dtype": "float32"}})
  assert not options.same_recipe(recorded, {**recorded, "seed": 1})
  assert options.precision_history(None, "float32", 650, "bfloat16") == [[0, "float32"], [650, "bfloat16"]]
  assert options.precision_history([[0, "float32"], [650, "bfloat16"]], "bfloat16", 900, "bfloat16") == [
      [0, "float32"], [650, "bfloat16"]]
  assert options.precision_history(None, "bfloat16", 5, "bfloat16") == [[0, "bfloat16"]]


def test_a_release_records_the_home_directory_as_tilde_and_compares_on_any_home():
  import os  # pylint: disable=g-import-not-at-top
  home = os.path.expanduser("~")
  run = {"seed": 0, "train": {"lr": 3e-3}, "data": {"source": f"distilled:{home}/runs/campaign/distilled"}}
  released = options.home_as_tilde(run)
  assert released["data"]["source"] == "distilled:~/runs/campaign/distilled"
  assert options.same_recipe(released, run)
  assert not options.same_recipe(released, {**run, "data": {"source": "distilled:/elsewhere/distilled"}})
