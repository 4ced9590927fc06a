"""Every ZO method on the same batch (section ``methods``): its step (Q = 1, sequential, its own config and optimizer)
against 2 of its own forwards, its noise pass, its draws of z per step, and the floor those put under a step."""

from __future__ import annotations

import argparse
import functools
import gc
from typing import Any, Callable

import torch

from adazeta.models import LoadedModel
from adazeta.optim import spsa
from adazeta.tools.bench.common import Report, Setup, Stats, setup_for, timed


def measure_methods(args: argparse.Namespace, report: Report, plain: LoadedModel, batch: Any) -> None:
    """Every ZO method on the same batch: its step (Q = 1, sequential, its own config and optimizer, on a copy of
    ``plain``) against 2 of its forwards, its noise pass and its draws of z per step."""
    for method in args.methods:
        measure_method(args, report, setup_for(args, method, plain=plain), batch, method)
        gc.collect()  # the method's model copy and optimizer go before the next is built


def measure_method(args: argparse.Namespace, report: Report, setup: Setup, batch: Any, method: str) -> None:
    opt = setup.built.optimizer
    loss = functools.partial(setup.scorer.loss, batch)
    draws = noise_draws_per_step(opt, loss)
    params = [p for g in opt.param_groups for p in g["params"]]
    masks = opt.masks(params)
    runs = {
        "forwards": torch.no_grad()(lambda: [float(loss()) for _ in range(2)]),
        "step": lambda: float(opt.step(loss, n_queries=1)),
        # One pass as the step makes it (draw z for every trainable entry and add it): scale 0 leaves the weights.
        "noise pass": lambda: spsa.perturb_(params, 1, 0.0, masks, opt.noise, layout=opt.layout),
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
    before = spsa.draws()
    float(opt.step(loss, n_queries=n_queries))
    return spsa.draws() - before
