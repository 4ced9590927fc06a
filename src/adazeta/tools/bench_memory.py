"""Peak memory of one training step per method, on the same model and the same batch.

    python -m adazeta.tools.bench_memory                       # SmolLM2-135M, 16 SST-2 prompts, twenty rows
    python -m adazeta.tools.bench_memory --methods inference adazeta --steps 3 --set model.dtype=bf16

Each method runs in a fresh subprocess, because a process's peak resident memory can only grow: a shared
process would report the largest method for all. In each subprocess the model, adapter, optimizer and batch
are built first, as a run wires them (``adazeta.build.build``); then the memory high-water mark is reset and
``--steps`` steps run (a forward for ``inference``, a ZO-SGD step for ZO methods, an AdamW step for first-order
ones). A row named ``<method>_gc`` (``lora_gc``, ``tt_adapter_gc``) is that first-order method with
``train.gradient_checkpointing=true``: backprop that recomputes each layer's activations instead of keeping them,
the memory-matched first-order baseline beside the ZO rows. A row named ``<method>+<optimizer>``
(``adazeta+zo_adam``, ...) is the method trained by another optimizer option: one row per ZO optimizer of the
field, on TT adapters, with its forwards per step and seconds per forward beside its memory. Reported:
- on the CPU, the peak resident set size during the steps (``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``), so that the transient of loading and dequantizing the model does not hide the
  step's own peak; the whole-process peak (``ru_maxrss``, what a run records) is reported beside it;
- on a GPU, the CUDA peak allocated during the steps.
Beside each measurement, the dry run's estimate of the same step (``adazeta.dryrun.memory_parts``, at the batch's
length): ``step_mem_mb``, the peak's growth over the loaded model, against ``estimate_step_mb``, the estimate less
its weights (``estimate_mb``: all of it; a CPU's peak also holds the Python runtime, about 500 MiB). The ratios
to inference are left blank when ``--methods`` has no ``inference`` row.
Writes ``results/bench/memory.csv`` under the current directory (one row per method) and ``memory.json`` (the
rows plus provenance).
Offline when $ADAZETA_MODEL_DIR / $ADAZETA_DATA_DIR (or ../shared) hold the model and data; else the Hub.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from adazeta.tools.offline import use_shared

# The field's ZO optimizers on AdaZeta's TT adapters, a row each (``adazeta+<optimizer>``).
OPTIMIZER_ROWS = [f"adazeta+{kind}" for kind in (
    "zo_sign", "zo_momentum", "zo_adam", "zo_cons", "es", "forward_grad", "hizoo", "lozo", "zo_muon")]
METHODS = [
    "inference", "ft", "lora", "lora_gc", "tt_adapter", "tt_adapter_gc", "mezo", "sparse_mezo", "mezo_lora",
    "mezo_adapter", "adazeta", *OPTIMIZER_ROWS,
]
CHECKPOINTED = "_gc"  # a row name's suffix: its method with activation checkpointing
WITH_OPTIMIZER = "+"  # ``<method>+<optimizer>``: the method with another optimizer option
COLUMNS = [
    "method", "trainable_params", "peak_mem_mb", "ratio", "process_peak_mem_mb", "process_ratio", "step_s",
    "forwards_per_step", "s_per_forward", "device", "measure", "step_mem_mb", "estimate_step_mb", "estimate_mb",
]


def status_kib(field: str) -> int | None:
    """A ``/proc/self/status`` field (VmRSS, VmHWM) in KiB; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_rss_peak() -> bool:
    """Reset the process's resident-memory high-water mark to its current RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _release_free_heap() -> None:
    """Hand freed heap back to the OS (glibc), so loading leftovers do not count as the steps' memory."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def row_overrides(row: str) -> list[str]:
    """The ``adazeta-run`` overrides that choose a row's method: ``inference`` is zero-shot's forward,
    ``<method>_gc`` the method with activation checkpointing, ``<method>+<optimizer>`` the method trained by
    another optimizer option (``conf/optimizer/``)."""
    if row == "inference":
        return ["method=zero_shot"]
    if WITH_OPTIMIZER in row:
        method, kind = row.split(WITH_OPTIMIZER, 1)
        return [f"method={method}", f"optimizer@method.optimizer={kind}"]
    if row.endswith(CHECKPOINTED):
        return [f"method={row.removesuffix(CHECKPOINTED)}", "train.gradient_checkpointing=true"]
    return [f"method={row}"]


