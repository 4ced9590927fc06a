"""Does a run reproduce another? Compares two finished runs' files.

    python -m adazeta.tools.twins RUN_DIR TWIN_DIR [--tolerance 1e-6]

Reads each folder's ``result.json``, ``eval.csv``, ``metrics.csv`` and ``predictions/test.csv`` and prints: the dev
evaluations of each, the dev-loss difference at step 0 (the same weights before any update: what the machine alone
changes) and the largest over the curve, the training steps whose logged loss or parameter norm differ, the test
predictions that differ, and the commit and CPU each ran from. Two runs reproduce each other when their dev curves
have the same steps with every loss within the tolerance and every test prediction is the same. Exit status 0 when
they do, 1 when they do not, 2 on bad input (a folder without a finished run).

A ZO run is sensitive to its last bits: two CPUs whose matrix kernels round differently give the same weights
dev losses that differ around 1e-7, and the steps then carry the difference on. A pair from different CPUs that
does not match is reported as such: it says nothing about the code; a same-CPU pair does.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from adazeta.errors import ConfigError
from adazeta.runs.record import read_record
from adazeta.tools import one_line_errors


def read_csv(path: Path) -> list[dict[str, str]]:
    """A CSV file's rows as dicts; [] when the file is missing (a run that wrote none)."""
    try:
        with open(path) as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


TRAINING = ("loss", "n_queries", "forward_passes", "param_norm")  # a step's logged values that a replay repeats


@dataclass(frozen=True)
class Twins:
    evaluations: tuple[int, int]      # dev evaluations of each run
    same_steps: bool                  # the two dev curves were taken at the same steps
    start_gap: float                  # |dev loss difference| at the first evaluation (nan without one)
    dev_gap: float                    # largest |dev loss difference| over the shared evaluations
    steps_differ: int | None          # training steps whose logged values differ (None: the logs do not pair)
    predictions_differ: int | None    # test predictions that differ (None: the runs scored other examples)
    cpus: tuple[str, str]
    commits: tuple[str, str]

    def reproduced(self, tolerance: float) -> bool:
        return self.same_steps and self.dev_gap <= tolerance and self.predictions_differ == 0

    @property
    def same_cpu(self) -> bool:
        return self.cpus[0] == self.cpus[1]


def cpu(rec: dict) -> str:
    """The CPU (or device) name a run's result records, ``?`` where it has none."""
    from adazeta.runs.results import cpu_label

    device = rec.get("device") or {}
    if not isinstance(device, dict):
        return str(device)
    return cpu_label(device) if device.get("name") else str(device.get("type") or "?")


def commit(rec: dict) -> str:
    git = rec.get("git") or {}
    return str(git.get("commit", "?"))[:7] + ("+dirty" if git.get("dirty") else "")


def dev_curve(run_dir: Path) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r["loss"])) for r in read_csv(run_dir / "eval.csv") if r["split"] == "dev"]


def compare(run_dir: Path, twin_dir: Path) -> Twins:
    """The two runs' files side by side; ConfigError where either folder holds no finished or diverged run."""
    recs = []
    for d in (run_dir, twin_dir):
        rec = read_record(Path(d))
        if rec is None or rec.get("status") not in ("finished", "diverged"):
            state = "no result.json" if rec is None else f"status {rec.get('status')!r}"
            raise ConfigError(f"{d} holds no finished run ({state}): give the folder of a run that has ended")
        recs.append(rec)
    mine, theirs = dev_curve(Path(run_dir)), dev_curve(Path(twin_dir))
    gaps = [abs(a - b) for (_, a), (_, b) in zip(mine, theirs)]
    steps = [read_csv(Path(d) / "metrics.csv") for d in (run_dir, twin_dir)]
    paired = len(steps[0]) == len(steps[1]) and all(a["step"] == b["step"] for a, b in zip(*steps))
    steps_differ = (sum(any(a.get(k) != b.get(k) for k in TRAINING) for a, b in zip(*steps)) if paired else None)
    preds = [[(r["row"], r["pred"]) for r in read_csv(Path(d) / "predictions" / "test.csv")] for d in (run_dir, twin_dir)]
    same_rows = bool(preds[0]) and [r for r, _ in preds[0]] == [r for r, _ in preds[1]]
    return Twins(
        evaluations=(len(mine), len(theirs)),
        same_steps=[s for s, _ in mine] == [s for s, _ in theirs],
        start_gap=gaps[0] if gaps else math.nan,
        dev_gap=max(gaps, default=math.nan),
        steps_differ=steps_differ,
        predictions_differ=sum(a != b for a, b in zip(*preds)) if same_rows else None,
        cpus=(cpu(recs[0]), cpu(recs[1])),
        commits=(commit(recs[0]), commit(recs[1])),
    )


def verdict(t: Twins, tolerance: float) -> str:
    said = f"{'reproduced' if t.reproduced(tolerance) else 'not reproduced'} (dev-loss tolerance {tolerance:g})"
    if not t.reproduced(tolerance) and not t.same_cpu:
        said += "\nthe runs ran on different CPUs: a same-CPU pair tests the code, this one does not"
    return said


@one_line_errors
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("twin", type=Path)
    parser.add_argument("--tolerance", type=float, default=1e-6, help="largest dev-loss difference allowed")
    args = parser.parse_args()
    t = compare(args.run, args.twin)
    missing = "—"
    print(f"| | {args.run} | {args.twin} |\n|---|---|---|\n"
          f"| commit | {t.commits[0]} | {t.commits[1]} |\n| CPU | {t.cpus[0]} | {t.cpus[1]} |\n"
          f"| dev evaluations | {t.evaluations[0]} | {t.evaluations[1]} |\n\n"
          f"step-0 dev-loss difference: {t.start_gap:.2e}\nlargest dev-loss difference: {t.dev_gap:.2e}"
          f"{'' if t.same_steps else ' (the curves were taken at different steps)'}\n"
          f"training steps that differ: {missing if t.steps_differ is None else t.steps_differ}\n"
          f"test predictions that differ: {missing if t.predictions_differ is None else t.predictions_differ}\n"
          f"{verdict(t, args.tolerance)}")
    sys.exit(0 if t.reproduced(args.tolerance) else 1)


if __name__ == "__main__":
    main()
