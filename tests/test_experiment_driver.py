"""adazeta.tools.experiment: grids at one seed, the dev-chosen lr for the other seeds and the stress test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from adazeta.tools import experiment as driver
from helpers import ROOT

CONFIG = {
    "arms": {
        "zo": {"overrides": ["method=adazeta"], "lr": [1e-3, 1e-4]},
        "fo": {"overrides": ["method=tt_adapter"], "lr": [1e-3], "first_order": True},
        "zs": {"overrides": ["method=zero_shot"]},
    },
    "design": {"select_seed": 0, "seeds": [0, 1, 2], "stress": [3, 10], "order": ["zs", "zo", "fo"]},
}


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
    jobs = driver.plan("x", CONFIG, "select", None)
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
    jobs = {(j.arm, j.lr): j for j in driver.plan("x", CONFIG, "select", None)}
    finish(jobs["zo", 1e-3], dev=0.70, dev_loss=0.60, test=0.99)
    assert [j.arm for j in driver.plan("x", CONFIG, "seeds", None)] == []  # zs, fo, zo's second point missing
    finish(jobs["zo", 1e-4], dev=0.70, dev_loss=0.40, test=0.10)  # same dev accuracy, lower dev loss: chosen
    finish(jobs["zs", None], dev=0.5)
    finish(jobs["fo", 1e-3], dev=0.9)
    seeds = driver.plan("x", CONFIG, "seeds", None)
    assert sorted((j.arm, j.lr, j.seed) for j in seeds) == [
        ("fo", 1e-3, 1), ("fo", 1e-3, 2), ("zo", 1e-4, 1), ("zo", 1e-4, 2), ("zs", None, 1), ("zs", None, 2)]
    stress = driver.plan("x", CONFIG, "stress", None)  # ZO arms only, in their own experiment; 10 x 1e-4 = 1e-3
    assert [(j.arm, j.lr, j.experiment) for j in stress] == [("zo", pytest.approx(3e-4), "x_stress")]  # is a grid point
    assert all(j.done() for j in jobs.values())


def test_unknown_arms_are_refused_with_the_known_ones(root):
    with pytest.raises(SystemExit, match="unknown arm.*known: zo, fo, zs"):
        driver.plan("x", CONFIG, "select", ["zo", "nope"])


def test_the_committed_cpu_zo_experiment_parses_and_plans():
    import yaml

    config = yaml.safe_load((ROOT / "conf" / "experiment" / "cpu_zo.yaml").read_text())
    jobs = driver.plan("cpu_zo", config, "select", None)
    arms = {j.arm for j in jobs}
    assert {"adazeta", "adazeta_identity", "tt_q1", "mezo_lora", "mezo", "tt_adapter_fo", "zero_shot"} <= arms
    assert all(j.seed == 0 for j in jobs)


def test_an_arm_with_its_own_seeds_runs_only_at_them(root):
    config = {"arms": {"zo": {"overrides": ["method=adazeta"], "lr": [1e-3]},
                       "zs": {"overrides": ["method=zero_shot"], "seeds": [0]},
                       "late": {"overrides": ["method=icl"], "seeds": [2]}},
              "design": {"select_seed": 0, "seeds": [0, 1, 2], "order": ["zo", "zs", "late"]}}
    select = driver.plan("x", config, "select", None)
    assert [(j.arm, j.seed) for j in select] == [("zo", 0), ("zs", 0)]
    for job in select:
        finish(job, dev=0.6)
    seeds = driver.plan("x", config, "seeds", None)
    assert [(j.arm, j.lr, j.seed) for j in seeds] == [("zo", 1e-3, 1), ("zo", 1e-3, 2), ("late", None, 2)]


def test_the_preregistered_claims_experiment_plans_seed_major_with_one_rate_per_arm(root):
    import yaml

    config = yaml.safe_load((ROOT / "conf" / "experiment" / "cpu_zo_claims.yaml").read_text())
    assert config["train"]["max_forward_passes"] == 3000 and config["data"]["seed"] == 0
    assert all(len(driver.grid(spec)) == 1 for spec in config["arms"].values())
    select = driver.plan("cpu_zo_claims", config, "select", None)
    assert [j.arm for j in select[:4]] == ["mezo_lora", "ada_official", "ada_paper", "tt_q1"]
    for job in select:
        finish(job, dev=0.6)
    seeds = driver.plan("cpu_zo_claims", config, "seeds", None)
    per_arm = {a: sorted(j.seed for j in seeds if j.arm == a) for a in {j.arm for j in seeds}}
    assert per_arm == {a: [1, 2, 3] for a in ("mezo_lora", "ada_official", "ada_paper", "tt_q1", "icl", "tt_fo")}


def test_a_dirty_tree_is_refused_unless_allowed_and_launches_are_logged(root, monkeypatch, tmp_path):
    monkeypatch.setattr(driver, "git_state", lambda: {"commit": "abc123def4567", "dirty": True})
    monkeypatch.setattr(sys, "argv", ["experiment.py", "cpu_zo_claims", "--arms", "zero_shot"])
    with pytest.raises(SystemExit, match="uncommitted changes.*--allow-dirty"):
        driver.main()
    job = driver.Job("zs", None, 0, "x", ["method=zero_shot"])
    job.run_dir.mkdir(parents=True)
    driver.log_launch(job, ["py", "-m", "adazeta.cli", "method=zero_shot"], {"commit": "abc", "dirty": True}, True)
    path = root / "results" / "runs" / "x" / "launches.csv"
    assert b"\r" not in path.read_bytes()
    rows = path.read_text().splitlines()
    assert rows[0].split(",") == driver.LAUNCH_COLUMNS
    assert rows[1].split(",")[1:] == ["zs", "", "0", "results/runs/x/zs/seed=0", "abc", "True", "True",
                                      "adazeta-run method=zero_shot"]
