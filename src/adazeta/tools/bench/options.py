"""The backbone's speed options side by side (``--options``): fp32 and each option of the model config, on the
machine the bench runs on, with AdaZeta's adapters on one SST-2 batch.

Per option: the loss forward, the ZO step at Q = 1 (sequential) and Q = 4 (batched, chunk 4), evaluation
throughput, each as a ratio to fp32 measured in the same run, every option's runs in one round-robin; the model's
resident bytes (parameters and buffers); the roofline (the decoder's rate in FLOP/s over its linear layers, as a
share of a dense matmul's rate in the same dtype); and fidelity, per method of ``--fidelity-methods`` on its own
adapters (AdaZeta's TT adapters and MeZO-LoRA's by default: at B = 0 a +-eps pair's loss difference is small, so
rounding weighs most there): the ZO estimate's cosine with the fp32 autograd gradient at Q = 1, 4, 16, the share
of projected gradients whose sign agrees with fp32's on the same directions, their error against the exact
directional derivatives of fp32's gradient, and the cosine of the Q = 16 estimate with the one those exact
derivatives give (``measure_fidelity``); and the realised-update guard's reading of a Q = 1 step (the share of the
trainable entries the update changed, cos(applied, intended)). An option whose Q = 16 estimate is more than 5 %
less faithful than fp32's by that last cosine, for any of the methods, is flagged as measurably worse, one whose
weights took less than half of an update as losing updates to rounding.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from typing import Any

import torch
import torch.nn.functional as F

from adazeta.tools.fidelity import (autograd_gradient, cosine, directional_derivatives, estimate_cosine,
                                   estimate_vector, projected_gradients)
from adazeta.optim.batched import ReplicaClosure
from adazeta.guards import GuardConfig, UpdateProbe
from adazeta.precision import BF16_FEATURES, QUANTIZED, cpu_flags
from adazeta.runs.results import cpu_name
from adazeta.tools.bench.common import Report, Setup, Stats, setup_for, timed, zo_optimizer

FIDELITY_QUERIES = (1, 4, 16)
# Methods whose estimate fidelity measures, on their own adapters: AdaZeta's TT adapters from the identity, and
# MeZO-LoRA's, whose B = 0 start leaves a +-eps pair's loss difference small, where rounding weighs most.
FIDELITY_METHODS = ("adazeta", "mezo_lora", "mezo_adapter")
WORSE = 0.05  # a cosine this much below fp32's (relative) is measurably worse


def options(compile_backend: str) -> dict[str, list[str]]:
    """Option name -> the model overrides it sets (fp32 first: the reference of every ratio)."""
    return {
        "fp32": ["model.dtype=fp32"],
        "bf16": ["model.dtype=bf16"],
        "bf16, adapters bf16": ["model.dtype=bf16", "model.adapter_dtype=backbone"],
        "fp16": ["model.dtype=fp16"],
        "bf16 linears": ["model.quantize=bf16"],
        "int8 weights": ["model.quantize=int8"],
        f"compile ({compile_backend})": [f"model.compile={compile_backend}"],
    }


def unknown_options(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--only-options``, in one line, or None."""
    names = options(args.compile_backend)
    unknown = [n for n in args.only_options or () if n not in names]
    if unknown:
        return (f"--only-options {', '.join(map(repr, unknown))}: no such option; the options are "
                + ", ".join(map(repr, names)))
    if args.only_options and not args.options:
        return "--only-options chooses among --options' options: add --options"
    return None


def option_setup(args: argparse.Namespace, overrides: list[str], method: str = "adazeta") -> Setup:
    """``method`` (AdaZeta unless said) on the bench batch with ``overrides`` (``model.dtype`` among them replaces
    ``--dtype``)."""
    dtype = next((o.split("=")[1] for o in overrides if o.startswith("model.dtype=")), args.dtype)
    rest = [o for o in overrides if not o.startswith("model.dtype=")]
    return setup_for(argparse.Namespace(**{**vars(args), "dtype": dtype}), method, extra=rest)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each tensor once)."""
    seen = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in seen.values())


def linear_weights(module: torch.nn.Module) -> int:
    """Multiply-adds per token of ``module``'s linear layers (dense, int8 and bf16)."""
    return sum(m.in_features * m.out_features for m in module.modules()
               if isinstance(m, (torch.nn.Linear, *QUANTIZED.values())))


def matmul_rate(tokens: int, hidden: int, dtype: torch.dtype, repeats: int) -> float:
    """FLOP/s of a dense (tokens x hidden) @ (hidden x 4 hidden) product in ``dtype``: the roofline's ceiling."""
    x, w = torch.randn(tokens, hidden, dtype=dtype), torch.randn(4 * hidden, hidden, dtype=dtype)
    F.linear(x, w)
    start = time.perf_counter()
    for _ in range(repeats):
        F.linear(x, w)
    return 2 * tokens * hidden * 4 * hidden * repeats / (time.perf_counter() - start)


