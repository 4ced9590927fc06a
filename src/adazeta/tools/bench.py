"""Speed benchmark: forwards, ZO steps (sequential and batched queries), every ZO method, scaling, evaluation
throughput, peak memory.

    make bench                                           # SmolLM2-135M, 16 real SST-2 prompts, CPU or GPU
    python -m adazeta.tools.bench --repeats 5 --queries 1 4 8 --chunks 4 8
    python -m adazeta.tools.bench --weights random --dtype bf16            # no model or data file: random weights
    python -m adazeta.tools.bench --model llama-1b-random --dtype bf16     # a GPU: random ~1.1 B Llama, bf16 backbone
    scripts/bench_gpu.sh                                             # both of the above on a GPU, into $OUT

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

Every model and optimizer is wired by ``adazeta.run.build`` from the settings the options compose to (``--model``,
``--weights``, ``--dtype``, ``--device``, the method; AdaZeta's sequential and batched optimizers as overrides, the
first-order step as method ``tt_adapter``'s AdamW). Random weights are the one piece made here: a seeded random
model of the architecture with SmolLM2's full vocabulary, and synthetic prompts, given to ``build`` in place of a
loaded model and task data.

Writes ``<out>/<model>[-random]-<device>-<dtype>.csv`` (one row per measurement; ``--out`` is results/bench under
the current directory unless given), a ``.md`` table with the targets' verdicts and a ``.json`` with the rows and
provenance (versions, commit, threads, load average before and after: other processes on the machine slow every
number down, and the load average says how much).
"""

from __future__ import annotations

import argparse
import copy
import csv
import ctypes
import dataclasses
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from adazeta.tools.bench_memory import _reset_rss_peak, _status_kib
from adazeta.adapters import tt
from adazeta.adapters.tt import TTAdapter
from adazeta.evaluate import evaluate
from adazeta.models import LoadedModel, ModelSource, architecture_config, load_model, resolve_device
from adazeta.tools.offline import use_shared
from adazeta.optim.batched import ReplicaClosure
from adazeta.optim import spsa
from adazeta.optim.spsa import NOISE_STREAMS
from adazeta.results import cpu_name, git_state, package_versions
from adazeta.run import Built, build, build_optimizer, compose_settings, seed_everything
from adazeta.scoring import Encoded, Scorer, batch_loss, collate, encode, replica_losses
from adazeta.settings import Settings
from adazeta.tasks.loaders import TaskData, load_task
from adazeta.tracking import quiet_third_party, sync

REFERENCE_ROW = "reference zo_forward (TT adapters; a row per candidate, padded to x8, full-vocabulary log-softmax)"
# name -> the model config the run composes (llama-1b-random: SmolLM2's config with LLAMA_1B's architecture, always
# random weights; tiny-llama: smoke tests).
MODELS = {"smollm2-135m": "smollm2-135m", "llama-1b-random": "smollm2-135m", "tiny-llama": "tiny-llama"}
# A TinyLlama-1.1B-shaped decoder with SmolLM2's vocabulary (so the same prompts tokenise the same way): overrides
# of model.architecture.
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False)
VOCAB, PAD_ID = 49152, 2  # SmolLM2's vocabulary size and pad id (its <|im_end|>), used by random-weight models
# Prompt lengths (tokens) and candidate token ids of the first 32 SST-2 and RTE training prompts as the project
# encodes them for SmolLM2 (LM-BFF / MeZO templates): synthetic batches of random tokens take these shapes.
PROMPT_LENGTHS = {
    "sst2": [6, 6, 9, 4, 8, 7, 8, 5, 12, 39, 9, 10, 7, 6, 15, 19, 24, 9, 7, 12, 8, 13, 17, 3, 8, 12, 5, 13, 5, 6, 5,
             11],
    "rte": [73, 77, 75, 63, 137, 131, 193, 69, 87, 59, 60, 69, 100, 46, 66, 66, 135, 61, 56, 37, 59, 105, 185, 65,
            138, 60, 59, 60, 46, 211, 149, 203],
}
CANDIDATES = {"sst2": [[13321], [1109]], "rte": [[10539], [5230]]}
NOISE = "per_tensor"  # the ZO optimizers' noise stream (--noise)
QUERY_MEMORY = 0.05  # query_chunk=auto's memory budget (--query-memory)


def chunk_arg(value: str) -> int | str:
    """``--chunks`` values: an int >= 1, or auto (chosen per batch from --query-memory)."""
    if value == "auto":
        return value
    chunk = int(value)
    if chunk < 1:
        raise argparse.ArgumentTypeError(f"chunk {value} must be >= 1 or auto")
    return chunk
ZO_METHODS = ["mezo", "sparse_mezo", "mezo_lora", "mezo_adapter", "adazeta"]
COLUMNS = ["section", "measurement", "setting", "median", "min", "max", "unit", "runs"]
TARGETS = {"s_per_query": 2.0, "step_over_forwards": 1.02, "memory_over_inference": 1.05, "tt_overhead": 0.05,
           "eval_speedup": 5.0}
# method -> (step / 2Q forwards, peak memory / inference): full-parameter methods draw noise for every weight.
METHOD_TARGETS = {"mezo": (1.2, 1.15), "sparse_mezo": (1.2, 1.15), "adapters": (1.02, 1.05)}


# --- setup: the runner's wiring (adazeta.run.build) ----------------------------------------------------------


