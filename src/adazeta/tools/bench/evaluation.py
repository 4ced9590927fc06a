"""Evaluation throughput (section ``evaluation``): examples per second, batched against one example at a time, on
the adapted model; and how close each layout runs to this device's dense-matmul rate, which bounds the speed-up."""

from __future__ import annotations

import argparse
import functools

import torch

from adazeta.scoring.evaluate import evaluate
from adazeta.tools.bench.common import Report, Setup, Stats, timed


def measure_evaluation(args: argparse.Namespace, report: Report, setup: Setup) -> None:
    """Evaluation of ``setup``'s dev examples, batched (``--eval-batch-size`` per forward) and one at a time."""
    scorer, model, device = setup.scorer, setup.model, setup.device
    r, w = args.repeats, args.warmup
    n = len(setup.dev_items)
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
