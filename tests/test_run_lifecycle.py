"""A run's life in its directory: one owner, skip only the same run, interrupt and resume, complete records."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import adazeta.run as run_module
from adazeta.errors import ConfigError
from adazeta.runs.rundir import atomic_write_text, claim, config_differences
from adazeta.run import CHECKPOINT, run
from adazeta.tracking import Tracker, WandbConfig
from helpers import TIMING, compose_cfg, rows, signal_at_step, tiny_overrides


def cfg(data_dir: Path, *extra: str):
    return compose_cfg(tiny_overrides(data_dir, "train.max_steps=8", "train.eval_every=2", *extra))


# --- one owner ---------------------------------------------------------------------------------------------


def test_a_claimed_directory_refuses_a_second_run_before_any_work(fixture_data, tmp_path):
    run_dir = tmp_path / "run"
    with claim(run_dir):
        with pytest.raises(ConfigError, match=r"in use by another run \(pid \d+"):
            run(cfg(fixture_data), run_dir)
    assert not (run_dir / "result.json").exists() and not (run_dir / "metrics.csv").exists()
    with claim(run_dir):  # released: claimable again
        pass


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path, caplog):
    run_dir = tmp_path / "run"
    code = (
        "import os, signal, sys; from pathlib import Path; from adazeta.runs.rundir import claim\n"
        f"with claim(Path({str(run_dir)!r})): os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=os.environ.copy())
    assert proc.returncode == -signal.SIGKILL
    assert "pid" in (run_dir / ".lock").read_text()  # the dead owner's note is still there
    with caplog.at_level("WARNING", logger="adazeta"), claim(run_dir):
        assert f"pid {os.getpid()}" in (run_dir / ".lock").read_text()
    assert "ended uncleanly" in caplog.text


def written(run_dir: Path) -> dict[str, int]:
    """Modification times of the run's records (the lock file changes hands by design)."""
    return {p.name: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}


# --- skip only what matches ----------------------------------------------------------------------------------


def test_a_finished_run_is_skipped_only_when_the_settings_match(fixture_data, tmp_path):
    run_dir = tmp_path / "run"
    first = run(cfg(fixture_data, "method=mezo_lora"), run_dir, ["method=mezo_lora"])
    assert first["status"] == "finished"
    before = written(run_dir)
    # The same run with other paths and logging settings: skipped, nothing rewritten.
    again = run(cfg(fixture_data, "method=mezo_lora", "wandb.project=other", "train.eval_batch_size=3"), run_dir)
    assert again["test_accuracy"] == first["test_accuracy"]
    assert written(run_dir) == before
    # Another seed or method: refused in one line that names the differences; nothing is touched.
    with pytest.raises(ConfigError, match=r"holds a finished run with other settings \(seed: 0 -> 1\); rerun with force=true"):
        run(cfg(fixture_data, "method=mezo_lora", "seed=1"), run_dir)
    with pytest.raises(ConfigError, match=r"method.name: 'mezo_lora' -> 'mezo'"):
        run(cfg(fixture_data, "method=mezo"), run_dir)
    assert written(run_dir) == before
    assert "name: mezo_lora" in (run_dir / ".hydra" / "config.yaml").read_text()
    forced = run(cfg(fixture_data, "method=mezo_lora", "seed=1", "force=true"), run_dir)
    assert forced["seed"] == 1 and "seed: 1" in (run_dir / ".hydra" / "config.yaml").read_text()


def test_settings_added_to_the_code_later_do_not_count_as_differences():
    old = {"seed": 0, "train": {"max_steps": 4}, "data": {"dir": "/a"}}
    new = {"seed": 0, "train": {"max_steps": 4, "checkpoint_every": None, "new_setting": 1}, "data": {"dir": "/b"}}
    assert config_differences(old, new) == []
    assert config_differences(new, old) == ["train.new_setting: 1 -> (absent)"]