@dataclasses.dataclass
class Setup:
    built: Built  # adazeta.run.build's pieces: the model with the method's adapter, its optimizer, the task data
    settings: Settings  # the method (AdaZeta unless asked otherwise) on SST-2, as the benchmark's options compose it
    items: list[Encoded]  # the benchmark batch
    dev_items: list[Encoded]  # evaluation examples

    @property
    def model(self) -> torch.nn.Module:
        return self.built.model

    @property
    def tokenizer(self) -> Any:
        return self.built.tokenizer

    @property
    def device(self) -> torch.device:
        return self.built.device


def random_weights(args: argparse.Namespace) -> bool:
    """A seeded random initialisation instead of the model's weights: ``--weights random``, and llama-1b-random."""
    return args.weights == "random" or args.model == "llama-1b-random"


def overrides(args: argparse.Namespace, method: str = "adazeta", task: str = "sst2", extra: Sequence[str] = ()
              ) -> list[str]:
    """The ``adazeta-run`` overrides of the benchmark's options: model, dtype, device, method and task; random
    weights set ``model.random_init=true``, and llama-1b-random is SmolLM2's config with a ~1.1 B architecture."""
    out = [
        f"model={MODELS[args.model]}", f"task={task}", f"method={method}",
        f"model.dtype={args.dtype}", f"model.device={args.device}",
        f"data.num_train={max(args.batch_size, 64)}", f"data.num_dev={args.eval_examples}", "data.num_eval=8",
        "wandb.mode=disabled",
    ]
    if random_weights(args):
        out.append("model.random_init=true")
    if args.model == "llama-1b-random":
        # SmolLM2's reference TT shapes are for hidden 576: null derives balanced ones for this width.
        out += ["model.name=llama-1b-random", "model.tt_shapes=null"]
        out += [f"model.architecture.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in LLAMA_1B.items()]
    if method in ZO_METHODS:
        out.append(f"++method.optimizer.noise={NOISE}")
    return [*out, *extra]


def settings_for(args: argparse.Namespace, method: str = "adazeta", task: str = "sst2", extra: Sequence[str] = ()
                 ) -> Settings:
    """The settings ``adazeta-run`` runs for :func:`overrides`."""
    return compose_settings(overrides(args, method, task, extra))


def zo_variant(batched: bool, chunk: int | str) -> list[str]:
    """The overrides of an AdaZeta optimizer the benchmark times: sequential or batched queries, and the chunk."""
    return [f"method.optimizer.batched_queries={'true' if batched else 'false'}",
            f"method.optimizer.query_chunk={chunk}", f"method.optimizer.query_memory={QUERY_MEMORY}"]


def random_backbone(s: Settings) -> LoadedModel:
    """A seeded random initialisation of ``s.model``'s architecture with SmolLM2's full vocabulary, built on its
    device; needs no file. (The random models ``adazeta.models.load_model`` builds take the vocabulary of a small
    in-memory tokenizer: the synthetic prompts index SmolLM2's, and its full LM head is part of every forward.)"""
    from transformers import AutoModelForCausalLM

    device = resolve_device(s.model.device)
    config = architecture_config(s.model, vocab_size=VOCAB)
    config.pad_token_id = PAD_ID
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s.seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=s.model.torch_dtype)
    model.eval().requires_grad_(False)
    return LoadedModel(model, SimpleNamespace(pad_token_id=PAD_ID), "causal", ModelSource("random"), device)


def backbone(args: argparse.Namespace, s: Settings) -> LoadedModel:
    """The plain model: the real weights as a run loads them, or (random weights) :func:`random_backbone`."""
    if random_weights(args):
        return random_backbone(s)
    quiet_third_party(s.verbose)
    return load_model(s.model, seed=s.seed)


def synthetic_items(task: str, n: int, seed: int, vocab: int) -> list[Encoded]:
    """``n`` examples with the real prompts' lengths (``PROMPT_LENGTHS``) and random tokens: no data needed."""
    g = torch.Generator().manual_seed(seed)
    lengths = PROMPT_LENGTHS[task]
    candidates = CANDIDATES[task]
    return [Encoded(torch.randint(1, vocab, (lengths[i % len(lengths)],), generator=g).tolist(),
                    [list(c) for c in candidates], i % len(candidates)) for i in range(n)]


def bench_items(args: argparse.Namespace, s: Settings, tok: Any, task: str, n: int) -> list[Encoded]:
    """``n`` encoded training examples of ``task`` (the scaling rows' prompts): the project's loader and template,
    or synthetic (random weights). The task data alone: a build would load another model."""
    if random_weights(args):
        return synthetic_items(task, n, s.seed, VOCAB)
    if task != s.task.name:
        s = settings_for(args, "adazeta", task)
    data = load_task(s.task, s.data, "causal", s.seed, None)
    return encode(data.train[:n], tok, "causal", s.model.max_length)


def setup_for(args: argparse.Namespace, method: str = "adazeta", extra: Sequence[str] = (),
              plain: LoadedModel | None = None) -> Setup:
    """``method``'s model, optimizer and the benchmark batch, wired by ``adazeta.run.build`` from the settings the
    options compose to (``extra``: more overrides). ``plain``: a backbone already made, which the model copies (the
    methods compared on one batch share one load); else the backbone is loaded, or randomly initialised, here.
    Random weights come with synthetic prompts of SST-2's lengths, so that no data file is read."""
    s = settings_for(args, method, extra=extra)
    seed_everything(s.seed)
    if plain is not None:
        plain = dataclasses.replace(plain, model=copy.deepcopy(plain.model))
    elif random_weights(args):
        plain = random_backbone(s)
    synthetic = TaskData([], [], [], "synthetic prompts") if random_weights(args) else None
    built = build(s, loaded=plain, data=synthetic)
    if synthetic is not None:
        items = synthetic_items("sst2", args.batch_size, s.seed, VOCAB)
        dev_items = synthetic_items("sst2", args.eval_examples, s.seed + 1, VOCAB)
    else:
        items, dev_items = built.enc["train"][: args.batch_size], built.enc["dev"][: args.eval_examples]
    return Setup(built, s, items, dev_items)


