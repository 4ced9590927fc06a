"""Speed benchmark: forwards, ZO steps (sequential and batched queries), evaluation throughput, peak memory.

    make bench                                           # SmolLM2-135M, 16 real SST-2 prompts, CPU or GPU
    python scripts/bench.py --repeats 5 --queries 1 4 8 --chunks 4 8
    python scripts/bench.py --model llama-1b-random --dtype bf16     # a GPU: random ~1.1 B Llama, bf16 backbone

One run measures, on one batch of ``--batch-size`` real SST-2 training prompts (the project's loader and
template; offline when $ADAZETA_MODEL_DIR / $ADAZETA_DATA_DIR or ../shared hold the model and data, else the
Hub): the inference forward (the plain model, the model with AdaZeta's TT adapters, and the reference code's
computation: one sequence per candidate and a full-vocabulary log-softmax); the ZO step at each Q, with
sequential and batched queries, per query and against 2Q of our own forwards; evaluation examples per second,
batched against one example at a time; a first-order (AdamW) step on the adapters; and the peak memory of
inference, of an AdaZeta step (sequential and batched) and of a first-order step, each measured in a fresh
subprocess (a process's peak resident memory only grows). Times are medians of ``--repeats`` runs after
``--warmup`` runs, with min and max; CUDA work is synchronised before every clock read, and memory is the
CUDA peak allocated on a GPU, the resident-set high-water mark of the measured phase on a CPU.

Writes ``results/bench/<model>-<device>-<dtype>.csv`` (one row per measurement), a ``.md`` table and a
``.json`` with the rows and provenance (versions, commit, threads, load average before and after: other
processes on the machine slow every number down, and the load average says how much to distrust them).
"""

from __future__ import annotations

import argparse
import copy
import csv
import ctypes
import dataclasses
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from adazeta.adapters import ADAPTERS  # noqa: E402
from adazeta.evaluate import evaluate  # noqa: E402
from adazeta.models import count_parameters, load_model  # noqa: E402
from adazeta.optim import OPTIMIZERS  # noqa: E402
from adazeta.optim.batched import ReplicaClosure  # noqa: E402
from adazeta.results import git_state, package_versions  # noqa: E402
from adazeta.scoring import Encoded, batch_loss, batches, collate, encode, replica_losses  # noqa: E402
from adazeta.tracking import sync  # noqa: E402

# name -> the model config the run composes (llama-1b-random borrows SmolLM2's tokenizer; tiny-llama: smoke tests).
MODELS = {"smollm2-135m": "smollm2-135m", "llama-1b-random": "smollm2-135m", "tiny-llama": "tiny-llama"}
# A TinyLlama-1.1B-shaped decoder with SmolLM2's vocabulary (so the same prompts tokenise the same way).
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False)
COLUMNS = ["section", "measurement", "setting", "median", "min", "max", "unit", "runs"]
TARGETS = {"s_per_query": 2.0, "step_over_forwards": 1.03, "memory_over_inference": 1.05}


# --- setup ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    model: torch.nn.Module
    tokenizer: Any
    device: torch.device
    settings: Any  # adazeta.run.Settings of method=adazeta on the task
    items: list[Encoded]  # the benchmark batch
    dev_items: list[Encoded]  # evaluation examples


def offline_env() -> None:
    """Use ../shared for the model and data when the user has not pointed elsewhere (as `make` does)."""
    for var, sub in (("ADAZETA_MODEL_DIR", "models"), ("ADAZETA_DATA_DIR", "data")):
        if not os.environ.get(var) and (SHARED / sub).is_dir():
            os.environ[var] = str(SHARED / sub)


