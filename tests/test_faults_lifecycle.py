"""Faults in a run's life, as a user meets them: damaged records, signals at awkward moments, a lost process.

What every case checks: a damaged file that only its owner can judge is one line naming the file and the way
out, exit status 2, and nothing written; a fault ends with a recorded status and the exit status that goes with
it (0 finished, 1 failed, 128 + n for signal n); a finished run is never lost; and what a message promises
(resume from step K, start over, nothing left to resume) is what the same command then does.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import adazeta.run as run_module
import adazeta.train as train_module
from adazeta import cli
from adazeta.run import CHECKPOINT, run
from helpers import ROOT, TIMING, compose_cfg, rows, signal_at_step, tiny_overrides, write_fixture_data

STEPS = 8  # every run here: tiny-llama, MeZO-LoRA, 8 steps, dev every 2


def overrides(data_dir: Path, *extra: str) -> list[str]:
    """The command's overrides: ``tiny_overrides`` at 8 steps, each key given once (``extra`` wins)."""
    base = tiny_overrides(data_dir, "method=mezo_lora", f"train.max_steps={STEPS}")
    keys = {e.split("=", 1)[0] for e in extra}
    base = [o for o in base if o.split("=", 1)[0] not in keys and o != "train.max_steps=4"]
    return [*base, *extra]


def run_cli(monkeypatch, capsys, data_dir: Path, run_dir: Path, *extra: str) -> tuple[int, str]:
    """``adazeta-run`` in this process: (exit status, stderr). The log handlers Hydra sets up (on this test's
    captured stderr) are taken down after it, so that a later run in the process does not log to a closed stream."""
    monkeypatch.setattr(sys, "argv", ["adazeta-run", *overrides(data_dir, *extra), f"hydra.run.dir={run_dir}"])
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        cli.main()
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return code, capsys.readouterr().err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("adazeta-run")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def contents(run_dir: Path) -> dict[str, bytes]:
    """Every file of the run directory, byte for byte, but its lock (which changes hands by design) and Hydra's
    log of each command (cli.log)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name not in (".lock", "cli.log")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Fixture data, a finished run and a run interrupted (SIGTERM) at step 5, made once for the module."""
    root = tmp_path_factory.mktemp("faults")
    data = write_fixture_data(root / "data")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("HF_HUB_OFFLINE", "1")
        m.setenv("HF_DATASETS_OFFLINE", "1")
        whole = run(compose_cfg(overrides(data)), root / "whole")
        signal_at_step(m, 5)
        cut = run(compose_cfg(overrides(data)), root / "cut")
    assert whole["status"] == "finished" and cut["status"] == "interrupted" and cut["checkpoint_step"] == 5
    return {"data": data, "whole": root / "whole", "cut": root / "cut", "record": whole}


