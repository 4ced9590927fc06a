"""A worker for tests/test_distributed.py, launched as ``python -m torch.distributed.run ... dist_worker.py``.

    dist_worker.py train OUT_DIR OVERRIDE...   build the run's pieces, train them, write OUT_DIR/rank{R}.pt:
                                               the trainable state and the queries each step evaluated
    dist_worker.py run RUN_DIR FAIL_STEP OVERRIDE...
                                               the whole run (adazeta.run.run); rank 1 raises at FAIL_STEP
                                               (0: never), to check that one record names the failure
    dist_worker.py cli WHAT OVERRIDE...        ``adazeta-run OVERRIDE...`` on every rank, and WHAT on one:
                                               ``R:OVERRIDE``: rank R adds OVERRIDE last (what a node's own
                                               environment or files can make differ); ``R@STEP:SIGNAL``: rank R
                                               sends SIGNAL to itself after STEP (``SIGINT/launcher``: to
                                               torchrun, which a terminal's Ctrl-C reaches, and which relays it
                                               to every rank); ``R@start-up:SIGNAL``: during the command's
                                               start-up check, before the run begins
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from adazeta import distributed
from adazeta.distributed import Spread
from adazeta.build import build, compose_settings, seed_everything
from adazeta.tasks.objectives import build_objective
from adazeta.tracking import DivergenceMonitor, SilentTracker
from adazeta.train import Loop, Splits, train, trainable_state


def train_and_save(out: Path, overrides: list[str]) -> None:
    s = compose_settings(overrides)
    d = distributed.init(s.distributed)
    seed_everything(s.seed)  # as adazeta.run.execute does
    b = build(s)
    tok = b.tokenizer
    evaluated: list[list[int]] = []
    step = b.optimizer.step

    def recording_step(*args, **kwargs):
        loss = step(*args, **kwargs)
        seeds = getattr(b.optimizer, "last_evaluated_seeds", None)
        evaluated.append(list(seeds) if seeds is not None else [])
        return loss

    b.optimizer.step = recording_step

    objective = build_objective(s.task, b.data, b.enc, tok, s.model.max_length, s.train.eval_batch_size)
    scorer = dataclasses.replace(b.scorer, objective=objective)
    size = s.train.eval_batch_size
    splits = Splits(b.enc["train"], scorer.batches(b.enc["dev"], size, sort=True),
                    scorer.batches(b.enc["eval"], size, sort=True))
    spread = Spread(d.rank, d.world_size, s.distributed.mode) if d.enabled else None
    loop = Loop(SilentTracker(), DivergenceMonitor(s.divergence), s.seed, b.schedule, spread=spread)
    outcome = train(scorer, b.optimizer, splits, s.train, loop)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"trainable": trainable_state(b.model), "evaluated": evaluated, "steps": outcome.steps,
                "forward_passes": outcome.forward_passes}, out / f"rank{d.rank}.pt")
    distributed.close()


def run_with_fault(run_dir: Path, fail_step: int, overrides: list[str]) -> None:
    import os

    import adazeta.train as train_module
    from adazeta.run import run
    from helpers import compose_cfg  # this script's folder is on sys.path

    if fail_step and int(os.environ.get("RANK", "0")) == 1:
        progress_step = train_module.Progress.step

        def failing(self, step, *args):
            if step == fail_step:
                raise RuntimeError(f"injected fault at step {step}")
            return progress_step(self, step, *args)

        train_module.Progress.step = failing
    run(compose_cfg(overrides), run_dir, overrides)


def cli_with_one_rank_different(what: str, overrides: list[str]) -> None:
    import os
    import signal
    import time

    import adazeta.train as train_module
    from adazeta import cli

    who, change = what.split(":", 1)
    rank, _, at = who.partition("@")
    mine = os.environ.get("RANK") == rank
    extra = [change] if mine and not at else []
    if mine and at == "start-up":  # during the command's start-up check, before the run begins
        name, _, target = change.partition("/")
        check = cli.check

        def check_then_signal(*args, **kwargs):
            checked = check(*args, **kwargs)
            os.kill(os.getppid() if target == "launcher" else os.getpid(), signal.Signals[name])
            time.sleep(5)  # the start-up still under way when torchrun relays the signal to the ranks
            return checked

        cli.check = check_then_signal
    elif mine and at:
        name, _, target = change.partition("/")
        progress_step = train_module.Progress.step

        def signalling(self, step, *args):
            progress_step(self, step, *args)
            if step == int(at):
                if target == "launcher":  # what a Ctrl-C to the terminal's process group reaches: torchrun
                    os.kill(os.getppid(), signal.Signals[name])
                    time.sleep(0.5)  # the step still under way when torchrun relays the signal to the ranks
                else:
                    os.kill(os.getpid(), signal.Signals[name])

        train_module.Progress.step = signalling
    sys.argv = ["adazeta-run", *overrides, *extra]
    cli.main()


if __name__ == "__main__":
    mode, target, *rest = sys.argv[1:]
    if mode == "cli":
        cli_with_one_rank_different(target, rest)
    elif mode == "train":
        train_and_save(Path(target), rest)
    else:
        run_with_fault(Path(target), int(rest[0]), rest[1:])
