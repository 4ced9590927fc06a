"""adazeta.tools.experiment: grids at one seed, the dev-chosen lr for the other seeds and the stress test."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from adazeta.errors import ConfigError
from adazeta.experiments import design_of
from adazeta.runs.rundir import claim, holder
from adazeta.tools import experiment as driver

CONFIG = {
    "arms": {
        "zo": {"overrides": ["method=adazeta"], "lr": [1e-3, 1e-4]},
        "fo": {"overrides": ["method=tt_adapter"], "lr": [1e-3], "first_order": True},
        "zs": {"overrides": ["method=zero_shot"]},
    },
    "design": {"select_seed": 0, "seeds": [0, 1, 2], "stress": [3, 10], "order": ["zs", "zo", "fo"]},
}
DESIGN = design_of(CONFIG)


@pytest.fixture
def root(tmp_path, monkeypatch):
    """The current directory, under which the driver keeps results/runs."""
    monkeypatch.chdir(tmp_path)
    return Path.cwd()


def finish(job, dev: float, dev_loss: float = 0.5, status: str = "finished", test: float = 0.0):
    job.run_dir.mkdir(parents=True, exist_ok=True)
    (job.run_dir / "result.json").write_text(json.dumps(
        {"status": status, "dev_accuracy": dev, "dev_loss": dev_loss, "test_accuracy": test}))


def test_select_runs_every_grid_point_at_the_selection_seed_interleaved_by_arm(root):
    jobs = driver.plan("x", DESIGN, "select", None)
    assert [(j.arm, j.lr, j.seed) for j in jobs] == [("zs", None, 0), ("zo", 1e-3, 0), ("fo", 1e-3, 0), ("zo", 1e-4, 0)]
    assert jobs[0].run_dir == root / "results" / "runs" / "x" / "zs" / "seed=0"
    assert jobs[1].run_dir.name == "lr=0.001,seed=0"
    assert "method.optimizer.lr=0.001" in driver.command("x", jobs[1], [])
    assert not any(a.startswith("method.optimizer.lr") for a in driver.command("x", jobs[0], []))
    # Each run is `adazeta-run` with these overrides, its directory given as an absolute path.
    assert driver.command("x", jobs[1], ["wandb.mode=offline"]) == [
        sys.executable, "-m", "adazeta.cli", "experiment=x", "method=adazeta", "method.name=zo",
        "method.optimizer.lr=0.001", "seed=0", "experiment_name=x",
        f"hydra.run.dir='{root}/results/runs/x/zo/lr=0.001,seed=0'", "wandb.mode=offline"]


def test_later_phases_wait_for_the_whole_grid_then_use_the_dev_choice_never_test(root):
    jobs = {(j.arm, j.lr): j for j in driver.plan("x", DESIGN, "select", None)}
    finish(jobs["zo", 1e-3], dev=0.70, dev_loss=0.60, test=0.99)
    assert [j.arm for j in driver.plan("x", DESIGN, "seeds", None)] == []  # zs, fo, zo's second point missing
    finish(jobs["zo", 1e-4], dev=0.70, dev_loss=0.40, test=0.10)  # same dev accuracy, lower dev loss: chosen
    finish(jobs["zs", None], dev=0.5)
    finish(jobs["fo", 1e-3], dev=0.9)
    seeds = driver.plan("x", DESIGN, "seeds", None)
    assert sorted((j.arm, j.lr, j.seed) for j in seeds) == [
        ("fo", 1e-3, 1), ("fo", 1e-3, 2), ("zo", 1e-4, 1), ("zo", 1e-4, 2), ("zs", None, 1), ("zs", None, 2)]
    stress = driver.plan("x", DESIGN, "stress", None)  # ZO arms only, in their own experiment; 10 x 1e-4 = 1e-3
    assert [(j.arm, j.lr, j.experiment) for j in stress] == [("zo", pytest.approx(3e-4), "x_stress")]  # is a grid point
    assert all(j.done() for j in jobs.values())


def test_unknown_arms_are_refused_with_the_known_ones(root):
    with pytest.raises(SystemExit, match="unknown arm.*known: zs, zo, fo"):
        driver.plan("x", DESIGN, "select", ["zo", "nope"])


def test_arms_are_picked_by_name_or_pattern_in_the_design_order(root):
    assert [j.arm for j in driver.plan("x", DESIGN, "select", ["z*"])] == ["zs", "zo", "zo"]
    assert [j.arm for j in driver.plan("x", DESIGN, "select", ["fo", "zs"])] == ["zs", "fo"]
    with pytest.raises(SystemExit, match=r"unknown arm\(s\) lora_\*; known"):
        driver.plan("x", DESIGN, "select", ["z*", "lora_*"])


def test_the_committed_cpu_zo_experiment_parses_and_plans():
    _, design = driver.load("cpu_zo")
    jobs = driver.plan("cpu_zo", design, "select", None)
    arms = {j.arm for j in jobs}
    assert {"adazeta", "adazeta_identity", "tt_q1", "mezo_lora", "mezo", "tt_adapter_fo", "zero_shot"} <= arms
    assert all(j.seed == 0 for j in jobs)


def test_an_arm_with_its_own_seeds_runs_only_at_them(root):
    config = {"arms": {"zo": {"overrides": ["method=adazeta"], "lr": [1e-3]},
                       "zs": {"overrides": ["method=zero_shot"], "seeds": [0]},
                       "late": {"overrides": ["method=icl"], "seeds": [2]}},
              "design": {"select_seed": 0, "seeds": [0, 1, 2], "order": ["zo", "zs", "late"]}}
    select = driver.plan("x", design_of(config), "select", None)
    assert [(j.arm, j.seed) for j in select] == [("zo", 0), ("zs", 0)]
    for job in select:
        finish(job, dev=0.6)
    seeds = driver.plan("x", design_of(config), "seeds", None)
    assert [(j.arm, j.lr, j.seed) for j in seeds] == [("zo", 1e-3, 1), ("zo", 1e-3, 2), ("late", None, 2)]


def test_the_preregistered_claims_experiment_plans_seed_major_with_one_rate_per_arm(root):
    config, design = driver.load("cpu_zo_claims")
    assert config["train"]["max_forward_passes"] == 3000 and config["data"]["seed"] == 0
    assert all(len(arm.lrs) == 1 for arm in design.arms.values())
    select = driver.plan("cpu_zo_claims", design, "select", None)
    assert [j.arm for j in select[:4]] == ["mezo_lora", "ada_official", "ada_paper", "tt_q1"]
    for job in select:
        finish(job, dev=0.6)
    seeds = driver.plan("cpu_zo_claims", design, "seeds", None)
    per_arm = {a: sorted(j.seed for j in seeds if j.arm == a) for a in {j.arm for j in seeds}}
    assert per_arm == {a: [1, 2, 3] for a in ("mezo_lora", "ada_official", "ada_paper", "tt_q1", "icl", "tt_fo")}


def test_a_dirty_tree_is_refused_unless_allowed_and_launches_are_logged(root, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(driver, "git_state", lambda: {"commit": "abc123def4567", "dirty": True})
    monkeypatch.setattr(sys, "argv", ["experiment.py", "cpu_zo_claims", "--arms", "zero_shot"])
    with pytest.raises(SystemExit) as stop:
        driver.main()
    assert stop.value.code == 2  # bad input: one line, as argparse's own errors
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search("uncommitted changes.*--allow-dirty", err[0])
    job = driver.Job("zs", None, 0, "x", ["method=zero_shot"])
    job.run_dir.mkdir(parents=True)
    driver.log_launch(job, ["py", "-m", "adazeta.cli", "method=zero_shot"], {"commit": "abc", "dirty": True}, True)
    path = root / "results" / "runs" / "x" / "launches.csv"
    assert b"\r" not in path.read_bytes()
    rows = path.read_text().splitlines()
    assert rows[0].split(",") == driver.LAUNCH_COLUMNS
    assert rows[1].split(",")[1:] == ["zs", "", "0", "results/runs/x/zs/seed=0", "abc", "True", "True",
                                      "adazeta-run method=zero_shot"]


# --- the one schema: a grid every arm runs over, its Hydra sweep derived from it ------------------------------------

GRID = {
    "arms": {"zo": {"overrides": ["method=mezo"], "lr": [1e-3, 1e-4]}, "zs": {"overrides": ["method=zero_shot"]}},
    "design": {"grid": {"task": ["rte", "cb"]}, "seeds": [0, 1]},
}


def test_a_grid_runs_every_arm_at_every_point_and_chooses_each_lr_per_point(root):
    design = design_of(GRID)
    select = driver.plan("t", design, "select", None)
    assert [(j.arm, dict(j.point)["task"], j.lr, j.seed) for j in select] == [
        ("zo", "rte", 1e-3, 0), ("zs", "rte", None, 0), ("zo", "rte", 1e-4, 0),
        ("zo", "cb", 1e-3, 0), ("zs", "cb", None, 0), ("zo", "cb", 1e-4, 0)]
    assert select[0].run_dir == root / "results" / "runs" / "t" / "zo" / "task=rte,lr=0.001,seed=0"
    assert select[1].run_dir.name == "task=rte,seed=0"
    cmd = driver.command("t", select[0], [])
    assert cmd[3:7] == ["experiment=t", "method=mezo", "task=rte", "method.name=zo"]
    by_point = {(j.arm, dict(j.point)["task"], j.lr): j for j in select}
    finish(by_point["zo", "rte", 1e-3], dev=0.9)  # rte prefers 1e-3, cb 1e-4: chosen where each was measured
    finish(by_point["zo", "rte", 1e-4], dev=0.6)
    finish(by_point["zo", "cb", 1e-3], dev=0.5)
    finish(by_point["zo", "cb", 1e-4], dev=0.7)
    finish(by_point["zs", "rte", None], dev=0.5)
    seeds = driver.plan("t", design, "seeds", None)
    assert [(j.arm, dict(j.point)["task"], j.lr, j.seed) for j in seeds] == [
        ("zo", "rte", 1e-3, 1), ("zs", "rte", None, 1), ("zo", "cb", 1e-4, 1)]  # zs at cb: its run is missing


def test_the_hydra_sweep_is_derived_from_the_arms_and_design():
    from omegaconf import OmegaConf

    from adazeta.experiments import sweep_params

    params = sweep_params(OmegaConf.create({**GRID, "experiment_name": "t", "seed": 0}))
    assert params == {"task": "rte,cb", "seed": "0,1", "method": "mezo,zero_shot"}  # the method innermost
    narrowed = OmegaConf.create({**GRID, "experiment_name": "t", "design": {**GRID["design"], "arms": ["zs"]}})
    assert sweep_params(narrowed)["method"] == "zero_shot"
    assert "seed" not in sweep_params(OmegaConf.create({"arms": GRID["arms"], "seed": 3}))  # undeclared: not swept
    assert sweep_params(OmegaConf.create({"seed": 0})) == {}  # no arms: a plain `adazeta-run -m`
    composite = OmegaConf.create({"experiment_name": "c", "arms": {"tt": {"overrides": ["method=adazeta",
                                                                                         "schedule=constant"]}}})
    with pytest.raises(ConfigError, match="arm 'tt' changes more than its method .*python -m adazeta.tools.experiment c"):
        sweep_params(composite)


@pytest.mark.parametrize("change,message", [
    ({"design": {"seeds": [0], "sedes": [1]}}, "design has unknown key.*sedes"),
    ({"arms": {"zo": {"lr": [1e-3]}}}, r"arms.zo needs `overrides:`"),
    ({"arms": {"zo": {"overrides": ["method=mezo"], "lrs": [1]}}}, r"arms.zo has unknown key.*lrs"),
    ({"arms": {"zo": {"overrides": ["method=mezo"], "lr": "1e-3"}}}, r"arms.zo.lr must be a non-empty list"),
    ({"arms": {"zo": {"overrides": ["method=mezo"], "lr": ["fast"]}}}, r"arms.zo.lr must list floats"),
    ({"design": {"arms": ["zo", "nope"]}}, "design.arms names nope"),
    ({"design": {"grid": ["task"]}}, "design.grid must map an override key to its values"),
])
def test_a_bad_schema_is_one_line_naming_the_key(change, message):
    bad = {"arms": change.get("arms", GRID["arms"]), "design": change.get("design", GRID["design"])}
    with pytest.raises(ConfigError, match=message):
        design_of(bad, "t")


def test_every_committed_experiment_has_the_one_schema_and_no_other():
    """Every experiment config declares arms (and, for a sweep, derives its Hydra params from them): no `tuning:`
    block, no hand-written sweeper params left to disagree with its arms."""
    from adazeta.experiments import compose_experiment
    from helpers import CONF

    for path in sorted((CONF / "experiment").glob("*.yaml")):
        config = compose_experiment(path.stem)
        assert design_of(config, path.stem) is not None, path.stem
        assert "tuning" not in config, path.stem
        text = path.read_text()
        if "sweeper:" in text:
            assert "params: ${experiment_sweep:}" in text, path.stem


def test_the_driver_refuses_an_unknown_experiment_in_one_line(root, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["experiment.py", "nosuch", "--dry"])
    with pytest.raises(SystemExit) as stop:
        driver.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1
    assert re.search("no experiment config .*nosuch.yaml; known experiments: .*cpu_zo", err[0])


@pytest.mark.parametrize("flag", [["--threads", "0"], ["--jobs", "-1"], ["--threads", "two"]])
def test_a_thread_or_job_count_below_one_is_refused_before_anything_starts(root, monkeypatch, capsys, flag):
    monkeypatch.setattr(sys, "argv", ["experiment.py", "cpu_zo_claims", *flag])
    with pytest.raises(SystemExit) as stop:
        driver.main()
    assert stop.value.code == 2 and f"argument {flag[0]}" in capsys.readouterr().err


def test_a_stop_signal_reaches_the_runs_and_the_driver_ends_with_its_status(root, tmp_path):
    """SIGTERM to the driver alone: its running run gets it too (it checkpoints and stops; here a child that
    records the signal), no further run starts, and the driver exits 128 + 15 with one line saying how to go on."""
    import signal
    import time

    child = tmp_path / "child.py"
    child.write_text("import signal, sys, time, pathlib\n"
                     "def stop(n, f):\n    pathlib.Path(sys.argv[1]).write_text(str(n)); sys.exit(128 + n)\n"
                     "signal.signal(signal.SIGTERM, stop)\n"
                     "pathlib.Path(sys.argv[1] + '.ready').write_text('up')\n"
                     "time.sleep(60)\n")
    script = tmp_path / "drive.py"
    script.write_text(
        "import sys, threading\n"
        "from adazeta.tools import experiment as d\n"
        f"d.command = lambda name, job, extra: [sys.executable, {str(child)!r}, str(job.run_dir / 'got')]\n"
        "d.git_state = lambda: {'commit': 'abc', 'dirty': False}\n"
        "sys.argv = ['experiment.py', 'cpu_zo_claims', '--arms', 'zero_shot,zero_shot_cc', '--phase', 'select',"
        " '--jobs', '1']\n"
        "d.main()\n")
    first = root / "results" / "runs" / "cpu_zo_claims" / "zero_shot" / "seed=0"
    first.mkdir(parents=True)
    (first / "stdout.log").write_text("the console of the run's first part\n")  # a run interrupted before
    proc = subprocess.Popen([sys.executable, str(script)], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(Path(driver.__file__).parents[2])})
    for _ in range(300):
        if (first / "got.ready").exists():
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert (first / "got").read_text() == str(int(signal.SIGTERM))  # the run got the signal
    assert not (root / "results" / "runs" / "cpu_zo_claims" / "zero_shot_cc").exists()  # nothing new started
    assert "Traceback" not in err and "stopped by SIGTERM" in err and "the same command continues" in err
    assert sum(line.startswith("$ ") for line in out.splitlines()) == 1, out  # only the run that started
    log = (first / "stdout.log").read_text().splitlines()  # its first part's console is kept, then the new one
    assert log[0] == "the console of the run's first part" and log[1].startswith("# --- continued ")


def test_a_run_another_process_holds_is_left_to_it_and_a_free_one_is_launched(root, monkeypatch, capsys):
    """Two drivers can share a phase: a run whose directory is claimed by a live run is skipped (not launched, not
    logged as a launch, not a failure); a lock file nobody holds any more (a finished or killed run) is no claim."""
    monkeypatch.setattr(driver, "git_state", lambda: {"commit": "abc123def4567", "dirty": False})
    monkeypatch.setattr(sys, "argv", ["experiment.py", "cpu_zo_claims", "--arms", "zero_shot", "--phase", "select"])
    (job,) = list(driver.plan("cpu_zo_claims", driver.load("cpu_zo_claims")[1], "select", ["zero_shot"]))
    assert holder(job.run_dir) is None  # never claimed
    launched = []
    monkeypatch.setattr(driver.CHILDREN, "run", lambda cmd, env, log: launched.append(cmd) or 0)
    with claim(job.run_dir):
        assert holder(job.run_dir).startswith(f"pid {os.getpid()} ")
        with pytest.raises(SystemExit) as stop:
            driver.main()
    assert stop.value.code == 0 and launched == []
    assert "zero_shot lr=None seed=0: skipped, another run holds it (pid " in capsys.readouterr().out
    assert not (root / "results" / "runs" / "cpu_zo_claims" / "launches.csv").exists()

    assert holder(job.run_dir) is None  # released: the lock file stays, with no owner
    with pytest.raises(SystemExit) as stop:
        driver.main()
    assert stop.value.code == 0 and len(launched) == 1
    assert len((root / "results" / "runs" / "cpu_zo_claims" / "launches.csv").read_text().splitlines()) == 2


def test_a_run_another_driver_ended_after_the_plan_is_not_launched_again(root, monkeypatch, capsys):
    """Two drivers sharing a phase each plan it at their start; a run the other one finished since then (no longer
    held) is skipped: no second launch, no launch row, its stdout.log kept."""
    monkeypatch.setattr(driver, "git_state", lambda: {"commit": "abc123def4567", "dirty": False})
    monkeypatch.setattr(sys, "argv", ["experiment.py", "cpu_zo_claims", "--arms", "zero_shot,zero_shot_cc",
                                      "--phase", "select", "--jobs", "1"])
    design = driver.load("cpu_zo_claims")[1]
    first, second = (j for arm in ("zero_shot", "zero_shot_cc")
                     for j in driver.plan("cpu_zo_claims", design, "select", [arm]))
    launched = []

    def run(cmd, env, log):  # while this driver runs the first job, the other finishes the second
        launched.append(cmd)
        if len(launched) == 1:
            finish(second, dev=0.6)
            (second.run_dir / "stdout.log").write_text("the other driver's log\n")
        return 0

    monkeypatch.setattr(driver.CHILDREN, "run", run)
    with pytest.raises(SystemExit) as stop:
        driver.main()
    out = capsys.readouterr().out
    assert stop.value.code == 0 and len(launched) == 1 and f"hydra.run.dir='{first.run_dir}'" in " ".join(launched[0])
    assert "zero_shot_cc lr=None seed=0: skipped, finished meanwhile" in out
    assert (second.run_dir / "stdout.log").read_text() == "the other driver's log\n"
    assert len((root / "results" / "runs" / "cpu_zo_claims" / "launches.csv").read_text().splitlines()) == 2


# --- a task matrix: grids at some points, rates carried to the rest, arms on some tasks, budgets from a pilot ------

MATRIX = {
    "arms": {
        "zo": {"overrides": ["method=mezo_lora"], "lr": [1e-3, 1e-4], "budgeted": True},
        "full": {"overrides": ["method=mezo"], "lr": [1e-5, 1e-6], "budgeted": True, "only": {"task": ["sst2", "cb"]}},
        "zs": {"overrides": ["method=zero_shot"], "seeds": [0]},
    },
    "design": {"grid": {"task": ["sst2", "rte", "cb"]}, "seeds": [0, 1], "select_at": {"task": ["sst2", "rte"]},
               "budget": {"axis": "task", "pilots": {"sst2": "p/s/seed=*", "rte": "p/r", "cb": "p/c"},
                          "share": 0.9, "floor": 400, "cap": 1000, "round_to": 200, "evals": 5}},
}


def pilot(root: Path, where: str, losses: dict[int, float], status: str = "finished", seed: int = 0):
    """A pilot run at Q = 1 (2 forwards a step) with these dev losses by forward passes."""
    run = root / "results" / "runs" / where
    run.mkdir(parents=True, exist_ok=True)
    (run / "result.json").write_text(json.dumps({"status": status}))
    (run / "eval.csv").write_text("step,split,loss,accuracy,tied\n" + "".join(
        f"{f // 2},dev,{loss},0.5,0.0\n" for f, loss in losses.items()))
    (run / "metrics.csv").write_text("step,forward_passes\n" + "".join(f"{s},{2 * s}\n" for s in range(1, 2000)))


def test_the_budget_rule_takes_the_first_evaluation_past_the_share_of_the_pilots_drop(root):
    from adazeta.experiments import budget_at

    budget = design_of(MATRIX).budget
    runs = root / "results" / "runs"
    assert budget_at(budget, "rte", runs).forwards is None  # not run yet
    pilot(root, "p/r", {0: 1.0, 200: 0.8, 400: 0.62, 600: 0.6, 800: 0.6, 1000: 0.6})  # 90 %: 0.64, made at 400
    assert budget_at(budget, "rte", runs).forwards == 400
    pilot(root, "p/c", {0: 1.0, 200: 1.0, 400: 0.999, 600: 1.0, 800: 1.0, 1000: 1.0})  # did not move: the cap
    assert budget_at(budget, "cb", runs).forwards == 1000 and "did not move" in budget_at(budget, "cb", runs).why
    # two pilot seeds are averaged: 90 % of (1.0 -> 0.5) is 0.55, which the mean reaches at 600 (0.5 at 1000)
    pilot(root, "p/s/seed=0", {0: 1.0, 200: 0.9, 400: 0.7, 600: 0.5, 800: 0.5, 1000: 0.5, 1200: 0.1})
    pilot(root, "p/s/seed=1", {0: 1.0, 200: 0.9, 400: 0.7, 600: 0.6, 800: 0.5, 1000: 0.5, 1200: 0.1}, "running")
    assert budget_at(budget, "sst2", runs).forwards is None  # one seed still running
    pilot(root, "p/s/seed=1", {0: 1.0, 200: 0.9, 400: 0.7, 600: 0.6, 800: 0.5, 1000: 0.5, 1200: 0.1})
    sst2 = budget_at(budget, "sst2", runs)  # 1200 is past the cap: never looked at
    assert sst2.forwards == 600 and sst2.curve[-1] == (1000, 0.5)
    pilot(root, "p/r", {0: 1.0, 200: 0.2, 400: 9.0}, status="diverged")
    assert budget_at(budget, "rte", runs).forwards == 1000  # a pilot that diverged within the cap: the cap
    pilot(root, "p/r", {0: 1.0, 200: 0.2, 400: 0.2, 1000: 0.2, 1200: 9.0}, status="diverged")
    assert budget_at(budget, "rte", runs).forwards == 400  # ... after it: its curve up to the cap counts


def test_a_matrix_runs_grids_at_the_selection_points_and_carries_the_rate_to_the_others(root):
    design = design_of(MATRIX)
    waiting = driver.plan("m", design, "select", None)  # no pilot has ended: only the arms without a budget start
    assert [(j.arm, dict(j.point)["task"]) for j in waiting] == [("zs", "sst2"), ("zs", "rte")]
    pilot(root, "p/s/seed=0", {0: 1.0, 200: 0.5, 1000: 0.5})
    pilot(root, "p/r", {0: 1.0, 200: 0.9, 400: 0.8, 600: 0.7, 800: 0.6, 1000: 0.5})
    select = driver.plan("m", design, "select", None)
    assert [(j.arm, dict(j.point)["task"], j.lr) for j in select] == [
        ("zo", "sst2", 1e-3), ("full", "sst2", 1e-5), ("zs", "sst2", None), ("zo", "sst2", 1e-4), ("full", "sst2", 1e-6),
        ("zo", "rte", 1e-3), ("zs", "rte", None), ("zo", "rte", 1e-4)]  # full runs at sst2 and cb only; no grid at cb
    assert "train.max_forward_passes=400" in select[0].overrides  # the floor
    assert "train.eval_every_forwards=200" in driver.command("m", select[-1], [])  # rte: 1000 forwards, 5 evaluations
    assert not any("max_forward_passes" in o for o in select[2].overrides)  # zero-shot has no budget
    runs = {(j.arm, dict(j.point)["task"], j.lr): j for j in select}
    finish(runs["zo", "sst2", 1e-3], dev=0.80)  # mean over sst2 and rte: 1e-3 0.65, 1e-4 0.70: 1e-4 is carried
    finish(runs["zo", "sst2", 1e-4], dev=0.70)
    finish(runs["zo", "rte", 1e-3], dev=0.50)
    assert not [j for j in driver.plan("m", design, "seeds", None) if j.arm == "zo" and dict(j.point)["task"] == "cb"]
    finish(runs["zo", "rte", 1e-4], dev=0.70)
    finish(runs["full", "sst2", 1e-5], dev=0.6)
    finish(runs["full", "sst2", 1e-6], dev=0.6, dev_loss=0.4)  # a tie on accuracy: the lower loss
    seeds = driver.plan("m", design, "seeds", None)
    got = sorted((j.arm, dict(j.point)["task"], j.lr, j.seed) for j in seeds if j.arm != "zs")
    assert got == [("full", "sst2", 1e-6, 1),  # cb: its pilot has not run, so no budget there yet
                   ("zo", "rte", 1e-4, 1), ("zo", "sst2", 1e-3, 1)]  # at a grid point its own choice
    pilot(root, "p/c", {0: 1.0, 1000: 0.5})
    seeds = driver.plan("m", design, "seeds", None)
    cb = sorted((j.arm, j.lr, j.seed) for j in seeds if dict(j.point)["task"] == "cb")
    assert cb == [("full", 1e-6, 0), ("full", 1e-6, 1), ("zo", 1e-4, 0), ("zo", 1e-4, 1), ("zs", None, 0)]


@pytest.mark.parametrize("change,message", [
    ({"only": ["sst2"]}, r"arms.zo.only must map a grid axis"),
    ({"budget": {"axis": "task"}}, r"design.budget needs `pilots:`"),
    ({"budget": {"pilots": {"rte": "p"}, "cap": 100, "floor": 400}}, r"floor <= cap"),
    ({"budget": {"pilots": {"rte": "p"}, "axis": "model"}}, r"budget.axis is 'model', which design.grid does not"),
    ({"budget": {"pilots": {"rte": "p"}, "shares": 1}}, r"budget has unknown key.*shares"),
])
def test_a_bad_matrix_schema_is_one_line_naming_the_key(change, message):
    arms = {"zo": {"overrides": ["method=mezo"], "lr": [1e-3], **({"only": change["only"]} if "only" in change else {})}}
    design = {"grid": {"task": ["rte"]}, **({"budget": change["budget"]} if "budget" in change else {})}
    with pytest.raises(ConfigError, match=message):
        design_of({"arms": arms, "design": design}, "t")
