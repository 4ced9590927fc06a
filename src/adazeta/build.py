"""The wiring of a run, apart from its lifecycle: settings -> preflight -> model + adapter -> task data -> scorer
with the task's objective -> optimizer + query schedule -> run length.

``build`` is what a run trains (``adazeta.run``), what the dry run counts (its adapters attach the same way,
``attach_adapter``) and what every tool (benches, diagnostics) measures, so that no tool wires a model, a scorer or
an optimizer of its own. The run's lifecycle (claim, skip, resume, checkpoint, record) stays in ``adazeta.run``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from torch import nn

import adazeta.adapters  # noqa: F401  (registers the built-in adapters)
import adazeta.optim  # noqa: F401  (registers the built-in optimizers)
from adazeta.adapters import ADAPTERS
from adazeta import distributed, precision
from adazeta.scoring.calibration import content_free_examples
from adazeta.errors import ConfigError
from adazeta.tasks.demonstrations import add_demonstrations_, add_per_example_demonstrations_, with_demonstrations
from adazeta.models import (
    LoadedModel,
    count_parameters,
    device_map_of,
    enable_gradient_checkpointing_,
    load_model,
    resolve_device,
    resolve_source,
)
from adazeta.optim import OPTIMIZERS, check_contract, zeroth_order
from adazeta.optim.batched import replica_sites
from adazeta.paths import config_dir
from adazeta.schedules import SCHEDULES, Schedule, budget_steps, mean_queries
from adazeta.scoring import Encoded, Scorer, packing_supported
from adazeta.settings import Settings, parse, unused_keys
from adazeta.tasks.family import family as as_family
from adazeta.tasks.loaders import TaskData, check_data, load_task, split_rows, validate_local_rows
from adazeta.tasks.objectives import build_objective
from adazeta.tracking import check_wandb, quiet_third_party
from adazeta.train import RunLength, steps_per_epoch

log = logging.getLogger("adazeta")


def compose_config(overrides: list[str]) -> DictConfig:
    """The config ``adazeta-run <overrides>`` would compose (for a tool that runs a real run: ``adazeta.run.run``)."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def compose_settings(overrides: list[str]) -> Settings:
    """The settings ``adazeta-run <overrides>`` would run, for the tools that use the runner's wiring."""
    return parse(compose_config(overrides))


def train_use(s: Settings) -> str | None:
    """What the method takes from the train split, or None: zero-shot uses it only for dev, and runs without it."""
    if s.demonstrations is not None:
        return "for its demonstrations"
    if s.probe is not None:
        return "to fit its probe"
    if s.optimizer is not None:
        return "to train"
    return None


def preflight(s: Settings) -> None:
    """Checks that need no model: adapter shapes against the architecture, local model and data files."""
    hidden = s.model.hidden_size
    if hidden:
        s.adapter.config.check_hidden(hidden)
    s.adapter.config.check_ready()
    where = distributed.launch_env()
    if where is None or where[0] == 0:  # rank 0 alone logs to wandb
        check_wandb(s.wandb)
    precision.check(s.model, s.adapter.config.trains_backbone, s.method)
    why = unused_keys(s).get("train.gradient_checkpointing")
    if why is not None:  # from a config file: a command line setting it is refused earlier (adazeta.overrides)
        raise ConfigError(f"train.gradient_checkpointing=true: {why}")
    if s.model.device_map is not None:
        if s.optimizer is not None and not s.optimizer.config.zeroth_order:
            raise ConfigError(
                f"model.device_map={s.model.device_map} spreads the model for forward-only methods (ZO, zero-shot, "
                f"ICL, LP); method {s.method!r} trains with backward: unset model.device_map (several GPUs: torchrun)"
            )
        if distributed.launch_env() is not None:
            raise ConfigError(
                f"model.device_map={s.model.device_map} with several processes: each process would spread the model "
                "over every GPU; use one process with model.device_map, or torchrun without it"
            )
    if s.optimizer is not None and distributed.launch_env() is not None \
            and s.distributed.mode not in s.optimizer.config.parallel_modes:
        ways = ", ".join(s.optimizer.config.parallel_modes) or "none: it runs on one process"
        raise ConfigError(
            f"optimizer {s.optimizer.kind!r} cannot spread its work over processes with distributed.mode="
            f"{s.distributed.mode} (modes it supports: {ways}); launch one process or choose another mode"
        )
    if s.task.f1_objective and s.optimizer is not None and s.optimizer.config.zeroth_order \
            and not s.optimizer.config.derivative_free:  # first-order methods are refused by the loop's own check
        raise ConfigError(f"task.f1_objective=true scores generated answers, which have no derivative: optimizer "
                          f"{s.optimizer.kind!r} differentiates the loss (its forward-mode estimator: "
                          "method.optimizer.estimator=forward_grad cannot train on it); use a finite-difference "
                          "estimator (method.optimizer.estimator=central)")
    if s.dry_run:
        return
    resolve_device(s.model.device)  # model.device=cuda on a machine without one: stop before any data is read
    resolve_source(s.model)
    use = train_use(s)
    needed_by = None if use is None else f"method {s.method!r} needs the train split {use}"
    task = s.bound_task()  # refuses a task without the model family's prompt format
    check_data(task, s.data, needed_by)
    validate_local_rows(task, s.data, use is not None)
    if s.optimizer is None and s.adapter.config.trains:
        raise ConfigError(f"method {s.method!r} trains an adapter but has no optimizer; set method.optimizer")
    if not s.adapter.config.replicable and s.optimizer and s.optimizer.config.batches_queries:
        raise ConfigError(
            f"method {s.method!r}: method.optimizer.batched_queries=true needs an adapter method (tt, lora, "
            f"bottleneck), not adapter.kind=full; set method.optimizer.batched_queries=false"
        )