def build(args: argparse.Namespace, adapters: bool = True) -> Setup:
    """Model (+ TT adapters), tokenizer and the benchmark batch, through the project's own config and loaders."""
    from hydra import compose, initialize_config_dir

    from adazeta.run import parse, seed_everything
    from adazeta.tasks.loaders import load_task

    overrides = [
        f"model={MODELS[args.model]}", "task=sst2", "method=adazeta",
        f"model.dtype={args.dtype}", f"model.device={args.device}",
        f"data.num_train={max(args.batch_size, 64)}", f"data.num_dev={args.eval_examples}", "data.num_eval=8",
        "wandb.mode=disabled",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        s = parse(compose(config_name="config", overrides=overrides))
    seed_everything(s.seed)
    if args.model == "llama-1b-random":
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

        from adazeta.models import resolve_device, resolve_source

        source, device = resolve_source(s.model), resolve_device(s.model.device)
        gguf = {"gguf_file": source.gguf_file} if source.gguf_file else {}
        tok = AutoTokenizer.from_pretrained(source.path, **gguf)
        tok.pad_token = tok.pad_token or tok.eos_token
        config = LlamaConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, **LLAMA_1B)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=s.model.torch_dtype)
        model.eval().requires_grad_(False)
        # SmolLM2's reference TT shapes are for hidden 576: derive balanced ones for this width.
        s.adapter.config = dataclasses.replace(s.adapter.config, shape_down=None, shape_up=None)
    else:
        loaded = load_model(s.model, seed=s.seed)
        model, tok, device = loaded.model, loaded.tokenizer, loaded.device
    if adapters:
        model = ADAPTERS.get(s.adapter.kind).builder(model, s.adapter.config)
    data = load_task(s.task, s.data, "causal", s.seed, None)
    items = encode(data.train[: args.batch_size], tok, "causal", s.model.max_length)
    dev_items = encode(data.dev[: args.eval_examples], tok, "causal", s.model.max_length)
    return Setup(model, tok, device, s, items, dev_items)


def zo_optimizer(setup: Setup, batched: bool, chunk: int, n_queries: int) -> torch.optim.Optimizer:
    named = [(n, p) for n, p in setup.model.named_parameters() if p.requires_grad]
    cfg = dataclasses.replace(setup.settings.optimizer.config, batched_queries=batched, query_chunk=chunk)
    opt = OPTIMIZERS.get(setup.settings.optimizer.kind).builder(named, cfg, setup.settings.seed)
    opt.n_queries = n_queries
    return opt


def first_order_optimizer(setup: Setup) -> torch.optim.Optimizer:
    entry = OPTIMIZERS.get("adamw")
    named = [(n, p) for n, p in setup.model.named_parameters() if p.requires_grad]
    return entry.builder(named, entry.config_cls(), setup.settings.seed)


def first_order_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    model.train()
    opt.zero_grad(set_to_none=True)
    loss = batch_loss(model, batch, "causal")
    loss.backward()
    opt.step()
    model.eval()
    return loss.detach()


def reference_style_loss(model: torch.nn.Module, items: list[Encoded], pad_id: int, device: torch.device) -> Any:
    """The reference code's computation: each (prompt, candidate) its own row; log-softmax over the full
    vocabulary at every position; then the candidates' tokens are read. Same loss, more work."""
    rows, reads = [], []
    for i, ex in enumerate(items):
        for j, cand in enumerate(ex.candidates):
            reads.append([(len(rows), len(ex.prompt) + k - 1, tok, i, j) for k, tok in enumerate(cand)])
            rows.append(ex.prompt + cand)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, : len(row)], mask[r, : len(row)] = torch.tensor(row), 1
    logp = F.log_softmax(model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float(), dim=-1)
    scores = torch.full((len(items), max(len(e.candidates) for e in items)), float("-inf"), device=device)
    for cand in reads:
        scores[cand[0][3], cand[0][4]] = torch.stack([logp[r, t, tok] for r, t, tok, _, _ in cand]).mean()
    return F.cross_entropy(scores, torch.tensor([e.gold for e in items], device=device))


# --- timing --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Stats:
    median: float
    min: float
    max: float
    runs: int

    def scaled(self, factor: float) -> "Stats":
        return Stats(self.median * factor, self.min * factor, self.max * factor, self.runs)


