"""adazeta.tools.twins: does a run reproduce another? On hand-made run folders, and on the committed same-CPU
twin of ZO-SGD's seed-0 run (README, the cpu_zo_optimizers_recentred follow-up's P3)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from adazeta.tools import twins
from helpers import ROOT, study_pages


def write_run(run_dir, losses, preds, cpu="This CPU", commit="abcdef0123", norms=None, status="finished"):
    (run_dir / "predictions").mkdir(parents=True)
    steps = [50 * i for i in range(len(losses))]
    with open(run_dir / "eval.csv", "w") as f:
        f.write("step,split,loss,accuracy,tied\n")
        f.writelines(f"{s},dev,{loss},0.5,0.0\n" for s, loss in zip(steps, losses))
        f.write(f"{steps[-1]},test,0.5,0.5,0.0\n")
    norms = norms or [1.0] * steps[-1]
    with open(run_dir / "metrics.csv", "w") as f:
        f.write("step,epoch,loss,n_queries,forward_passes,lr,step_time_s,peak_mem_mb,param_norm\n")
        f.writelines(f"{s},0,0.5,1,{2 * s},0.001,{0.1 * s},1000,{norms[s - 1]}\n" for s in range(1, steps[-1] + 1))
    with open(run_dir / "predictions" / "test.csv", "w") as f:
        f.write("index,row,gold,pred,correct,score_0,score_1\n")
        f.writelines(f"{i},{100 + i},1,{p},{p},-1.0,-0.5\n" for i, p in enumerate(preds))
    (run_dir / "result.json").write_text(json.dumps({
        "status": status, "git": {"commit": commit, "dirty": False}, "device": {"type": "cpu", "name": cpu}}))
    return run_dir


def test_a_replay_reproduces_and_any_difference_is_counted(tmp_path):
    losses, preds = [1.0, 0.8, 0.7], [1, 0, 1, 1]
    a = write_run(tmp_path / "a", losses, preds)
    b = write_run(tmp_path / "b", losses, preds, commit="0123456789")  # another commit, the same numbers
    t = twins.compare(a, b)
    assert t.reproduced(1e-6) and t.same_cpu and t.steps_differ == 0 and t.commits == ("abcdef0", "0123456")
    c = write_run(tmp_path / "c", [1.0, 0.8, 0.7 + 1e-3], [1, 0, 0, 1], norms=[1.0] * 99 + [1.1])
    t = twins.compare(a, c)
    assert not t.reproduced(1e-6) and t.reproduced(2e-3) is False  # a prediction differs at any tolerance
    assert (t.start_gap, t.predictions_differ, t.steps_differ) == (0.0, 1, 1)
    assert t.dev_gap == pytest.approx(1e-3)
    assert twins.compare(a, write_run(tmp_path / "d", losses, preds[:3])).predictions_differ is None  # other rows


def test_the_cli_says_when_the_cpus_differ_and_exits_by_the_verdict(tmp_path):
    a = write_run(tmp_path / "a", [1.0, 0.8], [1, 0])
    same = write_run(tmp_path / "same", [1.0, 0.8], [1, 0])
    other = write_run(tmp_path / "other", [1.0 + 4e-7, 0.81], [1, 1], cpu="Other CPU")

    def run(*args):
        return subprocess.run([sys.executable, "-m", "adazeta.tools.twins", *map(str, args)], capture_output=True,
                              text=True, cwd=ROOT)

    ok = run(a, same)
    assert ok.returncode == 0 and "reproduced (dev-loss tolerance 1e-06)" in ok.stdout
    assert "different CPUs" not in ok.stdout
    bad = run(a, other)
    assert bad.returncode == 1 and "not reproduced" in bad.stdout and "ran on different CPUs" in bad.stdout
    assert "step-0 dev-loss difference: 4.00e-07" in bad.stdout and "test predictions that differ: 1" in bad.stdout
    assert run(a, other, "--tolerance", "0.1").returncode == 1  # a prediction still differs
    running = write_run(tmp_path / "running", [1.0, 0.8], [1, 0], status="running")
    for missing in (tmp_path / "nowhere", running):
        err = run(a, missing)
        assert err.returncode == 2 and err.stderr.count("\n") == 1 and "holds no finished run" in err.stderr


TWIN = ROOT / "results" / "diagnostics" / "same_cpu_twin" / "tt_zo_sgd_lr3e-4_s0_e3bfb0b"
RUNS = ROOT / "results" / "runs"


def test_the_committed_same_cpu_twin_reproduces_across_commits_and_not_across_cpus():
    """The README's P3 reading: e3bfb0b's ZO-SGD seed 0 replayed on the CPU of the c1266fd re-run matches it in every
    dev loss, every training step and every test prediction; the Intel Xeon twin of cpu_zo_optimizers does not,
    from step 0 on."""
    here = RUNS / "cpu_zo_optimizers_recentred" / "tt_zo_sgd" / "lr=0.0003,seed=0"
    t = twins.compare(TWIN, here)
    assert t.reproduced(0.0) and t.steps_differ == 0 and t.same_cpu and t.commits == ("e3bfb0b", "c1266fd")
    assert t.evaluations == (11, 11)
    old = twins.compare(TWIN, RUNS / "cpu_zo_optimizers" / "tt_zo_sgd" / "lr=0.0003,seed=0")
    assert not old.same_cpu and old.commits == ("e3bfb0b", "e3bfb0b") and old.steps_differ == 500
    assert 1e-7 < old.start_gap < 1e-6 and old.predictions_differ == 53 and round(old.dev_gap, 4) == 0.0196
    readme = " ".join(study_pages().split())
    tests = [json.loads((RUNS / "cpu_zo_optimizers" / "tt_zo_sgd" / f"lr=0.0003,seed={s}" / "result.json").read_text())
             ["test_accuracy"] for s in range(3)]
    rerun = json.loads((here / "result.json").read_text())["test_accuracy"]
    assert f"test {100 * rerun:.1f} against {100 * tests[0]:.1f}" in readme
    assert "three seeds: {:.1f}, {:.1f} and {:.1f} on test".format(*(100 * a for a in tests)) in readme
    assert f"differ by {old.start_gap:.1e}".replace("e-07", "e-7") in readme and "0.0196 in dev loss and 53 of 872" in readme
