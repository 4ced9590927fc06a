"""A study's report, whichever engine its endpoints need: ``make report NAME=<experiment>``.

    python -m adazeta.tools.report cpu_zo_claims

The experiment's ``endpoints:`` block says which report reads it: ``kind: declared`` (a list of predictions, each
a declared test: ``study_report``, the engine for every new study); ``kind: matrix`` (a task matrix:
``matrix_report``); speed / stability / accuracy (a claims experiment: ``claims_report``); share / goal /
reproduces (an optimizer comparison: ``optimizers_report``); cpu_zo, which declares none, has ``cpu_zo_report``.
Every report is followed by ``make_tables`` (the tables beside it). An experiment with no endpoints gets the
tables alone.
"""

from __future__ import annotations

import argparse
import runpy
import sys

from adazeta.errors import ConfigError
from adazeta.experiments import compose_experiment
from adazeta.tools import one_line_errors


def engine(name: str) -> tuple[str, list[str]] | None:
    """(the report module under adazeta.tools, its arguments) for experiment ``name``; None: tables only."""
    if name == "cpu_zo":
        return "cpu_zo_report", ["--experiment", name]
    ends = compose_experiment(name).get("endpoints") or {}
    if ends.get("kind") == "matrix":
        return "matrix_report", [name]
    if ends.get("kind") == "declared":
        return "study_report", [name]
    if ends.get("kind") is not None:
        raise ConfigError(f"experiment {name}: endpoints.kind {ends['kind']!r} has no report; known: matrix, declared")
    if "speed" in ends:
        return "claims_report", [name]
    if {"share", "goal", "reproduces"} & set(ends):
        return "optimizers_report", [name]
    return None


def run_module(module: str, args: list[str]) -> None:
    saved = sys.argv
    sys.argv = [module, *args]
    try:
        runpy.run_module(f"adazeta.tools.{module}", run_name="__main__")
    finally:
        sys.argv = saved


@one_line_errors
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment")
    args = parser.parse_args()
    chosen = engine(args.experiment)
    if chosen is not None:
        run_module(*chosen)
    run_module("make_tables", [])


if __name__ == "__main__":
    main()
