"""Gradient fidelity: the ZO estimate against autograd's gradient, on one real minibatch, as Q grows.

    python -m adazeta.tools.grad_fidelity                # adazeta (both inits), mezo_lora, mezo on SmolLM2 SST-2
    python -m adazeta.tools.grad_fidelity --methods adazeta_identity --queries 1 4 16 --seeds 0 1
    python -m adazeta.tools.grad_fidelity --report-only  # rebuild the table and figure from the CSVs

For each method: the first minibatch a run with seed 0 trains on (batch 16), the autograd gradient g of its
loss over the method's trainable set, and for several direction seeds the ZO estimate from Q = 1, 2, 4, ..., 64
queries (central differences, eps 1e-3): cosine with g, relative norm error, finite-difference error, and the
loss decrease that a step at the method's learning rate gives on that minibatch, per forward pass spent.
Writes results/grad_fidelity/<method>.csv (one per method; rerun a method to replace it), fidelity.md and
results/figures/grad_fidelity.png, under the current directory.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch

from adazeta.tools.offline import use_shared

OUT = Path("results", "grad_fidelity")
FIGURE = Path("results", "figures", "grad_fidelity.png")

# method -> (adazeta-run overrides, lr of the step whose effect is measured: the cpu_zo grid's first value)
METHODS = {
    "adazeta": (["method=adazeta"], 3e-4),
    "adazeta_identity": (["method=adazeta", "method.adapter.init=identity"], 3e-4),
    "mezo_lora": (["method=mezo_lora"], 1e-3),
    "mezo": (["method=mezo"], 3e-6),
}
COLUMNS = ["method", "trainable", "lr", "seed", "queries", "cosine", "expected_cosine", "relative_error",
           "norm_ratio", "fd_error", "loss_decrease", "predicted_decrease", "decrease_per_forward", "base_loss"]


def measure(method: str, queries: list[int], seeds: list[int], lr: float | None, extra: list[str]) -> Path:
    from adazeta.tools.fidelity import autograd_gradient, expected_cosine, zo_fidelity
    from adazeta.build import build, compose_settings, seed_everything

    overrides, default_lr = METHODS[method]
    s = compose_settings(["task=sst2", "model=smollm2-135m", "data.num_dev=8", "data.num_eval=8",
                          "wandb.mode=disabled", *overrides, *extra])
    lr = default_lr if lr is None else lr
    seed_everything(s.seed)
    b = build(s)
    model, scorer = b.model, b.scorer
    model.eval()
    # The first minibatch of a run with this seed (the training loop's data order).
    order = torch.randperm(len(b.enc["train"]), generator=torch.Generator().manual_seed(s.seed))
    items = [b.enc["train"][i] for i in order[: s.train.batch_size].tolist()]
    batch = scorer.collate(items)
    params = [p for _, p in b.named]
    dim = sum(p.numel() for p in params)
    grad = autograd_gradient(params, lambda: scorer.loss(batch))
    base = float(scorer.loss(batch).detach())
    masks = b.optimizer.masks(params) if hasattr(b.optimizer, "masks") else None
    start = time.time()
    rows = zo_fidelity(params, lambda: scorer.loss(batch), grad, queries, seeds,
                       s.optimizer.config.eps, lr, masks)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{method}.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        for r in rows:
            writer.writerow(dict(method=method, trainable=dim, lr=lr, expected_cosine=expected_cosine(r.queries, dim),
                                 base_loss=base, **dataclasses.asdict(r)))
    print(f"{method}: d = {dim:,}, {len(rows)} rows in {time.time() - start:.0f} s -> {path}", flush=True)
    return path


def report() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    files = sorted(OUT.glob("*.csv"))
    if not files:
        sys.exit("grad_fidelity.py: error: no results/grad_fidelity/*.csv yet; run without --report-only first")
    df = pd.concat([pd.read_csv(f) for f in files])
    order = [m for m in METHODS if m in set(df.method)] + sorted(set(df.method) - set(METHODS))
    agg = df.groupby(["method", "queries"]).agg(
        trainable=("trainable", "first"), lr=("lr", "first"), seeds=("seed", "nunique"),
        cos=("cosine", "mean"), cos_std=("cosine", "std"), expected=("expected_cosine", "first"),
        rel=("relative_error", "mean"), fd=("fd_error", "mean"), dec=("loss_decrease", "mean"),
        dec_std=("loss_decrease", "std"), per_fwd=("decrease_per_forward", "mean"),
        pred=("predicted_decrease", "mean"), base=("base_loss", "first"),
    ).reset_index()
    lines = [
        "# Gradient fidelity: ZO estimate vs autograd on one SST-2 minibatch (SmolLM2-135M, batch 16, eps 1e-3)",
        "",
        "Made by `python -m adazeta.tools.grad_fidelity` (`make study NAME=grad_fidelity`). Mean (std) over direction seeds; the",
        "estimate for Q is the mean of the first Q queries of each seed. `expected` is sqrt(Q / (Q + d + 1)), the",
        "cosine of Gaussian-direction SPSA with exact differences. `loss change` is L(w) - L(w - lr g_hat) on the",
        "same minibatch (positive = the step helped); `per forward` divides it by the 2Q forwards spent.",
        "",
        "| method | d (trainable) | lr | Q | seeds | cosine | expected | rel. norm error | FD error | loss change | per forward |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in order:
        for _, r in agg[agg.method == m].sort_values("queries").iterrows():
            std = f" ({r.cos_std:.4f})" if not math.isnan(r.cos_std) else ""
            dstd = f" ({r.dec_std:.4f})" if not math.isnan(r.dec_std) else ""
            lines.append(f"| {m} | {int(r.trainable):,} | {r.lr:g} | {int(r.queries)} | {int(r.seeds)} | "
                         f"{r.cos:.4f}{std} | {r.expected:.4f} | {r.rel:.1f} | {r.fd:.3f} | {r.dec:+.4f}{dstd} | "
                         f"{r.per_fwd:+.5f} |")
    (OUT / "fidelity.md").write_text("\n".join(lines) + "\n")
    from adazeta.tools.plots import method_colors, save_figure

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = method_colors(order)  # one colour per method, the same in every chart
    for m in order:
        a = agg[agg.method == m].sort_values("queries")
        line, = axes[0].plot(a.queries, a.cos, marker="o", label=f"{m} (d={int(a.trainable.iloc[0]):,})",
                             color=colors[m])
        axes[0].plot(a.queries, a.expected, ls="--", color=line.get_color(), alpha=0.6)
        axes[1].plot(a.queries, a.per_fwd, marker="o", color=line.get_color(), label=m)
    axes[0].set(xscale="log", yscale="log", xlabel="queries Q", ylabel="cos(ZO estimate, gradient)",
                title="alignment (dashed: sqrt(Q/(Q+d+1)))")
    axes[1].set(xscale="log", xlabel="queries Q", ylabel="loss decrease per forward pass",
                title="one step at the method's lr, same minibatch")
    axes[1].axhline(0, color="grey", lw=0.5)
    for ax in axes:
        ax.set_xticks([1, 2, 4, 8, 16, 32, 64], labels=["1", "2", "4", "8", "16", "32", "64"])
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, FIGURE)
    print(f"wrote {OUT / 'fidelity.md'} and {FIGURE}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="direction seeds")
    parser.add_argument("--lr", type=float, default=None, help="the step's lr (default: each method's, see METHODS)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("overrides", nargs="*", help="extra adazeta-run overrides (after --)")
    args = parser.parse_args()
    if min(args.queries) < 1:
        sys.exit("grad_fidelity.py: error: --queries must be >= 1")
    use_shared()
    if not args.report_only:
        for method in args.methods:
            measure(method, args.queries, args.seeds, args.lr, args.overrides)
    report()


if __name__ == "__main__":
    main()
