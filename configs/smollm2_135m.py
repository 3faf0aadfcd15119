"""SmolLM2-135M-Instruct (embedded, Q4_1 GGUF dequantized to float32): every stage of the pipeline.

  python experiments/analyze.py     --config=configs/smollm2_135m.py --workdir=W
  python experiments/distill.py     --config=configs/smollm2_135m.py --workdir=D   # then data.source=distilled:D
  python experiments/train_draft.py --config=configs/smollm2_135m.py --workdir=W --config.layers=2,15,27
  python experiments/speculate.py   --config=configs/smollm2_135m.py --workdir=W --config.draft=W
  python experiments/compare_layers.py --config=configs/smollm2_135m.py:compare --workdir=W \
      --config.compare.analysis=ANALYSIS_W
  (append `:smoke` to the config path for a seconds-to-a-minute CPU run; `:demo` is the README's main job:
  analysis, two short drafts, speculative decoding and the comparison; its time on 2 CPU cores: README)

Each stage reads only its own section (`analysis`, `train` + `draft_model`, `speculate`) plus the shared
fields at the top. Layer ids use the HF hidden-state convention (README): index 0 = embeddings, i = output
of block i-1, L = final norm. For SmolLM2, L = 30 and EAGLE-3's rule gives [2, 15, 27].

List fields are tuples (`layers`, `analysis.strategies`, `compare.sets` / `lams` / `datasets` /
`temperatures`); on the command line give them comma-separated (`--config.layers=2,15,27`,
`--config.compare.sets=eagle3,greedy`) or as a tuple (`--config.layers='(2,15,27)'`); `--config.layers=`
empties one. `compare.manual` stays a ';'-separated string (`--config.compare.manual='1,2,3;27,28,29'`):
ml_collections' tuple parser refuses ';', and a tuple of tuples needs quoted parentheses.
"""

import ml_collections

from layerwave import options