@dataclass
class Built:
    """A run's pieces, wired from its settings: what ``execute`` trains and what the tools (benchmarks) use."""

    loaded: LoadedModel
    model: nn.Module  # the backbone with the method's adapter; only the trainable set requires grad
    data: TaskData
    enc: dict[str, list[Encoded]]  # train, dev, eval
    named: list[tuple[str, torch.Tensor]]  # the trainable parameters
    optimizer: torch.optim.Optimizer | None
    schedule: Schedule
    total_params: int
    trainable_params: int
    length: RunLength  # steps per epoch, step limit, forward budget, the schedule's E: decided once
    scorer: Scorer  # how examples are scored with the adapted model, with the task's objective as a field
    demonstrations: float | None = None  # ICL: mean number of demonstrations per test prompt
    content_free: list[Encoded] | None = None  # contextual calibration's content-free prompts

    @property
    def schedule_epochs(self) -> float | None:
        """E the schedule was built for, when a forward-pass budget decided it (else None)."""
        return self.length.schedule_epochs if self.length.budget_steps is not None else None

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    @property
    def family(self) -> str:
        return self.loaded.family

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    def record_fields(self, s: Settings, d: distributed.Dist = distributed.SINGLE) -> dict[str, Any]:
        """What was built, as the run record's fields (``adazeta.runs.record.RunRecord``): sizes, sources, truncation, the
        scoring layout, the ZO estimator and mean Q, the processes and devices."""
        zo = zeroth_order(self.optimizer)
        fields: dict[str, Any] = {
            "total_params": self.total_params,
            "trainable_params": self.trainable_params,
            "num_train": len(self.data.train), "num_dev": len(self.data.dev), "num_eval": len(self.data.eval),
            "data_source": self.data.source,
            "model_source": dataclasses.asdict(self.loaded.source),
            "truncated": {split: sum(e.truncated for e in items) for split, items in self.enc.items()},
            "scoring_layout": "packed" if as_family(self.family).packs and packing_supported(self.model) else "rows",
            **distributed.describe(d, s.distributed.mode, zo),  # world_size, parallel, backend
        }
        if self.demonstrations is not None:
            fields["demonstrations"] = self.demonstrations
        if self.schedule_epochs is not None:
            fields["schedule_epochs"] = self.schedule_epochs
        if zo:
            fields["mean_queries"] = mean_queries(self.schedule, self.length.steps_per_epoch, self.length.planned_steps)
            fields["zo"] = {k: getattr(s.optimizer.config, k)  # a ZOSGDConfig's, as the settings chose them
                            for k in ("estimator", "batched_queries", "query_chunk")}
        if s.model.device_map:  # which devices accelerate spread the model over
            fields["devices"] = sorted(set(device_map_of(self.loaded.model).values())) or [str(self.device)]
        return fields



