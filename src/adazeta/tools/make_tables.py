"""Build results/tables/<experiment>.{md,tex} from result files, with the paper's numbers beside ours.

    python -m adazeta.tools.make_tables [--results results/runs ...] [--paper results/paper_numbers.csv]
                                  [--out results/tables]

Hyper-parameters are selected on dev only; test is reported as mean (std over seeds, ddof = 1), † counts
diverged runs. Each published number carries a mark naming its source (publication, table, model, confirmed
or not), spelled out in a legend under the table. Runs in seconds, on any machine: it reads JSON and CSV files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from adazeta.paths import config_dir
from adazeta.errors import ConfigError
from adazeta.experiments import compose_experiment, design_of
from adazeta.tools.tables import (build_table, load_paper_numbers, load_results, paper_numbers_file, select_on_dev,
                                  to_latex, to_markdown)
from adazeta.tools.endpoints.matrix import report


def experiment_axes(name: str) -> tuple[list[str] | None, list[str] | None]:
    """Methods and tasks an experiment compares, from its one schema (adazeta.experiments): the methods of its Hydra
    sweep (arms that are a method alone, in their order) and its grid's tasks; None where the experiment has no
    config here or no such axis (an experiment of composite arms: every method its results hold)."""
    if not (Path(config_dir()) / "experiment" / f"{name}.yaml").is_file():
        return None, None
    design = design_of(compose_experiment(name), name)
    if design is None:
        return None, None
    tasks = design.grid.get("task")
    methods = [arm.method for arm in design.arms.values()]
    return (None if None in methods else methods), ([str(t) for t in tasks] if tasks else None)


def cells_chosen_on_dev(results: Any) -> Any:
    """Each experiment's setting chosen on dev, cell by cell (``select_on_dev``), except the task matrices': they
    choose by their own registered rule (a rate pooled over tasks, only once a grid has ended), in their report."""
    if not len(results):
        return results
    selected = select_on_dev(results)
    return selected[~selected["experiment"].isin(matrix_experiments())].reset_index(drop=True)


def matrix_experiments() -> list[str]:
    """The experiments whose config declares task-matrix endpoints (``endpoints.kind: matrix``)."""
    import yaml

    names = []
    for path in sorted((Path(config_dir()) / "experiment").glob("*.yaml")):
        endpoints = (yaml.safe_load(path.read_text()) or {}).get("endpoints") or {}
        if isinstance(endpoints, dict) and endpoints.get("kind") == "matrix":
            names.append(path.stem)
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", nargs="+", type=Path, default=[Path("results", "runs")])
    parser.add_argument("--paper", type=Path, default=None,
                        help="the published numbers (default: results/paper_numbers.csv, else the packaged copy)")
    parser.add_argument("--out", type=Path, default=Path("results", "tables"))
    parser.add_argument("--figures", type=Path, default=Path("results", "figures"),
                        help="where a task-matrix experiment's figure per task goes")
    args = parser.parse_args()

    try:
        results = load_results([p for p in args.results if p.exists()])
        args.paper = args.paper or paper_numbers_file()
        paper = load_paper_numbers(args.paper)
    except ConfigError as err:
        print(f"make_tables: error: {err}", file=sys.stderr)
        sys.exit(2)
    selected = cells_chosen_on_dev(results)
    args.out.mkdir(parents=True, exist_ok=True)
    # stress tests (NAME_stress) run chosen settings at raised rates: nothing there is to be selected
    experiments = sorted(e for e in set(paper["experiment"]) - {"memory"} | set(selected.get("experiment", []))
                         if not str(e).endswith("_stress"))
    for name in experiments:
        methods, tasks = experiment_axes(name)
        table = build_table(selected, paper, name, methods, tasks)
        caption = f"{name}: test accuracy x100 (F1 for generation tasks)"
        (args.out / f"{name}.md").write_text(f"# {caption}\n\n" + to_markdown(table))
        (args.out / f"{name}.tex").write_text(to_latex(table, caption))
        print(f"{name}: {len(table.cells)} methods, {len(table.sources)} sources of published numbers "
              f"-> {args.out / name}.md/.tex")
    for name in matrix_experiments():  # their table beside the paper's numbers, and their report, even if empty
        root = next((r for r in args.results if (r / name).is_dir()), args.results[0])
        report(name, root, args.paper, args.out, args.figures)
        print(f"{name}: task matrix -> {args.out / name}.md/.tex, {args.out / name}_report.md")
    if len(selected):
        selected.to_csv(args.out / "selected.csv", index=False)
    print(f"{len(results)} result files, {len(selected)} selected cells")


if __name__ == "__main__":
    main()
