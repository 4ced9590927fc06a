"""Run an experiment made of arms: each arm's lr grid on dev, then seeds at the chosen lr, then a stress test.

    python -m adazeta.tools.experiment cpu_zo [--phase select|seeds|stress|all] [--jobs 2] [--threads 1] [--dry]
                                        [--arms tt_q1,mezo_lora] [extra adazeta-run overrides]

The experiment config (conf/experiment/NAME.yaml) lists `arms` (overrides + lr grid) and `design` (selection
seed, seeds, stress multipliers, run order). Every run is one `adazeta-run` in its own directory,
results/runs/NAME/ARM/lr=LR,seed=S under the current directory (the repository root through make); a directory
that already holds a finished or diverged result is skipped, so the experiment can be interrupted and continued.
The lr of an arm is chosen on dev accuracy (ties: dev loss) at the selection seed, never on test, and only once
its whole grid has run. Stress runs go to NAME_stress.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

from adazeta.paths import config_dir
from adazeta.tools.offline import use_shared
from adazeta.record import ENDED, main_score
from adazeta.results import git_state

PHASES = ("select", "seeds", "stress")


@dataclass
class Job:
    arm: str
    lr: float | None  # None: an arm without a learning rate (zero-shot)
    seed: int
    experiment: str
    overrides: list[str]

    @property
    def run_dir(self) -> Path:
        name = f"seed={self.seed}" if self.lr is None else f"lr={self.lr:g},seed={self.seed}"
        return runs_dir() / self.experiment / self.arm / name

    def done(self) -> bool:
        return status(self.run_dir) in ENDED


def runs_dir() -> Path:
    """results/runs under the current directory, absolute: each run gets it in its hydra.run.dir."""
    return Path.cwd() / "results" / "runs"


def status(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / "result.json").read_text()).get("status")
    except (OSError, ValueError):
        return None


def record(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "result.json").read_text())
    except (OSError, ValueError):
        return None


def grid(spec: dict) -> list[float | None]:
    """An arm's learning rates; [None] for an arm that trains nothing."""
    return [float(lr) for lr in spec["lr"]] if spec.get("lr") else [None]


def runs_at(spec: dict, seed: int) -> bool:
    """Whether an arm runs at ``seed``: every design seed unless the arm lists its own ``seeds`` (an arm that does
    not depend on the run seed, zero-shot or a deterministic probe, runs once)."""
    return spec.get("seeds") is None or seed in [int(s) for s in spec["seeds"]]


UNDECIDED = object()


def chosen_lr(name: str, arm: str, spec: dict, seed: int) -> float | None | object:
    """The grid's lr with the best dev accuracy at ``seed`` (ties: lower dev loss), as ``make tables`` selects;
    UNDECIDED until every grid point has a finished or diverged result. Test is never looked at."""
    results = []
    if not runs_at(spec, seed):  # an arm that never runs at the selection seed has nothing to select
        return grid(spec)[0] if len(grid(spec)) == 1 else UNDECIDED
    for lr in grid(spec):
        rec = record(Job(arm, lr, seed, name, []).run_dir)
        if rec is None or rec.get("status") not in ENDED:
            return UNDECIDED
        results.append((-main_score(rec, "dev"), rec["dev_loss"], len(results), lr))
    return min(results)[3]