def _start_peak(device: Any) -> tuple[str, float, float]:
    """Reset the peak this row reads: (how it is measured, the process's RSS in MB, the measure's start in MB)."""
    import torch

    _release_free_heap()
    rss_start = (status_kib("VmRSS") or 0) / 1024
    measure = "cuda_peak_allocated" if device.type == "cuda" else ("rss_hwm" if reset_rss_peak() else "ru_maxrss")
    start_mb = rss_start
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start_mb = torch.cuda.memory_allocated(device) / 2**20
    return measure, rss_start, start_mb


def _peak(measure: str, device: Any) -> tuple[float, float]:
    """(the peak in MB by ``measure`` since ``_start_peak``, the process's lifetime peak RSS in MB)."""
    import torch

    process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    if measure == "cuda_peak_allocated":
        return torch.cuda.max_memory_allocated(device) / 2**20, process_peak
    if measure == "rss_hwm":
        return status_kib("VmHWM") / 1024, process_peak
    return process_peak, process_peak


def worker(method: str, args: argparse.Namespace) -> dict:
    """Build one row's model, optimizer and batch (``adazeta.build.build``); measure ``args.steps`` steps. Runs in
    its own process."""
    import functools

    import torch

    from adazeta.optim import zeroth_order
    from adazeta.optim.batched import ReplicaClosure
    from adazeta.build import build, compose_settings, preflight, seed_everything
    from adazeta.dryrun import memory_parts
    from adazeta.train import first_order_step

    overrides = [
        f"model={args.model}",
        f"task={args.task}",
        *row_overrides(method),
        f"train.batch_size={args.batch_size}",
        f"data.num_train={args.batch_size}",
        "data.num_dev=8",
        "data.num_eval=8",
        "wandb.mode=disabled",
        *args.set,
    ]
    s = compose_settings(overrides)
    preflight(s)  # as a run checks its settings: a `_gc` row of a ZO or training-free method is refused
    seed_everything(s.seed)
    built = build(s)  # model + adapter, task data, optimizer: as a run wires them
    optimizer, device, scorer = built.optimizer, built.device, built.scorer
    trainable = built.trainable_params
    items = built.enc["train"][: args.batch_size]
    batch = scorer.collate(items)
    zo = zeroth_order(optimizer)
    weights = list(scorer.model.parameters())
    estimate = memory_parts(s, sum(p.numel() for p in weights), [tuple(p.shape) for p in weights if p.requires_grad],
                            seq_len=int(batch.input_ids.shape[1]), largest_weight=max(p.numel() for p in weights))
    del built, weights

    # The training loop's closure: a ZO optimizer may evaluate weight replicas or run a jvp through the model.
    closure = ReplicaClosure(scorer.model, functools.partial(scorer.replica_losses, batch), batch)

    def step() -> None:
        if optimizer is None:
            with torch.inference_mode():
                float(scorer.loss(batch))
        elif zo:
            float(optimizer.step(closure))
        else:
            float(first_order_step(scorer, optimizer, items))

    measure, rss_start, start_mb = _start_peak(device)
    forwards_before = getattr(optimizer, "forward_passes", 0)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = (time.perf_counter() - start) / args.steps
    # forwards a step: the ZO optimizer's count; a first-order step or an inference: one forward (plus a backward)
    forwards = (optimizer.forward_passes - forwards_before) / args.steps if zo else 1
    peak, process_peak = _peak(measure, device)
    return {
        "method": method,
        "trainable_params": trainable,
        "peak_mem_mb": round(peak, 1),
        "process_peak_mem_mb": round(process_peak, 1),
        "rss_start_mb": round(rss_start, 1),
        "step_s": round(elapsed, 3),
        "forwards_per_step": round(forwards, 2),
        "s_per_forward": round(elapsed / forwards, 4),
        "device": device.type,
        "measure": measure,
        # beside the measurement, the dry run's estimate of the same step (at this batch's length): the step's
        # growth over the loaded model against the estimate less its weights; the whole against the estimate
        "step_mem_mb": round(peak - start_mb, 1),
        "estimate_step_mb": round((sum(estimate.values()) - estimate["weights"]) / 2**20, 1),
        "estimate_mb": round(sum(estimate.values()) / 2**20, 1),
        "estimate_parts_mb": {k: round(v / 2**20, 1) for k, v in estimate.items()},
    }


