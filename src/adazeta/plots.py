"""Figures: convergence curves (mean and band over seeds, divergence marked, Q on a second axis), memory bars.

Reads the CSV files every run writes (metrics.csv, eval.csv) next to its result.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

COLORS = {"adazeta": "tab:red", "mezo_lora": "tab:blue", "mezo": "tab:green", "sparse_mezo": "tab:purple"}


def read_run(run_dir: Path) -> dict:
    """One run's record and curves: dev loss per step joined with the forward passes spent by then."""
    run_dir = Path(run_dir)
    record = json.loads((run_dir / "result.json").read_text())
    metrics = pd.read_csv(run_dir / "metrics.csv")
    evals = pd.read_csv(run_dir / "eval.csv")
    dev = evals[evals["split"] == "dev"].copy()
    spent = dict(zip(metrics["step"], metrics["forward_passes"]))
    spent[0] = 0
    dev["forward_passes"] = dev["step"].map(spent)
    return {"record": record, "metrics": metrics, "dev": dev}


def _band(curves: list[pd.DataFrame], x: str, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and standard deviation over seeds (ddof = 1, as the tables), each curve interpolated onto ``grid``
    (NaN past its end); one seed has no spread (0)."""
    ys = [np.interp(grid, c[x], c["loss"], right=np.nan) for c in curves]
    stack = np.vstack(ys)
    counts = np.sum(~np.isnan(stack), axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        std = np.where(counts > 1, np.nanstd(stack, axis=0, ddof=1) if len(ys) > 1 else 0.0, 0.0)
    return np.nanmean(stack, axis=0), std


def convergence_figure(runs: list[dict], task: str, x: str = "forward_passes", out: Path | None = None) -> plt.Figure:
    """Dev loss against forward passes (or steps) per method; band = +-1 std over seeds; x = diverged run ends."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax_q = ax.twinx()
    methods = sorted({r["record"]["method"] for r in runs})
    for method in methods:
        mine = [r for r in runs if r["record"]["method"] == method]
        color = COLORS.get(method)
        curves = [r["dev"] for r in mine if len(r["dev"])]
        if not curves:
            continue
        grid = np.linspace(0, max(c[x].max() for c in curves), 100)
        mean, std = _band(curves, x, grid)
        (line,) = ax.plot(grid, mean, label=f"{method} (n={len(curves)})", color=color)
        ax.fill_between(grid, mean - std, mean + std, alpha=0.2, color=line.get_color())
        for r in mine:
            if r["record"].get("status") == "diverged" and len(r["dev"]):
                last = r["dev"].iloc[-1]
                ax.plot(last[x], last["loss"], "x", color=line.get_color(), markersize=9)
        queries = mine[0]["metrics"]
        if len(queries) and queries["n_queries"].max() > 1:
            qx = queries["forward_passes"] if x == "forward_passes" else queries["step"]
            ax_q.step(qx, queries["n_queries"], where="post", linestyle=":", color=line.get_color(), alpha=0.8)
    ax.set_xlabel("forward passes" if x == "forward_passes" else "step")
    ax.set_ylabel("dev loss")
    ax_q.set_ylabel("queries per step Q (dotted)")
    ax_q.set_ylim(bottom=0)
    ax.set_title(f"{task}\ndev loss, mean ± std over seeds (x = diverged run)", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=120)
    return fig


def run_figure(run_dir: Path, out: Path | None = None) -> plt.Figure:
    """A single run: training loss per step, dev/test marks, and Q."""
    run = read_run(run_dir)
    m, record = run["metrics"], run["record"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    if len(m):
        ax.plot(m["step"], m["loss"], alpha=0.4, label="train loss (per step)")
        smooth = m["loss"].rolling(max(1, len(m) // 20), min_periods=1).mean()
        ax.plot(m["step"], smooth, label="train loss (smoothed)")
    ax.plot(run["dev"]["step"], run["dev"]["loss"], "o-", label="dev loss")
    if len(m) and m["n_queries"].max() > 0:
        ax_q = ax.twinx()
        ax_q.step(m["step"], m["n_queries"], where="post", color="gray", linestyle=":")
        ax_q.set_ylabel("Q")
        ax_q.set_ylim(bottom=0)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{record['method']} / {record['task']} / {record['model']} (seed {record['seed']}): {record['status']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=120)
    return fig


def memory_figure(table: pd.DataFrame, out: Path | None = None) -> plt.Figure:
    """Bars of peak memory per method (``table`` has columns method and peak_mem_mb)."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.bar(table["method"], table["peak_mem_mb"] / 1024, color=[COLORS.get(m, "tab:gray") for m in table["method"]])
    for i, v in enumerate(table["peak_mem_mb"] / 1024):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("peak memory (GiB)")
    ax.set_title("Peak memory per method")
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=120)
    return fig
