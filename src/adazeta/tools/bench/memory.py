"""Peak memory (section ``memory``): inference, AdaZeta's steps (sequential, batched at each chunk), a first-order
step and every method's step, each phase in a fresh ``python -m adazeta.tools.bench --phase`` process (a process's
peak resident memory only grows)."""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import os
import subprocess
import sys
from typing import Any

import torch

from adazeta.optim.batched import ReplicaClosure
from adazeta.tools.bench.common import Report, chunk_arg, first_order_step, setup_for, zo_variant
from adazeta.tools.bench_memory import reset_rss_peak, status_kib
from adazeta.tracking import sync


def _status_mb(field: str) -> float | None:
    kib = status_kib(field)
    return None if kib is None else kib / 1024


def memory_phase(args: argparse.Namespace) -> dict[str, Any]:
    """Build everything, then reset the peak and run ``--memory-steps`` of one phase. Runs in its own process."""
    phase, _, chunk = args.phase.partition(":")
    if phase == "method":  # the method's own config and optimizer
        setup = setup_for(args, chunk)
    elif phase in ("adazeta", "adazeta_batched"):  # AdaZeta's optimizer, sequential or batched queries
        setup = setup_for(args, "adazeta", zo_variant(args, phase == "adazeta_batched", chunk_arg(chunk or "1")))
    elif phase == "first_order":  # AdamW on AdaZeta's TT adapters
        setup = setup_for(args, "tt_adapter")
    else:  # inference: a forward of AdaZeta's adapted model
        setup = setup_for(args, "adazeta")
    scorer, device, opt = setup.scorer, setup.device, setup.built.optimizer
    batch = scorer.collate(setup.items)
    closure = ReplicaClosure(scorer.model, functools.partial(scorer.replica_losses, batch), batch)
    if phase == "inference":
        def run() -> None:
            with torch.inference_mode():
                float(scorer.loss(batch))
    elif phase in ("adazeta", "adazeta_batched"):
        run = lambda: float(opt.step(closure, n_queries=args.memory_queries))  # noqa: E731
    elif phase == "method":  # Q = 1, sequential
        run = lambda: float(opt.step(functools.partial(scorer.loss, batch), n_queries=1))  # noqa: E731
    else:
        run = lambda: float(first_order_step(scorer, opt, batch))  # noqa: E731
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
        measure = "rss_high_water_mark" if reset_rss_peak() else "process_max_rss"
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
            labels[phase] += f": {res['chunk']} per forward within query_memory {args.query_memory}"
            report.add("memory", "query_chunk=auto chose", labels[phase], res["chunk"], "replicas per forward")
        report.add("memory", "peak memory", labels[phase], res["peak_mb"], f"MB ({res['measure']})")
        report.add("memory", "peak memory / inference", labels[phase], res["peak_mb"] / base, "x")
        report.add("memory", "above the loaded model", labels[phase], res["peak_mb"] - res["baseline_mb"], "MB")
