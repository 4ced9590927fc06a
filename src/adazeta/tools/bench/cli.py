"""The bench's options and command: the sections in the order they run, then the .csv, .md and .json."""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from adazeta.optim.spsa import NOISE_STREAMS
from adazeta.runs.results import cpu_name, git_state, package_versions
from adazeta.build import seed_everything
from adazeta.scoring import Scorer
from adazeta.tools import bench as package
from adazeta.tools.bench.common import MODELS, ZO_METHODS, Report, backbone, chunk_arg, settings_for, setup_for
from adazeta.tools.bench.evaluation import measure_evaluation
from adazeta.tools.bench.forwards import measure_forwards
from adazeta.tools.bench.memory import measure_memory, memory_phase
from adazeta.tools.bench.methods import measure_methods
from adazeta.precision import COMPILE_BACKENDS
from adazeta.tools.bench.options import FIDELITY_METHODS, measure_options, unknown_options
from adazeta.tools.bench.output import COLUMNS, markdown, verdicts
from adazeta.tools.bench.scaling import measure_scaling
from adazeta.tools.bench.steps import measure_first_order, measure_zo_steps
from adazeta.tools.offline import use_shared


def measure_speed(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    """All timings, in this process: forwards (plain, adapted, reference), every method, ZO steps, scaling,
    first-order, evaluation, in this order."""
    s = settings_for(args)
    seed_everything(s.seed)
    plain = backbone(args, s)
    # AdaZeta's model is a copy, so that plain and adapted forwards can be timed side by side.
    setup = setup_for(args, plain=plain)
    batch = setup.scorer.collate(setup.items)
    plain_scorer = Scorer.of(plain.model, plain.tokenizer, plain.family, plain.device)
    info = measure_forwards(args, report, setup, plain_scorer, batch)
    measure_methods(args, report, plain, batch)
    del plain, plain_scorer  # the plain backbone goes before the steps: from here on, the adapted model alone
    measure_zo_steps(args, report, setup, batch)
    if args.scaling_sizes:
        measure_scaling(args, report, setup)
    measure_first_order(args, report, setup, batch)
    measure_evaluation(args, report, setup)
    return info


def build_parser() -> argparse.ArgumentParser:
    """The bench's options (``scripts/bench_gpu.sh`` passes these; a test parses its command lines)."""
    parser = argparse.ArgumentParser(prog="python -m adazeta.tools.bench",
                                     description=package.__doc__.split("\n\n")[0])
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
    parser.add_argument("--options", action="store_true",
                        help="the backbone's speed options side by side (bf16, fp16, adapters in the backbone's "
                             "dtype, bf16 or int8 linears, compile): times as ratios to fp32, roofline, memory, fidelity")
    parser.add_argument("--only-options", nargs="+", metavar="NAME",
                        help="with --options: these options alone, by the names it prints (fp32, the reference of "
                             "every ratio, is always measured)")
    parser.add_argument("--fidelity-methods", nargs="+", choices=FIDELITY_METHODS, default=["adazeta", "mezo_lora"],
                        help="with --options: the adapter methods whose ZO estimate fidelity measures, each on its "
                             "own adapters (timings are AdaZeta's)")
    parser.add_argument("--compile-backend", choices=COMPILE_BACKENDS, default="inductor",
                        help="the torch.compile backend --options measures")
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
    parser = build_parser()
    args = parser.parse_args()
    if problem := unknown_options(args):
        parser.error(problem)
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
    summary: list[str] = []
    if args.options:
        info, summary = {}, measure_options(args, report)
    else:
        info = {} if args.only_memory else measure_speed(args, report)
    if not args.skip_memory and not args.options:
        measure_memory(args, report)
    load_after = os.getloadavg()

    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    name = f"{args.model}{'-random' if args.weights == 'random' and 'random' not in args.model else ''}" \
           f"-{device}-{'options' if args.options else args.dtype}{'' if args.noise == 'per_tensor' else '-' + args.noise}"
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()} for r in report.rows)
    table = markdown(report)
    checks = summary or verdicts(report, args)
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
