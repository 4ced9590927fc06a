"""The tools: commands that run, measure and report on runs; no run imports them.

Each runs from the repository root as ``python -m adazeta.tools.<name>`` (or through its ``make`` target); what it
writes goes under the current directory (``results/...``), and ``../shared`` beside it holds the offline model and
data where ``$ADAZETA_MODEL_DIR`` / ``$ADAZETA_DATA_DIR`` are unset (``offline``).

Drivers (launch runs through ``adazeta-run``):
    experiment         every experiment's one driver (its arms, grid and seeds: adazeta.experiments): lr grids
                       on dev, seeds at the dev-chosen lr, stress runs (make study NAME=cpu_zo_claims;
                       python -m adazeta.tools.experiment table2_llama --phase select)

Reports (read result files, write tables and figures):
    make_tables        results/tables from results/runs, dev-selected, the paper's numbers beside (make tables)
    make_figures       convergence curves, memory bars, one run's curves (make figures)
    study_report       a study's report from the endpoints its config declares, then the tables (make report
                       NAME=...); the tests it runs are in ``endpoints`` (declared predictions, task matrix,
                       claims, optimizer comparisons), each reading runs through ``endpoints.runs``
    endpoints          the endpoint tests a study declares: a package of the forms above, read by study_report
    config_reference   the docs' generated pages: every config key described, optimizers, tasks (make docs)
    twins              does a run reproduce another: dev curve, training log, test predictions, commits and CPUs

Benches and instruments (build runs as ``adazeta-run`` would, then measure):
    bench              speed: forwards, ZO steps, every ZO method, scaling, evaluation, memory phases (make bench)
    bench_memory       peak memory of one step per method, each in a fresh process (make bench BENCH=memory)
    bench_dist         ZO queries per second on 1 and N processes, torchrun (make bench BENCH=dist)
    grad_fidelity      the ZO estimate against the autograd gradient as Q grows, per method (make study NAME=grad_fidelity)
    diagnose_zo        a ZO run's steps watched from inside: norms, adapter gains, overflow
    displacement       how far a finished run's adapters moved from their step-0 values, per parameter group

Shared by them:
    offline            ``../shared`` as the offline model and data folders when a tool runs directly
    tables             result records to dev-selected tables (markdown, LaTeX), the paper's numbers beside
    plots              the figures' pieces: colours per method, clipped loss axes, pixel-compared saving
    fidelity           ZO gradient estimates against autograd (grad_fidelity and the bench's options)

The rule (tests/test_layout.py): the tools import the library (``adazeta.*``); nothing outside ``adazeta.tools``
imports ``adazeta.tools``.
"""

import functools
import sys
from pathlib import Path
from typing import Callable

from adazeta.errors import ConfigError


def one_line_errors(main: Callable[[], None]) -> Callable[[], None]:
    """A tool's ``main``: bad input (a ConfigError: an unknown experiment, a damaged run file) ends it with one
    line on stderr and exit status 2, as ``adazeta-run`` does, never a traceback."""

    @functools.wraps(main)
    def wrapper() -> None:
        try:
            main()
        except ConfigError as err:
            tool = Path(sys.modules[main.__module__].__file__ or "tool").stem  # "__main__" under python -m
            print(f"{tool}: error: {err}", file=sys.stderr)
            sys.exit(2)

    return wrapper
