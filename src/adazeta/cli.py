"""``adazeta-run``: the Hydra entry point, and nothing else.

    adazeta-run method=adazeta task=rte            # one run
    adazeta-run -m method=adazeta,mezo seed=0,1    # a sweep (Hydra multirun)
    adazeta-run --help                             # one page: usage, groups and options, main keys, exit codes

The command line is checked before Hydra runs it (``adazeta.overrides``): flags and overrides are composed
first, without torch, so that a mistyped option is reported in a second; a single run's composed config is then
parsed into its typed settings (which imports torch), before Hydra creates the run directory, and those settings
are handed to the run (``adazeta.settings.parse_once``), which does not parse them again. The runner
(``adazeta.run``: torch, transformers) and ``adazeta.distributed`` (torch) are imported inside the functions that
run, the one place this package imports late on purpose.

Exit status (README, "Bad input costs one line"):

    0        the run finished, diverged or stalled (a result), was skipped as already done, or --help / --cfg printed
    1        the run failed (an error in the run itself, or a write that failed); a sweep with a failed point
    2        usage: a bad flag, override or value, a missing file, a refused run or sweep directory: one line on
             stderr, no run starts; a sweep that left out values that could not compose or whose points all fail
    128 + n  stopped by signal n (SIGHUP: 129, SIGINT: 130, SIGUSR1: 138, SIGUSR2: 140, SIGTERM: 143): recorded;
             the last line says whether, and from which step, the same command resumes (Ctrl-C before the run
             began: 130, one line, nothing recorded)
"""

from __future__ import annotations

import os
import signal
import sys
import threading

# The package installed the Ctrl-C handler of the command's imports before anything else (adazeta/__init__.py).
from adazeta import STARTUP_INTERRUPTED, interrupted_while_importing  # noqa: E402

_COMMAND = __name__ == "__main__" or os.path.basename(sys.argv[0]) == "adazeta-run"  # not a library import (tests)
if _COMMAND and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, interrupted_while_importing)  # main() takes Ctrl-C over once imports are done

import contextlib  # noqa: E402  (after the Ctrl-C handler: these imports take seconds)
import logging  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # One of several processes (torchrun relays a Ctrl-C to every rank): a Ctrl-C while the modules below load
    # ends this process quietly, not with a traceback per rank; from ``main`` on it is an interrupted start-up.
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from adazeta.console import QuietStdout
from adazeta.errors import ConfigError, PeerError
from adazeta.overrides import check
from adazeta.paths import CONFIG_ENV, config_dir  # noqa: F401  (CONFIG_ENV re-exported)
from adazeta.runs.record import main_score, resume_hint
from adazeta.runs.rundir import STOP_SIGNALS, Interrupted, PeerLost, claim, received_signal

