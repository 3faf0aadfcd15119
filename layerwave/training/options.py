"""The draft-training stage's settings as typed, validated options: `config.train` and `config.draft_model`.

Place in the pipeline: `Recipe.from_config` builds them once from their config sections
(`layerwave.options.from_section`: every field converted to its type, a wrong kind refused naming the field);
`__post_init__` checks ranges once, with the fix in the error. `training.loop.train` then reads typed fields;
`layerwave.compare` builds one `Recipe` and gives each cell its seed.
"""

from __future__ import annotations

import dataclasses
import os
from typing import ClassVar

from layerwave import options as options_lib
from layerwave.data.options import DataOptions
from layerwave.models import gates as gates_lib
from layerwave.training import step as step_lib

__all__ = ["DraftModelOptions", "Recipe", "TrainOptions"]


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class DraftModelOptions:
  """`config.draft_model`: the EAGLE-3 draft's shape (docs/METHOD.md §7).

  Attributes:
    vocab_size: V_d, capped at the target's vocabulary.
    num_layers: decoder layers of the draft (EAGLE-3: 1).
    fc_norm: RMSNorm each selected layer's chunk before fc.
    init_from_target: start lm_head and the final norm from the target's rows.
    gates: "" (EAGLE-3's fusion) or a learned gate per layer, "hard_concrete" | "softmax" | "group_lasso"
      (`layerwave.models.gates`; needs `fc_norm`): the draft of a learned selection
      (`layerwave.training.learned`), trained on every candidate depth.
    gate_k: the number of layers the gates' regulariser leaves in use.
    gate_strength: λ, the regulariser's weight in the loss.
    gate_lr_scale: the gate logits' learning rate relative to train.lr.
  """

  # Fields added after runs were recorded: they enter a run's (or sweep's) settings only when they differ from
  # their defaults, so that a run recorded before them still resumes (`record`).
  LATER: ClassVar[tuple[str, ...]] = ("gates", "gate_k", "gate_strength", "gate_lr_scale")

  vocab_size: int = 32000
  num_layers: int = 1
  fc_norm: bool = False
  init_from_target: bool = True
  gates: str = ""
  gate_k: int = 3
  gate_strength: float = 0.1
  gate_lr_scale: float = 100.0

  def __post_init__(self):
    _require(self.vocab_size >= 1, f"draft_model.vocab_size (V_d) must be >= 1, got {self.vocab_size}; set "
             "--config.draft_model.vocab_size=32000 (capped at the target's vocabulary).")
    _require(self.num_layers >= 1, f"draft_model.num_layers must be >= 1, got {self.num_layers}; EAGLE-3 "
             "drafts have 1 (--config.draft_model.num_layers=1).")
    _require(self.gates in ("",) + gates_lib.KINDS, f"draft_model.gates must be '' (no gates) or one of "
             f"{list(gates_lib.KINDS)}, got {self.gates!r}; set e.g. --config.draft_model.gates=softmax.")
    _require(not self.gates or self.fc_norm, "draft_model.gates needs draft_model.fc_norm=True: every depth is "
             "normalised before its gate, so that gates compare depths at one scale; add "
             "--config.draft_model.fc_norm=True.")
    if self.gates:
      self.gate_config  # pylint: disable=pointless-statement  # its own range checks, now

  @property
  def gate_config(self) -> gates_lib.GateConfig | None:
    """The draft's `GateConfig`, or None for an ungated draft."""
    if not self.gates:
      return None
    return gates_lib.GateConfig(kind=self.gates, k=self.gate_k, strength=self.gate_strength,
                                lr_scale=self.gate_lr_scale)

  def record(self) -> dict:
    """The fields as a dict, less the `LATER` ones at their defaults (what fingerprints hold)."""
    defaults = {f.name: f.default for f in dataclasses.fields(self)}
    return {k: v for k, v in dataclasses.asdict(self).items() if not (k in self.LATER and v == defaults[k])}


