"""What happens between training steps, each at its own cadence: logging, held-out evaluation and checkpoints
(`training.loop.train` registers them, as levanter's `TrainerHooks` does).

A `Hook` is a function of the step just taken (`StepInfo`) with its period; `run_steps` runs the steps and,
after each, the hooks `Hooks.due` names, waiting for a step's result only when a hook reads it, so the steps
between hooks dispatch asynchronously. `Progress` keeps the run's counters: real tokens and seconds of training steps over the
whole run (carried across resumptions: the curves' axes) and this invocation's rate.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from absl import logging

from layerwave import checkpoint as ckpt_lib
from layerwave import metrics as metrics_lib
from layerwave.training import losses


@dataclasses.dataclass
class Progress:
  """The run's counters.

  Attributes:
    start_step: the step this invocation started from.
    stop: the step it stops at.
    tokens: real tokens trained over the whole run (carried across resumptions).
    seconds: seconds of training steps over the whole run (batch preparation counts; evaluation does not).
    tokens_here: real tokens this invocation trained.
    tic: when this invocation's training began (`time.perf_counter`).
  """

  start_step: int
  stop: int
  tokens: int = 0
  seconds: float = 0.0
  tokens_here: int = 0
  tic: float = dataclasses.field(default_factory=time.perf_counter)

  def add(self, tokens: int, seconds: float) -> None:
    """Counts one training step."""
    self.tokens += tokens
    self.tokens_here += tokens
    self.seconds += seconds

  def rate(self) -> float:
    """This invocation's real tokens per second (evaluation and checkpoints included in the time)."""
    return self.tokens_here / max(time.perf_counter() - self.tic, 1e-9)


@dataclasses.dataclass(frozen=True)
class StepInfo:
  """A step just taken, as the hooks see it.

  Attributes:
    step: the steps done (the number the metrics and checkpoints are written at).
    state: the training state after it (`step.TrainState`).
    metrics: the step's metrics, still on device.
    progress: the run's counters, this step counted.
  """

  step: int
  state: Any
  metrics: dict
  progress: Progress


@dataclasses.dataclass(frozen=True)
class Hook:
  """`fn` after every `every`-th step and, when `at_stop`, after the invocation's last."""

  fn: Callable[[StepInfo], None]
  every: int
  at_stop: bool = True

  def due(self, step: int, stop: int) -> bool:
    return step % self.every == 0 or (self.at_stop and step == stop)


class Hooks:
  """The hooks of a run, run in the order they were added."""

  def __init__(self):
    self._hooks: list[Hook] = []

  def add(self, fn: Callable[[StepInfo], None], every: int, at_stop: bool = True) -> None:
    self._hooks.append(Hook(fn, every, at_stop))

  def due(self, step: int, stop: int) -> list[Hook]:
    return [hook for hook in self._hooks if hook.due(step, stop)]


def run_steps(state, bound, hooks: Hooks, progress: Progress):
  """The training steps from `progress.start_step` to `progress.stop`, each followed by the hooks due.

  Args:
    state: the training state (`step.TrainState`) at `progress.start_step`.
    bound: the source bound to the draft (`sources.Bound`): its batches and its train function.
    hooks: what runs between steps.
    progress: the run's counters (updated).

  Returns:
    The state after the last step.
  """
  for step in range(progress.start_step, progress.stop):
    step_tic = time.perf_counter()  # batch preparation counts as training time; evaluation does not
    batch = next(bound.batches)
    real_tokens = int(batch.attention_mask.sum())
    state, m = bound.train(state, batch)
    done = step + 1
    due = hooks.due(done, progress.stop)
    if due:
      jax.block_until_ready(state.step)  # the clock stops when the step has run, not when it was dispatched
    progress.add(real_tokens, time.perf_counter() - step_tic)
    info = StepInfo(done, state, m, progress)
    for hook in due:
      hook.fn(info)
  return state


