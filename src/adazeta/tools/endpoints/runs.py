"""What every endpoint test reads: a study's ended runs (record, dev curve, test correctness per example), and the
words and numbers its verdicts are written in.

A run is read only from its files (result.json, eval.csv, metrics.csv, predictions/test.csv); a run that has not
ended (finished or diverged) is missing, so a report can be made at any point of a study.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from adazeta.errors import ConfigError
from adazeta.experiments import Design
from adazeta.runs.record import read_record
from adazeta.tools import twins
from adazeta.tools.twins import read_csv
from adazeta.tools.experiment import Job


MISSING = "—"
CONFIRMED, REFUTED, UNRESOLVED = "confirmed", "refuted", "unresolved"


@dataclass
class Point:
    step: int
    forwards: float
    wall_s: float  # training time up to this evaluation (the steps' own time; evaluations not counted)
    loss: float
    accuracy: float


@dataclass
class Run:
    arm: str
    seed: int
    rec: dict
    curve: list[Point] = field(default_factory=list)
    test_rows: list[str] = field(default_factory=list)  # source rows of the test examples, in order
    test_correct: np.ndarray | None = None

    @property
    def unstable_reason(self) -> str | None:
        """Why this run counts as unstable (the divergence rule stopped it, or late drift), else None."""
        if self.rec.get("status") == "diverged":
            return "diverged: " + str(self.rec.get("reason"))
        return None

    def seconds_per_forward(self) -> float:
        """Training seconds per forward pass up to the last evaluation (evaluations excluded); nan without one."""
        last = self.curve[-1] if self.curve else None
        return last.wall_s / last.forwards if last and last.forwards else math.nan

    def code(self) -> str:
        """The commit the run ran from (7 characters), with ``+dirty`` where its tree had uncommitted changes."""
        return twins.commit(self.rec)

    def drift(self, until: float = math.inf) -> float:
        """Final / best dev loss over the run's evaluations (those up to step ``until``: the run as if it had
        stopped there)."""
        losses = [p.loss for p in self.curve if p.step <= until and not math.isnan(p.loss)]
        return losses[-1] / min(losses) if losses else math.nan

    def stopped_by(self, step: float) -> bool:
        """Whether the divergence rule had stopped the run by ``step``."""
        return self.rec.get("status") == "diverged" and bool(self.curve) and self.curve[-1].step <= step


def load_run(arm: str, seed: int, run_dir: Path) -> Run | None:
    rec = read_record(run_dir)
    if rec is None or rec.get("status") not in ("finished", "diverged"):
        return None
    forwards, wall, total = {0: 0}, {0: 0.0}, 0.0
    for r in read_csv(run_dir / "metrics.csv"):
        total += float(r["step_time_s"])
        forwards[int(r["step"])], wall[int(r["step"])] = int(r["forward_passes"]), total
    curve = [Point(int(r["step"]), forwards.get(int(r["step"]), math.nan), wall.get(int(r["step"]), math.nan),
                   float(r["loss"]), float(r["accuracy"]))
             for r in read_csv(run_dir / "eval.csv") if r["split"] == "dev"]
    rows = read_csv(run_dir / "predictions" / "test.csv")
    correct = np.array([float(r["correct"]) for r in rows]) if rows else None
    return Run(arm, seed, rec, curve, [r["row"] for r in rows], correct)


def cpu_note(runs: dict[str, dict[int, Run]]) -> str:
    """Which CPUs the runs ran on: times compare only within one CPU (the machines here differ 3-4x in speed)."""
    by_cpu: dict[str, list[str]] = {}
    for arm, seeds in runs.items():
        for seed, run in sorted(seeds.items()):
            by_cpu.setdefault(twins.cpu(run.rec), []).append(f"{arm} {seed}")
    if len(by_cpu) <= 1:
        return f"every run on {next(iter(by_cpu), 'one CPU')}"
    return ("runs on several CPUs, whose times do not compare: " +
            "; ".join(f"{cpu}: {', '.join(runs_)}" for cpu, runs_ in sorted(by_cpu.items())))


def load_runs(name: str, design: Design) -> dict[str, dict[int, Run]]:
    out: dict[str, dict[int, Run]] = {}
    for arm, spec in design.arms.items():
        out[arm] = {}
        for seed in design.seeds:
            if not spec.runs_at(seed):
                continue
            run = load_run(arm, seed, Job(arm, spec.lrs[0], seed, name, []).run_dir)
            if run is not None:
                out[arm][seed] = run
    return out


def planned(design: Design, arm: str) -> list[int]:
    return [s for s in design.seeds if design.arms[arm].runs_at(s)]


def correctness(runs: dict[int, Run]) -> tuple[np.ndarray | None, list[str]]:
    """(seeds x examples) test correctness of an arm's runs with predictions, and their rows (checked equal)."""
    kept = [r for _, r in sorted(runs.items()) if r.test_correct is not None]
    if not kept:
        return None, []
    rows = kept[0].test_rows
    for r in kept[1:]:
        if r.test_rows != rows:
            raise ConfigError(f"{r.arm} seed {r.seed} was tested on other examples than seed "
                             f"{kept[0].seed}: its runs are not paired (data.seed must be fixed)")
    return np.stack([r.test_correct for r in kept]), rows


def fmt(x: float, digits: int = 3) -> str:
    return MISSING if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def fmt_p(p: float) -> str:
    if p is None or math.isnan(p):
        return MISSING
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def p_is(p: float) -> str:
    """``p = 0.012`` or ``p < 0.001`` in a sentence."""
    text = fmt_p(p)
    return "p " + text if text.startswith("<") else "p = " + text


def first_at_or_below(curve: list[Point], target: float) -> float:
    for p in curve:
        if p.loss <= target + 1e-9:  # the target is a mean of the reference's own losses: float rounding
            return p.forwards
    return math.inf


def interim(runs: dict[str, dict[int, Run]], arms: list[str], plan: dict[str, int] | None) -> str:
    """' (interim: `arm` n of m seeds, ...)' for the arms of a verdict with seeds still to run; '' when none."""
    missing = {arm: (len(runs.get(arm, {})), plan[arm]) for arm in arms
               if plan and len(runs.get(arm, {})) < plan.get(arm, 0)}
    return (" (interim: " + ", ".join(f"`{a}` {n} of {m} seeds" for a, (n, m) in missing.items()) + ")"
            if missing else "")
