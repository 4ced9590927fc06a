"""Run an experiment: each arm's lr grid on dev, then seeds at the chosen lr, then a stress test; at every grid point.

    python -m adazeta.tools.experiment cpu_zo [--phase select|seeds|stress|all] [--jobs 2] [--threads 1] [--dry]
                                        [--arms tt_q1,mezo_lora] [extra adazeta-run overrides]

``--arms`` takes names or shell-style patterns (``--arms 'tt_*'``: every arm whose name starts with tt_).

The one driver of every experiment. It reads the experiment's one schema (``arms`` and ``design``,
``adazeta.experiments``) from its config as ``adazeta-run experiment=NAME`` composes it. Every run is one
``adazeta-run`` in its own directory, results/runs/NAME/ARM/[POINT,]lr=LR,seed=S under the current directory (the
repository root through make; POINT: the design grid's values, ``task=rte``); a directory that already holds a
finished or diverged result is skipped, so the experiment can be interrupted and continued, and one that another
process is running (its directory's lock is held) is left to it, so several drivers can share a phase. The lr of an
arm is chosen at each grid point on dev accuracy (ties: dev loss) at the selection seed, never on test, and only
once its whole lr grid has run there. Stress runs go to NAME_stress. (``adazeta-run -m experiment=NAME`` is the same
experiment's sweep at its reference settings, through Hydra's launchers.)
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import fnmatch
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adazeta.errors import ConfigError
from adazeta.experiments import Arm, Design, budget_at, compose_experiment, design_of
from adazeta.tools.offline import use_shared
from adazeta.runs.record import ENDED, main_score
from adazeta.runs.results import git_state
from adazeta.runs.rundir import holder

PHASES = ("select", "seeds", "stress")


class InputError(SystemExit):
    """Bad input to the driver: one line on stderr and exit status 2 (as argparse's own errors), nothing started."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = f"experiment.py: error: {message}"

    def __str__(self) -> str:
        return self.message


@dataclass
class Job:
    arm: str
    lr: float | None  # None: the lr the config composes to, or an arm that trains nothing (zero-shot)
    seed: int
    experiment: str
    overrides: list[str]
    point: tuple[tuple[str, Any], ...] = ()  # the design grid's values at this run: (("task", "rte"),)

    @property
    def run_dir(self) -> Path:
        parts = [f"{k}={v}" for k, v in self.point] + ([] if self.lr is None else [f"lr={self.lr:g}"])
        return runs_dir() / self.experiment / self.arm / ",".join([*parts, f"seed={self.seed}"])

    def done(self) -> bool:
        return status(self.run_dir) in ENDED


def runs_dir() -> Path:
    """results/runs under the current directory, absolute: each run gets it in its hydra.run.dir."""
    return Path.cwd() / "results" / "runs"


def status(run_dir: Path) -> str | None:
    return (record(run_dir) or {}).get("status")


def record(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "result.json").read_text())
    except (OSError, ValueError):
        return None


UNDECIDED = object()


def chosen_lr(name: str, arm: Arm, seed: int, point: tuple = ()) -> float | None | object:
    """The grid's lr with the best dev accuracy at ``seed`` (ties: lower dev loss), as ``make tables`` selects;
    UNDECIDED until every grid point has a finished or diverged result. Test is never looked at."""
    if not arm.runs_at(seed):  # an arm that never runs at the selection seed has nothing to select
        return arm.lrs[0] if len(arm.lrs) == 1 else UNDECIDED
    results = []
    for lr in arm.lrs:
        rec = record(Job(arm.name, lr, seed, name, [], point).run_dir)
        if rec is None or rec.get("status") not in ENDED:
            return UNDECIDED
        results.append((-main_score(rec, "dev"), rec["dev_loss"], len(results), lr))
    return min(results)[3]


def carried_lr(name: str, design: Design, arm: Arm) -> float | None | object:
    """The lr of ``arm`` chosen over the selection points (``design.select_at``) where it runs: the best mean dev
    accuracy over them at the selection seed (ties: the lower mean dev loss); UNDECIDED until each has ended."""
    if len(arm.lrs) == 1:
        return arm.lrs[0]
    points = [tuple(p.items()) for p in design.points() if design.selects_at(p) and arm.runs_at_point(p)]
    if not points:
        return UNDECIDED
    scores = []
    for i, lr in enumerate(arm.lrs):
        records = [record(Job(arm.name, lr, design.select_seed, name, [], point).run_dir) for point in points]
        if any(r is None or r.get("status") not in ENDED for r in records):
            return UNDECIDED
        dev = [main_score(r, "dev") for r in records]  # type: ignore[union-attr]
        loss = [r["dev_loss"] for r in records]  # type: ignore[index]
        scores.append((-sum(dev) / len(dev), sum(loss) / len(loss), i, lr))
    return min(scores)[3]