# A single run's settings as the pre-check parsed them (``check``), for the run to take rather than parse again.
_prechecked: dict[str, Any] = {}


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def _main(cfg: DictConfig) -> float | None:
    from adazeta.run import run

    _raise_if_interrupted_during_start_up()  # a Ctrl-C that an import swallowed still stops the start-up
    hydra_cfg = HydraConfig.get()
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    if sweeping:  # many runs share one console: log lines, not bars
        from adazeta.tracking import PLAIN_PROGRESS_ENV

        os.environ[PLAIN_PROGRESS_ENV] = "1"
    run_dir = Path(hydra_cfg.runtime.output_dir)
    from adazeta.distributed import launch_env

    where = launch_env()
    if where is not None and where[0] != 0:  # another task of a multi-task SLURM job: rank 0 reports
        try:
            run(cfg, run_dir, list(hydra_cfg.overrides.task), settings=_prechecked.get("settings"))
        except ConfigError:
            pass
        return None
    try:
        record = run(cfg, run_dir, list(hydra_cfg.overrides.task), settings=_prechecked.get("settings"))
        if where is not None:
            _exiting_on_signal()  # the run is over and recorded: no start-up left for a signal to stop
    except ConfigError as err:
        # A user's mistake: one line with the fix, no traceback.
        print(f"adazeta-run: error: {err}", file=sys.stderr)
        if sweeping:
            report_failure(hydra_cfg, f"{_point(hydra_cfg)}: {err}")
            return None  # the other jobs of the sweep still run
        sys.exit(2)
    except OSError as err:
        # The disk filled or a permission changed while writing the record: what was written stays.
        print(f"adazeta-run: error: could not write to {run_dir}: {err.strerror or err}; files already written "
              "there are kept", file=sys.stderr)
        sys.exit(1)
    except Exception:
        if not sweeping:
            raise
        # result.json already says `failed`, with the reason; one failed job must not stop a sweep.
        logging.getLogger("adazeta").exception("job %s failed; the sweep goes on", hydra_cfg.job.num)
        report_failure(hydra_cfg, f"{_point(hydra_cfg)}: {sys.exc_info()[0].__name__}: {sys.exc_info()[1]} "
                                  f"(see {run_dir})")
        return None
    if record.get("status") == "interrupted":
        # Stopped by a signal: the run is recorded (and checkpointed, when it could be); a sweep stops here too.
        _exiting_on_signal()
        print(f"adazeta-run: interrupted ({record.get('reason')}); {resume_hint(record)}", file=sys.stderr)
        sys.exit(128 + signal.Signals[record.get("signal") or "SIGINT"].value)
    received = received_signal()
    if received is not None:
        # A signal during the final evaluation or the record: the run completed first; the signal still stops.
        _exiting_on_signal()
        print(f"adazeta-run: {received} came too late to stop the run: it completed and is recorded "
              f"({record.get('status')}) in {run_dir}; nothing is left to resume", file=sys.stderr)
        sys.exit(128 + signal.Signals[received].value)
    return main_score(record, "dev")  # what a Hydra sweeper would optimise: dev accuracy, or F1


def _exiting_on_signal() -> None:
    """The run is recorded and this process now exits with its signal's status: a further stop signal (a second
    Ctrl-C, a scheduler's repeated SIGTERM) must not kill it on the way out, with another status."""
    from adazeta.runs.rundir import STOP_SIGNALS

    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class NewRunDir(Callback):
    """Notes, before Hydra makes a single run's directory, what it already holds (``hydra.callbacks`` in
    conf/config.yaml): a dry run, or a run refused at its start, then leaves no folder holding an empty log."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _run_dir_before
        try:
            path = Path(str(config.hydra.run.dir)).absolute()
        except Exception:  # a directory only Hydra can resolve: nothing is removed afterwards
            return
        existing = next((p for p in [path, *path.parents] if p.exists()), path.anchor)
        _run_dir_before = (path, set(os.listdir(path)) if path.is_dir() else None, Path(existing))


# The run directory, its entries before Hydra made it (None: it was absent) and its nearest folder that existed.
_run_dir_before: tuple[Path, set[str] | None, Path] | None = None


def remove_unused_run_dir() -> None:
    """Remove what Hydra created for a single run that wrote nothing: its empty log file, and the directory (and
    its parents) when this command created them and they hold nothing else. Anything that was there before, or
    that the run wrote, stays."""
    global _run_dir_before
    if _run_dir_before is None:
        return
    path, before, existed = _run_dir_before
    _run_dir_before = None
    if not path.is_dir():
        return
    entries = set(os.listdir(path)) - (before or set())
    if not all(name.endswith(".log") and (path / name).is_file() and (path / name).stat().st_size == 0
               for name in entries):
        return  # the run wrote something: keep it all
    for handler in list(logging.getLogger().handlers):  # Hydra's file handler on the log about to go
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == path:
            logging.getLogger().removeHandler(handler)
            handler.close()
    for name in entries:
        (path / name).unlink(missing_ok=True)
    if before is not None:
        return  # the directory was there before this command
    folder = path
    while folder != existed and existed in folder.parents and not os.listdir(folder):
        folder.rmdir()  # made by this command (below the nearest folder that existed) and empty
        folder = folder.parent


FAILURES = "failed_points.txt"  # in a sweep's directory: one line per point that did not run to a result


def _point(hydra_cfg: Any) -> str:
    return " ".join(hydra_cfg.overrides.task) or f"job {hydra_cfg.job.num}"


def report_failure(hydra_cfg: Any, line: str) -> None:
    """Append one line to the sweep's report: jobs may run in other processes (joblib, SLURM) than ``main``."""
    path = Path(hydra_cfg.sweep.dir) / FAILURES
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:  # one short append per line: whole lines, even concurrently
        f.write(line.replace("\n", " ") + "\n")