@dataclasses.dataclass(frozen=True)
class TrainOptions:
  """`config.train`: the budget, the optimizer and the training-time test (docs/METHOD.md §7).

  Attributes:
    batch_size: global batch (divisible by the mesh's data axis).
    num_steps: total steps; the cosine decay ends here unless `schedule_steps` is set.
    schedule_steps: the learning-rate schedule's length (0 = `num_steps`). A run resumes only with the
      schedule it started with (checked against its checkpoint): to train past a finished run's end, keep
      its schedule with `schedule_steps` = its old `num_steps` (the extra steps run at the schedule's end
      value) or start a new workdir.
    stop_after: stop after this many steps of this invocation (preemption drills); 0 = off.
    lr, warmup_steps, b1, b2, weight_decay, clip_norm: AdamW with warmup and cosine decay, clipped.
    ttt_steps: K unrolled training-time-test steps.
    decay: step j's loss weighs decay**j.
    assistant_only: loss (and vocabulary counts) on assistant tokens only.
    vocab_examples: examples counted for the draft vocabulary; 0 = the whole train split.
    log_every, eval_every, eval_batches, checkpoint_every: how often to log, evaluate, checkpoint.
    end_lr_fraction: the cosine schedule ends at this fraction of `lr` (1 = constant after warmup).
    freeze_head: keep the draft's LM head as initialised (`draft_model.init_from_target`: the target's rows).
    eval_ttt_steps: unrolled steps of the held-out evaluation (0 = `ttt_steps`); a fixed value compares drafts
      trained with different K at the same draft depth.
    eval_features: evaluate on this store's heldout split instead of `features`' (e.g. drafts trained on
      different text, all evaluated on the target's own answers); needs `features`.
    features: a feature store directory (experiments/extract_features.py) to train from offline, with no
      target in the step; "" = online (the target runs in every step).
    max_sequences: train on only the first N sequences (by dataset index) of `features`' train split (0 = all):
      a data-limited run on a prefix of a larger store, e.g. to ask what extra text adds once the target's
      answers run out.
    extra_features: comma-separated feature stores whose train splits are read after `features`' (needs
      `features`): more text beside the target's answers, e.g. ShareGPT's own answers through the target (a
      forward, no generation). Each must store the run's layers in the same dtype and split its conversations
      as the run's data does (`data.heldout_fraction`, `data.split_seed`), so that no held-out conversation of
      `features` is trained on; the held-out evaluation stays `features`' (or `eval_features`'). Mixed by
      count: a batch draws from every sequence alike.
    compute_dtype: the draft's forward and backward passes in training: "float32" or "bfloat16" (parameters,
      gradients and optimizer state stay float32; held-out evaluation always runs in float32, as inference).
      Precision, not recipe: a run may resume (or continue from its release) in the other dtype; its
      checkpoints and releases keep the history (`compute_dtypes`).
    target_dtype: online training only: the dtype of the target's forward that makes each step's inputs
      (features, h_L and through it the targets): "" = the target's own (`config.dtype`), or "bfloat16": the
      float32 target's parameters cast once (`inference.with_dtype`), as `features.compute_dtype` does for a
      store's training split; the held-out evaluation keeps the target itself, as at inference. Part of the
      recipe (a run resumes only with the same value). Offline runs read a store, whose forward ran at
      extraction (`features.compute_dtype`), and refuse it.
    init_from: a draft release (`releases/<name>` or its directory) of an earlier, unfinished run of this same
      recipe, to continue when `W` holds no checkpoint (a new machine): training goes on from the release's
      step, data position and learning rate, with its bfloat16-rounded weights in float32 and fresh AdamW
      moments (the only difference from an exact resume; its first updates are bias-corrected like a fresh
      start's). A release of another recipe, target, layers or store is refused; a checkpoint in `W` wins.
    remat: the memory-saving path for long sequences at scale (`losses.ttt_loss`): each unrolled step
      rematerialised in the backward pass and the draft's attention in blocks of query rows. The same losses,
      gradients to float rounding; off by default, so CPU runs keep their exact numbers.
    bucket_widths: length buckets (`data.BatchIterator`'s `widths`): each batch holds about batch_size *
      data.max_length token slots, as [floor(batch_size * max_length / w), w] for the smallest width w >= its
      sequences' lengths, so short sequences stop paying for padding; () = every batch [batch_size,
      max_length]. Each width's row count must be divisible by the mesh's data axis (checked at start).
  """

  # Fields that may change between a run and its resumption (run length, logging, evaluation).
  RESUMABLE: ClassVar[tuple[str, ...]] = ("num_steps", "schedule_steps", "stop_after", "log_every", "eval_every", "eval_batches",
                                          "eval_ttt_steps", "eval_features", "checkpoint_every",
                                          "init_from")

  # Fields a resumed run may change because they change the arithmetic's precision, not the recipe (as the
  # mesh does): they stay in the recorded settings, resumption compares the rest (`same_recipe`), and each
  # checkpoint records the run's precision history (`compute_dtypes`: [first step, dtype] segments).
  PRECISION: ClassVar[tuple[str, ...]] = ("compute_dtype",)

  # Fields added after runs were recorded: they enter a run's (or sweep's) settings only when set, so that a
  # run recorded before them still resumes (`drop_unset_later`).
  LATER: ClassVar[tuple[str, ...]] = ("max_sequences", "extra_features", "target_dtype", "remat")

  batch_size: int
  num_steps: int
  schedule_steps: int = 0
  stop_after: int = 0
  lr: float = 3e-4
  warmup_steps: int = 50
  b1: float = 0.9
  b2: float = 0.95
  weight_decay: float = 0.0
  clip_norm: float = 0.5
  ttt_steps: int = 7
  decay: float = 0.8
  assistant_only: bool = True
  vocab_examples: int = 0
  log_every: int = 25
  eval_every: int = 250
  eval_batches: int = 8
  checkpoint_every: int = 250
  end_lr_fraction: float = 0.0
  freeze_head: bool = False
  eval_ttt_steps: int = 0
  eval_features: str = ""
  features: str = ""
  max_sequences: int = 0
  extra_features: str = ""
  bucket_widths: tuple[int, ...] = ()
  compute_dtype: str = "float32"
  target_dtype: str = ""
  init_from: str = ""
  remat: bool = False

  def __post_init__(self):
    for name in ("batch_size", "num_steps", "ttt_steps", "log_every", "eval_every", "eval_batches",
                 "checkpoint_every"):
      value = getattr(self, name)
      _require(value >= 1, f"train.{name} must be >= 1, got {value}; set --config.train.{name}=N with N >= 1.")
    for name in ("stop_after", "warmup_steps", "vocab_examples", "weight_decay", "eval_ttt_steps", "schedule_steps",
                 "max_sequences"):
      value = getattr(self, name)
      _require(value >= 0, f"train.{name} must be >= 0, got {value}; set --config.train.{name}=0 to turn it "
               "off.")
    _require(self.lr > 0, f"train.lr must be > 0, got {self.lr}; set e.g. --config.train.lr=3e-4.")
    _require(self.clip_norm > 0, f"train.clip_norm must be > 0, got {self.clip_norm}; set e.g. "
             "--config.train.clip_norm=0.5.")
    for name in ("b1", "b2"):
      value = getattr(self, name)
      _require(0 <= value < 1, f"train.{name} must be in [0, 1), got {value}; AdamW's default is "
               f"--config.train.{name}={0.9 if name == 'b1' else 0.95}.")
    _require(0 < self.decay <= 1, f"train.decay must be in (0, 1], got {self.decay}; EAGLE-3 uses "
             "--config.train.decay=0.8.")
    _require(not self.eval_features or bool(self.features), "train.eval_features evaluates offline; it needs "
             "train.features (a store to train from). Unset --config.train.eval_features to evaluate online.")
    _require(not (self.extra_features or self.max_sequences) or bool(self.features),
             "train.extra_features and train.max_sequences read feature stores; they need train.features (the "
             "store of the target's own answers to train from).")
    _require(all(p.strip() for p in self.extra_features.split(",")) if self.extra_features else True,
             f"train.extra_features={self.extra_features!r} has an empty entry; give comma-separated store "
             "directories, e.g. --config.train.extra_features=runs/sharegpt-features.")
    _require(all(w >= 1 for w in self.bucket_widths), f"train.bucket_widths must be positive, got "
             f"{self.bucket_widths}; e.g. --config.train.bucket_widths=128,256 (max_length is always added).")
    _require(self.compute_dtype in step_lib.COMPUTE_DTYPES, f"train.compute_dtype must be one of "
             f"{list(step_lib.COMPUTE_DTYPES)}, got {self.compute_dtype!r}; set --config.train.compute_dtype=float32.")
    _require(self.target_dtype in ("",) + step_lib.COMPUTE_DTYPES, f"train.target_dtype must be '' (the "
             f"target's own dtype) or one of {list(step_lib.COMPUTE_DTYPES)}, got {self.target_dtype!r}; set "
             "--config.train.target_dtype=bfloat16 or leave it empty.")
    _require(not (self.target_dtype and self.features), f"train.target_dtype={self.target_dtype!r} sets the "
             "online forward's dtype, but this run reads the store train.features, whose forward ran at extraction "
             "(features.compute_dtype). Set --config.train.target_dtype='' for an offline run.")
    _require(0 <= self.end_lr_fraction <= 1, f"train.end_lr_fraction must be in [0, 1], got "
             f"{self.end_lr_fraction}; 0 decays to zero, 1 keeps the peak rate.")

  @property
  def optimizer(self) -> step_lib.OptimizerSettings:
    """The optimizer's hyperparameters (a static argument of `train_step`)."""
    return step_lib.OptimizerSettings(self.lr, self.warmup_steps, self.schedule_length, clip_norm=self.clip_norm,
                                      b1=self.b1, b2=self.b2, weight_decay=self.weight_decay,
                                      end_lr_fraction=self.end_lr_fraction, freeze_head=self.freeze_head)

  @classmethod
  def drop_unset_later(cls, train: dict) -> dict:
    """`train` (a dict of these fields) less the `LATER` fields left at their defaults."""
    return {k: v for k, v in train.items() if not (k in cls.LATER and not v)}

  @property
  def extra_feature_dirs(self) -> list[str]:
    """`extra_features` as a list of directories."""
    return [p.strip() for p in self.extra_features.split(",")] if self.extra_features else []

  @property
  def schedule_length(self) -> int:
    """The steps the learning-rate schedule spans (checked on resume: it must not change mid-run)."""
    return self.schedule_steps or self.num_steps

  @property
  def loss(self) -> step_lib.LossSettings:
    """The training steps' loss settings (in `StepProgram.loss`)."""
    return step_lib.LossSettings(self.ttt_steps, self.decay, self.assistant_only, compute_dtype=self.compute_dtype,
                                 remat=self.remat)

  @property
  def eval_loss(self) -> step_lib.LossSettings:
    """The evaluation's: unrolled `eval_ttt_steps` deep when set, in float32 without remat (as at inference)."""
    return step_lib.LossSettings(self.eval_ttt_steps or self.ttt_steps, self.decay, self.assistant_only)

  def stop_step(self, start: int) -> int:
    """The step this invocation stops at, resuming from `start`."""
    return min(self.num_steps, start + self.stop_after) if self.stop_after else self.num_steps


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Everything that fixes what a training run computes besides the target and the layers it reads.

  Attributes:
    train: the budget, optimizer and training-time test.
    draft_model: the draft's shape.
    data: the conversations (online) or the store's checks (offline: `train.features`).
    seed: draft initialisation and data order.
  """

  train: TrainOptions
  draft_model: DraftModelOptions
  data: DataOptions
  seed: int = 0

  @classmethod
  def from_config(cls, config) -> Recipe:
    """From a config's `train`, `draft_model`, `data` sections and its `seed`."""
    return cls(train=options_lib.from_section(TrainOptions, config.train, "train"),
               draft_model=options_lib.from_section(DraftModelOptions, config.draft_model, "draft_model"),
               data=options_lib.from_section(DataOptions, config.data, "data"),
               seed=options_lib.convert(config.seed, int, "seed"))

  def fingerprint_settings(self) -> dict:
    """The fields a resumed run must share with its start: all but `TrainOptions.RESUMABLE` (run length,
    logging, evaluation) and `train.features` and `train.extra_features`, which enter by the stores' own
    fingerprints (so a moved store still resumes); `train.max_sequences` only when set (runs recorded before
    it existed read all)."""
    train = TrainOptions.drop_unset_later(dataclasses.asdict(self.train))
    for key in TrainOptions.RESUMABLE + ("features", "extra_features"):
      train.pop(key, None)
    return {"seed": self.seed, "train": train, "draft_model": self.draft_model.record(),
            "data": self.data.record()}

  def to_dict(self) -> dict:
    """Every field (JSON-friendly), as checkpoints record the recipe they were trained with."""
    return {"seed": self.seed, "train": dataclasses.asdict(self.train),
            "draft_model": dataclasses.asdict(self.draft_model), "data": dataclasses.asdict(self.data)}