class Measured:
    """One option's timed runs and what reading them needs."""

    def __init__(self, args: argparse.Namespace, setup: Setup) -> None:
        scorer = setup.scorer
        self.setup, self.batch = setup, scorer.collate(setup.items)
        self.closure = ReplicaClosure(scorer.model, functools.partial(scorer.replica_losses, self.batch), self.batch)
        self.q1, q4 = zo_optimizer(args, setup, False, 1), zo_optimizer(args, setup, True, 4)
        eval_batches = scorer.batches(setup.dev_items, args.eval_batch_size, sort=True)

        def evaluate() -> None:
            with torch.no_grad():
                for b in eval_batches:
                    scorer.scores(b)

        self.runs = {
            "forward": torch.no_grad()(lambda: float(self.closure())),
            "ZO step, Q=1": lambda: float(self.q1.step(self.closure, n_queries=1)),
            "ZO step, Q=4 batched": lambda: float(q4.step(self.closure, n_queries=4)),
            "evaluation": evaluate,
        }


def time_options(args: argparse.Namespace, measured: dict[str, Measured]) -> dict[str, dict[str, Stats]]:
    """Every option's runs in one round-robin (each round runs every option's every run once), so that load from
    other processes, which drifts over a bench of several minutes, weighs on fp32 and each option alike."""
    device = next(iter(measured.values())).setup.device
    runs = {(name, key): fn for name, m in measured.items() for key, fn in m.runs.items()}
    stats = timed(runs, device, args.repeats, args.warmup)
    return {name: {key: stats[name, key] for key in m.runs} for name, m in measured.items()}


def read_option(args: argparse.Namespace, report: Report, name: str, m: Measured,
                stats: dict[str, Stats]) -> dict[str, float]:
    """Timings, the update guard, memory and roofline of one option; returns the medians for the ratios."""
    setup = m.setup
    medians = {k: v.median for k, v in stats.items()}
    # The realised-update guard's reading of one more Q = 1 step: how much of the intended update the weights took.
    probe = UpdateProbe([p for group in m.q1.param_groups for p in group["params"]], GuardConfig().sample)
    probe.before()
    m.q1.step(m.closure, n_queries=1)
    update = probe.after(m.q1.intended_update)
    report.add("update", "realised update: share of measured entries changed", name, update.changed, "")
    report.add("update", "realised update: cos(applied, intended)", name, update.cosine, "")
    medians["changed"], medians["update cosine"] = update.changed, update.cosine
    medians["evaluation"] = len(setup.dev_items) / medians["evaluation"]  # examples per second
    for key, st in stats.items():
        report.add("options", key, name, medians[key] if key == "evaluation" else st, "ex/s" if key == "evaluation" else "s")
    report.add("options", "model memory", name, model_bytes(setup.scorer.model) / 2**20, "MiB")
    backbone, _ = setup.scorer.parts()
    tokens = int(m.batch.input_ids.numel())
    hidden = setup.built.loaded.model.config.hidden_size
    # the products' dtype: bf16 linears multiply in bf16 whatever the backbone's dtype
    dtype = torch.bfloat16 if setup.settings.model.quantize == "bf16" else setup.settings.model.torch_dtype
    decoder_rate = 2 * tokens * linear_weights(backbone) / stats["forward"].median
    share = decoder_rate / matmul_rate(tokens, hidden, dtype, max(args.repeats, 3))
    report.add("options", "decoder rate / dense matmul rate", name, share, "x")
    medians["roofline"] = share
    return medians


def same_signs(a: list[float], b: list[float]) -> float:
    """The share of places where ``a`` and ``b`` have the same sign."""
    return sum((x > 0) == (y > 0) for x, y in zip(a, b)) / len(a)


def same_start(setups: dict[str, Setup]) -> dict[str, Setup]:
    """``setups`` with every option's trainable weights set to fp32's: a fidelity comparison needs one point. (peft
    makes LoRA's weights in the backbone's dtype, so on a bf16 or fp16 backbone they start rounded.)"""
    ref = [p for _, p in setups["fp32"].built.named]
    with torch.no_grad():
        for setup in setups.values():
            for mine, theirs in zip([p for _, p in setup.built.named], ref, strict=True):
                mine.copy_(theirs)
    return setups


