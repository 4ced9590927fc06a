"""The training steps (sections ``zo_step`` and ``first_order``): AdaZeta's ZO step at each Q, with sequential and
batched queries (one variant per ``--chunks`` value), per query and against the step's own number of loss forwards
timed in the same rounds; and a first-order (AdamW) step on the same TT adapters."""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch

from adazeta.optim.batched import ReplicaClosure
from adazeta.tools.bench.common import Report, Setup, first_order_optimizer, first_order_step, timed, zo_optimizer


def measure_zo_steps(args: argparse.Namespace, report: Report, setup: Setup, batch: Any) -> None:
    """AdaZeta's step on ``batch`` at each Q of ``--queries``, sequential and batched, against its forwards."""
    scorer, device = setup.scorer, setup.device
    r, w = args.repeats, args.warmup
    closure = ReplicaClosure(scorer.model, functools.partial(scorer.replica_losses, batch), batch)
    for q in args.queries:
        opts = {"sequential": zo_optimizer(args, setup, False, 1)}
        n_forwards = opts["sequential"].estimator.forwards(q)  # the estimator's own declaration
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


def measure_first_order(args: argparse.Namespace, report: Report, setup: Setup, batch: Any) -> None:
    """A first-order step (AdamW, method tt_adapter's optimizer) on ``setup``'s TT adapters."""
    r, w = args.repeats, args.warmup
    fo = first_order_optimizer(args, setup)
    stats = timed({"fo": lambda: float(first_order_step(setup.scorer, fo, batch))}, setup.device, r, w)["fo"]
    report.add("first_order", "first-order step (AdamW, TT adapters)", "packed", stats, "s")