def same_recipe(recorded: dict, current: dict) -> bool:
  """Whether a run recorded under `recorded` (`loop.fingerprint_settings`) may go on under `current`: equal but
  for `TrainOptions.PRECISION` (a run may switch train.compute_dtype when it resumes; the checkpoints keep the
  history)."""
  def strip(settings: dict) -> dict:
    train = {k: v for k, v in (settings.get("train") or {}).items() if k not in TrainOptions.PRECISION}
    return expand_home({**settings, "train": train})
  return options_lib.fingerprint(strip(dict(recorded))) == options_lib.fingerprint(strip(dict(current)))


def precision_history(recorded: list | None, recorded_dtype: str, step: int, dtype: str) -> list[list]:
  """A run's `compute_dtypes` after resuming at `step` in `dtype`: [[first step, dtype], ...] (a record from
  before histories were kept starts as [[0, recorded_dtype]])."""
  history = [list(x) for x in (recorded or [[0, recorded_dtype]])]
  if history[-1][1] != dtype:
    history.append([int(step), dtype])
  return history


def expand_home(obj):
  """`obj` with every string's "~/" expanded (releases record paths under the home directory as "~/...", so
  that a run recorded on one machine compares equal on another whose home differs)."""
  if isinstance(obj, dict):
    return {k: expand_home(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [expand_home(v) for v in obj]
  if isinstance(obj, str) and "~/" in obj:
    return obj.replace("~/", os.path.expanduser("~") + "/")
  return obj


def home_as_tilde(obj):
  """`obj` with the home directory in every string written as "~" (the inverse of `expand_home`)."""
  home = os.path.expanduser("~").rstrip("/") + "/"
  if isinstance(obj, dict):
    return {k: home_as_tilde(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [home_as_tilde(v) for v in obj]
  if isinstance(obj, str) and home != "/" and home in obj:
    return obj.replace(home, "~/")
  return obj
