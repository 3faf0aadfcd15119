"""SmolLM2-135M-Instruct (embedded, Q4_1 GGUF dequantized to float32): the sections every stage reads.

  python experiments/analyze.py     --config=configs/smollm2/base.py --workdir=W
  python experiments/distill.py     --config=configs/smollm2/base.py --workdir=D   # then data.source=distilled:D
  python experiments/train_draft.py --config=configs/smollm2/base.py --workdir=W --config.layers=2,15,27
  python experiments/speculate.py   --config=configs/smollm2/base.py --workdir=W --config.draft=W

The experiments are the files beside this one (smoke, demo, compare, cpu, recipe, paper), each stating only
what it changes here; `configs/smollm2_135m.py:<experiment>` names the same configs. Every section holds its
options dataclass' defaults (`options.section`: the dataclass is the one place a default is written, and its
docstring says what each field means); this file sets only the keys no dataclass holds, the required ones, and
the few whose value for SmolLM2 differs from the library's default. Each stage reads its own section
(`analysis`, `train` + `draft_model`, `speculate`, ...) plus the shared fields at the top. The sections are
locked: a misspelt key, here, in an experiment or on the command line, is refused, naming the nearest one.

Layer ids use the HF hidden-state convention (README): index 0 = embeddings, i = output of block i-1, L = final
norm. For SmolLM2, L = 30 and EAGLE-3's rule gives [2, 15, 27].

List fields are tuples (`layers`, `analysis.strategies`, `compare.sets` / `lams` / `datasets` /
`temperatures`); on the command line give them comma-separated (`--config.layers=2,15,27`,
`--config.compare.sets=eagle3,greedy`) or as a tuple (`--config.layers='(2,15,27)'`); `--config.layers=`
empties one. `compare.manual` stays a ';'-separated string (`--config.compare.manual='1,2,3;27,28,29'`):
ml_collections' tuple parser refuses ';', and a tuple of tuples needs quoted parentheses.
"""

from layerwave import options
from layerwave.analysis.collect import CollectOptions
from layerwave.analysis.report import SelectionOptions
from layerwave.compare import CompareOptions
from layerwave.data.options import DataOptions, DistillOptions
from layerwave.speculative.decode import SpecOptions
from layerwave.speculative.evaluate import DecodeSettings
from layerwave.training.features.extraction import FeatureOptions
from layerwave.training.learned import LearnedOptions
from layerwave.training.options import DraftModelOptions, TrainOptions


def _merged(name: str, *sections: options.Config) -> options.Config:
  """One config section read by several options dataclasses (a key two of them hold has one default)."""
  out = options.Config(name=name)
  for part in sections:
    for key, value in part.items():
      if key not in out:
        out[key] = value
      elif out[key] != value:
        raise ValueError(f"{name}.{key}: the dataclasses reading it disagree on its default.")
  return out


def get_config(arg: str | None = None) -> options.Config:
  if arg:
    raise ValueError(f"configs/smollm2/base.py takes no variant, got {arg!r}: the experiments are its sibling "
                     "files (configs/smollm2/demo.py, ...), or configs/smollm2_135m.py:<experiment>.")
  c = options.Config()
  c.model = "smollm2-135m-instruct"
  c.dtype = "float32"
  c.mesh = (("data", -1),)
  c.distributed = False  # call jax.distributed.initialize() (multi-host TPU / GPU)
  c.seed = 0  # draft initialisation and data order

  c.data = options.section(DataOptions, "data", source="sharegpt", max_length=512)
  # Distillation (experiments/distill.py) renders its prompts in `data.chat_format`, the format training reads
  # them back in. 32 continuous-batching rows: more add little on a CPU (BENCHMARKS.md); the dataclass' 0
  # (static batches) is what library callers get.
  c.distill = options.section(DistillOptions, "distill", skip=("chat_format",), slots=32)

  # Analysis (experiments/analyze.py, docs/METHOD.md §2-§6): `data` gives the sequences. 200k eligible tokens
  # (~100k kept at q=50: stable between the two halves) and a 2,048-token exact-CKA subsample; the library's
  # `collect_stats` defaults to neither. `normalize` holds "skean" | "none".
  c.analysis = _merged(
      "analysis",
      options.section(CollectOptions, "analysis", aliases={"filter_mode": "filter", "halves": "stability"},
                      max_tokens=200_000, exact_cka_tokens=2048, normalize="skean",
                      split="train", batch_size=8,  # sequences per batch (divisible by the 'data' axis)
                      bucket_widths=()),  # length buckets, e.g. (64, 128, 256); () = fixed batches
      options.section(SelectionOptions, "analysis"))

  # Draft training (experiments/train_draft.py): `layers` (HF convention), or `selection.strategy` of the
  # selection.json at `selection.path` (experiments/analyze.py) when `layers` is empty.
  c.layers = ()
  c.selection = options.Config({"path": "", "strategy": ""}, name="selection")
  c.draft_model = options.section(DraftModelOptions, "draft_model")
  # bfloat16 passes with float32 master weights: held-out sim τ paired by seed +0.007 ± 0.021 against float32,
  # steps 1.16x faster (BENCHMARKS.md "Throughput"); TrainOptions keeps float32 for library callers.
  c.train = options.section(TrainOptions, "train", batch_size=8, num_steps=1500, compute_dtype="bfloat16")
  c.learned = options.section(LearnedOptions, "learned")  # experiments/learn_layers.py
  # Feature stores (experiments/extract_features.py): the training split's forward in bfloat16 scores -0.001 ±
  # 0.007 held-out sim τ against float32 (BENCHMARKS.md "Throughput"); FeatureOptions' "" is the target's dtype.
  c.features = options.section(FeatureOptions, "features", compute_dtype="bfloat16")

  # Speculative decoding (experiments/speculate.py): a training workdir, or "random" (smoke runs).
  c.draft = ""
  c.speculate = _merged(
      "speculate", options.section(SpecOptions, "speculate"),
      options.section(DecodeSettings, "speculate", skip=("prompt_width", "spec", "auto", "plain"),
                      max_new_tokens=256,
                      dataset="mtbench",  # mtbench (first turns) | humaneval | gsm8k
                      num_prompts=80,  # 0 = every prompt of the dataset
                      compare_ar=True))  # also decode plainly: speedup and equality

  # Layer-set comparison (experiments/compare_layers.py): every cell = one layer set x one seed, trained with
  # `train` / `draft_model` / `data` and decoded with `speculate`. The full sweep: every strategy, the ablations,
  # a λ sweep, 3 random sets and 3 seeds at two temperatures (CompareOptions' defaults are the smallest sweep).
  c.compare = options.section(
      CompareOptions, "compare",
      sets=("eagle3", "entropy", "greedy", "exhaustive", "compartment", "nofilter", "entropy_only", "cka_only"),
      lams=(0.25, 4.0), num_random=3, seeds=3, temperatures=(0.0, 1.0),
      manual="")  # ';'-separated sets ("1,2,3;27,28,29"): a string, as the module docstring says
  return c.lock()


def selected_vs_baseline(c: options.Config) -> None:
  """A two-set comparison: the exhaustive selection against EAGLE-3's layers, one seed, greedy, MT-bench, with
  the speedup against plain decoding."""
  c.compare.sets = ("eagle3", "exhaustive")
  c.compare.lams = ()
  c.compare.num_random = 0
  c.compare.seeds = 1
  c.compare.temperatures = (0.0,)
  c.compare.datasets = ("mtbench",)
  c.compare.speedup = True