def timed(fns: dict[str, Callable[[], Any]], device: torch.device, repeats: int, warmup: int) -> dict[str, Stats]:
    """Wall-clock seconds of each ``fn()``: ``warmup`` untimed rounds, then median, min and max of ``repeats``.

    Round-robin (each round runs every fn once), so that load from other processes, which drifts during a
    benchmark, weighs on the compared variants alike.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            sync(device)  # queued CUDA work belongs to this run
            times[name].append(time.perf_counter() - start)
    return {name: Stats(statistics.median(t), min(t), max(t), repeats) for name, t in times.items()}


class Report:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, section: str, measurement: str, setting: str, stats: Stats | float, unit: str) -> None:
        if not isinstance(stats, Stats):
            stats = Stats(stats, stats, stats, 1)
        self.rows.append(dict(section=section, measurement=measurement, setting=setting, median=stats.median,
                              min=stats.min, max=stats.max, unit=unit, runs=stats.runs))
        print(f"  {measurement:<44} {setting:<26} {stats.median:10.4g} {unit}  "
              f"[{stats.min:.4g} .. {stats.max:.4g}], n={stats.runs}", file=sys.stderr, flush=True)

    def get(self, measurement: str, setting: str = "") -> dict[str, Any]:
        return next(r for r in self.rows if r["measurement"] == measurement and r["setting"] == setting)


def measure_speed(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    """All timings, in this process: forwards (plain, adapted, reference), ZO steps, first-order, evaluation."""
    setup = build(args, adapters=False)
    model, device, tok = setup.model, setup.device, setup.tokenizer
    batch = collate(setup.items, "causal", tok.pad_token_id).to(device)
    rows_batch = collate(setup.items, "causal", tok.pad_token_id, layout="rows").to(device)
    info = {
        "prompt_tokens": [len(e.prompt) for e in setup.items],
        "packed_rows_x_width": list(batch.input_ids.shape),
        "rows_layout_rows_x_width": list(rows_batch.input_ids.shape),
        "reference_layout_sequences": sum(len(e.candidates) for e in setup.items),
    }
    print(f"batch: {len(setup.items)} prompts, {sum(info['prompt_tokens'])} tokens (mean "
          f"{statistics.mean(info['prompt_tokens']):.1f}, max {max(info['prompt_tokens'])}); packed "
          f"{info['packed_rows_x_width']}, rows layout {info['rows_layout_rows_x_width']}", file=sys.stderr)
    r, w = args.repeats, args.warmup
    # The adapted model is a copy, so that plain and adapted forwards can be timed side by side.
    adapter = ADAPTERS.get(setup.settings.adapter.kind)
    adapted_model = adapter.builder(copy.deepcopy(model), setup.settings.adapter.config)
    info["trainable_params"] = count_parameters(adapted_model)[1]
    forwards = {
        "plain, packed": lambda: batch_loss(model, batch, "causal"),
        "plain, rows layout": lambda: batch_loss(model, rows_batch, "causal"),
        "TT adapters, packed": lambda: batch_loss(adapted_model, batch, "causal"),
    }
    if not args.skip_reference:
        forwards["plain, reference computation"] = functools.partial(
            reference_style_loss, model, setup.items, tok.pad_token_id, device)
    with torch.inference_mode():
        fwd = timed(forwards, device, r, w)
    for name, stats in fwd.items():
        report.add("forward", "inference forward", name, stats, "s")
    overhead = fwd["TT adapters, packed"].median / fwd["plain, packed"].median - 1
    report.add("forward", "TT adapters' forward overhead", "adapted / plain - 1 (medians)", overhead, "x")
    del model
    model = setup.model = adapted_model

    closure = ReplicaClosure(model, functools.partial(replica_losses, model, batch, "causal"))
    for q in args.queries:
        opts = {"sequential": zo_optimizer(setup, False, 1, q)}
        n_forwards = 2 * q if opts["sequential"].estimator == "central" else q + 1
        for chunk in args.chunks:  # chunks at or above the step's loss evaluations all run the same forwards
            opts[f"batched (chunk {chunk})"] = zo_optimizer(setup, True, chunk, q)
        runs = {"forward": torch.no_grad()(lambda: float(closure()))}  # as the step runs it: no autograd
        runs.update({f"Q={q}, {m}": functools.partial(lambda o: float(o.step(closure)), o) for m, o in opts.items()})
        stats = timed(runs, device, r, w)
        forward = stats.pop("forward")  # our loss forward, timed in the same rounds as the steps
        report.add("zo_step", "loss forward (TT adapters)", f"Q={q} rounds", forward, "s")
        for mode in stats:
            step = stats[mode]
            report.add("zo_step", "ZO step", mode, step, "s")
            report.add("zo_step", "ZO step per query", mode, step.scaled(1 / q), "s")
            report.add("zo_step", "ZO step / forwards of our model", f"{mode}; {n_forwards} forwards",
                       step.scaled(1 / (n_forwards * forward.median)), "x")

    fo = first_order_optimizer(setup)
    stats = timed({"fo": lambda: float(first_order_step(model, fo, batch))}, device, r, w)["fo"]
    report.add("first_order", "first-order step (AdamW, TT adapters)", "packed", stats, "s")

    n = len(setup.dev_items)
    eval_sets = {
        f"batched ({args.eval_batch_size} per forward)":
            [b.to(device) for b in batches(setup.dev_items, args.eval_batch_size, "causal", tok, sort=True)],
        "one example at a time": [collate([e], "causal", tok.pad_token_id).to(device) for e in setup.dev_items],
    }
    evals = {k: functools.partial(evaluate, model, v, "causal") for k, v in eval_sets.items()}
    stats = timed(evals, device, r, min(w, 1))
    for name, t in stats.items():
        report.add("evaluation", "evaluation throughput", name, Stats(n / t.median, n / t.max, n / t.min, t.runs),
                   "examples/s")
    return info


# --- memory (one subprocess per phase) ---------------------------------------------------------------------------


def _status_mb(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_rss_peak() -> bool:
    """Reset the resident-memory high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def memory_phase(args: argparse.Namespace) -> dict[str, Any]:
    """Build everything, then reset the peak and run ``--memory-steps`` of one phase. Runs in its own process."""
    setup = build(args)
    model, device = setup.model, setup.device
    batch = collate(setup.items, "causal", setup.tokenizer.pad_token_id).to(device)
    closure = ReplicaClosure(model, functools.partial(replica_losses, model, batch, "causal"))
    phase, _, chunk = args.phase.partition(":")
    if phase == "inference":
        def run() -> None:
            with torch.inference_mode():
                float(batch_loss(model, batch, "causal"))
    elif phase in ("adazeta", "adazeta_batched"):
        opt = zo_optimizer(setup, phase == "adazeta_batched", int(chunk or 1), args.memory_queries)
        run = lambda: float(opt.step(closure))  # noqa: E731
    else:
        fo = first_order_optimizer(setup)
        run = lambda: float(first_order_step(model, fo, batch))  # noqa: E731
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
        measure = "rss_high_water_mark" if _reset_rss_peak() else "process_max_rss"
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
    return {"phase": args.phase, "peak_mb": peak, "baseline_mb": baseline, "measure": measure}