def follow(argv: list[str], settings: Any = None) -> None:
    """Rank 1.. of a run on several processes: the same composed config, no run directory or log file of its
    own (rank 0 runs Hydra, owns the directory and tells the others where it is and what to do)."""
    from hydra import compose, initialize_config_dir

    from adazeta.distributed import launch_env
    from adazeta.run import run

    overrides = [a for a in argv if not a.startswith(("hydra.", "hydra/", "+hydra.", "++hydra."))]
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        run(cfg, Path("."), overrides, settings=settings)
        _exiting_on_signal()  # the run is over: no start-up left for a signal to stop
    except PeerError:
        return  # rank 0 prints the line and fails the launch; failing here first could stop rank 0 before it does
    except ConfigError as err:  # this rank's own mistake, found after the start-up check
        print(f"adazeta-run: error: rank {launch_env()[0]}: {err}", file=sys.stderr)
        sys.exit(2)
    except PeerLost as err:  # another rank's process is gone (this rank recorded rank 0's death, when it was)
        print(f"adazeta-run: error: {err}", file=sys.stderr)
        sys.exit(1)


def refuse_together(problem: str) -> None:
    """A rank whose command line is refused (several processes): it joins the others' start-up check, so that
    every rank stops at once and rank 0 alone prints the line, naming the rank, and exits 2 (a rank that exited
    first would have torchrun stop the others with its own report instead)."""
    from adazeta import distributed

    distributed.init()
    try:
        distributed.agree(None, problem)
    except PeerError:
        sys.exit(0)  # rank 0 prints the line and fails the launch
    except ConfigError as err:
        print(f"adazeta-run: error: {err}", file=sys.stderr)
        sys.exit(2)
    finally:
        distributed.close()


def _stop_start_up(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name, "the start-up")


def start_up_signals(rank: int) -> None:
    """Several processes: until the run installs its own handlers (``adazeta.runs.rundir.StopSignals``), a stop signal
    ends the start-up with one line from rank 0 and status 128 + n, not a traceback per rank. The other ranks end
    by the signal itself, at once: one waiting inside a collective for rank 0 runs no Python handler."""
    if rank == 0:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _stop_start_up)
    else:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


_start_up_interrupted: list[int] = []  # SIGINT received before the run began (kept even if a library swallowed it)


def _interrupted_during_start_up(signum: int, frame: Any) -> None:
    """Ctrl-C before the run began, once the modules are imported: a KeyboardInterrupt where it lands, and
    remembered, so that a library that swallows it (a bare ``except`` around an optional import) cannot let the run
    begin anyway: ``_main`` raises it again before the run starts."""
    _start_up_interrupted.append(signum)
    raise KeyboardInterrupt


def _raise_if_interrupted_during_start_up() -> None:
    if _start_up_interrupted:
        raise KeyboardInterrupt


