"""AdaZeta's step against batch size and prompt length (section ``scaling``): SST-2 and RTE prompts at each
``--scaling-sizes`` batch size, the step (Q = 1, sequential) and its 2 forwards."""

from __future__ import annotations

import argparse
import functools

import torch

from adazeta.tools.bench.common import Report, Setup, bench_items, timed, zo_optimizer


def measure_scaling(args: argparse.Namespace, report: Report, setup: Setup) -> None:
    """AdaZeta's step (Q = 1, sequential) and its 2 forwards against batch size and prompt length (SST-2, RTE)."""
    scorer, device = setup.scorer, setup.device
    opt = zo_optimizer(args, setup, False, 1)
    for task in ("sst2", "rte"):
        pool = bench_items(args, setup.settings, scorer, task, max(args.scaling_sizes))
        for size in args.scaling_sizes:
            items = pool[:size]
            batch = scorer.collate(items)
            loss = functools.partial(scorer.loss, batch)
            runs = {"forwards": torch.no_grad()(lambda: [float(loss()) for _ in range(2)]),
                    "step": lambda: float(opt.step(loss, n_queries=1))}
            stats = timed(runs, device, min(args.repeats, 3), min(args.warmup, 1))
            tokens = sum(len(e.prompt) for e in items)
            setting = f"{task}, batch {size}, {tokens} prompt tokens"
            report.add("scaling", "AdaZeta ZO step (Q=1, sequential)", setting, stats["step"], "s")
            report.add("scaling", "AdaZeta step / 2 forwards", setting, stats["step"].over(stats["forwards"]), "x")