def zo_optimizer(args: argparse.Namespace, setup: Setup, batched: bool, chunk: int | str) -> torch.optim.Optimizer:
    """Another AdaZeta optimizer over ``setup``'s adapters, from the settings of its variant: the rounds time
    several side by side on one model (a build makes one optimizer per model)."""
    return build_optimizer(settings_for(args, "adazeta", extra=zo_variant(batched, chunk)), setup.built.named)


def first_order_optimizer(args: argparse.Namespace, setup: Setup) -> torch.optim.Optimizer:
    """AdamW over ``setup``'s TT adapters, as method tt_adapter (AdaZeta's trainable set, first-order) sets it."""
    return build_optimizer(settings_for(args, "tt_adapter"), setup.built.named)


def first_order_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    model.train()
    opt.zero_grad(set_to_none=True)
    loss = batch_loss(model, batch, "causal")
    loss.backward()
    opt.step()
    model.eval()
    return loss.detach()


def reference_zo_forward(model: torch.nn.Module, items: list[Encoded], pad_id: int, device: torch.device) -> Any:
    """What the AdaZeta reference trainer's ``zo_forward`` computes for one loss (MeZO's large-model code, which
    it builds on: ``forward_wrap_with_option_len`` with ``train_as_classification``): one sequence per (prompt,
    candidate), right-padded to the longest rounded up to a multiple of 8 (its collator's ``pad_to_multiple_of``),
    the model's logits at every position and over the whole vocabulary, the shifted logits copied
    (``.contiguous()``), a full log-softmax, the candidate tokens' mean log-probability per sequence, and the
    cross-entropy over candidates. Run on the adapted model, it is the reference's loss forward."""
    rows, option_len = [], []
    for ex in items:
        for cand in ex.candidates:
            rows.append(ex.prompt + cand)
            option_len.append(len(cand))
    width = -(-max(map(len, rows)) // 8) * 8
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, : len(row)], mask[r, : len(row)] = torch.tensor(row), 1
    ids, mask = ids.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=mask).logits
    shift_logits = logits[..., :-1, :].contiguous()
    labels = ids[..., 1:].clone()
    labels[mask[..., 1:] == 0] = -100
    for r, n in enumerate(option_len):  # only the candidate's tokens count
        end = int(mask[r].sum()) - 1
        labels[r, : end - n] = -100
    log_probs = F.log_softmax(shift_logits, dim=-1)
    keep = labels != -100
    picked = torch.gather(log_probs, -1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per_row = (picked * keep).sum(-1) / keep.sum(-1)
    n_options = len(items[0].candidates)
    gold = torch.tensor([e.gold for e in items], device=device)
    return F.cross_entropy(per_row.view(-1, n_options).float(), gold)


# --- timing --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Stats:
    median: float
    min: float
    max: float
    runs: int
    samples: list[float] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, samples: list[float]) -> "Stats":
        return cls(statistics.median(samples), min(samples), max(samples), len(samples), list(samples))

    def scaled(self, factor: float) -> "Stats":
        return Stats.of([x * factor for x in self.samples])

    def over(self, other: "Stats") -> "Stats":
        """Round by round ratios: each sample against the one timed next to it, so that drift cancels."""
        return Stats.of([a / b for a, b in zip(self.samples, other.samples)])


