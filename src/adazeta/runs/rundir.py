"""A run directory has one owner, holds one configuration, never holds half a file; a run stops cleanly.

- ``claim``: an exclusive ``flock`` on ``<run_dir>/.lock`` for the whole run. A second run on the same directory
  gets a one-line error naming the owner's pid; a lock left by a process that died is released by the kernel
  with the process, so the next run simply takes it over (the pid it left is reported).
- ``config_differences``: which settings of a new command differ from the run a directory already holds, so
  that a finished run is skipped only when it is the same run.
- ``atomic_write_text``: temp file in the same directory, fsync, rename: a reader sees the old file or the new
  one, never a mix, and a failed write leaves the old file in place.
- ``StopSignals``: SIGTERM (a cluster's time limit, preemption), SIGINT (Ctrl-C), SIGHUP (the terminal closed) and
  SIGUSR1 / SIGUSR2 (a scheduler's notice that the end is near: SLURM's ``--signal``) ask the training loop to stop
  at the next step boundary, where it saves a checkpoint; during the final
  evaluation the first one lets the evaluation finish and its result be recorded; while the record is written,
  every signal waits for it. A second signal, or one before training starts, stops at once. The record says where
  the signal stopped the run and whether a checkpoint is left to resume from.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import threading
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from adazeta.errors import ConfigError
from adazeta.tasks.family import FAMILIES

LOCK_NAME = ".lock"
# Keys that say where files live or how a run is logged, not what it computes: they may differ between two
# commands for the same run. ``train.eval_batch_size``, ``train.checkpoint_every`` and ``model.device_map`` (where the
# layers sit) never change a number; ``method.optimizer.query_memory`` (how many replicas ``query_chunk=auto`` puts in one
# forward) changes the batched forwards' rounding only.
# ``task.version`` neither: the prompt format of the run's family is compared itself (its Family's ``unread_task_keys``).
NON_RESULT_KEYS = ("force", "dry_run", "verbose", "data.dir", "model.model_dir", "train.eval_batch_size",
                   "train.checkpoint_every", "train.save", "train.save_model", "task.version", "model.device_map",
                   "method.optimizer.query_memory")
# ``distributed.``: how the work is divided over processes (a data-parallel sum differs from one process only by
# rounding). ``guard.``: measurements of a run (its stall stop ends only a run whose updates change nothing).
# ``model.placements``: fixed data of the model's YAML (the recorded placement and model name say which sites a
# run used; older records do not hold it). ``arms.``, ``design.``: an experiment's plan (adazeta.experiments; older
# records hold a ``tuning.`` block, its former lr grids), not a run's hyper-parameters: a plan that grows (a new arm)
# must not split the runs it already holds.
NON_RESULT_PREFIXES = ("wandb.", "hydra.", "distributed.", "guard.", "model.placements.", "arms.", "design.", "tuning.")
# A task's settings for the other model family: a causal run never reads its masked template, and vice versa.
HEADLINE_KEYS = ("method.name", "task.name", "model.name", "seed")


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"train.max_steps": 4, ...}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def result_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The flattened config minus paths, logging settings and the other family's prompt format: what decides a
    run's numbers."""
    flat = flatten(config)
    family = FAMILIES.get(flat.get("model.family") or "causal")
    skip = NON_RESULT_PREFIXES + (family.unread_task_keys if family else ())
    return {k: v for k, v in flat.items() if k not in NON_RESULT_KEYS and not k.startswith(skip)}


