"""Figures: convergence curves (mean and band over seeds, divergence marked, Q on a second axis), memory bars, and
a study's dev-loss curves per arm (overlaid, or a panel per arm when there are many).

Reads the CSV files every run writes (metrics.csv, eval.csv) next to its result.json.
"""

from __future__ import annotations

import io
import json
import math
import os
import zlib
from pathlib import Path
from typing import Iterable, Sequence

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

# One colour per method, the same in every chart (conf/method/ and the memory bench's `inference`).
COLORS = {
    "adazeta": "tab:red", "mezo_lora": "tab:blue", "mezo": "tab:green", "sparse_mezo": "tab:purple",
    "ft": "tab:brown", "lora": "tab:orange", "adapter": "tab:pink", "tt_adapter": "tab:olive",
    "mezo_adapter": "tab:cyan", "zero_shot": "tab:gray", "icl": "teal", "lp": "goldenrod", "inference": "black",
}
# Other names (an experiment's arms: tt_q1, ada_official, ...) draw from these, each at a place fixed by its name.
OTHER_COLORS = ("#800000", "#000075", "#f032e6", "#9a6324", "#42d4f4", "#9acd32", "#911eb4", "#e6c700", "#4363d8",
                "#fa8072", "#2f4f4f")  # hues apart from COLORS


def method_colors(names: Iterable[str]) -> dict[str, str]:
    """A colour for each name, distinct within one chart: a method's own (COLORS) in every chart; another name
    takes its place in OTHER_COLORS by a hash of the name (the same in every chart), or the next free one."""
    names = list(dict.fromkeys(names))
    out = {n: COLORS[n] for n in names if n in COLORS}
    used = set(out.values())
    for name in names:
        if name in out:
            continue
        start = zlib.crc32(name.encode()) % len(OTHER_COLORS)
        free = [OTHER_COLORS[(start + i) % len(OTHER_COLORS)] for i in range(len(OTHER_COLORS))]
        out[name] = next((c for c in free if c not in used), free[0])  # more names than colours: reuse
        used.add(out[name])
    return out


def loss_limits(kept: Iterable[Sequence[float]], others: Iterable[Sequence[float]] = (),
                margin: float = 0.08) -> tuple[float, float] | None:
    """The y range of loss curves: its top set by the runs that did not diverge (``kept``: a diverged run's climb,
    1 -> 30, would flatten every other curve), its bottom by every run (``others`` too), with a margin; None when
    no run that did not diverge has a finite value."""
    def finite(curves: Iterable[Sequence[float]]) -> list[float]:
        return [float(v) for curve in curves for v in curve if math.isfinite(float(v))]

    top_values = finite(kept)
    if not top_values:
        return None
    values = top_values + finite(others)
    lo, hi = min(values), max(top_values)
    pad = (hi - lo) * margin or abs(hi) * margin or 1.0
    return lo - pad, hi + pad


def plot_clipped(ax: plt.Axes, xs: Sequence[float], ys: Sequence[float], top: float | None, **style) -> plt.Line2D:
    """A curve cut at ``top``: where it climbs above, a ^ at the chart's top edge and the highest value it reached."""
    xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if top is None:
        return ax.plot(xs, ys, **style)[0]
    above = ~(ys <= top)  # NaN and infinity count as above
    (line,) = ax.plot(xs, np.where(above, np.nan, ys), **style)
    if above.any():
        first = int(np.argmax(above))
        if first > 0:  # the climb up to the edge
            ax.plot(xs[first - 1 : first + 1], [ys[first - 1], top], color=line.get_color(), lw=line.get_linewidth(),
                    alpha=line.get_alpha())
        ax.plot(xs[above], np.full(int(above.sum()), top), "^", color=line.get_color(), markersize=5, clip_on=False)
        peak = np.nanmax(np.where(np.isfinite(ys), ys, np.nan)) if np.isfinite(ys).any() else float("inf")
        ax.annotate(f"{peak:.3g}", (xs[first], top), xytext=(2, -9), textcoords="offset points", fontsize=7,
                    color=line.get_color())
    return line


def save_figure(fig: plt.Figure, path: Path, dpi: int = 120) -> bool:
    """Write ``fig`` as a PNG only when its picture differs from the file already there (else leave the file, so
    that a committed figure regenerated from the same results leaves the checkout clean); True when written."""
    path = Path(path)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    data = buffer.getvalue()
    if path.is_file() and same_picture(path.read_bytes(), data):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return True


