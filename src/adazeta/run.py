"""A run's lifecycle: claim its directory, skip or resume what it holds, build it (``adazeta.build``), train,
checkpoint, test and record it (STYLE §1).
Over 400 lines: every path a run can end on (skipped, resumed, refused, interrupted, failed on another rank,
recorded) in one place, so that each writes result.json the same way.

config -> settings -> preflight -> build (model + adapter, data, scorer, optimizer, schedule) -> loop ->
evaluation -> tracked results. Everything is parsed into typed, validated dataclasses first, and local files are
checked, so that a user's mistake costs one line and no model load.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from adazeta import distributed
from adazeta.adapters.saved import adopt_saved_run
from adazeta.scoring.calibration import calibrate
from adazeta.distributed import Dist, Spread
from adazeta.dryrun import dry_run
from adazeta.errors import ConfigError, PeerError
from adazeta.probe import linear_probe
from adazeta.runs.record import ENDED, RunRecord, resume_hint
from adazeta.runs.results import device_info, git_state, package_versions, read_record, write_result
from adazeta.runs.rundir import (
    Interrupted,
    PeerLost,
    StopSignals,
    atomic_write_text,
    claim,
    config_differences,
    flatten,
    forget_signals,
    result_settings,
)
from adazeta.runs.saving import model_card, save_adapters
from adazeta.build import build, preflight, seed_everything
from adazeta.settings import Settings, parse_once
from adazeta.tasks.loaders import TaskData
from adazeta.tracking import (
    DivergenceMonitor,
    SilentTracker,
    STEP_COLUMNS,
    Tracker,
    eval_columns,
    missing_rows,
    peak_memory_mb,
    reset_peak_memory,
    write_predictions,
)
from adazeta.train import Checkpoints, Loop, Observer, Splits, train

log = logging.getLogger("adazeta")


def run(cfg: DictConfig, run_dir: Path, overrides: list[str] | None = None,
        observers: Sequence[Observer] = (), settings: Settings | None = None) -> dict[str, Any]:
    """Run one experiment described by the composed config; write its files to ``run_dir``; return the record.

    The run directory is claimed for the whole run (a second run on it is refused). A directory that holds a
    run of the same settings is skipped when that run ended (finished, diverged) and resumed from its
    checkpoint when it was interrupted; one that holds a run of other settings is refused unless ``force``, as is
    one whose record or checkpoint is damaged (never taken for an empty directory). ``observers``: tools that
    watch the run's steps and evaluations (``adazeta.train.Observer``: diagnostics, benches); no number changes.
    ``settings``: the command's pre-check parsed them already (used when they are this config's: parsed once).
    """
    forget_signals()
    where = distributed.launch_env()
    try:
        s: Settings | None = parse_once(adopt_saved_run(cfg, overrides or []), settings)
        preflight(s)
        problem = None
    except ConfigError as err:
        if where is None or cfg.get("dry_run") is True:
            raise
        s, problem = None, str(err)  # one rank's mistake (a file missing on its node): every rank stops with it
    if s is not None and s.dry_run:
        return dry_run(s) if where is None or where[0] == 0 else {}  # one report for the whole launch
    try:
        d = distributed.init(s.distributed if s is not None else None)
    except Exception:
        if problem is None:
            raise
        raise ConfigError(problem) from None  # no group to tell (no rendezvous): this rank says it alone
    if not d.enabled:
        return _run_claimed(s, run_dir, overrides, d, observers)
    try:
        # Before any work: the ranks run one experiment (the same settings), or none of them runs.
        distributed.agree(agreed_settings(s.raw) if s is not None else None, problem)
        run_dir = Path(distributed.broadcast(str(run_dir)))  # Hydra's timestamped folder: rank 0's
        if d.is_main:
            return _run_claimed(s, run_dir, overrides, d, observers)
        # The other ranks do what rank 0 decided: stop with its error, take its finished result, or run.
        decision, payload = distributed.broadcast(None)
        if decision == "error":
            raise PeerError(payload)
        if decision == "skip":
            return payload
        resume = load_checkpoint(run_dir / CHECKPOINT) if payload else None
        return execute(s, run_dir, resume, d, observers)
    finally:
        distributed.close()


def _run_claimed(s: Settings, run_dir: Path, overrides: list[str] | None, d: Dist,
                 observers: Sequence[Observer] = ()) -> dict[str, Any]:
    """Claim ``run_dir``, skip or resume what it holds, and run (rank 0 of several tells the others which)."""
    decided = False

    def decide(kind: str, payload: Any) -> Any:
        """Tell the other ranks (several processes) what rank 0 decided: skip, run, or stop with an error."""
        nonlocal decided
        decided = True
        return distributed.broadcast((kind, payload))[1] if d.enabled else payload

    try:
        with claim(run_dir):
            checkpoint = run_dir / CHECKPOINT
            if s.force:
                checkpoint.unlink(missing_ok=True)
            writable_record(run_dir)
            previous = None if s.force else previous_run(run_dir)
            resume = None
            if previous is not None:
                status, config, record = previous
                differences = config_differences(config, s.raw)
                if differences:
                    shown = "; ".join(differences[:3]) + (
                        f"; and {len(differences) - 3} more" if len(differences) > 3 else "")
                    raise ConfigError(
                        f"{run_dir} holds {article(status)} {status} run with other settings ({shown}); rerun with "
                        "force=true to replace it, or choose another hydra.run.dir"
                    )
                if status in ENDED:
                    log.info("skipping: %s already holds %s %s result (force=true reruns it)", run_dir, article(status),
                             status)
                    return decide("skip", record)
                if checkpoint.is_file():
                    resume = load_checkpoint(checkpoint)
                    check_resumable(run_dir, resume, s.task.metric)
                    check_layout(checkpoint, resume, distributed.layout(d, s.distributed.mode),
                                 s.distributed.resume_layout)
            write_provenance(run_dir, s.raw, overrides)
            decide("run", resume is not None)
            return execute(s, run_dir, resume, d, observers)
    except BaseException as err:
        if d.enabled and not decided:  # the other ranks wait for a decision: they stop too
            distributed.broadcast(("error", str(err) if isinstance(err, ConfigError) else f"{type(err).__name__}: {err}"))
        raise


def agreed_settings(raw: dict[str, Any]) -> dict[str, Any]:
    """What every rank of a run on several processes must hold alike: the settings that decide the run's numbers
    (``result_settings``: paths that may differ per node left out), how the work is divided, and the guards (the
    checksum is a collective every rank must reach at the same step)."""
    shared = {k: v for k, v in flatten(raw).items() if k == "distributed.mode" or k.startswith("guard.")}
    return {**result_settings(raw), **shared}


CHECKPOINT = "checkpoint.pt"


def article(word: str) -> str:
    """'an' before a vowel (an interrupted run), else 'a' (a finished run)."""
    return "an" if word[:1].lower() in "aeiou" else "a"


def previous_run(run_dir: Path) -> tuple[str, dict[str, Any], dict[str, Any] | None] | None:
    """(status, config, record) of the run ``run_dir`` already holds: its result record, else its checkpoint
    (killed: no record). None when it holds neither; ConfigError when either is damaged."""
    path = run_dir / "result.json"
    if path.exists():
        record = read_record(path)
        return record["status"], record["config"], record
    if (run_dir / CHECKPOINT).is_file():
        return "interrupted", load_checkpoint(run_dir / CHECKPOINT)["config"], None
    return None


def writable_record(run_dir: Path) -> None:
    """Stop before any work when the record could not be written at the end (a folder where result.json belongs)."""
    path = run_dir / "result.json"
    if path.exists() and not path.is_file():
        raise ConfigError(f"{path} is not a file, so the run's record could not be written there; move it away, or "
                          "choose another hydra.run.dir")


CHECKPOINT_KEYS = {"config": dict, "loop": dict, "tracker": dict}
LOOP_KEYS = ("step",)
TRACKER_KEYS = ("metrics_rows", "eval_rows", "last_step")


def checkpoint_problem(state: Any) -> str | None:
    """What makes ``state`` (a loaded checkpoint.pt) not a checkpoint this runner wrote, or None."""
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not the runner's dict"
    for key, kind in CHECKPOINT_KEYS.items():
        if not isinstance(state.get(key), kind):
            return f"no {key!r} entry" if key not in state else f"its {key!r} entry is not a {kind.__name__}"
    missing = [f"loop.{k}" for k in LOOP_KEYS if k not in state["loop"]]
    missing += [f"tracker.{k}" for k in TRACKER_KEYS if k not in state["tracker"]]
    return f"no {', '.join(missing)}" if missing else None


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint this runner wrote; ConfigError naming the file and the way out when it is not one."""
    way_out = "move it away to keep it, or rerun with force=true to start the run over"
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # a truncated file from a crash during the write's rename cannot happen; others can
        raise ConfigError(f"cannot read the checkpoint {path} ({type(err).__name__}); {way_out}") from None
    problem = checkpoint_problem(state)
    if problem is not None:
        raise ConfigError(f"{path} is not a checkpoint of this runner ({problem}); {way_out}")
    return state


