"""A study's report, from the endpoints its config declares, then the tables: ``make report NAME=<experiment>``.

    python -m adazeta.tools.study_report cpu_zo_claims [--out results]

One report for every study: it reads the experiment's ``endpoints:`` block (committed before the first run) and
judges each endpoint it declares from the run files (``adazeta.tools.endpoints`` lists the tests and the forms a
block takes). A study that declares none and keeps its own report beside its page (``studies/<name>/report.py``,
as cpu_zo, the first study, does) gets that one. Whatever has not run yet is reported as missing, so a report can
be made at any point of a study. ``make_tables`` follows, as for every report.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from adazeta.experiments import compose_experiment
from adazeta.tools import endpoints, one_line_errors


def own_report(name: str) -> Path:
    """Where a study keeps a report of its own (run from the repository root, as every tool is)."""
    return Path("studies") / name / "report.py"


def run_main(target: str | Path, args: list[str]) -> None:
    """Run a tool module (a dotted name) or a study's script (a path) as ``__main__`` with ``args``."""
    saved = sys.argv
    sys.argv = [str(target), *args]
    try:
        if isinstance(target, Path):
            runpy.run_path(str(target), run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__")
    finally:
        sys.argv = saved


def report(name: str, out: Path) -> Path | None:
    """Write the report of study ``name`` under ``out`` (its path), or run the study's own; None when neither."""
    ends = compose_experiment(name).get("endpoints") or {}
    path = endpoints.report(name, ends, out)
    if path is None and endpoints.form(ends) is None and own_report(name).is_file():
        run_main(own_report(name), ["--experiment", name])
    return path


@one_line_errors
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    path = report(args.experiment, args.out)
    if path is not None:
        print(path)
    run_main("adazeta.tools.make_tables", [])


if __name__ == "__main__":
    main()