def copy(runs, name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    shutil.copytree(runs[name], target)
    (target / ".lock").unlink(missing_ok=True)
    return target


def same_as_whole(run_dir: Path, runs) -> None:
    """The records of ``run_dir`` are the uninterrupted run's (timing columns aside)."""
    assert rows(run_dir / "metrics.csv", TIMING) == rows(runs["whole"] / "metrics.csv", TIMING)
    assert (run_dir / "eval.csv").read_bytes() == (runs["whole"] / "eval.csv").read_bytes()
    for key in ("status", "test_accuracy", "test_loss", "dev_loss", "best_step", "steps", "forward_passes"):
        assert record(run_dir)[key] == runs["record"][key], key


# --- a damaged record is damaged, never absent ----------------------------------------------------------------


def _edit(change):
    def damage(text: str) -> str:
        r = json.loads(text)
        change(r)
        return json.dumps(r)
    return damage


DAMAGED_RECORDS = {
    # name: (how result.json is damaged, what the line says about it)
    "truncated": (lambda text: text[: len(text) // 2], "not valid JSON"),
    "not_json": (lambda text: "status: finished\n", "not valid JSON"),
    "empty": (lambda text: "", "(empty)"),
    "not_utf8": (lambda text: b"\xff\xfe{}", "not UTF-8"),
    "a_list": (lambda text: json.dumps([json.loads(text)]), "a JSON list, not a record"),
    "no_config": (_edit(lambda r: r.pop("config")), "no 'config'"),
    "unknown_status": (_edit(lambda r: r.update(status="done")), "status 'done' is not one of"),
    "no_test_score": (_edit(lambda r: r.pop("test_accuracy")), "a finished record without 'test_accuracy'"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED_RECORDS))
def test_a_damaged_record_is_refused_in_one_line_and_never_overwritten(damage, runs, tmp_path, monkeypatch, capsys):
    run_dir = copy(runs, "whole", tmp_path)
    breaks, message = DAMAGED_RECORDS[damage]
    path = run_dir / "result.json"
    damaged = breaks(path.read_text())
    path.write_bytes(damaged if isinstance(damaged, bytes) else damaged.encode())
    before = contents(run_dir)
    for extra in (["seed=1"], []):  # another run on that directory, and the same one again
        code, err = run_cli(monkeypatch, capsys, runs["data"], run_dir, *extra)
        line = one_line(err)
        assert code == 2, err
        assert f"{path} is damaged" in line and message in line, line
        assert "move it away" in line and "force=true" in line, line
        assert contents(run_dir) == before  # nothing rewritten, the damaged record kept for its owner


def test_force_replaces_a_damaged_record(runs, tmp_path, monkeypatch, capsys):
    """The way out the line names works: force=true runs the run again and writes a whole record."""
    run_dir = copy(runs, "whole", tmp_path)
    (run_dir / "result.json").write_text('{"status": "fini')
    code, err = run_cli(monkeypatch, capsys, runs["data"], run_dir, "force=true")
    assert code == 0, err
    same_as_whole(run_dir, runs)


def test_a_folder_where_the_record_belongs_is_refused_before_any_work(runs, tmp_path, monkeypatch, capsys):
    """Today's alternative: the whole run, then an OSError when the record cannot be written."""
    run_dir = tmp_path / "run"
    (run_dir / "result.json").mkdir(parents=True)
    for extra in ([], ["force=true"]):
        code, err = run_cli(monkeypatch, capsys, runs["data"], run_dir, *extra)
        assert code == 2 and f"{run_dir / 'result.json'} is not a file" in one_line(err), err
        assert not (run_dir / "metrics.csv").exists()


# --- a checkpoint that cannot resume the run it claims ------------------------------------------------------------


DAMAGED_CHECKPOINTS = {
    # name: (what is saved as checkpoint.pt, given the run's checkpoint; what the line says)
    "another_structure": (lambda state: {"config": state["config"], "model": state["loop"]["trainable"]},
                          "is not a checkpoint of this runner (no 'loop' entry)"),
    "no_tracker_rows": (lambda state: {**state, "tracker": {"last_step": 5}},
                        "is not a checkpoint of this runner (no tracker.metrics_rows, tracker.eval_rows)"),
    "a_tensor": (lambda state: torch.zeros(3), "is not a checkpoint of this runner (it holds a Tensor"),
    "not_torch": (None, "cannot read the checkpoint"),
}


@pytest.mark.parametrize("with_record", [True, False], ids=["with_record", "killed_without_record"])
@pytest.mark.parametrize("damage", sorted(DAMAGED_CHECKPOINTS))
def test_a_foreign_or_broken_checkpoint_is_refused_in_one_line(damage, with_record, runs, tmp_path, monkeypatch,
                                                               capsys):
    run_dir = copy(runs, "cut", tmp_path)
    path = run_dir / CHECKPOINT
    if not with_record:  # a run killed before it wrote any record: the checkpoint alone says what the folder holds
        (run_dir / "result.json").unlink()
    make, message = DAMAGED_CHECKPOINTS[damage]
    if make is None:
        path.write_bytes(b"PK\x03\x04 not the end of a zip file")
    else:
        torch.save(make(torch.load(path, weights_only=False)), path)
    before = contents(run_dir)
    code, err = run_cli(monkeypatch, capsys, runs["data"], run_dir)
    line = one_line(err)
    assert code == 2 and str(path) in line and message in line, line
    assert "move it away" in line and "force=true" in line, line
    assert contents(run_dir) == before  # the interrupted record is not rewritten as failed


@pytest.mark.parametrize("lose", ["metrics_deleted", "eval_cut"])
def test_a_checkpoint_whose_records_lost_rows_is_refused_and_resumes_once_they_are_back(lose, runs, tmp_path,
                                                                                       monkeypatch, capsys):
    """Today the run started, failed in the tracker and rewrote the interrupted record as failed."""
    run_dir = copy(runs, "cut", tmp_path)
    name = "metrics.csv" if lose == "metrics_deleted" else "eval.csv"
    kept = (run_dir / name).read_bytes()
    if lose == "metrics_deleted":
        (run_dir / name).unlink()
        message = "the file is missing"
    else:
        (run_dir / name).write_bytes(b"".join(kept.splitlines(keepends=True)[:2]))
        message = "it holds 1 of the 3 rows the checkpoint continues"
    before = contents(run_dir)
    code, err = run_cli(monkeypatch, capsys, runs["data"], run_dir)
    line = one_line(err)
    assert code == 2, err
    assert f"{run_dir / name}: {message}, so the checkpoint at step 5 cannot resume the run" in line, line
    assert "restore the file, or rerun with force=true" in line, line
    assert contents(run_dir) == before and record(run_dir)["status"] == "interrupted"
    (run_dir / name).write_bytes(kept)  # the first way out the line names
    code, err = run_cli(monkeypatch, capsys, runs["data"], run_dir)
    assert code == 0 and record(run_dir)["resumed_from_step"] == 5, err
    same_as_whole(run_dir, runs)


# --- signals: what the record says is what happened, and what the line promises is true -----------------------


def test_sighup_is_a_stop_signal_like_sigterm(runs, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    with monkeypatch.context() as m:
        signal_at_step(m, 3, signal.SIGHUP)
        code, err = run_cli(m, capsys, runs["data"], run_dir)
    assert code == 128 + signal.SIGHUP, err
    assert "interrupted (SIGHUP at step 3); run the same command again to resume from its checkpoint at step 3" in \
        one_line(err)
    assert (record(run_dir)["status"], record(run_dir)["signal"]) == ("interrupted", "SIGHUP")
    code, err = run_cli(monkeypatch, capsys, runs["data"], run_dir)
    assert code == 0 and record(run_dir)["resumed_from_step"] == 3, err
    same_as_whole(run_dir, runs)


@pytest.mark.parametrize("checkpoint_every", [None, 3])
def test_a_second_signal_inside_a_step_says_where_it_stopped_and_what_a_rerun_does(checkpoint_every, runs, tmp_path,
                                                                                  monkeypatch, capsys):
    """Before: 'interrupted (SIGTERM, outside a training step)' and 'run the same command again to resume' with
    no checkpoint to resume from."""
    run_dir = tmp_path / "run"
    extra = [] if checkpoint_every is None else [f"train.checkpoint_every={checkpoint_every}"]
    with monkeypatch.context() as m:
        signal_at_step(m, 5, times=2)
        code, err = run_cli(m, capsys, runs["data"], run_dir, *extra)
    line = one_line(err)
    assert code == 128 + signal.SIGTERM, err
    got = record(run_dir)
    assert got["status"] == "interrupted" and got["signal"] == "SIGTERM"
    assert got["reason"] == "SIGTERM again during step 5: stopped at once" and "outside" not in line
    if checkpoint_every is None:
        assert got["checkpoint_step"] is None and not (run_dir / CHECKPOINT).exists()
        assert "no checkpoint was written, so the same command starts the run over" in line, line
    else:
        assert got["checkpoint_step"] == 3
        assert "run the same command again to resume from its checkpoint at step 3" in line, line
    code, err = run_cli(monkeypatch, capsys, runs["data"], run_dir, *extra)
    assert code == 0, err
    assert record(run_dir).get("resumed_from_step") == checkpoint_every  # started over, or resumed at step 3
    same_as_whole(run_dir, runs)


def evaluate_then(monkeypatch, split: str, action) -> None:
    """Call ``action()`` as the training loop starts its ``split`` evaluation (the final test: ``test``)."""
    evaluate = train_module.evaluate

    def evaluate_after_action(scorer, batches, generation, desc="", **kwargs):
        if desc == split:
            action()
        return evaluate(scorer, batches, generation, desc=desc, **kwargs)

    monkeypatch.setattr(train_module, "evaluate", evaluate_after_action)


def sigterm(times: int = 1):
    return lambda: [os.kill(os.getpid(), signal.SIGTERM) for _ in range(times)]


def test_a_signal_during_the_final_test_lets_it_finish_and_exits_with_the_signal(runs, tmp_path, monkeypatch, capsys):
    """Before: 'stopping after this step', then exit 0 as if no signal had come."""
    run_dir = tmp_path / "run"
    with monkeypatch.context() as m:
        evaluate_then(m, "test", sigterm())
        code, err = run_cli(m, capsys, runs["data"], run_dir)
    assert code == 128 + signal.SIGTERM, err
    line = one_line(err)
    assert "SIGTERM came too late to stop the run: it completed and is recorded (finished)" in line, line
    assert "nothing is left to resume" in line
    assert record(run_dir)["signal"] == "SIGTERM" and not (run_dir / CHECKPOINT).exists()
    same_as_whole(run_dir, runs)
    code, err = run_cli(monkeypatch, capsys, runs["data"], run_dir)  # nothing left: skipped, with status 0
    assert code == 0 and "Traceback" not in err, err


def test_a_second_signal_during_the_final_test_checkpoints_the_trained_run(runs, tmp_path, monkeypatch, capsys):
    """The same command then runs the test evaluation alone: no step is trained again."""
    run_dir = tmp_path / "run"
    with monkeypatch.context() as m:
        evaluate_then(m, "test", sigterm(2))
        code, err = run_cli(m, capsys, runs["data"], run_dir)
    assert code == 128 + signal.SIGTERM, err
    got = record(run_dir)
    assert got["reason"] == "SIGTERM again during the final test evaluation: stopped at once"
    assert got["checkpoint_step"] == STEPS and "test_accuracy" not in got
    assert f"resume from its checkpoint at step {STEPS}" in one_line(err)
    code, err = run_cli(monkeypatch, capsys, runs["data"], run_dir)
    assert code == 0 and record(run_dir)["resumed_from_step"] == STEPS, err
    same_as_whole(run_dir, runs)


def test_a_signal_at_the_step_a_budget_ends_training_checkpoints_before_the_test(runs, tmp_path, monkeypatch, capsys):
    """The forward budget ends the loop before its signal check; before, the signal was dropped and exit was 0."""
    budget = ["train.max_forward_passes=10"]
    whole = run(compose_cfg(overrides(runs["data"], *budget)), tmp_path / "whole")
    last = whole["steps"]
    assert last < STEPS  # the budget, not the step limit, ends this run
    run_dir = tmp_path / "run"
    with monkeypatch.context() as m:
        signal_at_step(m, last)
        code, err = run_cli(m, capsys, runs["data"], run_dir, *budget)
    assert code == 128 + signal.SIGTERM, err
    got = record(run_dir)
    assert got["reason"] == f"SIGTERM at step {last}, before the test evaluation"
    assert got["checkpoint_step"] == last and f"resume from its checkpoint at step {last}" in one_line(err)
    code, err = run_cli(monkeypatch, capsys, runs["data"], run_dir, *budget)
    assert code == 0 and record(run_dir)["resumed_from_step"] == last, err
    assert (run_dir / "eval.csv").read_bytes() == (tmp_path / "whole" / "eval.csv").read_bytes()
    assert record(run_dir)["test_accuracy"] == whole["test_accuracy"]


def test_signals_while_the_result_is_saved_never_lose_the_finished_run(runs, tmp_path, monkeypatch, capsys):
    """Two signals as the predictions are written (after the test): before, the record said `interrupted`, without
    predictions, and the next command trained the run again."""
    run_dir = tmp_path / "run"
    save_predictions = run_module.save_predictions

    def signalled_save(*args):
        sigterm(2)()
        save_predictions(*args)

    with monkeypatch.context() as m:
        m.setattr(run_module, "save_predictions", signalled_save)
        code, err = run_cli(m, capsys, runs["data"], run_dir)
    assert code == 128 + signal.SIGTERM and "recorded (finished)" in one_line(err), err
    assert (run_dir / "predictions" / "test.csv").is_file()
    same_as_whole(run_dir, runs)


def test_a_sigterm_while_the_record_is_written_waits_for_it(runs, tmp_path):
    """Before, the handlers were gone by then: SIGTERM killed the process and the finished run had no record."""
    run_dir = tmp_path / "run"
    code = (
        "import os, signal, sys, adazeta.run as r\n"
        "write = r.write_result\n"
        "def signalled(*a):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    write(*a)\n"
        "r.write_result = signalled\n"
        "from adazeta.cli import main; sys.argv = ['adazeta-run'] + sys.argv[1:]; main()"
    )
    args = [*overrides(runs["data"]), f"hydra.run.dir={run_dir}"]
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "recorded (finished)" in one_line(proc.stderr)
    same_as_whole(run_dir, runs)


def test_a_signal_during_a_zero_shot_evaluation_lets_it_finish(runs, tmp_path, monkeypatch, capsys):
    """A training-free run has nothing to checkpoint: its first signal lets the evaluation finish and be recorded."""
    run_dir = tmp_path / "run"
    plain = run(compose_cfg(overrides(runs["data"], "method=zero_shot")), tmp_path / "plain")
    with monkeypatch.context() as m:
        evaluate_then(m, "dev@0", sigterm())
        code, err = run_cli(m, capsys, runs["data"], run_dir, "method=zero_shot")
    assert code == 128 + signal.SIGTERM and "recorded (finished)" in one_line(err), err
    assert record(run_dir)["test_accuracy"] == plain["test_accuracy"]


def test_a_crash_during_the_test_resumes_to_the_test_alone(runs, tmp_path, monkeypatch, capsys):
    """With train.checkpoint_every, the trained run is checkpointed before its test: a crash there (or a kill)
    costs the test evaluation, not the steps after the last periodic checkpoint."""
    run_dir = tmp_path / "run"

    def crash():
        raise RuntimeError("node lost during the test (simulated)")

    with monkeypatch.context() as m:
        evaluate_then(m, "test", crash)
        with pytest.raises(RuntimeError):
            run(compose_cfg(overrides(runs["data"], "train.checkpoint_every=3")), run_dir)
    assert record(run_dir)["status"] == "failed" and record(run_dir)["checkpoint_step"] == STEPS
    resumed = run(compose_cfg(overrides(runs["data"], "train.checkpoint_every=3")), run_dir)
    assert resumed["resumed_from_step"] == STEPS
    same_as_whole(run_dir, runs)


def test_two_sigterms_30ms_apart_to_the_command_keep_their_promise(runs, tmp_path):
    """Real signals from outside, as a user's double Ctrl-C or a scheduler's repeated SIGTERM: whatever the line
    says the same command does (resume from step K, or start over), it does."""
    run_dir = tmp_path / "run"
    args = [*overrides(runs["data"], "train.max_steps=400", "train.eval_every=100", "train.checkpoint_every=25"),
            f"hydra.run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "adazeta.cli", *args], env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    deadline = time.time() + 240
    while time.time() < deadline:  # past the first periodic checkpoint
        metrics = run_dir / "metrics.csv"
        if metrics.is_file() and len(metrics.read_text().splitlines()) > 40:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.03)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    line = one_line(err)
    got = record(run_dir)
    assert got["status"] == "interrupted" and "outside a training step" not in got["reason"], got["reason"]
    promised = re.search(r"resume from its checkpoint at step (\d+)", line)
    assert promised or "starts the run over" in line, line
    assert got["checkpoint_step"] == (int(promised.group(1)) if promised else None)
    again = subprocess.run([sys.executable, "-m", "adazeta.cli", *args], env=env, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr
    assert record(run_dir).get("resumed_from_step") == (int(promised.group(1)) if promised else None)
    assert [int(r["step"]) for r in rows(run_dir / "metrics.csv")] == list(range(1, 401))


# --- several processes: a lost rank is named, in bounded time ---------------------------------------------------


def torchrun(run_dir: Path, data_dir: Path, *extra: str) -> subprocess.Popen:
    """``torchrun --standalone --nproc_per_node 2 adazeta-run`` of a long MeZO-LoRA run (one thread per process)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    args = [*overrides(data_dir, "train.max_steps=300", "train.eval_every=50", "train.checkpoint_every=25", *extra),
            f"hydra.run.dir={run_dir}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "adazeta.cli",
           *args]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of the process torchrun started for ``rank``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if parent == launcher.pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no process for rank {rank} under {launcher.pid}")


def wait_for_steps(run_dir: Path, launcher: subprocess.Popen, steps: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and launcher.poll() is None:
        metrics = run_dir / "metrics.csv"
        if metrics.is_file() and len(metrics.read_text().splitlines()) > steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"training did not get under way: {launcher.communicate()[0][-3000:]}")


def wait_for_record(run_dir: Path, launcher: subprocess.Popen, within: float) -> float:
    """Seconds until result.json appeared (at most ``within``)."""
    start = time.time()
    while time.time() - start < within:
        if (run_dir / "result.json").is_file():
            return time.time() - start
        time.sleep(0.1)
    launcher.kill()
    raise AssertionError(f"no record within {within} s: {launcher.communicate()[0][-3000:]}")


def test_a_rank_killed_with_sigkill_is_named_in_a_failed_record(runs, tmp_path):
    """Before: no result.json when torchrun's SIGTERM reached rank 0 while it looked for the cause."""
    run_dir = tmp_path / "run"
    launcher = torchrun(run_dir, runs["data"])
    wait_for_steps(run_dir, launcher, 30)
    victim = rank_pid(launcher, 1)
    os.kill(victim, signal.SIGKILL)
    wait_for_record(run_dir, launcher, within=60)
    output = launcher.communicate(timeout=120)[0]
    assert launcher.returncode != 0
    got = record(run_dir)
    assert got["status"] == "failed", output[-3000:]
    assert f"rank 1 (pid {victim} on " in got["reason"] and "ended without reporting an error" in got["reason"]
    assert got["checkpoint_step"] in (25, 50, 75, 100, 125, 150, 175, 200, 225, 250, 275)


def test_sigterm_to_one_rank_stops_the_run_and_records_the_signal(runs, tmp_path):
    """Before: rank 0 recorded `signal: null` and exited 130 (SIGINT's status)."""
    run_dir = tmp_path / "run"
    launcher = torchrun(run_dir, runs["data"])
    wait_for_steps(run_dir, launcher, 30)
    os.kill(rank_pid(launcher, 1), signal.SIGTERM)
    output = launcher.communicate(timeout=180)[0]
    got = record(run_dir)
    assert (got["status"], got["signal"]) == ("interrupted", "SIGTERM"), output[-3000:]
    assert re.fullmatch(r"SIGTERM \(rank 1\) at step \d+", got["reason"]), got["reason"]
    assert f"exitcode  : {128 + signal.SIGTERM} " in output  # torchrun's report of rank 0's status
    step = got["checkpoint_step"]
    assert f"resume from its checkpoint at step {step}" in output
    again = torchrun(run_dir, runs["data"])  # the same command
    output = again.communicate(timeout=600)[0]
    assert again.returncode == 0, output[-3000:]
    assert record(run_dir)["status"] == "finished" and record(run_dir)["resumed_from_step"] == step


def test_a_hung_rank_is_named_after_the_collective_timeout(runs, tmp_path):
    """A rank that neither answers nor ends (stopped here with SIGSTOP): distributed.timeout_s bounds the wait."""
    run_dir = tmp_path / "run"
    launcher = torchrun(run_dir, runs["data"], "distributed.timeout_s=10")
    wait_for_steps(run_dir, launcher, 30)
    victim = rank_pid(launcher, 1)
    os.kill(victim, signal.SIGSTOP)
    try:
        waited = wait_for_record(run_dir, launcher, within=90)
    finally:
        os.kill(victim, signal.SIGCONT)  # torchrun's own stop signal can then reach it
    launcher.communicate(timeout=120)
    got = record(run_dir)
    assert got["status"] == "failed" and waited >= 10
    assert f"rank 1 (pid {victim} on " in got["reason"]
    assert "did not answer within distributed.timeout_s=10" in got["reason"], got["reason"]


# --- the command around a run: Ctrl-C before it begins, a lost stdout, a sweep started twice ------------------------


@pytest.mark.parametrize("where", ["check", "settings"])
def test_ctrl_c_during_start_up_is_one_line_and_exit_130(where, fixture_data, tmp_path, monkeypatch, capsys):
    """Ctrl-C before the run begins (the command line being checked, or the settings parsed once Hydra made the
    folder): one line, exit 130, no traceback, and no run folder left behind."""
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(*((cli, "check") if where == "check" else (run_module, "parse_once")), interrupt)
    run_dir = tmp_path / "run"
    code, err = run_cli(monkeypatch, capsys, fixture_data, run_dir)
    assert code == 128 + signal.SIGINT, err
    assert err.strip().splitlines() == [cli.STARTUP_INTERRUPTED], err
    assert not run_dir.exists()


def as_from_a_terminal() -> None:
    """A child's SIGINT at its default, as a command typed in a terminal has it: a test runner started in the
    background (``cmd &`` in a script) ignores SIGINT, and its children would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def command_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.parametrize("argv0,command", [("/usr/bin/adazeta-run", True), ("my_script.py", False)])
def test_the_package_takes_ctrl_c_first_when_it_is_the_command(argv0, command):
    """The package installs the one-line Ctrl-C handler before it imports anything (omegaconf takes a tenth of a
    second): a SIGINT at the command's very start is the same line and 130; a library import keeps Python's."""
    code = (f"import os, signal, sys, time\nsys.argv[0] = {argv0!r}\nimport adazeta\n"
            "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=command_env(), capture_output=True, text=True, timeout=60,
                          preexec_fn=as_from_a_terminal)
    assert proc.stdout.strip() == str(not command)
    if command:
        assert proc.returncode == 128 + signal.SIGINT and proc.stderr.strip().splitlines() == [cli.STARTUP_INTERRUPTED]
    else:
        assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in proc.stderr  # Python's own ending


def test_a_real_ctrl_c_while_the_command_starts_is_one_line_and_exit_130(fixture_data, tmp_path):
    """SIGINT a second after the command starts, while its modules import: the same line, not the traceback of
    whichever import it stopped."""
    proc = subprocess.Popen([sys.executable, "-m", "adazeta.cli", *overrides(fixture_data),
                             f"hydra.run.dir={tmp_path / 'run'}"], env=command_env(), stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, preexec_fn=as_from_a_terminal)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert err.strip().splitlines() == [cli.STARTUP_INTERRUPTED], err
    assert not (tmp_path / "run" / "result.json").exists()


def test_a_caller_gets_its_signal_handlers_back_after_an_interrupted_run(fixture_data, tmp_path, monkeypatch,
                                                                         capsys):
    """``adazeta.cli.main`` called in another program's process (a test, a script): the run's stop handlers and
    the signals it ignores on its recorded way out are the command's, not the caller's. Before, SIGINT stayed
    ignored in the caller after an interrupted run, and every child it started later inherited that: a Ctrl-C
    test started after one then saw its command run to the end (exit 0)."""
    from adazeta.runs.rundir import STOP_SIGNALS

    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    with pytest.MonkeyPatch.context() as m:
        signal_at_step(m, 2)
        code, err = run_cli(monkeypatch, capsys, fixture_data, tmp_path / "run")
    assert code == 128 + signal.SIGTERM and record(tmp_path / "run")["status"] == "interrupted", err
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before


@pytest.mark.parametrize("swallowed", [False, True])
def test_a_ctrl_c_during_start_up_stops_it_even_where_a_library_swallows_it(swallowed, fixture_data, tmp_path,
                                                                            monkeypatch, capsys):
    """Ctrl-C while the overrides are checked (the settings parse imports torch): one line and exit 130, no run,
    and the caller's SIGINT handler back. A library that catches it (a bare ``except`` around an optional import)
    does not let the run begin anyway: the command remembers the signal and stops before the run starts.
    Deterministic: the signal is sent from inside the start-up, not after a guessed delay."""
    real_check = cli.check

    def check_then_ctrl_c(*args, **kwargs):
        checked = real_check(*args, **kwargs)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)  # the handler runs at the next bytecode boundary, inside this try
        except BaseException:
            if not swallowed:
                raise
        return checked

    caller = signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python sets it for a terminal's command
    monkeypatch.setattr(cli, "check", check_then_ctrl_c)
    monkeypatch.setattr(sys, "argv", ["adazeta-run", *overrides(fixture_data), f"hydra.run.dir={tmp_path / 'run'}"])
    try:
        with pytest.raises(SystemExit) as stop:
            cli.main()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the caller's handler is back
    finally:
        signal.signal(signal.SIGINT, caller)
    assert stop.value.code == 128 + signal.SIGINT
    assert capsys.readouterr().err.strip().splitlines() == [cli.STARTUP_INTERRUPTED]
    assert not (tmp_path / "run" / "result.json").exists()


def test_a_ctrl_c_remembered_by_an_earlier_call_does_not_stop_the_next_one(fixture_data, tmp_path, monkeypatch,
                                                                          capsys):
    """A caller's process that ignores SIGINT (a test runner or script started in the background): a Ctrl-C that an
    earlier ``main()`` in it remembered is that call's, not the next one's. Before, the next calls all stopped as
    "interrupted during start-up" without any signal."""
    monkeypatch.setattr(cli, "_start_up_interrupted", [signal.SIGINT])  # as the swallowed Ctrl-C above leaves it
    caller = signal.signal(signal.SIGINT, signal.SIG_IGN)
    monkeypatch.setattr(sys, "argv", ["adazeta-run", *overrides(fixture_data), "method=eval",
                                      f"hydra.run.dir={tmp_path / 'run'}"])
    try:
        with pytest.raises(SystemExit) as stop:
            cli.main()
    finally:
        signal.signal(signal.SIGINT, caller)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "method=eval needs eval.from=" in err and cli.STARTUP_INTERRUPTED not in err, err


@pytest.mark.parametrize("stdout", ["closed-pipe", "full-device"])
def test_a_stdout_that_is_closed_or_full_costs_at_most_one_line_and_the_run_goes_on(stdout, fixture_data, tmp_path):
    """``adazeta-run ... | head -n 1`` and ``> /dev/full``: the run finishes and is recorded, exit 0, and stderr
    holds no logging error (one line for a full device; nothing for a reader that left)."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "adazeta.cli", *overrides(fixture_data, "train.max_steps=2"),
            f"hydra.run.dir={run_dir}"]
    if stdout == "closed-pipe":
        proc = subprocess.Popen(args, env=command_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline()  # `head -n 1`: one line, then the pipe closes
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(timeout=300)
    else:
        with open("/dev/full", "w") as full:
            proc = subprocess.run(args, env=command_env(), stdout=full, stderr=subprocess.PIPE, text=True,
                                  timeout=300)
        err = proc.stderr
    assert proc.returncode == 0, err
    assert "Logging error" not in err and "Traceback" not in err and "Exception ignored" not in err, err
    expected = [] if stdout == "closed-pipe" else ["adazeta-run: stdout: no space left on the device it writes to; "
                                                   "the console output is dropped from here, the run's files are "
                                                   "written as usual"]
    assert err.strip().splitlines() == expected, err
    assert record(run_dir)["status"] == "finished"


def test_a_second_copy_of_a_running_sweep_is_refused_and_leaves_the_first_ones_report(fixture_data, tmp_path,
                                                                                      monkeypatch, capsys):
    """Two copies of one sweep in one folder: the second would find every point's run directory in use and report
    them failed, in the first's report. It is refused in one line, exit 2, and touches nothing there."""
    from adazeta.runs.rundir import claim

    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    report = sweep_dir / cli.FAILURES
    report.write_text("seed=3: the first sweep's own line\n")
    monkeypatch.setattr(sys, "argv", ["adazeta-run", "-m", *overrides(fixture_data), "seed=0,1",
                                      f"hydra.sweep.dir={sweep_dir}"])
    with claim(sweep_dir, sweep=True):  # the first copy, still running
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert one_line(err).startswith(f"adazeta-run: error: sweep directory {sweep_dir} is in use by another sweep (pid "
                                    f"{os.getpid()} "), err
    assert report.read_text() == "seed=3: the first sweep's own line\n"
    assert sorted(p.name for p in sweep_dir.iterdir()) == [".sweep.lock", cli.FAILURES]


# --- rank 0 died: the checkpoint it left is taken only when it is this run's ------------------------------------


@pytest.mark.parametrize("case", ["same settings", "other settings", "unreadable", "rows missing", "none"])
def test_a_checkpoint_rank_0_left_is_resumed_only_when_verified_else_moved_aside(case, runs, tmp_path):
    """``verified_checkpoint``: the survivor that records a run whose rank 0 died resumes from rank 0's checkpoint
    only when it is readable, of these settings and layout, with its CSV rows there; any other file is moved to
    ``checkpoint.unverified.pt`` (kept for a person to read, never resumed) and the same command starts over."""
    from adazeta import distributed
    from adazeta.settings import parse

    run_dir = copy(runs, "cut", tmp_path)
    original = (run_dir / CHECKPOINT).read_bytes()
    s = parse(compose_cfg(overrides(runs["data"], *(["seed=12345"] if case == "other settings" else []))))
    if case == "unreadable":
        (run_dir / CHECKPOINT).write_bytes(original[: len(original) // 2])
    elif case == "rows missing":
        lines = (run_dir / "metrics.csv").read_text().splitlines(keepends=True)
        (run_dir / "metrics.csv").write_text("".join(lines[:2]))
    elif case == "none":
        (run_dir / CHECKPOINT).unlink()
    step = run_module.verified_checkpoint(run_dir, s, distributed.SINGLE)
    if case == "same settings":
        assert step == 5 and (run_dir / CHECKPOINT).read_bytes() == original
        assert not (run_dir / run_module.UNVERIFIED).exists()
    else:
        assert step is None and not (run_dir / CHECKPOINT).exists()
        assert (run_dir / run_module.UNVERIFIED).is_file() == (case != "none")