def plan(name: str, config: dict, phase: str, arms: list[str] | None) -> list[Job]:
    design = config.get("design") or {}
    order = design.get("order") or list(config["arms"])
    order = [a for a in order if a in config["arms"]] + [a for a in config["arms"] if a not in order]
    if arms:
        unknown = sorted(set(arms) - set(config["arms"]))
        if unknown:
            sys.exit(f"experiment.py: error: unknown arm(s) {', '.join(unknown)}; known: {', '.join(config['arms'])}")
        order = [a for a in order if a in arms]
    select_seed = int(design.get("select_seed", 0))
    jobs: list[Job] = []
    if phase in ("select", "all"):
        # grid points interleaved across arms, so that every arm's grid fills in at the same pace
        grids = {a: grid(config["arms"][a]) for a in order}
        for i in range(max(len(g) for g in grids.values())):
            for a in order:
                if i < len(grids[a]) and runs_at(config["arms"][a], select_seed):
                    jobs.append(Job(a, grids[a][i], select_seed, name, config["arms"][a]["overrides"]))
    chosen: dict[str, float] = {}
    if phase in ("seeds", "stress", "all"):
        for a in order:
            lr = chosen_lr(name, a, config["arms"][a], select_seed)
            if lr is UNDECIDED:
                print(f"# {phase}: {a}: no lr chosen yet (its grid has not finished, or every run diverged)", flush=True)
            else:
                chosen[a] = lr
    if phase in ("seeds", "all"):
        for seed in design.get("seeds", [select_seed]):
            jobs += [Job(a, lr, int(seed), name, config["arms"][a]["overrides"])
                     for a, lr in chosen.items() if int(seed) != select_seed and runs_at(config["arms"][a], int(seed))]
    if phase in ("stress", "all"):
        for factor in design.get("stress", []):
            for a, lr in chosen.items():
                if lr is None or config["arms"][a].get("first_order"):
                    continue
                if any(g is not None and math.isclose(g, lr * float(factor), rel_tol=1e-6) for g in grid(config["arms"][a])):
                    continue  # that lr is a grid point: its seed-0 run is this stress run already
                jobs.append(Job(a, lr * float(factor), select_seed, f"{name}_stress", config["arms"][a]["overrides"]))
    return jobs


def command(name: str, job: Job, extra: list[str]) -> list[str]:
    lr = [] if job.lr is None else [f"method.optimizer.lr={job.lr:g}"]
    return [
        sys.executable, "-m", "adazeta.cli", f"experiment={name}", *job.overrides, f"method.name={job.arm}", *lr,
        f"seed={job.seed}", f"experiment_name={job.experiment}", f"hydra.run.dir='{job.run_dir}'", *extra,
    ]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment")
    parser.add_argument("--phase", choices=(*PHASES, "all"), default="all")
    parser.add_argument("--arms", type=lambda s: [a.strip() for a in s.split(",") if a.strip()])
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--dry", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--factors", type=float, nargs="+", help="stress multipliers, replacing design.stress")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="start runs although the source tree has uncommitted changes (recorded in launches.csv)")
    args, extra = parser.parse_known_args()
    path = Path(config_dir()) / "experiment" / f"{args.experiment}.yaml"
    if not path.is_file():
        sys.exit(f"experiment.py: error: no experiment config {path}")
    config = yaml.safe_load(path.read_text()) or {}
    if args.factors:
        config.setdefault("design", {})["stress"] = args.factors
    if not config.get("arms"):
        sys.exit(f"experiment.py: error: {path} has no `arms:` block; run it with adazeta-run -m experiment=...")

    code = git_state()
    if code["dirty"] and not args.dry and not args.allow_dirty:
        sys.exit(f"experiment.py: error: the source tree ({code['commit'][:12]}) has uncommitted changes, so a run's "
                 "record would not say which code made it; commit them, or pass --allow-dirty (recorded)")
    env = use_shared(dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads)))
    phases = PHASES if args.phase == "all" else (args.phase,)
    failed = 0
    for phase in phases:  # a later phase reads the choices the earlier ones made
        jobs = plan(args.experiment, config, phase, args.arms)
        todo = [j for j in jobs if not j.done()]
        print(f"# {phase}: {len(jobs)} runs, {len(jobs) - len(todo)} already done", flush=True)

        def launch(job: Job) -> int:
            cmd = command(args.experiment, job, extra)
            print("$ adazeta-run " + " ".join(shlex.quote(a) for a in cmd[3:]), flush=True)
            if args.dry:
                return 0
            job.run_dir.mkdir(parents=True, exist_ok=True)
            log_launch(job, cmd, code, args.allow_dirty)
            start = time.time()
            with open(job.run_dir / "stdout.log", "w") as log:
                rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
            print(f"# {job.arm} lr={job.lr} seed={job.seed}: {status(job.run_dir)} (exit {rc}, "
                  f"{time.time() - start:.0f} s)", flush=True)
            return rc

        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            failed += sum(rc != 0 for rc in pool.map(launch, todo))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