def build(s: Settings, loaded: LoadedModel | None = None, data: TaskData | None = None) -> Built:
    """Model + adapter -> task data -> optimizer + query schedule, as every run wires them.

    A run passes the settings alone. ``loaded`` and ``data`` stand in for the model and the task data the settings
    name, for the speed benchmark's random models with a real tokenizer's full vocabulary and its synthetic
    prompts (``adazeta.bench``, ``--weights random``), which need no file.
    """
    quiet_third_party(s.verbose)
    if loaded is None:
        loaded = load_model(s.model, seed=s.seed)
    if s.model.dtype != "fp32" and s.adapter.config.trains_backbone and s.optimizer and s.optimizer.config.zeroth_order:
        log.warning("ZO perturbations of %s weights lose precision; prefer model.dtype=fp32", s.model.dtype)
    model = attach_adapter(s, loaded.model)
    if s.train.gradient_checkpointing:  # first-order methods only (preflight)
        enable_gradient_checkpointing_(model)
    total, trainable = count_parameters(model)  # before int8 weights turn frozen parameters into buffers
    log.info("model %s from %s on %s: %s parameters, %s trainable (%s)", s.model.name, loaded.source.kind,
             loaded.device, f"{total:,}", f"{trainable:,}", s.adapter.kind)
    if loaded.device.type == "cpu":
        log.info(precision.cpu_line(s.model.dtype))
    tok = loaded.tokenizer
    # The task for the model's family, bound once, with the mask token a masked template holds.
    task = s.bound_task().with_mask(getattr(tok, "mask_token", None))
    scorer = Scorer.of(model, tok, loaded.family, loaded.device)  # encodes now; the objective joins it below
    if done := precision.apply_(model, s.model, scorer.parts()[0]):  # the backbone the scorer calls
        log.info("backbone: %s", ", ".join(f"{k}={v}" for k, v in done.items()))
    if data is None:
        data = load_task(task, s.data, s.seed, train_use(s) is not None)
    content_free = None
    if s.calibration == "contextual":  # the template around content-free inputs, with ICL's demonstrations too
        content_free = content_free_examples(task)
        if s.demonstrations is not None:
            content_free = with_demonstrations(content_free, data, s.demonstrations, tok, task, s.model.max_length,
                                               s.seed)
        content_free = scorer.encode(content_free, s.model.max_length)
    demonstrations = None
    if s.demonstrations is not None and s.demonstrations.protocol == "per_example":  # MeZO's icl.sh
        rows = split_rows(task, "train", s.data)
        demonstrations = add_per_example_demonstrations_(
            data, s.demonstrations, len(rows), lambda i: task.render((row := rows.take([i])[0]), row.get("label", 0)),
            task)
    elif s.demonstrations is not None:  # ICL: the mean number of demonstrations that fit a test prompt
        demonstrations = add_demonstrations_(data, s.demonstrations, tok, task, s.model.max_length, s.seed)
    enc = {split: scorer.encode(getattr(data, split), s.model.max_length) for split in ("train", "dev", "eval")}
    for split, items in enc.items():  # cut by the encoding, never refused
        if n := sum(e.truncated for e in items):
            log.warning("%s: %d of %d examples were truncated to fit model.max_length=%d (or the task's "
                        "reference limits)", split, n, len(items), s.model.max_length)
    objective = build_objective(s.task, data, enc, tok, s.model.max_length, s.train.eval_batch_size)
    objective = dataclasses.replace(objective, token_weighted=s.train.lm_reduction == "token")
    scorer = dataclasses.replace(scorer, objective=objective)  # one scorer, the task's objective in it
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = build_optimizer(s, named)
    if zeroth_order(optimizer) and s.optimizer.config.batches_queries:  # every trainable parameter must sit in a
        replica_sites(model, [p for _, p in named])                     # module that runs replicas
    length = run_length(s, len(data.train))
    schedule = SCHEDULES.get(s.schedule.kind).builder(s.schedule.config, length.schedule_epochs)
    log.info("task %s: %d train / %d dev / %d test examples from %s", s.task.name, len(data.train),
             len(data.dev), len(data.eval), data.source)
    return Built(loaded, model, data, enc, named, optimizer, schedule, total, trainable, length, scorer,
                 demonstrations, content_free)


def attach_adapter(s: Settings, backbone: nn.Module) -> nn.Module:
    """The method's adapter on ``backbone`` (a loaded model, or the dry run's model on the meta device): only the
    method's trainable set requires grad afterwards."""
    return ADAPTERS.get(s.adapter.kind).builder(backbone, s.adapter.config)


def build_optimizer(s: Settings, named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer | None:
    """The method's optimizer over ``named`` (the trainable parameters); None for a method that trains nothing."""
    if s.optimizer is None:
        return None
    if not named:
        raise ConfigError(f"method {s.method!r} has an optimizer but nothing to train")
    built = OPTIMIZERS.get(s.optimizer.kind).builder(named, s.optimizer.config, s.seed)
    return check_contract(s.optimizer.kind, built, s.optimizer.config)


def run_length(s: Settings, num_train: int) -> RunLength:
    """How long the run is: steps per epoch, step limit, forward budget and the epochs E of the query schedule.

    E is ``max_steps`` in epochs (as the reference code counts E) unless ``train.max_forward_passes`` ends the
    run first: then the reference schedule's exponent is derived from the epochs the budget actually reaches, so
    that its last epoch, not an epoch the run never sees, gets Q = q_target.
    """
    loop = steps_per_epoch(num_train, s.train.batch_size)
    budget = s.train.max_forward_passes
    length = functools.partial(RunLength, loop, s.train.max_steps, budget)
    if num_train == 0:  # a training-free run without a train split: the schedule is never asked
        return length(0.0)
    per_epoch = num_train / s.train.batch_size
    epochs = s.train.max_steps / per_epoch
    zo = s.optimizer is not None and s.optimizer.config.zeroth_order
    if budget is None or not zo or not s.schedule.config.uses_run_epochs:
        return length(epochs)
    steps = budget_steps(
        lambda e: SCHEDULES.get(s.schedule.kind).builder(s.schedule.config, e),
        loop,
        per_epoch,
        budget,
        forwards=s.optimizer.config.forwards,  # the optimizer's declaration: 2Q central, Q + 1 one-sided, ...
        max_steps=s.train.max_steps,
    )
    return length(steps / per_epoch, steps)


def seed_everything(seed: int) -> None:
    """Seed once, at entry. Below this, randomness comes from local generators derived from the seed."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