def measure_memory(args: argparse.Namespace, report: Report) -> None:
    results = {}
    phases = ["inference", "adazeta", *(f"adazeta_batched:{c}" for c in args.chunks), "first_order"]
    for phase in phases:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--phase", phase]
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
    for phase, res in results.items():
        report.add("memory", "peak memory", labels[phase], res["peak_mb"], f"MB ({res['measure']})")
        report.add("memory", "peak memory / inference", labels[phase], res["peak_mb"] / base, "x")
        report.add("memory", "above the loaded model", labels[phase], res["peak_mb"] - res["baseline_mb"], "MB")


# --- output --------------------------------------------------------------------------------------------------


def markdown(report: Report) -> str:
    lines = ["| measurement | setting | median | min | max | unit |", "|---|---|---:|---:|---:|---|"]
    for r in report.rows:
        lines.append(f"| {r['measurement']} | {r['setting']} | {r['median']:.3g} | {r['min']:.3g} | {r['max']:.3g} "
                     f"| {r['unit']} |")
    return "\n".join(lines)


def verdicts(report: Report, args: argparse.Namespace) -> list[str]:
    """The speed targets (README, Speed) against the measured medians, with mins beside the per-query times."""
    out = []
    for q in args.queries:
        per_query = [r for r in report.rows
                     if r["measurement"] == "ZO step per query" and r["setting"].startswith(f"Q={q},")]
        modes = [f"{r['setting'].split(', ', 1)[1]} {r['median']:.2f} (min {r['min']:.2f})" for r in per_query]
        out.append(f"Q={q}, s/query: " + ", ".join(modes)
                   + f" (target <= {TARGETS['s_per_query']})")
    ratios = [r for r in report.rows if r["measurement"] == "ZO step / forwards of our model"]
    out.append("step / 2Q forwards: " + ", ".join(f"{r['setting'].split(';')[0]}: {r['median']:.3f}" for r in ratios)
               + f" (target <= {TARGETS['step_over_forwards']})")
    mem = [r for r in report.rows if r["measurement"] == "peak memory / inference" and "AdaZeta" in r["setting"]]
    out += [f"{r['setting']}: {r['median']:.3f} x inference memory (target <= {TARGETS['memory_over_inference']})"
            for r in mem]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="backbone dtype; adapters stay fp32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's, one per core)")
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 8],
                        help="batched queries: loss evaluations per forward (one batched variant per value)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median, min, max)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--eval-examples", type=int, default=64)
    parser.add_argument("--eval-batch-size", type=int, default=32)
    parser.add_argument("--memory-queries", type=int, default=4)
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-reference", action="store_true", help="skip the reference computation's forward")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench")
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # internal: one memory phase, e.g. adazeta_batched:4
    args = parser.parse_args()
    offline_env()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.phase:
        print(json.dumps(memory_phase(args)))
        return

    started, load_before = time.time(), os.getloadavg()
    report = Report()
    print(f"bench: {args.model} ({args.dtype}), batch {args.batch_size}, {args.repeats} repeats after "
          f"{args.warmup} warm-up; load average {load_before[0]:.2f} on {os.cpu_count()} CPUs", file=sys.stderr)
    info = measure_speed(args, report)
    if not args.skip_memory:
        measure_memory(args, report)
    load_after = os.getloadavg()

    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    name = f"{args.model}-{device}-{args.dtype}"
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()} for r in report.rows)
    table = markdown(report)
    checks = verdicts(report, args)
    busy = load_before[0] > 0.5 * (os.cpu_count() or 1) or load_after[0] > 0.5 * (os.cpu_count() or 1)
    note = (f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after, on {os.cpu_count()} CPUs"
            + (": the machine was busy, so these timings are pessimistic" if busy and device == "cpu" else ""))
    (args.out / f"{name}.md").write_text(table + "\n\n" + "\n".join(f"- {c}" for c in checks) + f"\n- {note}\n")
    meta = {
        "model": args.model, "dtype": args.dtype, "device": device, "args": {k: str(v) for k, v in vars(args).items()},
        "batch": info, "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "cuda_device": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "load_average_before": load_before, "load_average_after": load_after, "wall_s": round(time.time() - started, 1),
        "git": git_state(), "packages": package_versions(), "rows": report.rows,
    }
    (args.out / f"{name}.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(table)
    print("\n" + "\n".join(checks) + f"\n{note}\nwrote {args.out / name}.csv/.md/.json in {meta['wall_s']} s")


if __name__ == "__main__":
    main()