def check_resumable(run_dir: Path, state: dict[str, Any], metric: str) -> None:
    """Before any work: the CSVs a checkpoint continues hold the rows it counts (none was deleted or cut)."""
    position, step = state["tracker"], state["loop"]["step"]
    for name, columns, rows in (("metrics.csv", STEP_COLUMNS, position["metrics_rows"]),
                                ("eval.csv", eval_columns(metric), position["eval_rows"])):
        problem = missing_rows(run_dir / name, columns, rows)
        if problem is not None:
            raise ConfigError(f"{run_dir / name}: {problem}, so the checkpoint at step {step} cannot resume the run; "
                              "restore the file, or rerun with force=true to start the run over")


def check_layout(path: Path, state: dict[str, Any], current: dict[str, Any], resume_layout: str) -> None:
    """Before any work: a checkpoint resumes on the process layout that wrote it, unless
    ``distributed.resume_layout=any``."""
    change = distributed.layout_change(state.get("layout"), current)
    if change is None:
        return
    if resume_layout == "any":
        log.warning("resuming %s on another process layout (%s), as distributed.resume_layout=any allows", path, change)
        return
    raise ConfigError(f"{path} was written on another process layout ({change}), which would continue the run with "
                      "its work divided otherwise; launch as before, or rerun with distributed.resume_layout=any to "
                      "resume anyway (or force=true to start over)")