def log_metrics(writer: metrics_lib.MetricWriter, num_steps: int) -> Callable[[StepInfo], None]:
  """The training metrics (`train/*`, `draft/acc_j`), the rate and the ETA, to `writer` and the log."""
  def log(info: StepInfo) -> None:
    m, p = jax.device_get(info.metrics), info.progress
    elapsed = time.perf_counter() - p.tic
    rate = p.tokens_here / elapsed
    eta = (p.stop - info.step) * elapsed / max(info.step - p.start_step, 1)
    scalars = metrics_lib.flatten("train", {k: m[k] for k in ("loss", "grad_norm", "sim_tau")})
    scalars.update(metrics_lib.flatten("draft", {"acc_j": m["acc_j"]}))
    scalars["train/tokens_per_s"] = rate
    scalars["train/tokens"] = p.tokens
    scalars["train/seconds"] = p.seconds
    writer.write_scalars(info.step, scalars)
    logging.info("step %d/%d  loss %.3f  acc_0 %.3f  %.0f tok/s  ETA %.0fs", info.step, num_steps,
                 float(m["loss"]), float(m["acc_j"][0]), rate, eta)
  return log


def evaluate(batches: Iterable, max_batches: int, eval_fn: Callable[[Any], dict]) -> dict:
  """Held-out metrics pooled over at most `max_batches` batches; `eval_fn(batch)` → a step's metrics."""
  sums, n = None, 0
  for i, batch in enumerate(batches):
    if i >= max_batches:
      break
    m = jax.device_get(eval_fn(batch))
    sums = m if sums is None else jax.tree.map(np.add, sums, m)
    n += 1
  if not n:
    return {}
  mean = jax.tree.map(lambda x: np.asarray(x) / n, sums)
  # Accuracies pooled over tokens (not a mean of per-batch ratios), and the held-out simulated τ from them
  # (eval_step computes none per batch); out-of-vocabulary targets are misses.
  mean["acc_j"] = sums["hits_j"] / np.maximum(sums["tokens_j"], 1.0)
  mean["acc_in_vocab_j"] = sums["hits_j"] / np.maximum(sums["in_vocab_j"], 1.0)
  mean["sim_tau"] = float(losses.simulated_tau(mean["acc_j"]))
  mean["predicted_positions"] = float(sums["tokens_j"][0])  # what the accuracies pool (first depth)
  for count in ("tokens", "hits_j", "tokens_j", "in_vocab_j"):
    mean.pop(count, None)
  return mean


@dataclasses.dataclass
class Evaluation:
  """The held-out evaluation hook: `evaluate` over `max_batches` of a fresh pass, written as `eval/*`.

  Attributes:
    batches: a fresh pass over the held-out split.
    max_batches: at most this many batches (`train.eval_batches`).
    eval_fn: `(state, batch) -> metrics`.
    writer: where the scalars go.
    last: the latest evaluation's pooled metrics (empty before the first).
  """

  batches: Callable[[], Iterable]
  max_batches: int
  eval_fn: Callable
  writer: metrics_lib.MetricWriter
  last: dict = dataclasses.field(default_factory=dict)

  def __call__(self, info: StepInfo) -> None:
    self.last = last = evaluate(self.batches(), self.max_batches, lambda b: self.eval_fn(info.state, b))
    scalars = metrics_lib.flatten("eval", {"loss": last["loss"], "sim_tau": last["sim_tau"]})
    scalars.update(metrics_lib.flatten("eval/draft", {"acc_j": last["acc_j"],
                                                      "acc_in_vocab_j": last["acc_in_vocab_j"]}))
    p = info.progress
    scalars.update({"train/tokens": p.tokens, "train/seconds": p.seconds})  # the curves' x axes
    self.writer.write_scalars(info.step, scalars)


@dataclasses.dataclass
class Checkpoints:
  """The checkpoint hook: the state, the vocabulary tables and the run's record, with the data position and
  the counters, at a step.

  Attributes:
    ckpt: the run's checkpointer.
    vocab: the draft's vocabulary tables (saved with every checkpoint).
    meta: the run's record (`training.loop`'s checkpoint meta) less the step's own fields.
    position: the training batches' data position now (`BatchIterator.position`).
  """

  ckpt: ckpt_lib.Checkpointer
  vocab: Any
  meta: dict
  position: Callable[[], Any]

  def save(self, step: int, state, progress: Progress) -> None:
    self.ckpt.save(step, state, self.vocab, {**self.meta, "step": step, "data_position": self.position().to_dict(),
                                             "tokens_trained": progress.tokens, "train_seconds": progress.seconds})

  def __call__(self, info: StepInfo) -> None:
    self.save(info.step, info.state, info.progress)
