"""The endpoint tests a study declares, read by one report (``adazeta.tools.study_report``).

A study's config says what it will judge in its ``endpoints:`` block, committed before its first run; the report
reads the block and runs the tests it names. The block takes one of four forms:

    kind: declared     a list of predictions, each a named test (``declared``: difference, chosen_lr, stability);
                       the form for every new study
    kind: matrix       a task matrix's table and its endpoints e1-e4 (``matrix``; written by ``make tables``)
    speed / stability / accuracy
                       forwards to a target, stability at equal steps and forwards, paired accuracy with a margin
                       (``claims``: cpu_zo_claims, cpu_zo_speed)
    share / goal / reproduces / accuracy
                       forwards as a share of a reference optimizer's, a dev-accuracy goal, reproduction of a twin
                       run, paired accuracy (``optimizers``: cpu_zo_optimizers and its follow-ups)

The last two are the forms of the studies committed before the declared list existed; their blocks are read as
they were registered, never rewritten. ``runs`` holds what every test reads: a run's record, curve and test
correctness per example.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adazeta.errors import ConfigError

FORMS = ("declared", "matrix", "claims", "optimizers")


def form(ends: dict[str, Any]) -> str | None:
    """Which form an ``endpoints:`` block takes (one of FORMS); None when it declares none."""
    if not ends:
        return None
    kind = ends.get("kind")
    if kind is not None:
        if kind not in ("declared", "matrix"):
            raise ConfigError(f"endpoints.kind {kind!r} has no report; use declared (a list of predictions) or "
                              "matrix (a task matrix)")
        return str(kind)
    if "speed" in ends:
        return "claims"
    if {"share", "goal", "reproduces"} & set(ends):
        return "optimizers"
    raise ConfigError(f"endpoints declares {', '.join(sorted(ends))}, none of which a report reads; write "
                      "`kind: declared` with a `list:` of predictions")


def report(name: str, ends: dict[str, Any], out: Path) -> Path | None:
    """Write ``name``'s report under ``out`` by its endpoints' form; None for a matrix (``make tables`` writes it)
    or a study that declares none."""
    chosen = form(ends)
    if chosen == "declared":
        from adazeta.tools.endpoints import declared
        return declared.report(name, out)
    if chosen == "claims":
        from adazeta.tools.endpoints import claims
        return claims.report(name, out)
    if chosen == "optimizers":
        from adazeta.tools.endpoints import optimizers
        return optimizers.report(name, out)
    return None
