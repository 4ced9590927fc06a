"""Run an experiment's full tuning grid: one Hydra multirun per method, over that method's own grid.

    python -m adazeta.tools.sweep table2_llama [--dry] [extra Hydra overrides, e.g. hydra/launcher=joblib]

`adazeta-run -m experiment=NAME` sweeps method x task x seed at each method's reference hyper-parameters; the
experiment's `tuning:` block gives per-method grids (learning rates differ by orders of magnitude between
methods, so one shared grid would not do). Finished grid points are skipped on a rerun (force=true reruns).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from adazeta.paths import config_dir


def commands(name: str, extra: list[str]) -> list[list[str]]:
    spec = yaml.safe_load((Path(config_dir()) / "experiment" / f"{name}.yaml").read_text()) or {}
    params = dict(spec.get("hydra", {}).get("sweeper", {}).get("params", {}))
    tuning = spec.get("tuning") or {}
    methods = [m.strip() for m in str(params.pop("method")).split(",")]
    out = []
    for method in methods:
        grid = {k: ",".join(str(v) for v in values) for k, values in (tuning.get(method) or {}).items()}
        args = [f"experiment={name}", f"method={method}"]
        args += [f"{k}={v}" for k, v in {**params, **grid}.items()]
        out.append([sys.executable, "-m", "adazeta.cli", "-m", *args, *extra])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment")
    parser.add_argument("--dry", action="store_true", help="print the commands, run nothing")
    args, extra = parser.parse_known_args()
    failed = 0
    for cmd in commands(args.experiment, extra):
        print("$ adazeta-run " + " ".join(shlex.quote(a) for a in cmd[3:]), flush=True)
        if not args.dry:
            failed += subprocess.run(cmd).returncode != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
