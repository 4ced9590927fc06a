"""Scaling benchmark: ZO queries per second on 1 and N processes, and the all-reduce's share of a step.

    make bench BENCH=dist                                       # SmolLM2-135M, AdaZeta, Q = 8, 1 and 2 processes
    python -m adazeta.tools.bench_dist --procs 1 2 --queries 8 --steps 3 method=mezo_lora
    python -m adazeta.tools.bench_dist --procs 1 2 model=tiny-llama task=rte data.dir=...   # any adazeta-run overrides

Each process count is one ``torchrun --standalone --nproc_per_node N`` of this module (one thread per process
unless ``--threads``), which builds the run as ``adazeta-run`` would (``adazeta.build.build``), takes one training
minibatch, and times ``--steps`` ZO steps at ``--queries`` queries after one warm-up step. Reported per process
count: step time (median), queries per second, the speed-up over one process, and two communication figures:
``allreduce_s``, the time a step spends in its all-reduce *including the wait for the slowest rank* (load
imbalance shows here), and ``allreduce_alone_s``, the same all-reduce of 3Q floats timed alone after a barrier
(the communication itself). Writes ``<out>/dist.json`` and ``<out>/dist.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

DEFAULT_OVERRIDES = ["method=adazeta", "schedule=constant", "task=sst2", "wandb.mode=disabled"]


def worker(queries: int, steps: int, out: Path, overrides: list[str]) -> None:
    """One process of the benchmark: build, warm up, time ``steps`` steps, time the all-reduce alone."""
    import torch.distributed as dist

    from adazeta import distributed
    from adazeta.optim import zeroth_order
    from adazeta.optim.batched import ReplicaClosure
    from adazeta.build import build, compose_settings, seed_everything

    s = compose_settings(overrides)
    d = distributed.init(s.distributed)
    seed_everything(s.seed)
    b = build(s)
    if not zeroth_order(b.optimizer):
        raise SystemExit(f"bench_dist measures ZO steps; method {s.method!r} is first-order")
    spread = distributed.Spread(d.rank, d.world_size, s.distributed.mode) if d.enabled else None
    items = b.enc["train"][: s.train.batch_size]
    scorer = b.scorer
    comm = b.optimizer.comm_s  # the optimizer times its own all-reduce, one entry a step

    def one_step() -> float:
        plan = spread.plan(queries, len(items)) if spread else None
        mine = plan.items(items) if plan else items
        batch = scorer.collate(mine)
        closure = ReplicaClosure(b.model, lambda r: scorer.replica_losses(batch, r))
        if d.enabled:
            dist.barrier()
        start = time.perf_counter()
        loss = b.optimizer.step(closure, n_queries=queries, plan=plan) if plan else b.optimizer.step(
            closure, n_queries=queries)
        float(loss)
        return time.perf_counter() - start

    one_step()  # warm-up
    comm.clear()
    times = [one_step() for _ in range(steps)]
    alone = []
    if d.enabled:
        vector = torch.zeros(3 * queries, device=b.device)
        for _ in range(50):
            dist.barrier()
            start = time.perf_counter()
            distributed.all_sum_(vector)
            alone.append(time.perf_counter() - start)
    row = {
        "rank": d.rank, "world_size": d.world_size, "step_s": times, "allreduce_s": comm,
        "allreduce_alone_s": alone, "queries": queries, "threads": torch.get_num_threads(),
        "mode": spread.describe(queries) if spread else "one process", "method": s.method, "model": s.model.name,
        "batch_size": len(items), "device": str(b.device),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"world{d.world_size}-rank{d.rank}.json").write_text(json.dumps(row))
    if d.enabled:
        # Every rank has written its figures, so past this barrier the process ends at once: a rank has aborted
        # in CI (SIGABRT, no Python error) where only the gloo group's teardown was likely left to run.
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def launch(nproc: int, threads: int, queries: int, steps: int, out: Path, overrides: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONFAULTHANDLER": "1"}  # a rank's abort shows its stack
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "adazeta.tools.bench_dist", "--worker", "--queries", str(queries), "--steps", str(steps),
           "--out", str(out), *overrides]
    subprocess.run(cmd, env=env, check=True)


def summarise(out: Path, procs: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in procs:
        ranks = [json.loads((out / f"world{n}-rank{r}.json").read_text()) for r in range(n)]
        step = statistics.median(max(times) for times in zip(*(r["step_s"] for r in ranks)))  # the slowest rank
        comm = statistics.median(ranks[0]["allreduce_s"]) if ranks[0]["allreduce_s"] else 0.0
        alone = statistics.median(ranks[0]["allreduce_alone_s"]) if ranks[0]["allreduce_alone_s"] else 0.0
        q = ranks[0]["queries"]
        rows.append({"processes": n, "mode": ranks[0]["mode"], "step_s": round(step, 4),
                     "queries_per_s": round(q / step, 3), "allreduce_s": round(comm, 6),
                     "allreduce_share": round(comm / step, 5), "allreduce_alone_s": round(alone, 6),
                     "allreduce_alone_share": round(alone / step, 6), "queries": q,
                     "method": ranks[0]["method"], "model": ranks[0]["model"], "batch_size": ranks[0]["batch_size"],
                     "threads_per_process": ranks[0]["threads"], "device": ranks[0]["device"]})
    base = rows[0]["queries_per_s"]
    for row in rows:
        row["speedup"] = round(row["queries_per_s"] / base, 3)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| processes | split | step (s) | queries/s | speed-up | all-reduce in step (s, share) | "
             "all-reduce alone (s, share) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['processes']} | {r['mode']} | {r['step_s']:.3f} | {r['queries_per_s']:.2f} | "
                     f"{r['speedup']:.2f}x | {r['allreduce_s']:.4f} ({100 * r['allreduce_share']:.2f} %) | "
                     f"{r['allreduce_alone_s']:.6f} ({100 * r['allreduce_alone_share']:.3f} %) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--threads", type=int, default=1, help="threads per process")
    parser.add_argument("--out", type=Path, default=Path("results/bench/dist"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    overrides = [*DEFAULT_OVERRIDES, *overrides]  # later overrides win
    if args.worker:
        worker(args.queries, args.steps, args.out, overrides)
        return
    if args.procs[0] != 1:
        parser.error("--procs must start with 1: the speed-up is against one process")
    load_before = os.getloadavg()
    for n in args.procs:
        launch(n, args.threads, args.queries, args.steps, args.out, overrides)
    rows = summarise(args.out, args.procs)
    meta = {"overrides": overrides, "load_before": load_before, "load_after": os.getloadavg(),
            "cpus": os.cpu_count(), "torch": torch.__version__}
    (args.out / "dist.json").write_text(json.dumps({"rows": rows, "meta": meta}, indent=2) + "\n")
    text = (f"{table(rows)}\n\n{rows[0]['method']} on {rows[0]['model']}, Q = {args.queries}, batch "
            f"{rows[0]['batch_size']}, {args.threads} thread(s) per process, {rows[0]['device']}; median of "
            f"{args.steps} steps after one warm-up; load average before/after {load_before[0]:.2f}/"
            f"{meta['load_after'][0]:.2f}.\n")
    (args.out / "dist.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