def budget_overrides(design: Design, arm: Arm, point: tuple) -> list[str] | None:
    """The forward budget of a budgeted arm at this point, as overrides; None while its pilot is running."""
    if design.budget is None or not arm.budgeted:
        return []
    b = budget_at(design.budget, dict(point).get(design.budget.axis), runs_dir())
    if b.forwards is None:
        return None
    return [f"train.max_forward_passes={b.forwards}",
            f"train.eval_every_forwards={max(1, b.forwards // design.budget.evals)}"]


def plan(name: str, design: Design, phase: str, arms: list[str] | None = None) -> list[Job]:
    """The runs of ``phase`` (select, seeds, stress or all), in run order: grid points interleaved across arms
    (every arm's grid fills in at the same pace), seed-major within a phase, at every point of the design grid."""
    order = list(design.order)
    if arms:  # names or shell-style patterns ("tt_*": every TT arm)
        unknown = sorted(a for a in arms if not fnmatch.filter(order, a))
        if unknown:
            raise InputError(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(order)}")
        order = [a for a in order if any(fnmatch.fnmatchcase(a, pattern) for pattern in arms)]
    jobs: list[Job] = []
    for point in [tuple(p.items()) for p in design.points()]:
        jobs += _plan_point(name, design, phase, order, point)
    return jobs


def _plan_point(name: str, design: Design, phase: str, order: list[str], point: tuple) -> list[Job]:
    select_seed, selecting = design.select_seed, design.selects_at(dict(point))
    where = ",".join(f"{k}={v}" for k, v in point)
    arms: dict[str, Arm] = {a: design.arms[a] for a in order if design.arms[a].runs_at_point(dict(point))}
    budgets: dict[str, list[str]] = {}
    for a, arm in arms.items():
        extra = budget_overrides(design, arm, point)
        if extra is None:
            print(f"# {phase}: {a}{' at ' + where if where else ''}: no forward budget yet (its pilot has not "
                  "ended)", flush=True)
        else:
            budgets[a] = extra
    order = [a for a in order if a in budgets]

    def job(arm: Arm, lr: float | None, seed: int, experiment: str = name) -> Job:
        return Job(arm.name, lr, seed, experiment, [*arm.overrides, *budgets[arm.name]], point)

    jobs: list[Job] = []
    if phase in ("select", "all") and selecting and order:
        for i in range(max(len(arms[a].lrs) for a in order)):
            jobs += [job(arms[a], arms[a].lrs[i], select_seed) for a in order
                     if i < len(arms[a].lrs) and arms[a].runs_at(select_seed)]
    chosen: dict[str, float | None] = {}
    if phase in ("seeds", "stress", "all"):
        for a in order:
            lr = (chosen_lr(name, arms[a], select_seed, point) if selecting
                  else carried_lr(name, design, arms[a]))
            if lr is UNDECIDED:
                print(f"# {phase}: {a}{' at ' + where if where else ''}: no lr chosen yet (its grid has not finished, "
                      "or every run diverged)", flush=True)
            else:
                chosen[a] = lr  # type: ignore[assignment]
    if phase in ("seeds", "all"):
        for seed in design.seeds:  # where no grid ran, the selection seed runs here too
            jobs += [job(arms[a], lr, seed) for a, lr in chosen.items()
                     if (seed != select_seed or not selecting) and arms[a].runs_at(seed)]
    if phase in ("stress", "all"):
        for factor in design.stress:
            for a, lr in chosen.items():
                if lr is None or arms[a].first_order:
                    continue
                if any(g is not None and math.isclose(g, lr * factor, rel_tol=1e-6) for g in arms[a].lrs):
                    continue  # that lr is a grid point: its seed-0 run is this stress run already
                jobs.append(job(arms[a], lr * factor, select_seed, f"{name}_stress"))
    return jobs


def command(name: str, job: Job, extra: list[str]) -> list[str]:
    lr = [] if job.lr is None else [f"method.optimizer.lr={job.lr:g}"]
    point = [f"{k}={v}" for k, v in job.point]
    return [
        sys.executable, "-m", "adazeta.cli", f"experiment={name}", *job.overrides, *point, f"method.name={job.arm}",
        *lr, f"seed={job.seed}", f"experiment_name={job.experiment}", f"hydra.run.dir='{job.run_dir}'", *extra,
    ]


def load(name: str) -> tuple[dict[str, Any], Design]:
    """The experiment's composed config and its design; exits with one line when it has none or a bad one."""
    try:
        config = compose_experiment(name)
        design = design_of(config, name)
    except ConfigError as err:
        raise InputError(str(err)) from None
    if design is None:
        raise InputError(f"experiment {name} has no `arms:` block; run it with adazeta-run -m experiment={name}")
    return config, design


LAUNCH_COLUMNS = ["time", "arm", "lr", "seed", "run_dir", "commit", "dirty", "allow_dirty", "command"]


def log_launch(job: Job, cmd: list[str], code: dict, allow_dirty: bool) -> None:
    """One row per launched run in results/runs/<experiment>/launches.csv: when, from which code, the command."""
    path = runs_dir() / job.experiment / "launches.csv"
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")  # plain \n line ends, as every CSV the project writes
        if new:
            writer.writerow(LAUNCH_COLUMNS)
        writer.writerow([time.strftime("%Y-%m-%dT%H:%M:%S"), job.arm, "" if job.lr is None else f"{job.lr:g}",
                         job.seed, str(job.run_dir.relative_to(runs_dir().parent.parent)), code["commit"],
                         code["dirty"], allow_dirty, "adazeta-run " + " ".join(shlex.quote(a) for a in cmd[3:])])


