"""One run on two processes (torchrun, gloo on CPU) against the same run on one: the same update, no query twice."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adazeta.distributed import DistributedConfig, Spread, StepPlan
from adazeta.errors import ConfigError
from adazeta.optim.spsa import query_seed
from adazeta.run import run
from helpers import ROOT, compose_cfg, tiny_overrides

WORKER = Path(__file__).with_name("dist_worker.py")


def launch(nproc: int, *args: str, module: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc`` (one thread per process) of the worker or of the CLI."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}"}
    target = ["-m", "adazeta.cli"] if module else [str(WORKER)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *target, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


# --- how a step is divided -------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("mode", ["auto", "query", "data"])
@pytest.mark.parametrize("n_queries", [1, 2, 3, 4, 5, 8])
def test_every_query_and_example_is_evaluated_exactly_once_over_the_ranks(world, mode, n_queries):
    n_items = 7
    plans = [Spread(r, world, mode).plan(n_queries, n_items) for r in range(world)]
    covered = [(q, x) for p in plans for q in p.queries(n_queries) for x in p.items(list(range(n_items)))]
    assert sorted(covered) == [(q, x) for q in range(n_queries) for x in range(n_items)]
    for q in range(n_queries):  # the shards of a query weigh the whole minibatch
        assert sum(p.weight for p in plans if q in p.queries(n_queries)) == pytest.approx(1.0)
    if mode == "query" or (mode == "auto" and n_queries % world == 0):
        assert all(p.shards == 1 and p.weight == 1.0 for p in plans)  # queries only: nothing but zeros added


def test_auto_spreads_queries_when_there_are_enough_and_shards_data_otherwise():
    assert Spread(0, 2, "auto").describe(4) == "query-parallel"
    assert Spread(0, 2, "auto").describe(1) == "data-parallel"
    assert Spread(0, 4, "auto").describe(2) == "query-parallel x data-parallel (2 x 2)"
    assert StepPlan(1, 2, 0, 1, 5).items(list("abcde")) == ["d", "e"]  # contiguous; the first shard takes the extra


def test_bad_distributed_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"distributed.mode='rows' must be one of auto, query, data"):
        DistributedConfig(mode="rows")
    with pytest.raises(ConfigError, match=r"distributed.timeout_s=0 must be an int >= 1"):
        DistributedConfig(timeout_s=0)


# --- two processes against one ----------------------------------------------------------------------------------

CASES = {
    "adazeta-query": ["method=adazeta", "schedule=constant", "schedule.q=4", "distributed.mode=query"],
    "adazeta-auto-q3-batched": ["method=adazeta", "schedule=constant", "schedule.q=3",
                                "method.optimizer.batched_queries=true"],
    "mezo_lora-data": ["method=mezo_lora", "distributed.mode=data"],
    "lora-ddp": ["method=lora", "method.optimizer.lr=1e-2"],
    # Rules with state and estimators that shape the losses: every rank computes the same update from the summed
    # estimate, so two processes still train one model.
    "zo_adam-query": ["method=adazeta", "optimizer@method.optimizer=zo_adam", "schedule=constant", "schedule.q=4",
                      "distributed.mode=query"],
    "es-data": ["method=mezo_lora", "optimizer@method.optimizer=es", "distributed.mode=data"],
}


def _train(tmp_path: Path, nproc: int, name: str, fixture_data: Path) -> list[dict]:
    out = tmp_path / f"{name}-{nproc}"
    overrides = tiny_overrides(fixture_data, "train.max_steps=6", "train.eval_every=3", *CASES[name])
    if nproc == 1:  # a plain process, as a user runs it
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}"}
        done = subprocess.run([sys.executable, str(WORKER), "train", str(out), *overrides], env=env,
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
    else:
        done = launch(nproc, "train", str(out), *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(nproc)]


@pytest.mark.parametrize("name", list(CASES))
def test_two_processes_make_the_one_process_update(name, fixture_data, tmp_path):
    (one,) = _train(tmp_path, 1, name, fixture_data)
    two = _train(tmp_path, 2, name, fixture_data)
    assert one["steps"] == two[0]["steps"] == 6 and one["forward_passes"] == two[0]["forward_passes"]
    for rank in two:  # every rank holds the same weights as the other, and as one process (fp32, 1e-6)
        assert rank["trainable"].keys() == one["trainable"].keys()
        for key, value in one["trainable"].items():
            assert torch.equal(rank["trainable"][key], two[0]["trainable"][key]), key
            torch.testing.assert_close(rank["trainable"][key], value, rtol=1e-6, atol=1e-6, msg=key)
    moved = [k for k, v in one["trainable"].items() if v.abs().sum() > 0]
    assert moved, "the run must have trained something for the comparison to mean anything"
    if name == "adazeta-query":
        # Query-parallel: exactly the one-process numbers, and no query evaluated twice or skipped.
        for key, value in one["trainable"].items():
            assert torch.equal(two[0]["trainable"][key], value), key
        for step, (a, b) in enumerate(zip(two[0]["evaluated"], two[1]["evaluated"])):
            assert not set(a) & set(b), f"step {step}: both ranks evaluated {set(a) & set(b)}"
            assert sorted(a + b) == sorted(query_seed(0, step, q) for q in range(4))
            assert len(a) == len(b) == 2


# --- the whole command ------------------------------------------------------------------------------------------

def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_torchrun_adazeta_run_writes_one_record_from_rank_zero(fixture_data, tmp_path):
    overrides = tiny_overrides(fixture_data, "method=adazeta", "schedule=constant", "schedule.q=2")
    single = tmp_path / "single"
    one = run(compose_cfg(overrides), single, overrides)
    done = launch(2, *overrides, f"hydra.run.dir={tmp_path / 'two'}", module=True)
    assert done.returncode == 0, done.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "result.json").read_text())
    assert (two["world_size"], two["parallel"], two["backend"]) == (2, "zo:auto", "gloo")
    assert (one["world_size"], one["parallel"]) == (1, "none")
    assert two["status"] == "finished" and two["test_accuracy"] == one["test_accuracy"]
    assert _rows(tmp_path / "two" / "eval.csv") == _rows(single / "eval.csv")
    losses = lambda d: [r["loss"] for r in _rows(d / "metrics.csv")]  # noqa: E731
    assert losses(tmp_path / "two") == losses(single)
    # Rank 0's files only: the same as one process, plus Hydra's log of the command, with one writer.
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted([*(p.name for p in single.iterdir()),
                                                                           "cli.log"])
    assert (tmp_path / "two" / "cli.log").read_text().count("finished after") == 1
    # Run again: rank 0 finds the finished run and both processes skip it.
    again = launch(2, *overrides, f"hydra.run.dir={tmp_path / 'two'}", module=True)
    assert again.returncode == 0 and "skipping" in again.stdout + again.stderr
    # Other settings on the same directory: rank 0 refuses before any work, and the other rank stops with it.
    other = launch(2, *overrides, "seed=1", f"hydra.run.dir={tmp_path / 'two'}", module=True, timeout=120)
    assert other.returncode != 0 and "holds a finished run with other settings (seed: 0 -> 1)" in other.stderr


def test_a_failure_on_another_rank_ends_the_run_with_one_record_naming_it(fixture_data, tmp_path):
    overrides = tiny_overrides(fixture_data, "method=mezo_lora", "train.max_steps=8")
    done = launch(2, "run", str(tmp_path / "run"), "3", *overrides)
    assert done.returncode != 0
    record = json.loads((tmp_path / "run" / "result.json").read_text())
    assert record["status"] == "failed" and record["world_size"] == 2
    assert "rank 1: RuntimeError: injected fault at step 3" in record["reason"]


# --- models larger than one GPU ---------------------------------------------------------------------------------

def test_placement_says_when_a_model_needs_several_gpus_and_estimates_each():
    from adazeta.dryrun import placement

    est = {"weights": 12.5, "activations": 1.4, "gradients": 0.0, "optimizer_state": 0.0, "step_temporaries": 0.1,
           "total": 14.0}
    assert placement(est, [], None, True)["fits"] == "cpu"
    assert placement(est, [80.0], None, True)["fits"] == "one_gpu"
    two = placement(est, [10.0, 10.0, 10.0], None, True)  # 12.5 / 2 + 1.5 = 7.75 GiB <= 0.9 x 10 on each of two
    assert two["fits"] == "2_gpus" and two["per_device_gib"] == pytest.approx(7.75)
    assert "set model.device_map=auto" in two["advice"]
    assert placement(est, [4.0, 4.0], "auto", True)["fits"] == "offload"
    assert "first-order method cannot use model.device_map" in placement(est, [10.0], None, False)["advice"]


def test_device_map_auto_gives_the_same_run_and_records_the_devices(fixture_data, tmp_path):
    overrides = tiny_overrides(fixture_data, "method=mezo_lora")
    plain = run(compose_cfg(overrides), tmp_path / "plain", overrides)
    spread = run(compose_cfg([*overrides, "model.device_map=auto"]), tmp_path / "map", overrides)
    assert spread["devices"] == ["cpu"] and "devices" not in plain  # no GPU here: accelerate keeps it on the CPU
    assert _rows(tmp_path / "map" / "eval.csv") == _rows(tmp_path / "plain" / "eval.csv")


def test_device_map_is_refused_for_backward_and_for_several_processes(fixture_data, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="method 'lora' trains with backward: unset model.device_map"):
        run(compose_cfg(tiny_overrides(fixture_data, "method=lora", "model.device_map=auto")), tmp_path / "a")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="model.device_map=auto with several processes"):
        run(compose_cfg(tiny_overrides(fixture_data, "method=mezo_lora", "model.device_map=auto")), tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before any work


def test_slurm_tasks_of_one_job_run_one_experiment_without_torchrun(fixture_data, tmp_path):
    """Two SLURM tasks (what hydra.launcher.tasks_per_node=2 starts) find each other from SLURM's variables."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    overrides = tiny_overrides(fixture_data, "method=mezo_lora", f"hydra.run.dir={tmp_path / 'run'}")
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": str(rank),
               "SLURM_LOCALID": str(rank), "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "4321",
               "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "1", "SUBMITIT_EXECUTOR": "slurm",
               "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT / "src")}
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR"):
            env.pop(key, None)
        procs.append(subprocess.Popen([sys.executable, "-m", "adazeta.cli", *overrides], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    record = json.loads((tmp_path / "run" / "result.json").read_text())
    assert (record["world_size"], record["parallel"], record["status"]) == (2, "zo:auto", "finished")


def test_a_sweep_under_torchrun_is_one_line_and_runs_nothing(fixture_data, tmp_path):
    done = launch(2, "-m", *tiny_overrides(fixture_data, "seed=0,1", f"hydra.sweep.dir={tmp_path / 'sweep'}"),
                  module=True)
    assert done.returncode != 0
    assert "a sweep (-m) cannot run under torchrun" in done.stderr
    assert not (tmp_path / "sweep").exists()


# --- several processes fail safely ------------------------------------------------------------------------------

def launch_cli(what: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun ... adazeta-run ARGS`` with one rank made different (``dist_worker.py cli WHAT``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER), "cli",
           what, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_the_start_up_check_names_the_refused_ranks_and_a_resume_names_the_layout_change():
    """Which rank a refusal names when several are refused, and what a layout change says (no process group)."""
    from adazeta.distributed import _refusal, layout_change

    assert _refusal([("h", None), ("h", None)], {"seed": 0}) is None
    assert _refusal([("h", "data.dir: not found"), ("h", "data.dir: not found")], None) == \
        "every rank: data.dir: not found"
    assert _refusal([("h", None), (None, "bad"), (None, "worse")], None) == \
        "rank 1: bad (and 1 other rank(s) with another error)"
    assert layout_change(None, {"world_size": 2, "mode": "auto"}) is None  # a checkpoint from before layouts
    assert layout_change({"world_size": 2, "mode": "query"}, {"world_size": 2, "mode": "data"}) == "mode query -> data"
    assert layout_change({"world_size": 4, "mode": "auto"}, {"world_size": 4, "mode": "auto"}) is None


def no_rank_traceback(stderr: str) -> bool:
    """Whether no rank printed a traceback of the runner's code (torchrun's own summary of a failed launch aside)."""
    return f"{os.sep}adazeta{os.sep}" not in stderr and "[rank0]:" not in stderr and "[rank1]:" not in stderr


@pytest.mark.parametrize("what, line", [
    # Ranks that disagree on a setting that changes the numbers: refused before the run directory is touched.
    ("1:method.optimizer.lr=0.5", "the ranks were given different settings, so they would train different models: "
                                  "method.optimizer.lr is 0.001 on rank 0, 0.5 on rank 1"),
    # One rank's mistake (its command line, a file its node lacks): every rank stops, rank 0 says which rank.
    ("1:train.eval_evry=3", "rank 1: train.eval_evry=3: train has no key 'eval_evry'"),
    ("1:data.dir=/nonexistent", "rank 1: method 'mezo_lora' needs the train split to train: data file not found: "
                                "/nonexistent/"),
])
def test_ranks_that_disagree_or_one_rank_refused_stop_every_rank_in_one_line(what, line, fixture_data, tmp_path):
    """Before: ranks given different settings ran apart until the step-50 checksum and left a checkpoint of a
    desynchronised run, and a bad override on one rank ended in torchrun's report alone."""
    run_dir = tmp_path / "run"
    done = launch_cli(what, *tiny_overrides(fixture_data, "method=mezo_lora", "method.optimizer.lr=1e-3"),
                      f"hydra.run.dir={run_dir}")
    errors = [x for x in done.stderr.splitlines() if x.startswith("adazeta-run: error:")]
    assert len(errors) == 1 and line in errors[0], done.stderr[-3000:]
    assert "exitcode  : 2" in done.stderr and "rank      : 0" in done.stderr  # rank 0 alone fails, with status 2
    assert no_rank_traceback(done.stderr), done.stderr[-3000:]
    assert not run_dir.exists()  # no record, no checkpoint: nothing ran


def test_ctrl_c_to_the_process_group_checkpoints_and_a_resume_keeps_the_layout(fixture_data, tmp_path):
    """Ctrl-C reaches torchrun, which relays it to every rank: the run is interrupted after the step, checkpointed,
    recorded once, and no rank prints a traceback; a resume on another process layout (before: resumed silently) is
    refused in one line unless distributed.resume_layout=any."""
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(fixture_data, "method=mezo_lora", "train.max_steps=8", f"hydra.run.dir={run_dir}")
    done = launch_cli("0@3:SIGINT/launcher", *overrides)
    record = json.loads((run_dir / "result.json").read_text())
    assert (record["status"], record["signal"], record["checkpoint_step"]) == ("interrupted", "SIGINT", 3), \
        done.stderr[-3000:]
    assert done.stderr.count("adazeta-run: interrupted (SIGINT") == 1 and no_rank_traceback(done.stderr)
    assert (run_dir / "checkpoint.pt").is_file()
    one = [o for o in overrides if not o.startswith("hydra.")]
    with pytest.raises(ConfigError, match=r"was written on another process layout \(world_size 2 -> 1, mode auto -> "
                                          r"None\).*rerun with distributed.resume_layout=any"):
        run(compose_cfg(one), run_dir, one)
    assert json.loads((run_dir / "result.json").read_text()) == record  # refused before any work
    resumed = run(compose_cfg([*one, "distributed.resume_layout=any"]), run_dir, one)
    assert (resumed["status"], resumed["resumed_from_step"], resumed["steps"]) == ("finished", 3, 8)


def test_ctrl_c_to_the_process_group_during_start_up_is_one_line_and_writes_nothing(fixture_data, tmp_path):
    """Ctrl-C while the ranks check their command line (before the run begins): torchrun relays it, rank 0 says so
    in one line and exits 130, the other ranks end by the signal, no rank prints a traceback, nothing is written."""
    run_dir = tmp_path / "run"
    done = launch_cli("0@start-up:SIGINT/launcher", *tiny_overrides(fixture_data, "method=mezo_lora"),
                      f"hydra.run.dir={run_dir}")
    lines = [x for x in done.stderr.splitlines() if x.startswith("adazeta-run:")]
    assert lines == ["adazeta-run: interrupted (SIGINT during the start-up, before the run began); nothing was "
                     "written, so the same command starts the run"], done.stderr[-3000:]
    assert done.returncode != 0 and no_rank_traceback(done.stderr), done.stderr[-3000:]
    assert not run_dir.exists()


def test_rank_zero_killed_leaves_a_failed_record_with_its_last_checkpoint(fixture_data, tmp_path):
    """Before: SIGKILL to rank 0 left no result.json at all. Now the surviving rank sees rank 0's process gone,
    writes the failed record naming it, and offers the checkpoint rank 0 left once it checked that it resumes."""
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(fixture_data, "method=mezo_lora", "train.max_steps=8", "train.checkpoint_every=2",
                               f"hydra.run.dir={run_dir}")
    done = launch_cli("0@5:SIGKILL", *overrides)
    assert done.returncode != 0
    record = json.loads((run_dir / "result.json").read_text())
    assert record["status"] == "failed" and record["world_size"] == 2, done.stderr[-3000:]
    assert record["reason"].startswith("rank 0 (pid ") and "ended without reporting an error" in record["reason"]
    assert "rank 1 recorded the run in its place" in record["reason"]
    assert record["checkpoint_step"] == 4
    assert "adazeta-run: error: rank 0 (pid " in done.stderr and "[rank1]:" not in done.stderr  # one line, no trace
    one = [o for o in overrides if not o.startswith("hydra.")]
    resumed = run(compose_cfg([*one, "distributed.resume_layout=any"]), run_dir, one)
    assert (resumed["status"], resumed["resumed_from_step"]) == ("finished", 4)