def verified_checkpoint(run_dir: Path, s: Settings, d: Dist) -> int | None:
    """The step of the checkpoint rank 0 left in ``run_dir`` before its process died, when it is one this run can
    resume from (readable, these settings and process layout, its CSV rows all there); None otherwise, and a file
    that is not is moved aside (``checkpoint.unverified.pt``), so that the same command starts the run over."""
    path = run_dir / CHECKPOINT
    if not path.is_file():
        return None
    try:
        state = load_checkpoint(path)
        if config_differences(state["config"], s.raw):
            raise ConfigError("written with other settings")
        check_resumable(run_dir, state, s.task.metric)
        check_layout(path, state, distributed.layout(d, s.distributed.mode), "same")
        return int(state["loop"]["step"])
    except ConfigError as err:
        log.warning("%s cannot resume this run (%s): moved to %s", path, err, UNVERIFIED)
        os.replace(path, run_dir / UNVERIFIED)
        return None


UNVERIFIED = "checkpoint.unverified.pt"


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """torch.save to a temp file, then one rename: a crash mid-write leaves the previous checkpoint."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def write_provenance(run_dir: Path, raw: dict[str, Any], overrides: list[str] | None) -> None:
    """``.hydra/config.yaml`` and ``overrides.yaml``, written only once the directory is ours and matches."""
    where = run_dir / ".hydra"
    where.mkdir(parents=True, exist_ok=True)
    atomic_write_text(where / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(raw)))
    if overrides is not None:
        atomic_write_text(where / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(list(overrides))))


def execute(
    s: Settings, run_dir: Path, resume: dict[str, Any] | None = None, d: Dist = distributed.SINGLE,
    observers: Sequence[Observer] = (),
) -> dict[str, Any]:
    """Build, train, test and record one run; ``resume``: a checkpoint this run's settings wrote earlier.

    A stop signal (``adazeta.runs.rundir.STOP_SIGNALS``: TERM, INT, HUP, USR1, USR2) ends the run ``interrupted``
    (checkpointed when it happens during training; during the final evaluation, a first signal lets the run finish
    and be recorded: see ``adazeta.runs.rundir.PHASES``); a finished or diverged run removes its checkpoint.
    ``result.json`` is written in every case, atomically, the signals held back meanwhile.
    Several processes (``d``): every rank trains; rank 0 alone writes files and wandb, and when another rank
    fails, or a signal stops it at once, rank 0 records the run with that rank's report; when rank 0's process
    ends without one (SIGKILL), the lowest surviving rank records the run in its place (``verified_checkpoint``).
    """
    # Seconds over every invocation: a resumed run starts its clock at the time its checkpoint recorded.
    started = time.time() - (float(resume.get("wall_time_s", 0.0)) if resume is not None else 0.0)
    code = git_state()  # the code that runs, read before it runs (the tree may change during a long run)
    seed_everything(s.seed)
    record = RunRecord(s.method, s.task.name, s.task.version, s.model.name, s.seed, s.experiment)
    checkpoint, tracker = run_dir / CHECKPOINT, None
    saved: list[int | None] = [None]  # the step of the checkpoint in run_dir, the one the same command resumes from
    if resume is not None:
        saved[0] = record.resumed_from_step = resume["loop"]["step"]
        log.info("resuming %s from its checkpoint at step %d", run_dir, resume["loop"]["step"])
    signals = StopSignals(distributed.lost_peers if d.enabled else None)
    writer = d.is_main  # rank 0 writes the record; another rank only when rank 0's process is gone
    with signals:
        try:
            tracker = _execute(s, run_dir, resume, record, signals, saved, started, d, observers)
        except Interrupted as stop:  # a signal stopped the run at once
            signals.at("save", "the run's record")
            record.status, record.signal, record.reason = "interrupted", stop.name, stop.describe()
            if d.enabled and not d.is_main:
                distributed.report_failure(record.reason, stop.name)  # for rank 0's record
        except Exception as err:
            signals.at("save", "the run's record")
            reason = f"{type(err).__name__}: {err}"
            if d.enabled and not d.is_main:
                heir = distributed.heir_of_main()
                if heir is None:
                    distributed.report_failure(reason)  # for rank 0's record
                    raise
                writer, record.reason = True, heir  # rank 0 died without a word: this rank records the run
                saved[0] = verified_checkpoint(run_dir, s, d)
                raise PeerLost(f"{heir}: failed, in {run_dir / 'result.json'}") from err
            peer = distributed.peer_failure(err) if d.enabled else None
            if peer is None or peer.signal is None:
                record.reason = peer.reason if peer else reason  # a collective broken by another rank: its failure
                raise
            # Another rank was stopped at once by a signal, which broke this rank's collective: interrupted too.
            record.status, record.signal, record.reason = "interrupted", peer.signal, peer.reason
        finally:
            signals.at("save", "the run's record")  # from here every signal waits for the record
            if record.status in ("interrupted", "failed"):
                record.checkpoint_step = saved[0] if checkpoint.is_file() else None
            elif signals.requested is not None:  # it came during the final evaluation, which finished
                record.signal = signals.requested
            if writer:  # rank 0 writes the record (or the rank that outlived it)
                record.wall_time_s = round(time.time() - started, 2)
                record.git, record.packages, record.config = code, package_versions(), s.raw
                written = record.as_dict()
                try:
                    write_result(run_dir / "result.json", written)
                    distributed.mark_recorded(record.status)
                finally:
                    if tracker is not None:
                        tracker.summary({k: v for k, v in written.items()
                                         if isinstance(v, (int, float, str)) and v is not None})
                        tracker.close(failed=record.status == "failed")
            elif tracker is not None:
                tracker.close()
        if d.is_main and record.status in ENDED:
            checkpoint.unlink(missing_ok=True)  # the result is final: nothing to resume
    if record.status == "interrupted" and writer:  # the other ranks cannot tell whether rank 0 saved its checkpoint
        log.warning("interrupted (%s); %s", record.reason, resume_hint(record.as_dict()))
    elif signals.requested is not None:
        log.warning("%s: the run completed first and is recorded (%s) in %s", signals.requested, record.status,
                    run_dir)
    signals.forward()  # a notice's earlier handler (submitit's, on SIGUSR2): now that all is saved, let it requeue
    return record.as_dict()


def summary_line(outcome: Any, metric: str, select_on: str, run_dir: Path) -> str:
    """The run's last log line: how it ended, which dev evaluation was kept and on what, dev loss and score from the
    first evaluation to the kept one (the loss chooses the kept state by default: it can fall while the score stays),
    and the test score of that state."""
    chosen = "dev loss" if select_on == "loss" else f"dev {metric}"
    dev_first, dev_best = outcome.initial_dev, outcome.best_dev
    return (f"{outcome.status} after {outcome.steps} steps (best dev step {outcome.best_step}, chosen on {chosen}): "
            f"dev loss {dev_first.loss:.4f} -> {dev_best.loss:.4f}, dev {metric} {dev_first.score:.4f} -> "
            f"{dev_best.score:.4f}, test {metric} {outcome.test.score:.4f}; results in {run_dir}")


def save_predictions(run_dir: Path, outcome: Any, data: TaskData) -> None:
    """predictions/dev.csv (the best-dev state's) and test.csv, each row named by its source row, for paired
    comparisons between runs on the same examples (adazeta.stats)."""
    for split, result, examples in (("dev", outcome.best_dev, data.dev), ("test", outcome.test, data.eval)):
        if result.predictions is not None and len(result.predictions):
            rows = [i if e.row is None else e.row for i, e in enumerate(examples)]
            write_predictions(run_dir, split, result.predictions, rows)


def save_trained(run_dir: Path, model: Any, s: Settings, record: RunRecord, outcome: Any) -> None:
    """``adapter/`` (the tested best-dev state), ``adapter_last/`` (``train.save=last|both``), and ``model/`` for a
    full-parameter method with ``train.save_model=true`` (adazeta.runs.saving)."""
    kind, config = s.adapter.kind, s.adapter.config
    if not config.trains:
        return
    overrides = run_dir / ".hydra" / "overrides.yaml"
    command = OmegaConf.load(overrides) if overrides.is_file() else []
    base = {"name": s.model.name, "hub_id": s.model.hub_id, "path": s.model.path, "gguf_file": s.model.gguf_file,
            "family": s.model.family, "dtype": s.model.dtype}

    def card(folder: Path) -> str:
        return model_card(record.as_dict(), [str(c) for c in command], kind, base, folder,
                          whole_model=config.trains_backbone)

    if config.trains_backbone:
        if s.train.save_model:
            size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
            log.info("writing the trained model (%.2f GiB) to %s", size, run_dir / "model")
            model.save_pretrained(str(run_dir / "model"))
            (run_dir / "model" / "README.md").write_text(card(run_dir / "model"))
        return
    if s.train.save in ("best", "both"):
        save_adapters(model, run_dir / "adapter", kind, config, base, card(run_dir / "adapter"))
    if s.train.save in ("last", "both") and outcome.last_state is not None:
        save_adapters(model, run_dir / "adapter_last", kind, config, base, card(run_dir / "adapter_last"),
                      state=outcome.last_state)


def open_tracker(s: Settings, run_dir: Path, resume: dict[str, Any] | None, d: Dist) -> Tracker:
    """Rank 0's CSV files and wandb run (continued when the run resumes), tagged for grouping; a silent one elsewhere."""
    tags = [f"method:{s.method}", f"task:{s.task.name}", f"model:{s.model.name}"]
    if s.experiment:
        tags.append(f"experiment:{s.experiment}")
    if not d.is_main:
        return SilentTracker(resume=resume["tracker"] if resume else None)
    return Tracker(run_dir, s.wandb, f"{s.method}-{s.task.name}-s{s.seed}", s.raw, tags,
                   resume=resume["tracker"] if resume else None, metric=s.task.metric)


def _execute(
    s: Settings, run_dir: Path, resume: dict[str, Any] | None, record: RunRecord, signals: StopSignals,
    saved: list[int | None], started: float, d: Dist = distributed.SINGLE, observers: Sequence[Observer] = (),
) -> Tracker:
    """The body of ``execute``: builds, trains and tests; ``record`` fills from what was built
    (``Built.record_fields``) and what happened (``Outcome.record_fields``). Returns the tracker it opened.
    ``saved[0]``: the step of each checkpoint written; ``started``: the run's clock (``time.time()`` at its start, less
    the seconds of the invocations before a resume), so a checkpoint records the run's time up to it."""
    b = build(s)
    reset_peak_memory(b.device)
    record.update(**b.record_fields(s, d))
    scorer, calibration = calibrate(b.scorer, s.calibration, b.content_free, b.enc["dev"], s.train.eval_batch_size)
    if calibration is not None:
        record.calibration = calibration
        log.info("calibration %s: bias per candidate %s", s.calibration, [round(v, 4) for v in calibration["bias"]])
    if d.enabled and b.optimizer is None:
        log.warning("method %r trains nothing: every one of the %d processes evaluates the same examples",
                    s.method, d.world_size)
    tracker = open_tracker(s, run_dir, resume, d)

    def save(state: dict[str, Any]) -> None:
        """The checkpoint, written whole: a signal meanwhile waits for it (the one a first signal asked for)."""
        phase, where = signals.phase, signals.where
        signals.at("save", f"the checkpoint at step {state['step']}")
        try:
            if d.is_main:
                save_checkpoint(run_dir / CHECKPOINT, {"config": s.raw, "loop": state, "tracker": tracker.position(),
                                                       "wall_time_s": round(time.time() - started, 2),
                                                       "layout": distributed.layout(d, s.distributed.mode)})
            saved[0] = state["step"]
        finally:
            signals.at(phase, where)

    try:
        if s.probe is not None:
            signals.at("setup", "the linear probe's fit and evaluation")
            outcome, record.probe = linear_probe(scorer, b.enc, s.probe, s.train.eval_batch_size, tracker, s.seed)
        else:
            checkpoints = Checkpoints(save=save, resume=resume["loop"] if resume else None, stop=signals,
                                      at=signals.at)
            splits = Splits(b.enc["train"], scorer.batches(b.enc["dev"], s.train.eval_batch_size, sort=True),
                            scorer.batches(b.enc["eval"], s.train.eval_batch_size, sort=True))
            spread = Spread(d.rank, d.world_size, s.distributed.mode) if d.enabled else None
            loop = Loop(tracker, DivergenceMonitor(s.divergence), s.seed, b.schedule, b.length, checkpoints, spread,
                        guard=s.guard, observers=observers)
            outcome = train(scorer, b.optimizer, splits, s.train, loop)
        signals.at("save", "the run's record")
    except BaseException:
        tracker.close(failed=True)
        raise
    record.update(metric=s.task.metric, device=device_info(b.device), peak_mem_mb=round(peak_memory_mb(b.device), 1),
                  **outcome.record_fields())
    if outcome.status == "interrupted":
        return tracker
    if d.is_main:
        save_predictions(run_dir, outcome, b.data)
        save_trained(run_dir, b.model, s, record, outcome)
    log.info(summary_line(outcome, s.task.metric, s.train.select_on, run_dir))
    return tracker