class Children:
    """The runs this driver has started and not yet seen end; a stop signal is passed on to them (each run
    checkpoints and records where it stopped), no new run starts, and the driver ends with the signal's status."""

    def __init__(self) -> None:
        self.running: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.stopped: int | None = None

    def run(self, cmd: list[str], env: dict, log: Any) -> int:
        with self.lock:
            if self.stopped is not None:
                return 128 + self.stopped
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            self.running.add(proc)
        try:
            return proc.wait()
        finally:
            with self.lock:
                self.running.discard(proc)

    def stop(self, signum: int, _frame: Any = None) -> None:
        if self.stopped is None:
            self.stopped = signum
            print(f"# {signal.Signals(signum).name}: no new run starts; the running ones checkpoint and stop (the "
                  "same command continues them)", flush=True)
        if signum == signal.SIGINT:
            return  # Ctrl-C reaches the runs from the terminal itself; a second SIGINT would stop them at once
        with self.lock:
            for proc in self.running:
                try:
                    proc.send_signal(signum)
                except ProcessLookupError:
                    pass


CHILDREN = Children()


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def main() -> None:
    try:
        _main()
    except InputError as err:
        print(err.message, file=sys.stderr)
        raise SystemExit(2) from None


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment")
    parser.add_argument("--phase", choices=(*PHASES, "all"), default="all")
    parser.add_argument("--arms", type=lambda s: [a.strip() for a in s.split(",") if a.strip()])
    parser.add_argument("--jobs", type=positive, default=2, help="runs at a time")
    parser.add_argument("--threads", type=positive, default=1, help="torch threads per run")
    parser.add_argument("--dry", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--factors", type=float, nargs="+", help="stress multipliers, replacing design.stress")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="start runs although the source tree has uncommitted changes (recorded in launches.csv)")
    args, extra = parser.parse_known_args()
    _, design = load(args.experiment)
    if args.factors:
        design = dataclasses.replace(design, stress=tuple(args.factors))

    code = git_state()
    if code["dirty"] and not args.dry and not args.allow_dirty:
        raise InputError(f"the source tree ({code['commit'][:12]}) has uncommitted changes, so a run's record would "
                         "not say which code made it; commit them, or pass --allow-dirty (recorded)")
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, CHILDREN.stop)
    env = use_shared(dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads)))
    phases = PHASES if args.phase == "all" else (args.phase,)
    failed = 0
    for phase in phases:  # a later phase reads the choices the earlier ones made
        if CHILDREN.stopped is not None:
            break
        jobs = plan(args.experiment, design, phase, args.arms)
        todo = [j for j in jobs if not j.done()]
        print(f"# {phase}: {len(jobs)} runs, {len(jobs) - len(todo)} already done", flush=True)

        def launch(job: Job) -> int:
            cmd = command(args.experiment, job, extra)
            where = "".join(f" {k}={v}" for k, v in job.point)
            owner = holder(job.run_dir)
            if owner is not None:  # another driver (or a hand-started run) has it: leave it to that process
                print(f"# {job.arm}{where} lr={job.lr} seed={job.seed}: skipped, another run holds it ({owner})",
                      flush=True)
                return 0
            if job.done():  # another driver ended it after this phase was planned: its files are left as they are
                print(f"# {job.arm}{where} lr={job.lr} seed={job.seed}: skipped, {status(job.run_dir)} meanwhile",
                      flush=True)
                return 0
            if CHILDREN.stopped is not None:  # stopping: the runs not started stay for the next invocation
                return 0
            print("$ adazeta-run " + " ".join(shlex.quote(a) for a in cmd[3:]), flush=True)
            if args.dry:
                return 0
            job.run_dir.mkdir(parents=True, exist_ok=True)
            log_launch(job, cmd, code, args.allow_dirty)
            start = time.time()
            with open(job.run_dir / "stdout.log", "a") as log:  # a resumed run's console follows its first part's
                if log.tell():
                    log.write(f"# --- continued {time.strftime('%Y-%m-%d %H:%M:%S')} by the study driver ---\n")
                    log.flush()
                rc = CHILDREN.run(cmd, env, log)
            print(f"# {job.arm}{where} lr={job.lr} seed={job.seed}: {status(job.run_dir)} (exit {rc}, "
                  f"{time.time() - start:.0f} s)", flush=True)
            return rc

        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            failed += sum(rc != 0 for rc in pool.map(launch, todo))
    if CHILDREN.stopped is not None:
        print(f"experiment.py: stopped by {signal.Signals(CHILDREN.stopped).name}; the runs it stopped kept their "
              "checkpoints: the same command continues them", file=sys.stderr)
        sys.exit(128 + CHILDREN.stopped)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