def same_picture(a: bytes, b: bytes) -> bool:
    """Whether two PNGs show the same pixels (their bytes may differ in metadata)."""
    if a == b:
        return True
    import matplotlib.image as mpimg

    try:
        pa, pb = mpimg.imread(io.BytesIO(a), format="png"), mpimg.imread(io.BytesIO(b), format="png")
    except Exception:  # not a PNG we can read: rewrite it
        return False
    return pa.shape == pb.shape and bool(np.array_equal(pa, pb))


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
    # training time by then: the steps' own seconds, without evaluations (what equal-time comparisons read)
    elapsed = dict(zip(metrics["step"], metrics["step_time_s"].cumsum())) if "step_time_s" in metrics else {}
    elapsed[0] = 0.0
    dev["wall_time_s"] = dev["step"].map(elapsed)
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
    colors = method_colors(methods)
    diverged = {id(r) for r in runs if r["record"].get("status") == "diverged" and len(r["dev"])}
    # The loss axis is set by the runs that did not diverge; a diverged run's climb is cut at its top, marked ^.
    limits = None
    if diverged:
        limits = loss_limits((r["dev"]["loss"] for r in runs if id(r) not in diverged and len(r["dev"])),
                             (r["dev"]["loss"] for r in runs if id(r) in diverged))
    top = limits[1] if limits else None
    for method in methods:
        mine = [r for r in runs if r["record"]["method"] == method]
        color = colors[method]
        curves = [r["dev"] for r in mine if len(r["dev"])]
        if not curves:
            continue
        grid = np.linspace(0, max(c[x].max() for c in curves), 100)
        mean, std = _band(curves, x, grid)
        line = plot_clipped(ax, grid, mean, top, label=f"{method} (n={len(curves)})", color=color)
        ax.fill_between(grid, mean - std, mean + std, alpha=0.2, color=line.get_color())
        for r in mine:
            if id(r) in diverged:
                last = r["dev"].iloc[-1]
                ax.plot(last[x], min(last["loss"], top) if top is not None else last["loss"], "x",
                        color=line.get_color(), markersize=9, clip_on=False)
        queries = mine[0]["metrics"]
        if len(queries) and queries["n_queries"].max() > 1:
            qx = queries["forward_passes"] if x == "forward_passes" else queries["step"]
            ax_q.step(qx, queries["n_queries"], where="post", linestyle=":", color=line.get_color(), alpha=0.8)
    ax.set_xlabel("forward passes" if x == "forward_passes" else "step")
    ax.set_ylabel("dev loss")
    if limits is not None:
        ax.set_ylim(*limits)
    ax_q.set_ylabel("queries per step Q (dotted)")
    ax_q.set_ylim(bottom=0)
    cut = "; ^ = cut at the top" if limits is not None else ""
    ax.set_title(f"{task}\ndev loss, mean ± std over seeds (x = diverged run{cut})", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    if out is not None:
        save_figure(fig, out)
    return fig


def matrix_figure(runs: list[dict], title: str, out: Path | None = None) -> plt.Figure:
    """Dev loss of every arm at one task, against forward passes (left) and against training wall time (right):
    the mean over seeds of each arm's dev-selected setting, a thin line per seed; x marks a diverged run's end."""
    fig, axes = plt.subplots(1, 2, figsize=(11.0, 4.0), sharey=True)
    methods = sorted({r["record"]["method"] for r in runs if len(r["dev"]) > 1})
    colors = method_colors(methods)
    for ax, x, label in ((axes[0], "forward_passes", "forward passes"), (axes[1], "wall_time_s", "training time (s)")):
        for method in methods:
            curves = [r for r in runs if r["record"]["method"] == method and len(r["dev"]) > 1]
            for r in curves:
                ax.plot(r["dev"][x], r["dev"]["loss"], color=colors[method], alpha=0.3, linewidth=0.8)
                if r["record"].get("status") == "diverged":
                    ax.plot(r["dev"][x].iloc[-1], r["dev"]["loss"].iloc[-1], "x", color=colors[method])
            grid = np.linspace(0, max(c["dev"][x].max() for c in curves), 100)
            mean, _ = _band([c["dev"] for c in curves], x, grid)
            ax.plot(grid, mean, color=colors[method], label=f"{method} (n={len(curves)})", linewidth=1.8)
        ax.set_xlabel(label)
    axes[0].set_ylabel("dev loss")
    axes[1].legend(loc="upper right", fontsize=7)
    fig.suptitle(f"{title}: dev loss, each arm's chosen setting (thin: seeds; x: diverged)", fontsize=10)
    fig.tight_layout()
    if out is not None:
        save_figure(fig, out)
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
        save_figure(fig, out)
    return fig


def memory_figure(table: pd.DataFrame, out: Path | None = None) -> plt.Figure:
    """Bars of peak memory per method (``table`` has columns method and peak_mem_mb)."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    colors = method_colors(table["method"])
    ax.bar(table["method"], table["peak_mem_mb"] / 1024, color=[colors[m] for m in table["method"]])
    for i, v in enumerate(table["peak_mem_mb"] / 1024):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    # Slanted names: eight or more methods side by side overlap when written flat.
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", rotation_mode="anchor")
    ax.set_ylabel("peak memory (GiB)")
    ax.set_title("Peak memory per method")
    fig.tight_layout()
    if out is not None:
        save_figure(fig, out)
    return fig


OVERLAY_ARMS = 6  # up to this many arms share one chart; more get a panel each (17 overlaid lines are unreadable)


def loss_curves_figure(curves: dict[str, list[list[tuple[float, float, float]]]], path: Path
                       ) -> tuple[float, float] | None:
    """Dev loss curves per arm, one per seed, each a list of (forward passes, training minutes, loss) points.

    Up to ``OVERLAY_ARMS`` arms: two charts (against forward passes, against training minutes), every arm in its
    colour. More: a panel per arm (its seeds in its colour, every other arm's seeds faint grey behind), forward
    passes on x, the arm's median training minutes in its title. The y range runs from the lowest loss to the
    highest starting loss: a climb above where training began (a diverged run, or a blow-up at the last evaluation)
    is cut at the top edge with its peak marked, instead of flattening every other curve. Returns that y range."""
    shown = [arm for arm, seeds in curves.items() if seeds]
    starts = [[run[0][2]] for arm in shown for run in curves[arm] if run]
    every = [[loss for _, _, loss in run] for arm in shown for run in curves[arm]]
    limits = loss_limits(starts, every)
    top = limits[1] if limits else None
    colours = method_colors(shown)  # one colour per arm, the same in every chart
    if len(shown) <= OVERLAY_ARMS:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for arm in shown:
            for j, run in enumerate(curves[arm]):
                label = arm if j == 0 else None
                ys = [loss for _, _, loss in run]
                for ax, xs in ((axes[0], [f for f, _, _ in run]), (axes[1], [m for _, m, _ in run])):
                    plot_clipped(ax, xs, ys, top, color=colours[arm], alpha=0.8, lw=1.2, label=label)
        axes[0].set_xlabel("forward passes")
        axes[1].set_xlabel("training minutes (evaluations excluded)")
        axes[0].set_ylabel("dev loss (one line per seed)")
        axes[0].legend(fontsize=8)
        panels = list(axes)
    else:
        cols = 4 if len(shown) > 9 else 3
        rows = math.ceil(len(shown) / cols)
        fig, grid = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.5 * rows), sharex=True, sharey=True,
                                 squeeze=False)
        panels = [ax for row in grid for ax in row]
        for ax, arm in zip(panels, shown):
            for other in shown:  # the field, faint, behind this arm's own curves
                if other != arm:
                    for run in curves[other]:  # cut by the axes, unmarked: the markers are the arm's own
                        ax.plot([f for f, _, _ in run], [loss for _, _, loss in run], color="0.85", lw=0.8)
            for run in curves[arm]:
                plot_clipped(ax, [f for f, _, _ in run], [loss for _, _, loss in run], top, color=colours[arm], lw=1.5)
            minutes = [run[-1][1] for run in curves[arm] if run]
            ax.set_title(f"{arm} ({np.median(minutes):.0f} min)" if minutes else arm, fontsize=9)
        for ax in panels[len(shown):]:
            ax.axis("off")
        for ax in grid[-1]:
            ax.set_xlabel("forward passes", fontsize=8)
        for row in grid:
            row[0].set_ylabel("dev loss", fontsize=8)
        fig.suptitle("dev loss, one line per seed (grey: the other arms); in brackets: median training minutes",
                     fontsize=9)
    for ax in panels:
        ax.grid(alpha=0.3)
        if limits:
            ax.set_ylim(*limits)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return limits
