"""Write figures: convergence per experiment and task, memory bars, and (optionally) one run.

    python -m adazeta.tools.make_figures [--results results/runs] [--out outputs/figures] [--x forward_passes|step]
    python -m adazeta.tools.make_figures --out results/figures          # refresh the committed figures
    python -m adazeta.tools.make_figures --run outputs/sst2/adazeta/.../   # the curves of a single run

They go to outputs/figures (not committed) unless --out says otherwise, and a figure is rewritten only when its
picture changes: regenerating the committed results/figures from the same results leaves the checkout clean (a
run records its checkout's `dirty` flag). Paths are relative to the current directory.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import pandas as pd

from adazeta.tools import one_line_errors
from adazeta.tools.plots import convergence_figure, memory_figure, plt, read_run, run_figure, save_figure
from adazeta.runs.record import read_record
from adazeta.tools.tables import load_results, select_on_dev, setting_id, setting_of


@one_line_errors
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("results", "runs"))
    parser.add_argument("--out", type=Path, default=Path("outputs", "figures"),
                        help="where the figures go (results/figures: the committed ones; a PNG is rewritten only "
                             "when its picture changes)")
    parser.add_argument("--x", choices=["forward_passes", "step"], default="forward_passes")
    parser.add_argument("--memory", type=Path, default=Path("results", "bench", "memory.csv"))
    parser.add_argument("--run", type=Path, help="plot one run directory instead")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    def write(fig, out: Path) -> None:
        print(f"{'wrote' if save_figure(fig, out) else 'unchanged'} {out}")
        plt.close(fig)

    if args.run:
        write(run_figure(args.run), args.out / f"run_{args.run.resolve().name}.png")
        return

    # Only each method's dev-selected hyper-parameter setting is drawn (as in the tables).
    results = load_results([args.results]) if args.results.exists() else pd.DataFrame()
    chosen = set()
    if len(results):
        sel = select_on_dev(results)
        chosen = set(zip(sel["experiment"], sel["model"], sel["task"], sel["method"], sel["setting"]))
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for path in sorted(args.results.rglob("result.json")) if args.results.exists() else []:
        record = read_record(path)
        if record is None:
            continue
        key = (record.get("experiment") or "adhoc", record["model"], record["task"])
        setting = setting_id(setting_of(record.get("config") or {}))
        if (*key, record["method"], setting) in chosen and (path.parent / "metrics.csv").is_file():
            groups[key].append(read_run(path.parent))
    for (experiment, model, task), runs in sorted(groups.items()):
        write(convergence_figure(runs, f"{experiment}: {model} on {task}", args.x),
              args.out / f"{experiment}_{model}_{task}.png")
    if args.memory.is_file():
        table = pd.read_csv(args.memory)
        if {"method", "peak_mem_mb"} <= set(table.columns):
            write(memory_figure(table), args.out / "memory.png")


if __name__ == "__main__":
    main()