def timed(fns: dict[str, Callable[[], Any]], device: torch.device, repeats: int, warmup: int) -> dict[str, Stats]:
    """Wall-clock seconds of each ``fn()``: ``warmup`` untimed rounds, then median, min and max of ``repeats``.

    Round-robin (each round runs every fn once), so that load from other processes, which drifts during a
    benchmark, weighs on the compared variants alike.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            sync(device)  # queued CUDA work belongs to this run
            times[name].append(time.perf_counter() - start)
    return {name: Stats.of(t) for name, t in times.items()}


class Report:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, section: str, measurement: str, setting: str, stats: Stats | float, unit: str) -> None:
        if not isinstance(stats, Stats):
            stats = Stats.of([stats])
        self.rows.append(dict(section=section, measurement=measurement, setting=setting, median=stats.median,
                              min=stats.min, max=stats.max, unit=unit, runs=stats.runs))
        print(f"  {measurement:<44} {setting:<26} {stats.median:10.4g} {unit}  "
              f"[{stats.min:.4g} .. {stats.max:.4g}], n={stats.runs}", file=sys.stderr, flush=True)

    def get(self, measurement: str, setting: str = "") -> dict[str, Any]:
        return next(r for r in self.rows if r["measurement"] == measurement and r["setting"] == setting)


def measure_speed(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    """All timings, in this process: forwards (plain, adapted, reference), ZO steps, first-order, evaluation."""
    s = settings_for(args)
    seed_everything(s.seed)
    plain = backbone(args, s)
    # AdaZeta's model is a copy, so that plain and adapted forwards can be timed side by side.
    setup = setup_for(args, plain=plain)
    model, adapted_model, device, tok = plain.model, setup.model, setup.device, setup.tokenizer
    batch = collate(setup.items, "causal", tok.pad_token_id).to(device)
    rows_batch = collate(setup.items, "causal", tok.pad_token_id, layout="rows").to(device)
    info = {
        "prompt_tokens": [len(e.prompt) for e in setup.items],
        "packed_rows_x_width": list(batch.input_ids.shape),
        "rows_layout_rows_x_width": list(rows_batch.input_ids.shape),
        "reference_layout_sequences": sum(len(e.candidates) for e in setup.items),
    }
    print(f"batch: {len(setup.items)} prompts, {sum(info['prompt_tokens'])} tokens (mean "
          f"{statistics.mean(info['prompt_tokens']):.1f}, max {max(info['prompt_tokens'])}); packed "
          f"{info['packed_rows_x_width']}, rows layout {info['rows_layout_rows_x_width']}", file=sys.stderr)
    r, w = args.repeats, args.warmup
    info["trainable_params"] = setup.built.trainable_params
    forwards = {
        "plain, packed": lambda: batch_loss(model, batch, "causal"),
        "plain, rows layout": lambda: batch_loss(model, rows_batch, "causal"),
        "TT adapters, packed": lambda: batch_loss(adapted_model, batch, "causal"),
    }
    if not args.skip_reference:
        forwards[REFERENCE_ROW] = functools.partial(
            reference_zo_forward, adapted_model, setup.items, tok.pad_token_id, device)
    with torch.inference_mode():
        fwd = timed(forwards, device, r, w)
    for name, stats in fwd.items():
        report.add("forward", "inference forward", name, stats, "s")
    # The overhead is a few % of a forward, below the drift between rounds: pairs of forwards, ratio per pair;
    # and in the same rounds the adapters' unfolded products (tt.FOLD off: the same numbers), to show the gain.
    def unfolded() -> Any:
        tt.FOLD = False
        try:
            return forwards["TT adapters, packed"]()
        finally:
            tt.FOLD = True

    with torch.inference_mode():
        pairs = timed({"plain": forwards["plain, packed"], "adapted": forwards["TT adapters, packed"],
                       "unfolded": unfolded}, device, max(args.overhead_pairs, r), w)
    overhead = pairs["adapted"].over(pairs["plain"])
    tokens = sum(info["prompt_tokens"])
    report.add("forward", "TT adapters' forward overhead",
               f"SST-2 prompts, {tokens} tokens; adapted / plain - 1, {overhead.runs} pairs",
               Stats.of([x - 1 for x in overhead.samples]), "x")
    report.add("forward", "TT adapters' forward overhead, unfolded products",
               f"SST-2 prompts, {tokens} tokens; the same rounds",
               Stats.of([x - 1 for x in pairs["unfolded"].over(pairs["plain"]).samples]), "x")
    report.add("forward", "TT adapters' forward, folded / unfolded products", f"SST-2 prompts, {tokens} tokens; "
               "the same rounds", pairs["adapted"].over(pairs["unfolded"]), "x")
    if args.overhead_long_pairs:
        # The adapters' cost has a part per call (90 of them on SmolLM2) besides its part per token: over a
        # forward of longer prompts (RTE's) that part weighs less.
        long_items = bench_items(args, setup.settings, tok, "rte", args.batch_size)
        long_batch = collate(long_items, "causal", tok.pad_token_id).to(device)
        with torch.inference_mode():
            long = timed({"plain": lambda: batch_loss(model, long_batch, "causal"),
                          "adapted": lambda: batch_loss(adapted_model, long_batch, "causal")},
                         device, args.overhead_long_pairs, min(w, 1))
        ratio = long["adapted"].over(long["plain"])
        report.add("forward", "TT adapters' forward overhead",
                   f"RTE prompts, {sum(len(e.prompt) for e in long_items)} tokens; adapted / plain - 1, "
                   f"{ratio.runs} pairs", Stats.of([x - 1 for x in ratio.samples]), "x")
    measure_adapters_alone(args, report, adapted_model, batch, pairs["plain"])
    measure_methods(args, report, plain, batch)
    del model, plain
    model = adapted_model

    closure = ReplicaClosure(model, functools.partial(replica_losses, model, batch, "causal"), batch)
    for q in args.queries:
        opts = {"sequential": zo_optimizer(args, setup, False, 1)}
        n_forwards = 2 * q if opts["sequential"].estimator == "central" else q + 1
        for chunk in args.chunks:  # chunks at or above the step's loss evaluations all run the same forwards
            opts[f"batched (chunk {chunk})"] = zo_optimizer(args, setup, True, chunk)
        # The step's own number of plain loss forwards (no autograd, as the step runs them), in the same rounds.
        runs = {"forwards": torch.no_grad()(lambda: [float(closure()) for _ in range(n_forwards)])}
        runs.update({f"Q={q}, {m}": functools.partial(lambda o, q: float(o.step(closure, n_queries=q)), o, q)
                     for m, o in opts.items()})
        stats = timed(runs, device, r, w)
        forwards = stats.pop("forwards")
        report.add("zo_step", "loss forward (TT adapters)", f"in the Q={q} rounds", forwards.scaled(1 / n_forwards), "s")
        for mode in stats:
            step = stats[mode]
            report.add("zo_step", "ZO step", mode, step, "s")
            report.add("zo_step", "ZO step per query", mode, step.scaled(1 / q), "s")
            report.add("zo_step", "ZO step / forwards of our model", f"{mode}; {n_forwards} forwards",
                       step.over(forwards), "x")
    if args.scaling_sizes:
        measure_scaling(args, report, setup)

    fo = first_order_optimizer(args, setup)
    stats = timed({"fo": lambda: float(first_order_step(model, fo, batch))}, device, r, w)["fo"]
    report.add("first_order", "first-order step (AdamW, TT adapters)", "packed", stats, "s")

    n = len(setup.dev_items)
    scorer = Scorer.of(model, tok, "causal", device)
    eval_sets = {
        f"batched ({args.eval_batch_size} per forward)": scorer.batches(setup.dev_items, args.eval_batch_size, sort=True),
        "one example at a time": scorer.batches(setup.dev_items, 1),
    }
    evals = {k: functools.partial(evaluate, scorer, v) for k, v in eval_sets.items()}
    stats = timed(evals, device, r, min(w, 1))
    for name, t in stats.items():
        report.add("evaluation", "evaluation throughput", name, Stats.of([n / x for x in t.samples]), "examples/s")
    one, batched = stats["one example at a time"], next(v for k, v in stats.items() if k.startswith("batched"))
    report.add("evaluation", "evaluation speed-up", "batched / one example at a time", one.over(batched), "x")
    measure_eval_ceiling(report, model, eval_sets, stats, device, r)
    return info


def measure_adapters_alone(args: argparse.Namespace, report: Report, model: torch.nn.Module, batch: Any,
                           plain: Stats) -> None:
    """The TT adapters' own time in a forward, two ways, against the plain forward's time: alone (every adapter
    run on the input it saw in one adapted forward of ``batch``, one after another) and in place (hooks around
    every adapter inside adapted forwards, their times summed per forward). Inside a forward each adapter runs
    after the backbone's large products, cold, so in place takes longer than alone; the pairs' ratio holds both
    and the rest of the adapted forward."""
    adapters = [m for m in model.modules() if isinstance(m, TTAdapter)]
    if not adapters:
        return
    inputs: dict[nn.Module, torch.Tensor] = {}
    hooks = [adapter.register_forward_pre_hook(lambda m, args: inputs.setdefault(m, args[0].detach().clone()))
             for adapter in adapters]
    try:
        with torch.inference_mode():
            batch_loss(model, batch, "causal")
    finally:
        for hook in hooks:
            hook.remove()
    captured = [(a, inputs[a]) for a in adapters if a in inputs]

    def run_all() -> None:
        for adapter, x in captured:
            adapter(x)

    with torch.inference_mode():
        alone = timed({"alone": run_all}, batch.input_ids.device, max(args.overhead_pairs, args.repeats),
                      args.warmup)["alone"]
    setting = f"{len(captured)} adapters on their inputs of one forward"
    report.add("forward", "TT adapters alone", setting, alone, "s")
    report.add("forward", "TT adapters alone / plain forward", setting,
               Stats.of([x / plain.median for x in alone.samples]), "x")

    device = batch.input_ids.device
    spent, started = [0.0], {}

    def before(module: nn.Module, _: Any) -> None:
        sync(device)
        started[module] = time.perf_counter()

    def after(module: nn.Module, _: Any, __: Any) -> None:
        sync(device)
        spent[0] += time.perf_counter() - started.pop(module)

    hooks = [h for a in adapters for h in (a.register_forward_pre_hook(before), a.register_forward_hook(after))]
    in_place = []
    try:
        with torch.inference_mode():
            for i in range(args.warmup + max(args.repeats, 5)):
                spent[0] = 0.0
                batch_loss(model, batch, "causal")
                if i >= args.warmup:
                    in_place.append(spent[0])
    finally:
        for hook in hooks:
            hook.remove()
    setting = f"{len(captured)} adapters inside adapted forwards (hooks around each)"
    report.add("forward", "TT adapters in place", setting, Stats.of(in_place), "s")
    report.add("forward", "TT adapters in place / plain forward", setting,
               Stats.of([x / plain.median for x in in_place]), "x")


def layer_flops_per_token(model: torch.nn.Module) -> float:
    """2 x the decoder layers' weights: the multiply-adds of one token through them (attention scores aside)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = base.get_decoder().layers
    return 2.0 * sum(p.numel() for layer in layers for p in layer.parameters() if p.dim() == 2)