def run_all(args: argparse.Namespace) -> list[dict]:
    env = use_shared(dict(os.environ))
    rows = []
    for method in args.methods:
        cmd = [sys.executable, "-m", "adazeta.tools.bench_memory", "--worker", method, *sys.argv[1:]]
        print(f"measuring {method} ...", file=sys.stderr, flush=True)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            sys.stderr.write(out.stderr[-3000:])
            raise SystemExit(f"bench_memory: {method} failed (exit {out.returncode})")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = next((r for r in rows if r["method"] == "inference"), None)
    for r in rows:
        r["ratio"] = round(r["peak_mem_mb"] / base["peak_mem_mb"], 2) if base else None
        r["process_ratio"] = round(r["process_peak_mem_mb"] / base["process_peak_mem_mb"], 2) if base else None
    return rows


def _ratio(value: float | None) -> str:
    """A ratio to the inference row, blank when the run measured none."""
    return "" if value is None else f"{value:.2f}"


def table(rows: list[dict]) -> str:
    """A Markdown table: the rows the README shows, the dry run's estimates beside the measurements."""
    head = (
        "| method | trainable params | peak memory (MiB) | x inference | whole-process peak (MiB) | x inference "
        "| step's growth (MiB) | estimated (MiB) | s / step | forwards / step | s / forward |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['trainable_params']:,} | {r['peak_mem_mb']:,.0f} | {_ratio(r['ratio'])} | "
            f"{r['process_peak_mem_mb']:,.0f} | {_ratio(r['process_ratio'])} | {r['step_mem_mb']:,.0f} | "
            f"{r['estimate_step_mb']:,.0f} | {r['step_s']:.2f} | {r.get('forwards_per_step', '')} | "
            f"{r.get('s_per_forward', '')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=METHODS,
                        help="method configs; 'inference' = a forward only; '<method>_gc' = the method with "
                             "train.gradient_checkpointing=true; '<method>+<optimizer>' = the method trained by "
                             "another optimizer option (adazeta+zo_adam)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="sst2")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2, help="steps measured (AdamW allocates its state in step 1)")
    parser.add_argument("--set", nargs="*", default=[], help="extra Hydra overrides, e.g. model.dtype=bf16")
    parser.add_argument("--out", type=Path, default=Path("results", "bench", "memory.csv"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return

    rows = run_all(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)  # written before the table is printed: nothing is lost
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: r.get(k) for k in COLUMNS} for r in rows)
    from adazeta.runs.results import git_state, package_versions

    provenance = {
        "model": args.model, "task": args.task, "batch_size": args.batch_size, "steps": args.steps,
        "overrides": args.set, "git": git_state(), "packages": package_versions(), "cpu_count": os.cpu_count(),
    }
    args.out.with_suffix(".json").write_text(json.dumps({"rows": rows, **provenance}, indent=2) + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}", file=sys.stderr)
    print(table(rows))


if __name__ == "__main__":
    main()