# --- interrupt and resume ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["adazeta", "tt_adapter"])
def test_an_interrupted_run_resumes_to_the_uninterrupted_records(method, fixture_data, tmp_path, monkeypatch):
    extra = [f"method={method}", "schedule=adaptive"] if method == "adazeta" else [f"method={method}"]
    whole = run(cfg(fixture_data, *extra), tmp_path / "whole")
    assert whole["status"] == "finished"

    run_dir = tmp_path / "cut"
    with monkeypatch.context() as m:
        signal_at_step(m, 5)
        cut = run(cfg(fixture_data, *extra), run_dir)
    assert cut["status"] == "interrupted" and cut["signal"] == "SIGTERM" and cut["steps"] == 5
    assert "SIGTERM at step 5" in cut["reason"] and "test_accuracy" not in cut
    assert json.loads((run_dir / "result.json").read_text())["status"] == "interrupted"
    assert (run_dir / CHECKPOINT).is_file()
    assert len(rows(run_dir / "metrics.csv")) == 5
    assert all(r["split"] == "dev" for r in rows(run_dir / "eval.csv"))  # never tested

    # The run's time carries over: the checkpoint holds the seconds up to it, and the resumed record adds its own.
    state = torch.load(run_dir / CHECKPOINT, weights_only=False)
    assert 0 < state["wall_time_s"] <= cut["wall_time_s"]
    state["wall_time_s"] = 1000.0  # as if the first invocation had taken 1,000 s
    torch.save(state, run_dir / CHECKPOINT)
    began = time.time()
    resumed = run(cfg(fixture_data, *extra), run_dir)
    assert 1000.0 < resumed["wall_time_s"] <= 1000.0 + (time.time() - began) + 0.01
    assert resumed["status"] == "finished" and resumed["resumed_from_step"] == 5
    assert not (run_dir / CHECKPOINT).exists()
    assert rows(run_dir / "metrics.csv", TIMING) == rows(tmp_path / "whole" / "metrics.csv", TIMING)
    assert (run_dir / "eval.csv").read_bytes() == (tmp_path / "whole" / "eval.csv").read_bytes()
    for key in ("test_accuracy", "test_loss", "dev_loss", "best_step", "forward_passes", "steps"):
        assert resumed[key] == whole[key], key


def test_a_schedulers_notice_checkpoints_then_hands_over_to_its_handler(fixture_data, tmp_path, monkeypatch):
    """SLURM's USR2 before the time limit, or on preemption, with submitit's requeue handler installed."""
    run_dir = tmp_path / "run"
    seen = []

    def requeue(signum, frame):  # submitit's handler requeues the job: here, look at what the run saved first
        record = json.loads((run_dir / "result.json").read_text())
        seen.append((signum, record["status"], (run_dir / CHECKPOINT).is_file()))

    previous = signal.signal(signal.SIGUSR2, requeue)
    try:
        with monkeypatch.context() as m:
            signal_at_step(m, 3, signal.SIGUSR2)
            cut = run(cfg(fixture_data), run_dir)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert cut["status"] == "interrupted" and cut["signal"] == "SIGUSR2" and cut["steps"] == 3
    assert seen == [(signal.SIGUSR2, "interrupted", True)]  # called once, after the checkpoint and the record
    resumed = run(cfg(fixture_data), run_dir)  # the requeued job: the same command
    assert resumed["status"] == "finished" and resumed["resumed_from_step"] == 3


def test_a_crash_resumes_from_the_last_periodic_checkpoint(fixture_data, tmp_path, monkeypatch):
    """A killed run (no chance to save at the end) loses only the steps after its last checkpoint."""
    extra = ["method=mezo_lora", "train.checkpoint_every=3"]
    whole = run(cfg(fixture_data, *extra), tmp_path / "whole")
    run_dir = tmp_path / "cut"
    log_step = Tracker.log_step

    def crash_at_7(self, row):
        log_step(self, row)
        if row["step"] == 7:
            raise RuntimeError("node lost (simulated)")

    with monkeypatch.context() as m:
        m.setattr(Tracker, "log_step", crash_at_7)
        with pytest.raises(RuntimeError):
            run(cfg(fixture_data, *extra), run_dir)
    assert json.loads((run_dir / "result.json").read_text())["status"] == "failed"
    assert len(rows(run_dir / "metrics.csv")) == 7  # rows past the checkpoint (6) are rewritten on resume
    resumed = run(cfg(fixture_data, *extra), run_dir)
    assert resumed["resumed_from_step"] == 6
    assert rows(run_dir / "metrics.csv", TIMING) == rows(tmp_path / "whole" / "metrics.csv", TIMING)
    assert (run_dir / "eval.csv").read_bytes() == (tmp_path / "whole" / "eval.csv").read_bytes()
    assert resumed["test_accuracy"] == whole["test_accuracy"]


def test_a_signal_while_the_model_loads_is_recorded_without_a_traceback(fixture_data, tmp_path, monkeypatch):
    build = run_module.build

    def build_then_sigint(s):
        built = build(s)
        os.kill(os.getpid(), signal.SIGINT)
        return built

    monkeypatch.setattr(run_module, "build", build_then_sigint)
    before = signal.getsignal(signal.SIGINT)
    record = run(cfg(fixture_data, "method=mezo_lora"), tmp_path / "run")
    assert record["status"] == "interrupted" and record["signal"] == "SIGINT"
    assert "outside a training step" in record["reason"]
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


