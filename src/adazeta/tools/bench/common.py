"""What the bench's sections share: the options as ``adazeta-run`` settings, the runner's wiring of a method's model
and optimizer on the benchmark batch (``adazeta.build.build``), random weights and synthetic prompts, and the timing
rounds and the report every measurement lands in.

The noise stream and ``query_chunk=auto``'s memory budget come from the parsed options (``--noise``,
``--query-memory``), read where they are used: nothing here is set at run time.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from adazeta.models import LoadedModel, ModelSource, architecture_config, load_model, resolve_device
from adazeta.build import Built, build, build_optimizer, compose_settings, seed_everything
from adazeta.scoring import Encoded, Scorer
from adazeta.settings import Settings
from adazeta.tasks.loaders import TaskData, load_task
from adazeta.tracking import quiet_third_party, sync

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
ZO_METHODS = ["mezo", "sparse_mezo", "mezo_lora", "mezo_adapter", "adazeta"]


def chunk_arg(value: str) -> int | str:
    """``--chunks`` values: an int >= 1, or auto (chosen per batch from --query-memory)."""
    if value == "auto":
        return value
    chunk = int(value)
    if chunk < 1:
        raise argparse.ArgumentTypeError(f"chunk {value} must be >= 1 or auto")
    return chunk


# --- setup: the runner's wiring (adazeta.build.build) ----------------------------------------------------------


@dataclasses.dataclass
class Setup:
    built: Built  # adazeta.build.build's pieces: the model with the method's adapter, its optimizer, the task data
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

    @property
    def scorer(self) -> Scorer:
        """How the method's model scores the batch: the run's scorer (``Built.scorer``), the task's objective in it."""
        return self.built.scorer


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
        out.append(f"++method.optimizer.noise={args.noise}")
    return [*out, *extra]


def settings_for(args: argparse.Namespace, method: str = "adazeta", task: str = "sst2", extra: Sequence[str] = ()
                 ) -> Settings:
    """The settings ``adazeta-run`` runs for :func:`overrides`."""
    return compose_settings(overrides(args, method, task, extra))


def zo_variant(args: argparse.Namespace, batched: bool, chunk: int | str) -> list[str]:
    """The overrides of an AdaZeta optimizer the benchmark times: sequential or batched queries, and the chunk
    (``auto`` within ``--query-memory``)."""
    return [f"method.optimizer.batched_queries={'true' if batched else 'false'}",
            f"method.optimizer.query_chunk={chunk}", f"method.optimizer.query_memory={args.query_memory}"]


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


def bench_items(args: argparse.Namespace, s: Settings, scorer: Scorer, task: str, n: int) -> list[Encoded]:
    """``n`` training examples of ``task`` (the scaling rows' prompts) encoded by ``scorer``: the project's loader
    and template, or synthetic (random weights). The task data alone: a build would load another model."""
    if random_weights(args):
        return synthetic_items(task, n, s.seed, VOCAB)
    if task != s.task.name:
        s = settings_for(args, "adazeta", task)
    data = load_task(s.bound_task(), s.data, s.seed)
    return scorer.encode(data.train[:n], s.model.max_length)


def setup_for(args: argparse.Namespace, method: str = "adazeta", extra: Sequence[str] = (),
              plain: LoadedModel | None = None) -> Setup:
    """``method``'s model, optimizer and the benchmark batch, wired by ``adazeta.build.build`` from the settings the
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
    return build_optimizer(settings_for(args, "adazeta", extra=zo_variant(args, batched, chunk)), setup.built.named)


def first_order_optimizer(args: argparse.Namespace, setup: Setup) -> torch.optim.Optimizer:
    """AdamW over ``setup``'s TT adapters, as method tt_adapter (AdaZeta's trainable set, first-order) sets it."""
    return build_optimizer(settings_for(args, "tt_adapter"), setup.built.named)


def first_order_step(scorer: Scorer, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    """``adazeta.train.first_order_step`` with one micro-batch, on a batch collated once beforehand: the ZO steps
    are timed on the same fixed batch, so neither timing includes collation (the loop's step collates its items)."""
    model = scorer.model
    model.train()
    opt.zero_grad(set_to_none=True)
    loss = scorer.loss(batch)
    loss.backward()
    opt.step()
    model.eval()
    return loss.detach()


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


def timed(fns: dict[Any, Callable[[], Any]], device: torch.device, repeats: int, warmup: int) -> dict[Any, Stats]:
    """Wall-clock seconds of each ``fn()``: ``warmup`` untimed rounds, then median, min and max of ``repeats``.

    Round-robin (each round runs every fn once), so that load from other processes, which drifts during a
    benchmark, weighs on the compared variants alike.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(device)
    times: dict[Any, list[float]] = {name: [] for name in fns}
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