def config_differences(recorded: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for every setting the recorded run and the new command disagree on.

    A key only the new config has is a setting added to the code since the recorded run; new settings default
    to the old behaviour, so it is not a difference. A key the new config lacks is.
    """
    old, cur = result_settings(recorded), result_settings(new)
    missing = object()
    # What names the run first (the message shows the first few), then the rest in key order.
    keys = sorted(old, key=lambda k: (k not in HEADLINE_KEYS, HEADLINE_KEYS.index(k) if k in HEADLINE_KEYS else 0, k))
    return [
        f"{key}: {old[key]!r} -> {cur.get(key, missing)!r}" if key in cur else f"{key}: {old[key]!r} -> (absent)"
        for key in keys
        if cur.get(key, missing) != old[key]
    ]


def _owner(path: Path) -> str:
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def _lock(fd: int, kind: int) -> bool:
    """Take the lock ``kind`` on ``fd`` without waiting; False when another open file holds a conflicting one."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        return False
    return True


SWEEP_LOCK_NAME = ".sweep.lock"  # a sweep's own: its points' run directories may include the sweep directory


@contextmanager
def claim(run_dir: Path, sweep: bool = False) -> Iterator[None]:
    """Hold ``run_dir`` (``sweep``: a sweep's directory) exclusively for the duration; ConfigError if another live
    process holds it."""
    what, key = ("sweep", "hydra.sweep.dir") if sweep else ("run", "hydra.run.dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / (SWEEP_LOCK_NAME if sweep else LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ConfigError(f"cannot write the {what} directory {run_dir}: {err.strerror}; choose another {key}")
    try:
        if not _lock(fd, fcntl.LOCK_EX):
            raise ConfigError(
                f"{what} directory {run_dir} is in use by another {what} ({_owner(path)}); wait for it to end "
                f"or choose another {key}"
            ) from None
        previous = _owner(path)
        if previous != "unknown":
            # A lock file with an owner but no lock held: that process ended without releasing it (killed).
            logging.getLogger("adazeta").warning("took over %s from a run that ended uncleanly (%s)", path, previous)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # a clean exit leaves no owner behind
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def holder(run_dir: Path) -> str | None:
    """Who holds ``run_dir`` now (its lock file's owner line), or None when no live process does."""
    path = run_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None  # never claimed, or not readable: a run would find out itself
    try:
        if not _lock(fd, fcntl.LOCK_SH):  # refused while a run holds it exclusively
            return _owner(path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one rename; on failure the old file (if any) is left as it was."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


class Interrupted(BaseException):
    """Raised by a stop signal that stops the run at once; a BaseException so that no ``except Exception`` eats it.

    ``where``: what the run was doing (``StopSignals.where``); ``again``: a second signal (the first asked for a
    stop at the next step boundary, or after the final evaluation).
    """

    def __init__(self, name: str, where: str = "the set-up", again: bool = False):
        super().__init__(name)
        self.name, self.where, self.again = name, where, again

    def describe(self) -> str:
        """The record's reason: which signal, during what, and that it stopped the run at once."""
        if self.again:
            return f"{self.name} again during {self.where}: stopped at once"
        return f"{self.name} during {self.where}, outside a training step"


# A scheduler's notice that the job's time is nearly up or that it is preempted (SLURM's ``--signal=USR1@T``;
# submitit asks for USR2 and handles it by requeueing the job). Left to Python's default, either kills the process
# with no record and no checkpoint, so both stop a run like SIGTERM; a handler installed for one before the run
# (submitit's) is called once the run is checkpointed and recorded (``forward``).
NOTICE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
# Every signal that warns of an end: each stops the run at a step boundary, checkpointed and recorded.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, *NOTICE_SIGNALS)
# What the run is doing decides what a first stop signal does (a second one stops at once, except in ``save``):
#   setup  before training (model and data loading, a probe's fit): stop at once, nothing to checkpoint
#   step   a training step or a dev evaluation: finish the step, checkpoint, stop
#   final  the final evaluation: finish it and record the result, then exit with the signal's status
#   save   writing a checkpoint or the record: every signal waits until it is written (a finished run, or the
#          checkpoint a first signal asked for, is never lost to the second)
PHASES = ("setup", "step", "final", "save")

_received: list[str] = []  # the stop signals this process received since the last ``StopSignals`` was entered


def received_signal() -> str | None:
    """The first stop signal the last run received, or None: the command's exit status (128 + n) follows it."""
    return _received[0] if _received else None


def forget_signals() -> None:
    """A new run starts (a run that is skipped never enters ``StopSignals``): no signal received yet."""
    _received.clear()


class StopSignals:
    """Within ``with``: every stop signal (STOP_SIGNALS) acts by ``phase`` (see PHASES); ``at`` moves between phases.

    A notice signal (SIGUSR1, SIGUSR2) that had a Python handler before (submitit's requeue): ``forward()`` calls
    that handler after the run has written its checkpoint and record. ``lost_peers`` (several processes): a signal
    that arrives while another rank's process is gone (torchrun stops the survivors with SIGTERM) is that rank's
    failure, raised at once as ``PeerLost``.
    """

    def __init__(self, lost_peers: Callable[[], str | None] | None = None) -> None:
        self.requested: str | None = None
        self.notice: tuple[int, Any] | None = None  # the notice signal received and its earlier handler
        self.phase, self.where = "setup", "the set-up (model and data loading)"
        self.lost_peers = lost_peers
        self._previous: dict[int, Any] = {}

    def __call__(self) -> str | None:
        """The name of the signal that asked the run to stop, or None: the training loop's ``stop`` check."""
        return self.requested

    def at(self, phase: str, where: str) -> None:
        """The run enters ``phase`` (PHASES), doing ``where`` (named in the record when a signal stops it)."""
        assert phase in PHASES, phase
        self.phase, self.where = phase, where

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        log = logging.getLogger("adazeta")
        _received.append(name)
        if signum in NOTICE_SIGNALS:
            self.notice = (signum, self._previous.get(signum))
        if self.phase == "save":
            self.requested = self.requested or name
            log.warning("%s: stopping once %s is written", name, self.where)
            return
        lost = self.lost_peers() if self.lost_peers is not None and self.phase != "final" else None
        if lost is not None:
            raise PeerLost(lost)
        first = self.requested is None
        self.requested = self.requested or name
        if first and self.phase == "step":  # finish the step, checkpoint, stop
            log.warning("%s: stopping after this step (send it again to stop at once)", name)
            return
        if first and self.phase == "final":
            log.warning("%s: finishing %s and recording the result, then stopping (send it again to stop at "
                        "once)", name, self.where)
            return
        raise Interrupted(name, self.where, again=not first)

    def __enter__(self) -> "StopSignals":
        forget_signals()
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def forward(self) -> None:
        """Hand a received notice signal to the handler it displaced (submitit: requeue the job and exit)."""
        if self.notice is not None and callable(self.notice[1]):
            signum, handler = self.notice
            self.notice = None
            handler(signum, None)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class PeerLost(RuntimeError):
    """Another rank's process is gone (several processes): the run fails, naming it."""