def _selected_vs_baseline(compare: ml_collections.ConfigDict) -> None:
  """A two-set comparison: the exhaustive selection against EAGLE-3's layers, one seed, greedy, MT-bench,
  with the speedup against plain decoding."""
  compare.sets = ("eagle3", "exhaustive")
  compare.lams = ()
  compare.num_random = 0
  compare.seeds = 1
  compare.datasets = ("mtbench",)
  compare.temperatures = (0.0,)
  compare.speedup = True


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = options.Config()
  # -- shared -------------------------------------------------------------------------------------
  c.model = "smollm2-135m-instruct"
  c.dtype = "float32"
  c.mesh = (("data", -1),)
  c.distributed = False  # call jax.distributed.initialize() (multi-host TPU / GPU)
  c.seed = 0

  # -- data (layerwave.data): ShareGPT conversations through the chat template --------------------
  c.data = options.Config(name="data")
  c.data.source = "sharegpt"
  c.data.max_length = 512  # tokens per training / analysis sequence
  c.data.max_records = 0  # 0 = every conversation
  c.data.heldout_fraction = 0.05
  c.data.split_seed = 0
  c.data.chat_format = "template"  # "template" (the tokenizer's chat template) | "plain" (base models)

  # -- self-distilled data (experiments/distill.py): the target answers the training prompts ------
  # Writes W/dataset (array_record) + W/manifest.json; train on it with --config.data.source=distilled:W.
  # Prompts are rendered in `data.chat_format` (the format training reads them back in): with "plain" (a base
  # model) each answer is cut where the model starts the next "\n\nUser:" turn.
  c.distill = options.Config(name="distill")
  c.distill.source = "sharegpt"  # prompt source (its user turns)
  c.distill.num_prompts = 0  # conversations answered; 0 = all that pass the filters
  c.distill.turns = 1  # user turns answered per conversation, each after the target's own earlier answers
  c.distill.max_new_tokens = 512
  c.distill.max_prompt_tokens = 512  # longer first prompts are skipped (and counted)
  c.distill.temperature = 0.0  # 0 = greedy
  c.distill.top_k = 0
  c.distill.top_p = 1.0
  c.distill.seed = 0
  c.distill.batch_size = 16  # prompts per generate call (may change on resume; 16: the fastest measured, BENCHMARKS.md)
  c.distill.slots = 32  # continuous batching rows (0 = static batches); 32: more add little on a CPU (BENCHMARKS.md)
  c.distill.chunk_steps = 16  # continuous batching: decode steps between refills and loop checks
  c.distill.chunk_size = 64  # conversations per resumable chunk
  c.distill.loop_max_period = 64  # repetition loops: a block of <= 64 tokens repeated back to back...
  c.distill.loop_min_repeats = 3  # ...at least 3 times...
  c.distill.loop_min_tokens = 32  # ...over >= 32 tokens is cut after its first occurrence (period 0 = off)
  c.distill.keep_unfinished = True  # keep answers cut by max_new_tokens
  c.distill.exclude = "mtbench,humaneval,gsm8k"  # evaluation prompts that never enter the data
  c.distill.exclude_min_chars = 40  # containment (either way) counts from this length; equality always

  # -- analysis (experiments/analyze.py) -----------------------------------------------------------
  # docs/METHOD.md §2-§6; reads `data` for the sequences (`data.max_length` tokens each).
  c.analysis = options.Config(name="analysis")
  c.analysis.split = "train"
  c.analysis.batch_size = 8  # sequences per batch (divisible by the mesh's 'data' axis)
  # Length buckets (data.BatchIterator's widths): batches of batch_size x max_length token slots as [slots / w, w],
  # so short sequences are not padded to max_length; one compilation per width. () = fixed batches (ShareGPT at
  # 256 tokens fills 97% of them); distilled answers fill ~43% (BENCHMARKS.md, "Analysis in length buckets").
  c.analysis.bucket_widths = ()
  c.analysis.num_batches = 0  # 0 = until max_tokens (or the split) is used up
  c.analysis.max_tokens = 200_000  # eligible (assistant) tokens read: ~100k kept at q=50 (two-half stability)
  c.analysis.seed = 0  # batch order, HSIC minibatch shuffle, exact-CKA subsample, `random` strategy
  c.analysis.log_every = 10
  c.analysis.temperature = 1.0  # token entropy from softmax(logits / T)
  c.analysis.filter = "percentile"  # "percentile" (keep H >= q-th percentile) | "threshold" (nats)
  c.analysis.percentile = 50.0
  c.analysis.threshold = 0.0  # nats, filter="threshold" only
  c.analysis.calibration_batches = 4  # percentile calibration pass (forward only)
  c.analysis.assistant_only = True  # only assistant-turn tokens enter the statistics
  c.analysis.unfiltered = "matched"  # control without the filter: "matched" (same n) | "all" | "none"
  c.analysis.alpha = 1.0  # Rényi order of the matrix entropy
  c.analysis.normalize = "skean"  # "skean" (centre + unit rows) | "none"
  c.analysis.granularity = "prompt"  # informativeness E: "prompt" | "dataset" entropy
  c.analysis.normalized_entropy = False  # E divided by log(min(n, D))
  c.analysis.cka = "minibatch"  # C: "minibatch" (unbiased HSIC) | "exact" (token subsample)
  c.analysis.hsic_batch_size = 256  # tokens per HSIC minibatch
  # Growth between the prompt entropy's eigendecomposition sizes (compacted lengths 16, 24, 32, ...): the same
  # values at any ratio; each size compiles once, so long T at scale takes a coarser ladder (configs/scale.py).
  c.analysis.ladder_ratio = 1.3
  c.analysis.exact_cka_tokens = 2048  # exact-CKA subsample of kept tokens (0 = off; cka="exact" needs it)
  c.analysis.include_embeddings = False  # candidate id 0
  c.analysis.include_final = False  # candidate id L
  c.analysis.k = 3
  c.analysis.lam = 1.0
  c.analysis.min_gap = 0
  c.analysis.strategies = ("eagle3", "entropy", "greedy", "exhaustive", "compartment", "random")
  c.analysis.num_blocks = 0  # compartments: 0 = automatic
  c.analysis.stability = True  # even / odd batches accumulated apart; agreement in layer_stats.json

  # -- draft training (experiments/train_draft.py) ------------------------------------------------
  c.layers = ()  # (2, 15, 27) (HF convention); empty = take `selection.strategy` from `selection.path`
  c.selection = options.Config(name="selection")
  c.selection.path = ""  # a selection.json written by experiments/analyze.py
  c.selection.strategy = ""  # which record of that file
  c.draft_model = options.Config(name="draft_model")
  c.draft_model.vocab_size = 32000  # V_d, capped at the target vocabulary
  c.draft_model.num_layers = 1
  c.draft_model.fc_norm = False
  c.draft_model.init_from_target = True  # start lm_head / final norm from the target's rows
  # A learned selection (experiments/learn_layers.py): "" = EAGLE-3's fusion; "hard_concrete" | "softmax" |
  # "group_lasso" = one learned gate per layer read (every candidate depth), its regulariser leaving gate_k in use
  # (layerwave.models.gates; needs fc_norm). gate_strength: the regulariser's weight; gate_lr_scale: the gate
  # logits' learning rate relative to train.lr.
  c.draft_model.gates = ""
  c.draft_model.gate_k = 3
  c.draft_model.gate_strength = 0.1
  c.draft_model.gate_lr_scale = 100.0
  c.train = options.Config(name="train")
  c.train.batch_size = 8  # global; divisible by the mesh's data axis
  c.train.num_steps = 1500
  c.train.schedule_steps = 0  # the LR schedule's length (0 = num_steps); fixed for a run: resuming checks it
  c.train.stop_after = 0  # stop after this many steps of this invocation (preemption drills); 0 = off
  c.train.lr = 3e-4
  c.train.warmup_steps = 50
  c.train.b1 = 0.9
  c.train.b2 = 0.95
  c.train.weight_decay = 0.0
  c.train.clip_norm = 0.5
  c.train.ttt_steps = 7  # K unrolled training-time-test steps
  c.train.decay = 0.8  # step j weighs decay**j
  c.train.assistant_only = True  # loss (and vocabulary counts) on assistant tokens only
  c.train.vocab_examples = 0  # examples counted for the draft vocabulary; 0 = the whole train split
  c.train.log_every = 25
  c.train.eval_every = 250
  c.train.eval_batches = 8
  c.train.checkpoint_every = 250
  c.train.end_lr_fraction = 0.0  # the cosine decay ends at this fraction of lr (1 = constant)
  c.train.freeze_head = False  # keep the LM head as initialised from the target's rows
  c.train.eval_ttt_steps = 0  # held-out evaluation depth (0 = ttt_steps)
  c.train.eval_features = ""  # evaluate on this store's heldout split (default: train.features')
  c.train.features = ""  # a feature store (experiments/extract_features.py): train offline, no target in the step
  c.train.max_sequences = 0  # only the first N sequences of the store's train split (0 = all): data-limited runs
  c.train.extra_features = ""  # stores of other text whose train splits are read beside train.features' (options.py)
  c.train.bucket_widths = ()  # length buckets, e.g. (128, 256): short sequences in wider batches, less padding
  # The draft's passes in training: bfloat16 with float32 master weights, gradients and optimizer state. Measured
  # on the campaign's cell (make dtype-check, BENCHMARKS.md "Throughput"): held-out sim τ paired by seed +0.007 ±
  # 0.021 against float32 (3 seeds), steps 1.16x faster. "float32" keeps every pass in float32.
  c.train.compute_dtype = "bfloat16"
  # Online training only (no train.features): the target's forward that makes each step's inputs, "" = its own
  # dtype (float32) or "bfloat16" (what features.compute_dtype is to a store; options.py). Held-out evaluation
  # always runs on the float32 target.
  c.train.target_dtype = ""
  # Long sequences at scale (configs/scale.py): each unrolled TTT step rematerialised in the backward pass and the
  # draft's attention in query blocks (losses.ttt_loss). The same losses; off here so CPU numbers stay as measured.
  c.train.remat = False
  c.train.init_from = ""  # continue an unfinished run from its interim release (a new machine; options.py)

  # -- learned selection (experiments/learn_layers.py, layerwave.training.learned) -------------------
  # A gated draft (draft_model.gates) trained on every candidate depth of train.features, once per seed; its k
  # largest gates are the selection ("learned_gates-k<k>" in W/selection.json).
  c.learned = options.Config(name="learned")
  c.learned.ks = (3, 5)  # selection sizes written
  c.learned.seeds = 3  # gated runs, seeds 0..seeds-1
  c.learned.candidates = ()  # () = every candidate depth 1..L-1
  c.learned.sweep = ""  # a comparison workdir or release whose 1x cells the gates are scored against
  c.learned.baseline = ()  # the set the gated cells are paired with (() = EAGLE-3's rule)

  # -- feature extraction (experiments/extract_features.py, layerwave.training.features) ------------
  # The target runs over the chat dataset of `data` once; its features go to a store that
  # `--config.train.features=DIR` trains from (any layer set among the stored depths, many drafts).
  c.features = options.Config(name="features")
  c.features.dir = ""  # where the store is written
  c.features.depths = ""  # "" = the layers of `layers` (else every set in `selection.path`), "2,15,27" or "all"
  c.features.dtype = "bfloat16"  # or "float32" (twice the disk); the final-norm state h_L is always stored
  # The training split's forward in bf16 (the held-out split always in `dtype`, as at inference): 1.3-1.6x
  # the tokens/s, and a draft trained on it scores -0.001 +- 0.007 held-out sim τ against float32-computed
  # features (3 seeds, `make extract-dtype-check`, BENCHMARKS.md "Throughput"). "" = `dtype` (float32).
  c.features.compute_dtype = "bfloat16"
  c.features.shard_sequences = 256  # sequences per shard
  c.features.batch_size = 8  # sequences per forward (divisible by the mesh's data axis)
  c.features.splits = "train,heldout"

  # -- speculative decoding (experiments/speculate.py) --------------------------------------------
  c.draft = ""  # a training workdir (latest checkpoint), or "random" for an untrained draft (smoke runs)
  c.speculate = options.Config(name="speculate")
  c.speculate.dataset = "mtbench"  # mtbench (first turns) | humaneval | gsm8k
  c.speculate.num_prompts = 80  # 0 = every prompt of the dataset
  c.speculate.batch_size = 8  # prompts per generate call
  c.speculate.max_new_tokens = 256
  c.speculate.temperature = 0.0
  c.speculate.top_k = 0
  c.speculate.top_p = 1.0
  c.speculate.method = "chain"  # chain | tree
  c.speculate.num_draft_tokens = 5  # K (chain)
  c.speculate.tree_depth = 5  # EAGLE-2 dynamic tree budget
  c.speculate.tree_top_k = 8
  c.speculate.tree_tokens = 48
  c.speculate.draft_sample = False  # chain: sample drafts from q (T > 0) instead of argmax
  c.speculate.compare_ar = True  # also run layerwave.generate on the same prompts: speedup, equality
  # Speedups (speculate.py, bench_speculative.py, compare.speedup): plain and speculative decoding of each
  # batch timed in alternation (ABBA), this many pairs per batch after one warm-up; the median pair ratio.
  c.speculate.timing_repeats = 3

  # -- layer-set comparison (experiments/compare_layers.py, layerwave.compare) --------------------
  # Every cell = one layer set x one seed, trained with `train` / `draft_model` / `data` (the same budget
  # for all) and evaluated with `speculate` (method, K, batch size, top-k/p) on held-out prompts.
  c.compare = options.Config(name="compare")
  c.compare.analysis = ""  # analysis workdir (layer_stats.json); empty = run the analysis into W/analysis
  c.compare.sets = ("eagle3", "entropy", "greedy", "exhaustive", "compartment", "nofilter", "entropy_only",
                    "cka_only")
  c.compare.baseline = "eagle3"  # Δτ is paired against this set
  c.compare.ablation_strategy = "exhaustive"  # the strategy nofilter / entropy_only / lams re-run
  c.compare.lams = (0.25, 4.0)  # λ sweep of the ablation strategy
  c.compare.num_random = 3  # random k-sets (seeds random_seed, random_seed + 1, ...)
  c.compare.random_seed = 1
  c.compare.manual = ""  # explicit sets, ';'-separated: "1,2,3;27,28,29" (a string: see below)
  # Other k's (`--config.compare.ks=1,5,9`): k = 1 is "last" (h_L, as EAGLE-1/2 read); every other k gives
  # the ablation strategy at that k (greedy where exhaustive would enumerate > 5 M subsets) and "even-kK" (the
  # eagle3 rule at k). Spearman(objective, τ) stays over the sets of the baseline's k.
  c.compare.ks = ()
  # Dynamics (`--config.compare.budgets=0.25,4 --config.compare.budget_sets=eagle3,exhaustive`): those sets
  # (default all; the baseline must be among them) trained again at these multiples of train.num_steps (warm-up
  # and schedule scaled alike); results.md adds held-out sim τ and its paired Δ per budget.
  c.compare.budgets = ()
  # ("auto",): the baseline, the 3 best and the 2 worst by sim τ, once 1x is done (names beside it join them).
  c.compare.budget_sets = ()
  c.compare.seeds = 3  # training seeds 0..seeds-1 per set (init and data order)
  c.compare.datasets = ("mtbench", "humaneval", "gsm8k")  # held-out prompts (first turns)
  c.compare.num_prompts = 8  # per dataset; 0: no decoding in the cells (held-out sim τ only, sort_by=sim_tau)
  c.compare.max_prompt_tokens = 256  # prompts longer than this are skipped
  c.compare.temperatures = (0.0, 1.0)  # the first is the primary metric
  c.compare.max_new_tokens = 64
  c.compare.speedup = False  # speedup columns: plain vs speculative decoding, paired in every cell
  c.compare.keep_checkpoints = True  # False: delete each cell's checkpoints once its result is written
  c.compare.report_only = False  # only tabulate the finished cells (a partial or running comparison)
  c.compare.release = ""  # a released draft (releases/NAME) decoded beside the cells, same prompts and timing
  c.compare.release_batch_size = 1  # ... at this many prompts per call (1: where speculation pays, as users run it)
  # Finalists (`--config.compare.finalists=3`): once every cell has finished, the 3 sets of highest held-out sim
  # τ and the baseline decode finalist_prompts prompts per dataset (seeds 0..finalist_seeds-1, every temperature);
  # results.md adds their τ and Δτ against the baseline with a paired bootstrap over prompts. Needs checkpoints.
  c.compare.finalists = 0
  c.compare.finalist_prompts = 80
  c.compare.finalist_seeds = 1
  c.compare.finalist_temperatures = ()  # empty: compare.temperatures
  c.compare.finalist_max_prompt_tokens = 0  # the finalists' longest prompt (0: compare.max_prompt_tokens)
  # A linear probe of the next token per set and per layer (`--config.compare.probe_tokens=20000`, offline
  # comparisons: fit on train.features' train split, scored on its heldout split), tested as a predictor of τ.
  c.compare.probe_tokens = 0
  c.compare.probe_vocab = 1024  # probe classes: the most frequent next tokens
  c.compare.sort_by = "tau"  # results.md's row order: "tau" (first temperature) or "sim_tau" (held-out sim τ)

  c.lock()  # a variant sets only keys the sections hold: a misspelt one is refused, naming the nearest
  if arg == "smoke":
    c.data.max_length = 128
    c.data.max_records = 200
    c.distill.num_prompts = 8
    c.distill.max_new_tokens = 32
    c.distill.max_prompt_tokens = 128
    c.distill.batch_size = 4
    c.distill.slots = 4
    c.distill.chunk_size = 4
    c.analysis.batch_size = 4
    c.analysis.num_batches = 4
    c.analysis.max_tokens = 0
    c.analysis.calibration_batches = 1
    c.analysis.hsic_batch_size = 64
    c.analysis.exact_cka_tokens = 256
    c.analysis.log_every = 2
    c.train.batch_size = 2
    c.train.num_steps = 6
    c.train.warmup_steps = 2
    c.train.ttt_steps = 3
    c.train.compute_dtype = "float32"  # the tests' equalities (offline == online, 8 devices == 1) are float32's
    c.features.compute_dtype = ""  # likewise: the smoke stores are the float32 target's own features
    c.train.log_every = 2
    c.train.eval_every = 3
    c.train.eval_batches = 1
    c.train.checkpoint_every = 3
    c.speculate.num_prompts = 2
    c.speculate.batch_size = 2
    c.speculate.max_new_tokens = 32
    c.speculate.num_draft_tokens = 3
    _selected_vs_baseline(c.compare)
    c.compare.num_prompts = 2
    c.compare.max_new_tokens = 16
  elif arg in ("compare", "demo"):
    # Short drafts for comparisons on a CPU: every cell trains num_steps x 8 x 256 tokens with V_d 2,048
    # and K = 3 TTT steps, and drafts K = 3 tokens per verification.
    c.data.max_length = 256
    c.data.max_records = 4000
    c.draft_model.vocab_size = 2048
    c.train.num_steps = 30
    c.train.lr = 1e-3
    c.train.warmup_steps = 5
    c.train.ttt_steps = 3
    c.train.vocab_examples = 2000
    c.train.log_every = 5
    c.train.eval_every = 1000
    c.train.eval_batches = 4
    c.train.checkpoint_every = 1000
    c.speculate.num_draft_tokens = 3
    if arg == "demo":
      # The README's main job: analysis on ~16k tokens, then the selected (exhaustive) and the EAGLE-3
      # layers, one draft each, compared on 8 MT-bench prompts with speedup against plain decoding.
      c.analysis.max_tokens = 16_000
      c.analysis.calibration_batches = 2
      c.analysis.log_every = 5
      c.train.num_steps = 80
      # Its cells train online: the target's forward in bfloat16 (the held-out evaluation in float32) makes a
      # step 1.26x faster (`bench_train_dtype.py --online`, BENCHMARKS.md "Throughput"); the same forward in a
      # store's extraction cost no measurable held-out sim τ (features.compute_dtype above).
      c.train.target_dtype = "bfloat16"
      _selected_vs_baseline(c.compare)
      # First line of the table: the draft released in this repository, on the same prompts and timing.
      c.compare.release = "smollm2-135m-instruct-eagle3"
  elif arg == "cpu":
    # The draft this repository reports (BENCHMARKS.md, "Draft training"): a budget for a 2-core CPU.
    # V_d is cut to 8,192 because the draft's LM head dominates the step's cost on a CPU.
    c.data.max_length = 384
    c.draft_model.vocab_size = 8192
    c.train.num_steps = 200
    c.train.lr = 1e-3
    c.train.warmup_steps = 20
    c.train.log_every = 5
    c.train.eval_every = 50
    c.train.eval_batches = 4
    c.train.checkpoint_every = 25
  elif arg == "recipe":
    # The recipe sweep's base cell (experiments/sweep_recipe.py, BENCHMARKS.md): offline from a feature store
    # of self-distilled answers (give --config.data.source=distilled:D and --config.train.features=S, the
    # store extracted from that data with these data settings). Prompts <= 192 tokens + answers <= 320.
    c.data.max_length = 512
    c.draft_model.vocab_size = 8192
    c.train.num_steps = 300
    c.train.lr = 1e-3
    c.train.warmup_steps = 20
    c.train.ttt_steps = 5
    c.train.eval_ttt_steps = 5  # every cell evaluated 5 deep, whatever K it trains with
    c.train.log_every = 10
    c.train.eval_every = 50
    c.train.eval_batches = 8
    c.train.checkpoint_every = 50
    c.distill.max_new_tokens = 320
    c.distill.max_prompt_tokens = 192
    c.features.depths = "2,15,27"
  elif arg == "paper":
    # The paper's experiment at a CPU budget (`make paper`, RESULTS.md): offline cells on one store of every
    # depth of the first 2,000 distilled conversations (give --config.data.source=distilled:D,
    # --config.train.features=S, --config.train.eval_features=H: the held-out split in float32, as at
    # inference). Every cell: the campaign draft's recipe for train.num_steps, held-out sim τ 5 deep; speculative
    # τ for the finalists. The budget: 40 steps, the most for which the sweep (18 distinct sets x 3 seeds, the
    # dynamics' 6 sets x 3 seeds at 1/4x and 4x: 130.5 cells' worth of steps in 90 cells) fits in 6 CPU-hours at
    # the rates measured on its first cell (2026-12-07, quiet: ~2.3 s a step of the campaign's length buckets,
    # ~3,000 real tokens, 80 s a cell to compile and score the held-out split; ~30 min for the finalists).
    # A step reads ~16 conversations, so a 1x cell sees 0.37 epochs of the ~1,800 training ones, a 4x cell 1.5.
    # The store (~15 GB in bf16 for every depth) fits beside the campaign's.
    # 10 % held out (~200 conversations, the same hash split: a superset of the 5 % one) for a tighter metric.
    c.data.max_length = 512
    c.data.max_records = 2000
    c.data.heldout_fraction = 0.1
    c.analysis.bucket_widths = (64, 128, 256)  # the answers fill 43% of 512-token slots; 71% in these buckets
    c.draft_model.vocab_size = 4096
    c.train.num_steps = 40
    c.train.lr = 3e-3
    c.train.warmup_steps = 5
    c.train.ttt_steps = 3
    c.train.eval_ttt_steps = 5
    c.train.bucket_widths = (64, 128, 192, 256, 320, 384, 448)  # the campaign's (Makefile CAMPAIGN_WIDTHS)
    c.train.log_every = 8
    c.train.eval_every = 1000
    c.train.eval_batches = 1000  # every held-out conversation (one pass), the same for every cell
    c.train.checkpoint_every = 1000
    c.distill.max_new_tokens = 320
    c.distill.max_prompt_tokens = 192
    c.features.depths = "all"
    # eagle3's one-shallower twin (a tool confusing the index conventions) and a late contiguous foil.
    c.compare.manual = "1,14,26;25,26,27"
    c.compare.ks = (1, 5, 9)
    # Cells are scored by held-out sim τ alone (τ on 4 prompts a dataset was noise beside it, and cost a
    # decoding run a cell); the finalists decode 80 prompts a dataset.
    c.compare.num_prompts = 0
    c.compare.temperatures = (0.0,)
    c.compare.finalists = 3
    c.compare.finalist_prompts = 80
    c.compare.finalist_temperatures = (0.0, 1.0)
    c.compare.finalist_max_prompt_tokens = 512  # all 80 of each dataset (MT-bench's longest first turn: 402)
    c.compare.probe_tokens = 20000
    c.compare.budgets = (0.25, 4.0)
    c.compare.budget_sets = ("auto", "exhaustive")  # and the paper's own choice, wherever it ranks at 1x
    c.compare.sort_by = "sim_tau"  # the primary metric
  elif arg:
    raise ValueError(f"Unknown config variant {arg!r}; use ':smoke', ':cpu', ':compare', ':demo', ':recipe', "
                     "':paper' or nothing.")
  return c.unlock()  # configs/scale.py adds its own keys