def measure_eval_ceiling(report: Report, model: torch.nn.Module, eval_sets: dict[str, list], stats: dict[str, Stats],
                         device: torch.device, repeats: int) -> None:
    """How close each evaluation layout runs to this device's dense-matmul rate, and so what the batched/one-at-
    a-time throughput ratio can reach: batched evaluation near the matmul rate cannot speed up by packing."""
    per_token = layer_flops_per_token(model)
    hidden = model.config.hidden_size
    inter = getattr(model.config, "intermediate_size", 4 * hidden)
    first = next(iter(eval_sets.values()))
    rows = max((int(x.input_ids.numel()) for x in first), default=512)  # the batched layout's largest forward
    a = torch.randn(rows, hidden, device=device)
    b = torch.randn(hidden, inter, device=device)
    gemm = timed({"mm": lambda: float(torch.mm(a, b).sum())}, device, repeats, 1)["mm"]
    rate = 2.0 * rows * hidden * inter / gemm.median / 1e9
    report.add("evaluation", "dense matmul rate", f"({rows} x {hidden}) @ ({hidden} x {inter})", rate, "GFLOP/s")
    for name, batches in eval_sets.items():
        tokens = sum(int(x.attention_mask.sum()) if x.attention_mask.dim() == 2 else int(x.input_ids.numel())
                     for x in batches)
        achieved = per_token * tokens / stats[name].median / 1e9
        report.add("evaluation", "decoder-layer rate", name, achieved, "GFLOP/s")
        report.add("evaluation", "decoder-layer rate / dense matmul rate", name, achieved / rate, "x")