def measure_fidelity(args: argparse.Namespace, report: Report, setups: dict[str, Setup],
                     method: str = "adazeta") -> dict[str, float]:
    """Per option, on the same directions (seed 0, the method's eps): cos(ZO estimate, fp32 autograd gradient) at
    Q = 1, 4, 16; the sign agreement of its projected gradients with fp32's; and how far they are from the exact
    directional derivatives z . g of fp32's gradient: their relative error, their sign agreement, and the cosine
    of the Q = 16 estimate with the estimate those exact derivatives give (returned: the verdict's measure). The
    cosine with the gradient itself is about sqrt(Q / d), 0.01 at Q = 16 for AdaZeta's 179 k weights, where one
    of 16 projected gradients near zero changing sign moves it by more than 5 %: it says how good a Q-query
    estimate is, not whether an option spoils it."""
    tag = f" [{method}]"
    ref = setups["fp32"]
    eps = ref.settings.optimizer.config.eps
    n = max(FIDELITY_QUERIES)

    def loss_of(setup: Setup) -> Any:
        batch = setup.scorer.collate(setup.items)
        return lambda: setup.scorer.loss(batch)

    ref_params = [p for _, p in ref.built.named]
    grad = autograd_gradient(ref_params, loss_of(ref))
    ref_proj = projected_gradients(ref_params, loss_of(ref), 0, n, eps)
    exact = directional_derivatives(ref_params, 0, n, grad)
    ideal = estimate_vector(ref_params, exact, 0)
    faithful = {}
    for name, setup in setups.items():
        params = [p for _, p in setup.built.named]
        proj = ref_proj if setup is ref else projected_gradients(params, loss_of(setup), 0, n, eps)
        for q in FIDELITY_QUERIES:
            cos = estimate_cosine(params, proj[:q], 0, grad)
            report.add("fidelity", f"cosine with fp32 gradient, Q={q}{tag}", name, cos, "")
        report.add("fidelity", f"projected-gradient sign agreement with fp32{tag}", name, same_signs(proj, ref_proj), "")
        error = math.dist(proj, exact) / math.hypot(*exact)
        report.add("fidelity", f"projected gradients' relative error against exact z.g{tag}", name, error, "")
        report.add("fidelity", f"projected-gradient sign agreement with exact z.g{tag}", name, same_signs(proj, exact), "")
        faithful[name] = cosine(estimate_vector(params, proj, 0), ideal)
        report.add("fidelity", f"cosine with the exact-derivative estimate, Q={n}{tag}", name, faithful[name], "")
    return faithful


def measure_options(args: argparse.Namespace, report: Report) -> list[str]:
    """Every option, then the ratios to fp32 and the verdicts; returns the summary lines to print."""
    flags = cpu_flags()
    lines = [f"CPU: {cpu_name()}; " + ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in BF16_FEATURES)
             + f"; {torch.get_num_threads()} threads"]
    chosen = {name: o for name, o in options(args.compile_backend).items()
              if name == "fp32" or not args.only_options or name in args.only_options}
    setups = {name: option_setup(args, overrides) for name, overrides in chosen.items()}
    # Fidelity first, while every option's adapters are still at the one initial state they share: the timed runs
    # take ZO steps, each option its own, so that afterwards the options would be compared at different points.
    faithful = {method: measure_fidelity(args, report, same_start(setups if method == "adazeta" else
                                         {name: option_setup(args, o, method) for name, o in chosen.items()}), method)
                for method in args.fidelity_methods}
    measured = {name: Measured(args, setup) for name, setup in setups.items()}
    stats = time_options(args, measured)
    medians = {name: read_option(args, report, name, m, stats[name]) for name, m in measured.items()}
    base = medians["fp32"]
    runs_timed = ("forward", "ZO step, Q=1", "ZO step, Q=4 batched", "evaluation")
    for name, m in medians.items():
        speed = {k: (base[k] / m[k] if k != "evaluation" else m[k] / base[k]) for k in base if k in runs_timed}
        for key, ratio in speed.items():
            report.add("options", f"{key}: speed-up over fp32", name, ratio, "x")
        worse = [method for method, f in faithful.items() if f[name] < (1 - WORSE) * f["fp32"]]
        lines.append(f"{name:<22} " + "  ".join(f"{k} {v:.2f}x" for k, v in speed.items())
                     + f"  roofline {m['roofline']:.2f}  faithful (Q=16) "
                     + ", ".join(f"{f[name]:.3f} {method}" for method, f in faithful.items())
                     + f"  update taken {m['changed']:.1%} (cos {m['update cosine']:.3f})"
                     + (f"  MEASURABLY WORSE estimate than fp32 ({', '.join(worse)})" if worse else "")
                     + ("  UPDATES LOST to rounding" if m["changed"] < 0.5 else ""))
    return lines
