"""Speed benchmark: forwards, ZO steps (sequential and batched queries), every ZO method, scaling, evaluation
throughput, peak memory.

    make bench                                                          # SmolLM2-135M, 16 real SST-2 prompts; CPU or GPU
    python -m adazeta.tools.bench --repeats 5 --queries 1 4 8 --chunks 4 8
    python -m adazeta.tools.bench --weights random --dtype bf16         # no model or data file: random weights
    python -m adazeta.tools.bench --model llama-1b-random --dtype bf16  # a GPU: random ~1.1 B Llama, bf16 backbone
    scripts/bench_gpu.sh                                                # both of the above on a GPU, into $OUT

One run measures, on one batch of ``--batch-size`` SST-2 training prompts (the project's loader and template,
offline when $ADAZETA_MODEL_DIR / $ADAZETA_DATA_DIR or ../shared hold the model and data, else the Hub; with
``--weights random``, random tokens in the real prompts' lengths): the inference forward (the plain model, the
model with AdaZeta's TT adapters, and what the AdaZeta reference trainer's ``zo_forward`` computes on it); the
AdaZeta ZO step at each Q, with sequential and batched queries, per query and against 2Q of our own forwards
timed in the same rounds; every ZO method (``--methods``: MeZO, Sparse-MeZO, MeZO-LoRA, MeZO-Adapter, AdaZeta,
each with its own config, Q = 1) on the same batch, its step against 2 of its own forwards; AdaZeta's step
against batch size and prompt length (SST-2 and RTE prompts, ``--scaling-sizes``); evaluation examples per
second, batched against one example at a time; a first-order (AdamW) step on the adapters; and the peak memory
of inference, of AdaZeta steps (sequential and batched), of a first-order step and of every method's step, each
in a fresh subprocess (a process's peak resident memory only grows). Times are medians of ``--repeats`` rounds
after ``--warmup`` rounds, with min and max; each round runs every compared variant once (drift on a shared
machine weighs on all alike), and ratios are taken round by round. CUDA work is synchronised before every clock
read; memory is the CUDA peak allocated on a GPU, the resident-set high-water mark of the phase on a CPU.

Every model and optimizer is wired by ``adazeta.build.build`` from the settings the options compose to (``--model``,
``--weights``, ``--dtype``, ``--device``, the method; AdaZeta's sequential and batched optimizers as overrides, the
first-order step as method ``tt_adapter``'s AdamW). Random weights are the one piece made here: a seeded random
model of the architecture with SmolLM2's full vocabulary, and synthetic prompts, given to ``build`` in place of a
loaded model and task data.

Writes ``<out>/<model>[-random]-<device>-<dtype>.csv`` (one row per measurement; ``--out`` is results/bench under
the current directory unless given), a ``.md`` table with the targets' verdicts and a ``.json`` with the rows and
provenance (versions, commit, threads, load average before and after: other processes on the machine slow every
number down, and the load average says how much).

One module per section, run in this order by ``cli.measure_speed`` (the CSV's ``section`` column in brackets):
``forwards`` (forward), ``methods`` (methods), ``steps`` (zo_step, first_order), ``scaling`` (scaling),
``evaluation`` (evaluation), then ``memory`` (memory: each phase in a fresh ``python -m adazeta.tools.bench --phase``
process). ``common`` holds what they share (the options as run settings, the runner's wiring, the timing rounds,
the report), ``output`` the table and the targets' verdicts, ``cli`` the options and the command.
"""