def measure_methods(args: argparse.Namespace, report: Report, plain: LoadedModel, batch: Any) -> None:
    """Every ZO method on the same batch: its step (Q = 1, sequential, its own config and optimizer, on a copy of
    ``plain``) against 2 of its forwards, its noise pass and its draws of z per step."""
    for method in args.methods:
        measure_method(args, report, setup_for(args, method, plain=plain), batch, method)
        gc.collect()  # the method's model copy and optimizer go before the next is built


def measure_method(args: argparse.Namespace, report: Report, setup: Setup, batch: Any, method: str) -> None:
    model, opt = setup.model, setup.built.optimizer
    loss = functools.partial(batch_loss, model, batch, "causal")
    draws = noise_draws_per_step(opt, loss)
    params = [p for g in opt.param_groups for p in g["params"]]
    masks = opt.masks(params)
    runs = {
        "forwards": torch.no_grad()(lambda: [float(loss()) for _ in range(2)]),
        "step": lambda: float(opt.step(loss, n_queries=1)),
        # One pass as the step makes it (draw z for every trainable entry and add it): scale 0 leaves the weights.
        "noise pass": lambda: spsa.perturb_(params, 1, 0.0, masks, opt.noise, layout=opt._layout),
    }
    stats = timed(runs, batch.input_ids.device, args.repeats, args.warmup)
    setting = f"{method} ({setup.built.trainable_params:,} trainable), Q=1, sequential"
    report.add("methods", "ZO step per query", setting, stats["step"], "s")
    report.add("methods", "loss forward", setting, stats["forwards"].scaled(0.5), "s")
    report.add("methods", "ZO step / 2Q forwards", setting, stats["step"].over(stats["forwards"]), "x")
    report.add("methods", "noise pass (draw z, add it to the weights)", setting, stats["noise pass"], "s")
    report.add("methods", "draws of z per step", setting, float(draws), "passes")
    # What the step would cost if it were its forwards and its draws of z alone: the floor of this stream here.
    floor = [(f + draws * z) / f for f, z in zip(stats["forwards"].samples, stats["noise pass"].samples)]
    report.add("methods", "floor: (2Q forwards + draws x noise pass) / 2Q forwards", setting, Stats.of(floor), "x")


