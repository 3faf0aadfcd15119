"""Speculative decoding evaluated on chat prompts: the last stage shared by speculate, bench and compare.

Place in the pipeline: after draft training. `chat_prompts` turns MT-bench / HumanEval / GSM8K first turns
(or one question) into the target's chat-templated prompt ids; `evaluate` decodes them speculatively in
batches, alone or paired with plain decoding (`timing.paired_speedup`: both decode each batch in alternation,
so the speedup is the median pair ratio and greedy outputs can be compared token for token); `summary`
and `acceptance_row` turn an `Evaluation` into the metrics `experiments/speculate.py`,
`benchmarks/bench_speculative.py` and `layerwave.compare` write; `table` and `speedup_cell` format them.

Legend (`layerwave.axes`): K draft depth.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import numpy as np

from flax import nnx

from layerwave import layer_ids
from layerwave import options as options_lib
from layerwave.data import chat
from layerwave.data import sources
from layerwave.generate import generate as plain_generate
from layerwave.models.draft import Draft, DraftConfig
from layerwave.speculative import decode
from layerwave.speculative import timing
from layerwave.speculative import tuner
from layerwave.speculative.decode import generate as speculative_generate
from layerwave.training import restore

__all__ = ["DATASETS", "DecodeSettings", "Evaluation", "acceptance_row", "chat_prompts", "check_chat_format", "decode_fns",
           "evaluate", "load_draft", "question_prompt", "speedup_cell", "summary", "table"]

# Held-out prompt sets (first user turns).
DATASETS = ("mtbench", "humaneval", "gsm8k")


def load_draft(path: str, target, layers: Sequence[int] = (), draft_vocab_size: int = 32000, seed: int = 0):
  """`config.draft`: a training workdir or EAGLE-3 directory, or "random" (untrained, for smoke runs).

  Args:
    path: the draft (`layerwave.load_draft`), or "random".
    target: the loaded target.
    layers: the random draft's layer ids (default EAGLE-3's).
    draft_vocab_size: the random draft's V_d (capped at the target's vocabulary).
    seed: the random draft's initialisation.
  """
  if not path:
    raise ValueError("Set --config.draft to a draft training workdir (or 'random' for a smoke run).")
  if path != "random":
    return restore.load_draft(path, target)
  ids = tuple(layers) or layer_ids.eagle3_layer_ids(target.config.num_layers)
  dcfg = DraftConfig.from_target(target.config, ids,
                                 draft_vocab_size=min(draft_vocab_size, target.config.vocab_size))
  return Draft(dcfg, embedding=target.params["embed_tokens"]["embedding"][...], rngs=nnx.Rngs(seed))


def check_chat_format(tokenizer, chat_format: str) -> None:
  """Prompts in `chat_format` need a tokenizer (and, for "template", its chat template)."""
  if chat_format not in chat.CHAT_FORMATS:
    raise ValueError(f"Unknown data.chat_format {chat_format!r}; choose one of {', '.join(chat.CHAT_FORMATS)}.")
  if tokenizer is None:
    raise ValueError("The target has no tokenizer; prompts cannot be tokenised.")
  if chat_format == "template" and tokenizer.chat_template is None:
    raise ValueError("The target's tokenizer has no chat template (a base model); prompt it as plain text "
                     "with --config.data.chat_format=plain, as its draft was trained.")


def chat_prompts(tokenizer, dataset: str, num_prompts: int = 0, max_prompt_tokens: int = 0, *,
                 section: str = "speculate", chat_format: str = "template",
                 fields: tuple[str, str] = ("max_prompt_tokens", "num_prompts")) -> list[tuple[str, list[int]]]:
  """(record id, token ids) of the first user turn of `dataset`'s prompts, as the draft's data was written.

  Args:
    tokenizer: the target's tokenizer.
    dataset: one of `DATASETS`.
    num_prompts: how many (0 = all).
    max_prompt_tokens: skip prompts longer than this (0 = keep all); then fewer than `num_prompts` left
      is an error.
    section: the config section the counts come from, named in errors.
    fields: the names of its fields for `max_prompt_tokens` and `num_prompts`, named in errors.
    chat_format: `data.chat_format`: "template" (the tokenizer's chat template, generation prompt added) or
      "plain" ("User: ...\n\nAssistant:", for base models), as `chat.encode_prompt`.

  Raises:
    ValueError: an unknown dataset or format, a template format without a template, or too few prompts
      short enough.
  """
  if dataset not in DATASETS:
    raise ValueError(f"Unknown prompt set {dataset!r}; held-out prompt sets are {', '.join(DATASETS)}.")
  check_chat_format(tokenizer, chat_format)
  encode = lambda messages: chat.encode_prompt(tokenizer, messages, chat_format=chat_format).tolist()  # noqa: E731
  if not max_prompt_tokens:
    records = sources.get_source(dataset, limit=num_prompts or None)
    return [(r.id, encode(r.messages[:1])) for r in records]
  out = []
  for record in sources.get_source(dataset):
    ids = encode(record.messages[:1])
    if len(ids) <= max_prompt_tokens:
      out.append((record.id, ids))
    if len(out) == num_prompts:
      break
  if num_prompts and len(out) < num_prompts:
    raise ValueError(f"{dataset} has only {len(out)} prompts of <= {max_prompt_tokens} tokens; raise "
                     f"{section}.{fields[0]} or lower {section}.{fields[1]}.")
  return out


def question_prompt(tokenizer, text: str, chat_format: str = "template") -> list[tuple[str, list[int]]]:
  """One question as a prompt in `chat_format`, in `chat_prompts`' format."""
  check_chat_format(tokenizer, chat_format)
  record = sources.Record(id="prompt", source="prompt", messages=({"role": "user", "content": text},))
  return [(record.id, chat.encode_prompt(tokenizer, record.messages, chat_format=chat_format).tolist())]


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
  """How every prompt is decoded (both sides of a pair share the sampling settings).

  Attributes:
    max_new_tokens: tokens generated per prompt.
    temperature, top_k, top_p: sampling (T = 0: greedy).
    batch_size: prompts per generate call.
    timing_repeats: timed pairs per batch when paired.
    prompt_width: pad prompts to at least this many tokens (one compilation for every batch), 0 = off.
    spec: how to draft (`decode.SpecOptions`).
    auto: choose `spec` by measurement before decoding (`speculate.method="auto"`, `tuner.tune`): chains of
      1 .. `spec.num_draft_tokens` and the small trees of `tuner.AUTO_TREES`, each timed end to end against
      plain decoding on the first prompts; the fastest wins, and when none beat plain decoding there, `plain`.
    plain: decode without the draft (`layerwave.generate`), reported as speculation that drafts nothing (τ 1):
      what `auto` settles on when speculation does not pay on this machine at this batch size and sampling.
  """

  max_new_tokens: int
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  batch_size: int = 8
  timing_repeats: int = 3
  prompt_width: int = 0
  spec: decode.SpecOptions = decode.SpecOptions()
  auto: bool = False
  plain: bool = False

  def __post_init__(self):
    for name in ("max_new_tokens", "batch_size", "timing_repeats"):
      if int(getattr(self, name)) < 1:
        raise ValueError(f"speculate.{name} must be >= 1, got {getattr(self, name)}.")
    if self.temperature < 0:
      raise ValueError(f"speculate.temperature must be >= 0, got {self.temperature}.")

  @classmethod
  def from_config(cls, s, **overrides) -> DecodeSettings:
    """From a `config.speculate` section; `overrides` replace fields (e.g. compare's max_new_tokens)."""
    auto = s.get("method") == tuner.AUTO
    spec = options_lib.from_section(decode.SpecOptions, s, "speculate", **({"method": "chain"} if auto else {}))
    return options_lib.from_section(cls, s, "speculate", **{"spec": spec, "auto": auto, **overrides})

  @property
  def name(self) -> str:
    """The drafting method in words: "chain K=5" or "tree d=5 k=8 n=48"."""
    s = self.spec
    if self.auto:
      return f"auto (chain K<={s.num_draft_tokens} or a small tree)"
    if self.plain:
      return "plain (no setting beat it)"
    return s.method + (f" K={s.num_draft_tokens}" if s.method == "chain" else
                       f" d={s.tree_depth} k={s.tree_top_k} n={s.tree_tokens}")

  def tuned(self, target, draft, prompts: Sequence[Sequence[int]], seed: int) -> tuple[DecodeSettings,
                                                                                         tuner.Tuning | None]:
    """With `auto`: the settings with the tuner's choice (`plain` when no candidate beat plain decoding), and
    the tuning; otherwise `(self, None)`."""
    if not self.auto:
      return self, None
    budgets = tuple(b for b in tuner.AUTO_TREES if b.top_k <= draft.config.draft_vocab_size)
    tuning = tuner.tune(target, draft, list(prompts)[:tuner.CALIBRATION_PROMPTS], batch_size=self.batch_size,
                        max_new_tokens=min(self.max_new_tokens, 64), temperature=self.temperature,
                        top_k=self.top_k, top_p=self.top_p, seed=seed,
                        chain_lengths=range(1, self.spec.num_draft_tokens + 1), tree_budgets=budgets)
    return dataclasses.replace(self, spec=tuning.choice.spec, auto=False, plain=not tuning.beats_plain), tuning


def decode_fns(target, draft, settings: DecodeSettings, seed: int):
  """(plain, speculative) decode functions, batch → (outputs, metrics), with `settings`' sampling."""
  sampling = dict(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p, seed=seed,
                  prompt_width=settings.prompt_width)
  plain = lambda ids: plain_generate(  # noqa: E731
      target, ids, settings.max_new_tokens, **sampling, return_stats=True)
  spec = lambda ids: speculative_generate(  # noqa: E731
      target, draft, ids, settings.max_new_tokens, **sampling, **dataclasses.asdict(settings.spec))
  return plain, (functools.partial(plain_as_speculation, plain) if settings.plain else spec)


def plain_as_speculation(plain_fn, ids):
  """`plain_fn(ids)` (plain decoding with stats) reported as speculation that drafts nothing: every token its
  own verification (τ 1, no acceptance by depth), so `DecodeSettings.plain` rows fit the speculative tables."""
  out, stats = plain_fn(ids)
  metrics = decode.acceptance_metrics(np.asarray([[len(o)] for o in out], np.int64))
  new_tokens = sum(len(o) for o in out)
  metrics.update(steps=int(stats["steps"]), new_tokens=new_tokens, method="plain",
                 accept_lengths=[[0] * len(o) for o in out])
  return out, metrics


@dataclasses.dataclass
class Evaluation:
  """What `evaluate` measured.

  Attributes:
    outputs: the speculative new tokens per prompt.
    accept_length_hist: `[K+1]` accepted-length counts summed over the batches.
    per_batch: per batch {seconds, new_tokens, ...} (`run_batches` or `PairedTiming.per_batch`).
    timed: the paired timing, or None when speculation ran alone.
    settings: the settings decoded with (with `auto`, the tuner's choice).
    tuning: the tuner's measurements and choice (`auto`), or None.
  """

  outputs: list
  accept_length_hist: np.ndarray
  per_batch: list
  timed: timing.PairedTiming | None = None
  settings: DecodeSettings | None = None
  tuning: tuner.Tuning | None = None

  def prompt_stats(self) -> list[list[int]] | None:
    """Per prompt, in `outputs`' order, [emitted tokens, verifications] (`decode.prompt_stats`); None when a
    batch did not report them."""
    if not self.per_batch or any("prompt_stats" not in b for b in self.per_batch):
      return None
    return [p for b in self.per_batch for p in b["prompt_stats"]]


def evaluate(target, draft, prompts: Sequence[Sequence[int]], settings: DecodeSettings, seed: int,
             paired: bool, warmup: bool = True) -> Evaluation:
  """Speculative decoding of `prompts` in batches of `settings.batch_size`.

  Args:
    target, draft: the loaded target and draft.
    prompts: token ids per prompt.
    settings: sampling, drafting and batching.
    seed: sampling seed.
    paired: also decode every batch with `layerwave.generate`, timed in alternation with speculation
      (`timing.paired_speedup`, `settings.timing_repeats` pairs per batch). Otherwise one timed
      speculative call per batch.
    warmup: decode before timing when a batch's shapes are new, so compilation stays outside the clock.

  With `settings.auto`, the tuner first picks the drafting setting on the first prompts (its own measurement,
  outside the timed pairs) and every batch is then decoded with its choice.
  """
  settings, tuning = settings.tuned(target, draft, prompts, seed)
  plain, spec = decode_fns(target, draft, settings, seed)
  if paired:
    timed = timing.paired_speedup(plain, spec, prompts, settings.batch_size, settings.timing_repeats,
                                  warmup=warmup)
    return Evaluation(timed.spec_outputs, timed.accept_length_hist, timed.per_batch, timed, settings, tuning)
  outs, hist, _, per_batch = decode.run_batches(spec, prompts, settings.batch_size, warmup=warmup)
  return Evaluation(outs, hist, per_batch, None, settings, tuning)


def pooled(evaluations: Sequence[Evaluation]) -> Evaluation:
  """Several evaluations (e.g. one per dataset) as one: outputs, histograms, batches and timed pairs."""
  timed = [e.timed for e in evaluations]
  return Evaluation([o for e in evaluations for o in e.outputs], sum(e.accept_length_hist for e in evaluations),
                    [b for e in evaluations for b in e.per_batch],
                    timing.combine(timed) if all(t is not None for t in timed) and timed else None)


def equal_to_plain(ev: Evaluation) -> float:
  """Share of prompts whose speculative output equals plain decoding's (paired evaluations)."""
  return float(np.mean([a == b for a, b in zip(ev.outputs, ev.timed.plain_outputs)]))


def summary(ev: Evaluation) -> dict[str, Any]:
  """Aggregate metrics: τ, acceptance by depth, tokens/s; with pairs, the speedup and equality to AR."""
  out = decode.acceptance_metrics(ev.accept_length_hist[None])
  seconds = sum(r["seconds"] for r in ev.per_batch)
  new_tokens = sum(len(o) for o in ev.outputs)
  out.update(prompts=len(ev.outputs), new_tokens=new_tokens, seconds=seconds, tokens_per_s=new_tokens / seconds)
  if ev.timed is not None:
    out.update(ev.timed.summary(), ar_seconds=sum(r["plain_seconds"] for r in ev.per_batch),
               equal_to_ar=equal_to_plain(ev))
  if ev.settings is not None:
    out["setting"] = ev.settings.name
  if ev.tuning is not None:
    out["auto"] = ev.tuning.to_dict()
  return out


def acceptance_row(ev: Evaluation, greedy: bool) -> dict[str, Any]:
  """A comparison cell's row: τ, acceptance, the histogram; with pairs the speedup (equality when greedy)."""
  m = decode.acceptance_metrics(ev.accept_length_hist[None])
  row = {"tau": m["tau"], "acceptance": m["acceptance"], "verify_calls": m["verify_calls"],
         "new_tokens": sum(len(o) for o in ev.outputs), "accept_length_hist": ev.accept_length_hist.tolist()}
  stats = ev.prompt_stats()
  if stats is not None:
    row["prompt_stats"] = stats  # per prompt [emitted, verifications]: paired bootstraps over prompts
  if ev.timed is not None:
    row.update(ev.timed.summary())
    if greedy:
      row["equal_to_ar"] = equal_to_plain(ev)
  return row


def speedup_cell(m: dict[str, Any]) -> str:
  """The speedup as a table cell: the median pair ratio and [p25, p75] of the pairs."""
  return f"{m['speedup']:.2f}x [{m['speedup_p25']:.2f}, {m['speedup_p75']:.2f}]"


def table(m: dict[str, Any], settings: DecodeSettings) -> str:
  """A one-row markdown table of `summary`'s metrics, with how the speedup was timed below it."""
  acc = " ".join(f"{a:.2f}" for a in m["acceptance"])
  head = ("| method | T | prompts | τ | acceptance by depth | spec tok/s | AR tok/s | speedup [p25, p75] "
          "| =AR |")
  ar = (f"{m['ar_tokens_per_s']:.1f} | {speedup_cell(m)} | {m['equal_to_ar']:.0%}"
        if "speedup" in m else "- | - | -")
  name = m.get("setting", settings.name) + (" (auto)" if "auto" in m else "")
  lines = [head, "|" + "---|" * 9,
           f"| {name} | {settings.temperature:g} | {m['prompts']} | {m['tau']:.2f} | {acc} | "
           f"{m['tokens_per_s']:.1f} | {ar} |"]
  if "speedup" in m:
    lines.append(f"\nspeedup = spec ÷ AR tokens/s, {m['timing'].removeprefix('paired: ')}; the tok/s columns "
                 "are medians over the same pairs.")
  return "\n".join(lines)