def start_training(args: list[str], run_dir: Path, env: dict[str, str]) -> subprocess.Popen:
    """``adazeta-run args`` in its own process, returned once a few training steps are written."""
    proc = subprocess.Popen([sys.executable, "-m", "adazeta.cli", *args], env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    deadline = time.time() + 240
    while time.time() < deadline:  # wait until training is under way
        metrics = run_dir / "metrics.csv"
        if metrics.is_file() and len(metrics.read_text().splitlines()) > 3:
            break
        time.sleep(0.2)
    return proc


def test_sigterm_to_the_command_ends_with_one_line_and_the_same_command_resumes(fixture_data, tmp_path):
    run_dir = tmp_path / "run"
    args = [*tiny_overrides(fixture_data, "method=mezo_lora", "train.max_steps=400", "train.eval_every=100"),
            f"hydra.run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    proc = start_training(args, run_dir, env)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    assert "adazeta-run: interrupted (SIGTERM at step" in err and "run the same command again to resume" in err
    record = json.loads((run_dir / "result.json").read_text())
    assert record["status"] == "interrupted" and (run_dir / CHECKPOINT).is_file()
    again = subprocess.run([sys.executable, "-m", "adazeta.cli", *args], env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    record = json.loads((run_dir / "result.json").read_text())
    assert record["status"] == "finished" and record["resumed_from_step"] >= 3
    assert [int(r["step"]) for r in rows(run_dir / "metrics.csv")] == list(range(1, 401))



@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2],
                         ids=lambda n: signal.Signals(n).name)
def test_every_signal_that_warns_of_an_end_checkpoints_and_records_the_run(fixture_data, tmp_path, signum):
    """A scheduler's warnings (SLURM's --signal=USR1@T, submitit's USR2, a closed terminal's HUP, Ctrl-C's INT)
    stop the run as SIGTERM does: at a step boundary, checkpointed, recorded, exit status 128 + n. Left to Python's
    default, USR1 and USR2 kill the process with nothing written."""
    run_dir = tmp_path / "run"
    args = [*tiny_overrides(fixture_data, "method=mezo_lora", "train.max_steps=400", "train.eval_every=100"),
            f"hydra.run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    proc = start_training(args, run_dir, env)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in err and f"adazeta-run: interrupted ({name} at step" in err, err
    record = json.loads((run_dir / "result.json").read_text())
    assert record["status"] == "interrupted" and record["signal"] == name
    state = torch.load(run_dir / CHECKPOINT, weights_only=False)
    assert record["checkpoint_step"] == record["steps"] == state["loop"]["step"] >= 3

# --- complete records --------------------------------------------------------------------------------------


def test_a_failed_write_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "result.json"
    path.write_text('{"status": "finished"}\n')

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        atomic_write_text(path, '{"status": "failed"}\n')
    assert path.read_text() == '{"status": "finished"}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no temp file left behind


def test_the_command_reports_a_failed_final_write_in_one_line(fixture_data, tmp_path):
    run_dir = tmp_path / "run"
    code = (
        "import sys, adazeta.run as r\n"
        "def full(*a, **k): raise OSError(28, 'No space left on device')\n"
        "r.write_result = full\n"
        "from adazeta.cli import main; sys.argv = ['adazeta-run'] + sys.argv[1:]; main()"
    )
    args = [*tiny_overrides(fixture_data, "method=mezo_lora"), f"hydra.run.dir={run_dir}"]
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"adazeta-run: error: could not write to {run_dir}: No space left on device" in proc.stderr
    assert len(rows(run_dir / "metrics.csv")) == 4  # what the run wrote stays


# --- wandb ------------------------------------------------------------------------------------------------


def test_test_metrics_reach_wandb_when_the_best_step_is_early(tmp_path):
    tracker = Tracker(tmp_path, WandbConfig(mode="offline"), "t", {}, [])
    for step in range(1, 5):
        tracker.log_step({"step": step, "loss": 1.0})
    tracker.log_eval(2, "test", 0.5, 0.75)
    summary = dict(tracker.wandb.summary)
    tracker.close()
    assert summary["test/accuracy"] == 0.75 and summary["test/best_step"] == 2


def test_wandb_mode_auto_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    tracker = Tracker(tmp_path, WandbConfig(mode="auto"), "t", {}, [])
    assert tracker.wandb_mode == "disabled" and tracker.wandb is None
    tracker.close()


def test_no_secret_is_written(fixture_data, tmp_path, monkeypatch):
    """A wandb key in the environment never reaches the run's files (config, record, logs, wandb's own)."""
    key = "0123456789abcdef0123456789abcdef01234567"  # 40 hex characters, like a real key; not one
    monkeypatch.setenv("WANDB_API_KEY", key)
    run_dir = tmp_path / "run"
    record = run(compose_cfg(tiny_overrides(fixture_data, "method=mezo_lora", "wandb.mode=offline")), run_dir)
    assert record["status"] == "finished" and (run_dir / "wandb").is_dir()
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert len(written) > 5
    for path in written:
        assert key.encode() not in path.read_bytes(), path