def noise_draws_per_step(opt: torch.optim.Optimizer, loss: Callable[[], Any], n_queries: int = 1) -> int:
    """How many times one step of ``n_queries`` draws z for the whole trainable set (a pass that regenerates it,
    or the one draw of a kept z), counted on a step of ``opt``."""
    count = [0]
    real_each, real_flat = spsa._each_draw, spsa._flat_directions

    def counted(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            count[0] += 1
            return real(*a, **k)
        return call

    spsa._each_draw, spsa._flat_directions = counted(real_each), counted(real_flat)
    try:
        float(opt.step(loss, n_queries=n_queries))
    finally:
        spsa._each_draw, spsa._flat_directions = real_each, real_flat
    return count[0]


def measure_scaling(args: argparse.Namespace, report: Report, setup: Setup) -> None:
    """AdaZeta's step (Q = 1, sequential) and its 2 forwards against batch size and prompt length (SST-2, RTE)."""
    model, device, tok = setup.model, setup.device, setup.tokenizer
    opt = zo_optimizer(args, setup, False, 1)
    for task in ("sst2", "rte"):
        pool = bench_items(args, setup.settings, tok, task, max(args.scaling_sizes))
        for size in args.scaling_sizes:
            items = pool[:size]
            batch = collate(items, "causal", tok.pad_token_id).to(device)
            loss = functools.partial(batch_loss, model, batch, "causal")
            runs = {"forwards": torch.no_grad()(lambda: [float(loss()) for _ in range(2)]),
                    "step": lambda: float(opt.step(loss, n_queries=1))}
            stats = timed(runs, device, min(args.repeats, 3), min(args.warmup, 1))
            tokens = sum(len(e.prompt) for e in items)
            setting = f"{task}, batch {size}, {tokens} prompt tokens"
            report.add("scaling", "AdaZeta ZO step (Q=1, sequential)", setting, stats["step"], "s")
            report.add("scaling", "AdaZeta step / 2 forwards", setting, stats["step"].over(stats["forwards"]), "x")


# --- memory (one subprocess per phase) ---------------------------------------------------------------------------


def _status_mb(field: str) -> float | None:
    kib = _status_kib(field)
    return None if kib is None else kib / 1024


def memory_phase(args: argparse.Namespace) -> dict[str, Any]:
    """Build everything, then reset the peak and run ``--memory-steps`` of one phase. Runs in its own process."""
    phase, _, chunk = args.phase.partition(":")
    if phase == "method":  # the method's own config and optimizer
        setup = setup_for(args, chunk)
    elif phase in ("adazeta", "adazeta_batched"):  # AdaZeta's optimizer, sequential or batched queries
        setup = setup_for(args, "adazeta", zo_variant(phase == "adazeta_batched", chunk_arg(chunk or "1")))
    elif phase == "first_order":  # AdamW on AdaZeta's TT adapters
        setup = setup_for(args, "tt_adapter")
    else:  # inference: a forward of AdaZeta's adapted model
        setup = setup_for(args, "adazeta")
    model, device, opt = setup.model, setup.device, setup.built.optimizer
    batch = collate(setup.items, "causal", setup.tokenizer.pad_token_id).to(device)
    closure = ReplicaClosure(model, functools.partial(replica_losses, model, batch, "causal"), batch)
    if phase == "inference":
        def run() -> None:
            with torch.inference_mode():
                float(batch_loss(model, batch, "causal"))
    elif phase in ("adazeta", "adazeta_batched"):
        run = lambda: float(opt.step(closure, n_queries=args.memory_queries))  # noqa: E731
    elif phase == "method":  # Q = 1, sequential
        run = lambda: float(opt.step(functools.partial(batch_loss, model, batch, "causal"), n_queries=1))  # noqa: E731
    else:
        run = lambda: float(first_order_step(model, opt, batch))  # noqa: E731
    gc.collect()
    if device.type == "cpu":
        try:  # hand the loader's freed heap back to the OS, so that it is not counted as the phase's memory
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
    baseline = _status_mb("VmRSS")
    if device.type == "cuda":
        sync(device)
        baseline = torch.cuda.memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        measure = "cuda_peak_allocated"
    else:
        measure = "rss_high_water_mark" if _reset_rss_peak() else "process_max_rss"
    for _ in range(args.memory_steps):
        run()
    sync(device)
    if measure == "cuda_peak_allocated":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    elif measure == "rss_high_water_mark":
        peak = _status_mb("VmHWM")
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    chosen = getattr(opt, "last_chunk", None)  # batched: the replicas per forward (auto's choice)
    return {"phase": args.phase, "peak_mb": peak, "baseline_mb": baseline, "measure": measure, "chunk": chosen}


def measure_memory(args: argparse.Namespace, report: Report) -> None:
    results = {}
    phases = ["inference", "adazeta", *(f"adazeta_batched:{c}" for c in args.chunks), "first_order",
              *(f"method:{m}" for m in args.methods)]
    for phase in phases:
        cmd = [sys.executable, "-m", "adazeta.tools.bench", *sys.argv[1:], "--phase", phase]
        print(f"memory: {phase} ...", file=sys.stderr, flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        if out.returncode != 0:
            sys.stderr.write(out.stderr[-3000:])
            raise SystemExit(f"bench: memory phase {phase} failed (exit {out.returncode})")
        results[phase] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["inference"]["peak_mb"]
    labels = {"inference": "inference forward", "adazeta": f"AdaZeta step, Q={args.memory_queries}, sequential",
              "first_order": "first-order step (AdamW, TT adapters)"}
    labels.update({f"adazeta_batched:{c}": f"AdaZeta step, Q={args.memory_queries}, batched (chunk {c})"
                   for c in args.chunks})
    labels.update({f"method:{m}": f"{m} step, Q=1, sequential" for m in args.methods})
    for phase, res in results.items():
        if phase == "adazeta_batched:auto":
            labels[phase] += f": {res['chunk']} per forward within query_memory {QUERY_MEMORY}"
            report.add("memory", "query_chunk=auto chose", labels[phase], res["chunk"], "replicas per forward")
        report.add("memory", "peak memory", labels[phase], res["peak_mb"], f"MB ({res['measure']})")
        report.add("memory", "peak memory / inference", labels[phase], res["peak_mb"] / base, "x")
        report.add("memory", "above the loaded model", labels[phase], res["peak_mb"] - res["baseline_mb"], "MB")


# --- output --------------------------------------------------------------------------------------------------


def markdown(report: Report) -> str:
    lines = ["| measurement | setting | median | min | max | unit |", "|---|---|---:|---:|---:|---|"]
    for r in report.rows:
        lines.append(f"| {r['measurement']} | {r['setting']} | {r['median']:.3g} | {r['min']:.3g} | {r['max']:.3g} "
                     f"| {r['unit']} |")
    return "\n".join(lines)


def verdicts(report: Report, args: argparse.Namespace) -> list[str]:
    """The speed targets (README, Speed) against the measured medians, with mins beside the per-query times."""
    out = []
    for q in args.queries:
        per_query = [r for r in report.rows
                     if r["measurement"] == "ZO step per query" and r["setting"].startswith(f"Q={q},")]
        modes = [f"{r['setting'].split(', ', 1)[1]} {r['median']:.2f} (min {r['min']:.2f})" for r in per_query]
        out.append(f"Q={q}, s/query: " + ", ".join(modes)
                   + f" (target <= {TARGETS['s_per_query']})")
    ratios = [r for r in report.rows if r["measurement"] == "ZO step / forwards of our model"]
    out.append("step / 2Q forwards: " + ", ".join(f"{r['setting'].split(';')[0]}: {r['median']:.3f}" for r in ratios)
               + f" (target <= {TARGETS['step_over_forwards']})")
    mem = [r for r in report.rows if r["measurement"] == "peak memory / inference" and "AdaZeta" in r["setting"]]
    out += [f"{r['setting']}: {r['median']:.3f} x inference memory (target <= {TARGETS['memory_over_inference']})"
            for r in mem]
    for r in report.rows:
        if r["measurement"] == "TT adapters' forward overhead":
            out.append(f"TT adapters' forward overhead, {r['setting'].split(';')[0]}: {100 * r['median']:+.1f} % "
                       f"(min {100 * r['min']:+.1f} %; target <= {100 * TARGETS['tt_overhead']:.0f} %)")
        if r["measurement"] == "TT adapters' forward overhead, unfolded products":
            out.append(f"(the same adapters' unfolded products, in the same rounds: {100 * r['median']:+.1f} %)")
        if r["measurement"] == "TT adapters' forward, folded / unfolded products":
            out.append(f"(adapted forward, folded / unfolded products, round by round: {r['median']:.3f})")
        if r["measurement"] in ("TT adapters alone / plain forward", "TT adapters in place / plain forward"):
            where = r["measurement"].split(" / ")[0]
            out.append(f"{where}: {100 * r['median']:.1f} % of the plain forward "
                       f"(min {100 * r['min']:.1f} %; target <= {100 * TARGETS['tt_overhead']:.0f} %)")
        if r["measurement"] == "evaluation speed-up":
            out.append(f"evaluation, batched / one at a time: {r['median']:.2f}x (target >= {TARGETS['eval_speedup']})")
        if r["section"] == "methods" and r["measurement"] == "ZO step / 2Q forwards":
            method = r["setting"].split(" ")[0]
            target = METHOD_TARGETS.get(method, METHOD_TARGETS["adapters"])[0]
            floor = next((f for f in report.rows if f["section"] == "methods" and f["setting"] == r["setting"]
                          and f["measurement"].startswith("floor")), None)
            bound = "" if floor is None else f"; its forwards and draws of z alone: {floor['median']:.3f}"
            out.append(f"{method}: step / 2Q forwards {r['median']:.3f} (min {r['min']:.3f}{bound}; target <= {target})")
        if r["measurement"] == "peak memory / inference" and r["setting"].endswith("step, Q=1, sequential"):
            method = r["setting"].split(" ")[0]
            target = METHOD_TARGETS.get(method, METHOD_TARGETS["adapters"])[1]
            out.append(f"{method}: peak memory {r['median']:.3f} x inference (target <= {target})")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The bench's options (``scripts/bench_gpu.sh`` passes these; a test parses its command lines)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="backbone dtype; adapters stay fp32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--weights", choices=("real", "random"), default="real",
                        help="random: a seeded random initialisation of the architecture (full vocabulary) and "
                             "synthetic prompts of SST-2 and RTE lengths: needs no model or data file")
    parser.add_argument("--methods", nargs="*", default=ZO_METHODS, choices=ZO_METHODS,
                        help="ZO methods compared on the same batch (step, forwards, memory); none: skip")
    parser.add_argument("--noise", choices=NOISE_STREAMS, default="per_tensor",
                        help="the ZO noise stream of every optimizer (method.optimizer.noise)")
    parser.add_argument("--scaling-sizes", type=int, nargs="*", default=[8, 16, 32],
                        help="batch sizes of the SST-2 / RTE scaling rows (none: skip)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's, one per core)")
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--chunks", type=chunk_arg, nargs="+", default=[4, 8, "auto"],
                        help="batched queries: loss evaluations per forward (one batched variant per value), or "
                             "auto: chosen per batch within --query-memory x the inference forward's memory")
    parser.add_argument("--query-memory", type=float, default=0.05, help="query_chunk=auto's memory budget")
    parser.add_argument("--only-memory", action="store_true", help="the memory phases alone (no timings)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median, min, max)")
    parser.add_argument("--overhead-pairs", type=int, default=11,
                        help="pairs of plain and adapted forwards behind the TT adapters' overhead")
    parser.add_argument("--overhead-long-pairs", type=int, default=5,
                        help="the same pairs on a batch of RTE prompts (longer; 0: skip)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--eval-examples", type=int, default=64)
    parser.add_argument("--eval-batch-size", type=int, default=32)
    parser.add_argument("--memory-queries", type=int, default=4)
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-reference", action="store_true", help="skip the reference computation's forward")
    parser.add_argument("--out", type=Path, default=Path("results", "bench"))
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # internal: one memory phase, e.g. adazeta_batched:4
    return parser