def main() -> None:
    """Check the overrides (one line and exit 2 for a mistake), run, and sum up a sweep's failed points. Ctrl-C
    before the run begins (its directory claimed, its signals handled: ``adazeta.runs.rundir.StopSignals``) is one line
    and exit status 130."""
    main_thread = threading.current_thread() is threading.main_thread()
    # A caller's process (tests, a script calling main) gets its signal handlers back at the end, whatever the
    # run set (its stop handlers, the ignored signals of a recorded exit: children would inherit SIG_IGN).
    callers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if main_thread and not _own_process() else {}
    previous = signal.getsignal(signal.SIGINT)
    # By name: under `python -m adazeta.cli` the handler was installed by the module run as __main__.
    ours = previous is signal.default_int_handler or getattr(previous, "__name__", None) == \
        interrupted_while_importing.__name__
    _start_up_interrupted.clear()  # an earlier call's Ctrl-C in this process is not this call's
    if ours and main_thread:
        signal.signal(signal.SIGINT, _interrupted_during_start_up)
    else:
        ours = False
    if sys.stdout is not None and not isinstance(sys.stdout, QuietStdout):
        sys.stdout = QuietStdout(sys.stdout)  # before Hydra points its console log at sys.stdout
    try:
        _checked_main()
    except KeyboardInterrupt:
        remove_unused_run_dir()  # Hydra may have made the run's folder: it holds nothing yet
        print(STARTUP_INTERRUPTED, file=sys.stderr, flush=True)
        sys.stdout.flush()
        if _own_process():  # the command's own process (not a caller's, as in tests)
            # Not sys.exit: CPython ends a process whose KeyboardInterrupt reached its top level by killing itself
            # with SIGINT (status -2, not 130), and a library's handling on the way out can leave that mark. Nothing
            # is written yet (the run had not begun), so an immediate exit loses nothing.
            os._exit(128 + signal.SIGINT.value)
        sys.exit(128 + signal.SIGINT.value)
    finally:
        for sig, handler in callers.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _own_process() -> bool:
    """Whether this process is the command itself (``adazeta-run``, or ``python -m adazeta.cli``, whose ``main``
    runs in the imported module), not a program that called ``main``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return _COMMAND or (spec is not None and spec.name == "adazeta.cli")


def _checked_main() -> None:
    from adazeta.distributed import launch_env

    where = launch_env()
    if where is None:
        return _main_checked(where)
    start_up_signals(where[0])
    try:
        _main_checked(where)
    except Interrupted as stop:  # before the run began: nothing was written, nothing to resume
        _exiting_on_signal()
        if where[0] == 0:
            print(f"adazeta-run: interrupted ({stop.name} during {stop.where}, before the run began); nothing was "
                  "written, so the same command starts the run", file=sys.stderr)
        sys.exit(128 + signal.Signals[stop.name].value)


def _main_checked(where: tuple[int, int, int] | None) -> None:
    checked = check(sys.argv[1:], config_dir())
    if checked.errors and where is not None:
        refuse_together("; ".join(checked.errors))
    for line in checked.errors:
        print(f"adazeta-run: error: {line}", file=sys.stderr)
    if checked.errors:
        sys.exit(2)
    if where is not None and checked.sweep_dir is not None:
        if where[0] == 0:
            print("adazeta-run: error: a sweep (-m) cannot run under torchrun: start one torchrun per point, or "
                  "sweep with hydra/launcher=submitit_slurm and hydra.launcher.tasks_per_node=N", file=sys.stderr)
        # Rank 0 alone fails: a rank that failed first would have torchrun stop rank 0 before it prints the line.
        sys.exit(2 if where[0] == 0 else 0)
    if where is not None and where[0] != 0:
        follow(checked.argv, checked.settings)
        return
    if checked.argv[:1] == ["--help"]:  # a page to read (conf/hydra/help/adazeta.yaml), not Hydra's config dump
        from adazeta.helppage import render
        from adazeta.overrides import read_flags

        ns, source, _ = read_flags(checked.argv[1:], config_dir())
        print(render(source, list(ns.overrides)))
        return
    for line in checked.dropped:
        print(f"adazeta-run: error: {line} (left out of the sweep; the other values run)", file=sys.stderr)
    report = checked.sweep_dir / FAILURES if checked.sweep_dir else None
    with contextlib.ExitStack() as held:
        if checked.sweep_dir is not None:
            try:  # a second copy of this sweep would take the first one's points for failed ones, and its report
                held.enter_context(claim(checked.sweep_dir, sweep=True))
            except ConfigError as err:
                print(f"adazeta-run: error: {err}", file=sys.stderr)
                sys.exit(2)
        if report is not None:
            report.unlink(missing_ok=True)  # an earlier sweep's report: this sweep writes its own
        sys.argv = [sys.argv[0], *checked.argv]
        _prechecked["settings"] = checked.settings
        try:
            _main()
        finally:
            _prechecked.clear()
            remove_unused_run_dir()  # a dry run, or a run refused at its start: no folder with an empty log
        failed = report.read_text(encoding="utf-8").splitlines() if report is not None and report.is_file() else []
    if checked.dropped or failed:
        print(f"adazeta-run: {len(checked.dropped) + len(failed)} sweep point(s) did not run to a result:",
              file=sys.stderr)
        for line in checked.dropped + failed:
            print(f"  {line}", file=sys.stderr)
        sys.exit(1 if failed else 2)


if __name__ == "__main__":
    from adazeta import cli  # `python -m adazeta.cli`: one module, whose state Hydra's callback (NewRunDir) shares

    cli.main()