def main() -> None:
    args = build_parser().parse_args()
    global NOISE, QUERY_MEMORY
    NOISE, QUERY_MEMORY = args.noise, args.query_memory
    use_shared()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.phase:
        print(json.dumps(memory_phase(args)))
        return

    started, load_before = time.time(), os.getloadavg()
    report = Report()
    print(f"bench: {args.model} ({args.dtype}), batch {args.batch_size}, {args.repeats} repeats after "
          f"{args.warmup} warm-up; load average {load_before[0]:.2f} on {os.cpu_count()} CPUs", file=sys.stderr)
    info = {} if args.only_memory else measure_speed(args, report)
    if not args.skip_memory:
        measure_memory(args, report)
    load_after = os.getloadavg()

    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    name = f"{args.model}{'-random' if args.weights == 'random' and 'random' not in args.model else ''}" \
           f"-{device}-{args.dtype}{'' if args.noise == 'per_tensor' else '-' + args.noise}"
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()} for r in report.rows)
    table = markdown(report)
    checks = verdicts(report, args)
    busy = load_before[0] > 0.5 * (os.cpu_count() or 1) or load_after[0] > 0.5 * (os.cpu_count() or 1)
    note = (f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after, on {os.cpu_count()} CPUs "
            f"({cpu_name()})"
            + (": the machine was busy, so these timings are pessimistic" if busy and device == "cpu" else ""))
    (args.out / f"{name}.md").write_text(table + "\n\n" + "\n".join(f"- {c}" for c in checks) + f"\n- {note}\n")
    meta = {
        "model": args.model, "dtype": args.dtype, "device": device, "args": {k: str(v) for k, v in vars(args).items()},
        "batch": info, "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "cpu": cpu_name(),
        "cuda_device": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "load_average_before": load_before, "load_average_after": load_after, "wall_s": round(time.time() - started, 1),
        "git": git_state(), "packages": package_versions(), "rows": report.rows,
    }
    (args.out / f"{name}.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(table)
    print("\n" + "\n".join(checks) + f"\n{note}\nwrote {args.out / name}.csv/.md/.json in {meta['wall_s']} s")


if __name__ == "__main__":
    main()
