"""The task-matrix endpoints (adazeta.tools.endpoints.matrix) on hand-made runs of cpu_table2: the table with its calibrated row and the paper's
numbers, the endpoints' verdicts from the two-level bootstrap, the equal-time reading, and a figure per task."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from adazeta.tools.endpoints import matrix

EXAMPLES = 300


def fake_run(root: Path, arm: str, task: str, seed: int, accuracy: float, dev: float, lr: float | None = 1e-3,
             status: str = "finished", step_time: float = 1.0, peak: float = 1000.0, steps: int = 10):
    """A finished cpu_table2 run with its record, predictions, step log and dev curve."""
    name = ",".join([f"task={task}", *([] if lr is None else [f"lr={lr:g}"]), f"seed={seed}"])
    run = root / "cpu_table2" / arm / name
    (run / "predictions").mkdir(parents=True)
    easy = np.random.default_rng(7).random(EXAMPLES)  # every run finds the same examples easy
    correct = (easy + np.random.default_rng(seed).normal(0, 0.02, EXAMPLES) < accuracy).astype(int)
    (run / "predictions" / "test.csv").write_text("index,row,gold,pred,correct\n" + "".join(
        f"{i},{i},1,{c},{c}\n" for i, c in enumerate(correct)))
    (run / "metrics.csv").write_text("step,forward_passes,step_time_s,n_queries\n" + "".join(
        f"{s},{2 * s},{step_time},1\n" for s in range(1, steps + 1)))
    (run / "eval.csv").write_text("step,split,loss,accuracy,tied\n" + "".join(
        f"{s},dev,{1.0 - 0.04 * s},{dev * s / steps},0\n" for s in range(0, steps + 1, 2)))
    config = {"method": {"name": arm, "optimizer": None if lr is None else {"lr": lr}}, "task": {"name": task},
              "seed": seed, "experiment_name": "cpu_table2"}
    (run / "result.json").write_text(json.dumps({
        "experiment": "cpu_table2", "model": "smollm2-135m", "task": task, "method": arm, "seed": seed,
        "status": status, "dev_accuracy": dev, "dev_loss": 1 - dev, "test_accuracy": float(correct.mean()),
        "peak_mem_mb": peak, "num_train": 1000, "num_dev": 500, "num_eval": EXAMPLES, "wall_time_s": 3600.0,
        "device": {"type": "cpu", "name": "Test CPU", "cpu_features": ["avx2"]}, "config": config}))


# Each trained arm's lr grid (conf/experiment/cpu_table2.yaml) and the rate it chooses in these runs.
GRIDS = {"adazeta": ((1e-4, 3e-4, 1e-3), 1e-3), "mezo_lora": ((3e-4, 1e-3, 3e-3), 1e-3), "ft": ((3e-6, 1e-5, 3e-5), 1e-5)}


def fake_grid(root: Path, arm: str, tasks=("sst2", "wic")):
    """The rest of ``arm``'s grid at seed 0 on the selection tasks, each 10 dev points below the chosen rate's."""
    lrs, chosen = GRIDS[arm]
    for task in tasks:
        for lr in lrs:
            if lr != chosen:
                fake_run(root, arm, task, 0, 0.5, dev=0.4, lr=lr)


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    for task, (ada, lora) in {"sst2": (0.80, 0.74), "copa": (0.70, 0.64), "wic": (0.60, 0.55)}.items():
        for seed in range(3):  # AdaZeta 5-6 points above MeZO-LoRA at every task and seed
            fake_run(root, "adazeta", task, seed, ada + 0.01 * seed, dev=ada)
            fake_run(root, "mezo_lora", task, seed, lora + 0.01 * seed, dev=lora, status="diverged" if seed else "finished")
            fake_run(root, "ft", task, seed, 0.9, dev=0.9, step_time=5.0, peak=4000.0, lr=GRIDS["ft"][1])
        fake_run(root, "zero_shot_cc", task, 0, 0.5, dev=0.60, lr=None)
        fake_run(root, "zero_shot_prior", task, 0, 0.7, dev=0.55 if task != "wic" else 0.65, lr=None)
        fake_run(root, "lp", task, 0, 0.85, dev=0.85, lr=None)
    for arm in GRIDS:
        fake_grid(root, arm)
    return root


def test_the_matrix_report_fills_the_table_and_judges_the_endpoints(runs, tmp_path):
    tables, figures = tmp_path / "tables", tmp_path / "figures"
    text = matrix.report("cpu_table2", runs, Path("results/paper_numbers.csv"), tables, figures)
    table = (tables / "cpu_table2.md").read_text()
    # the calibrated row takes, per task, the calibration with the higher dev accuracy (never test)
    assert "calibrated: per task, whichever of zero_shot_cc, zero_shot_prior" in table
    assert "sst2: zero_shot_cc, copa: zero_shot_cc, wic: zero_shot_prior" in table
    calibrated = next(line for line in table.splitlines() if line.startswith("| calibrated |"))
    def test_of(arm, task):
        record = json.loads(next((runs / "cpu_table2" / arm).glob(f"task={task},*/result.json")).read_text())
        return f"{100 * record['test_accuracy']:.1f} ["

    assert calibrated.split("|")[2].strip().startswith(test_of("zero_shot_cc", "sst2"))  # columns: sst2, its paper
    assert calibrated.split("|")[6].strip().startswith(test_of("zero_shot_prior", "wic"))
    # the paper's numbers beside ours, the tasks without training data marked, the split sizes, diverged runs
    assert "| adazeta | 8" in table and "74.0ᵇ" in table and "no train data" in table
    assert f"splits (train / dev / test): sst2 1000 / 500 / {EXAMPLES}" in table
    assert "n=3 †2" in next(line for line in table.splitlines() if line.startswith("| mezo_lora |"))
    assert (tables / "cpu_table2.tex").is_file()
    # E1: a consistent 5-6 point lead at three tasks is confirmed on the pooled test
    e1 = text[text.index("### E1"):text.index("### E2")]
    assert "| sst2 | +6." in e1 and "H1 (adazeta above mezo_lora): **confirmed**" in e1
    assert "Pooled over 3 tasks" in e1
    # E2: the best ZO arm (adazeta, on dev) is below LP everywhere; against the calibrated row the tasks disagree
    e2 = text[text.index("### E2"):text.index("### E3")]
    assert "| sst2 | adazeta | -" in e2 and "above lp: **refuted**" in e2 and "above calibrated: **unresolved**" in e2
    # E3: FT's dev accuracy read at the ZO arm's training time (10 s: FT's evaluation at step 2, 10 s of steps),
    # and FT's peak memory 4x
    assert "| sst2 | ft | 18.0 | adazeta | 80.0 | 4.00 |" in text
    # the cost and the CPUs are stated; the budgets are pending without pilots
    assert "core-hours by their wall times" in text and "Test CPU (no AMX)" in text and "| copa | pending |" in text
    assert sorted(p.name for p in figures.glob("*.png")) == ["cpu_table2_copa.png", "cpu_table2_sst2.png",
                                                             "cpu_table2_wic.png"]
    assert (tables / "cpu_table2_report.md").read_text() == text


def test_an_experiment_without_matrix_endpoints_is_refused_in_one_line(tmp_path):
    from adazeta.errors import ConfigError

    with pytest.raises(ConfigError, match="declares no task-matrix endpoints"):
        matrix.report("cpu_zo_claims", tmp_path, Path("results/paper_numbers.csv"), tmp_path, None)


def test_an_arm_whose_lr_grid_is_still_running_has_no_cell_yet(tmp_path):
    """A grid point is not a result: until every rate of an arm's grid has ended at each selection task (seed 0),
    no rate is chosen, so the arm's cells stay empty and the report says how far its grid is."""
    root = tmp_path / "runs"
    for task in ("sst2", "wic"):
        fake_run(root, "adazeta", task, 0, 0.8, dev=0.8)  # 1e-3 ended; 1e-4 and 3e-4 not yet
        fake_run(root, "mezo_lora", task, 0, 0.7, dev=0.7)
    fake_grid(root, "mezo_lora")  # mezo_lora's grid is complete
    fake_run(root, "adazeta", "sst2", 0, 0.5, dev=0.4, lr=1e-4)  # adazeta: 3 of 6
    tables = tmp_path / "tables"
    text = matrix.report("cpu_table2", root, Path("results/paper_numbers.csv"), tables, None)
    rows = {line.split("|")[1].strip(): line for line in (tables / "cpu_table2.md").read_text().splitlines()
            if line.startswith("| ")}
    assert rows["adazeta"].split("|")[2].strip() == "—"  # sst2: no cell while the grid runs
    record = json.loads((root / "cpu_table2" / "mezo_lora" / "task=sst2,lr=0.001,seed=0" / "result.json").read_text())
    assert rows["mezo_lora"].split("|")[2].strip().startswith(f"{100 * record['test_accuracy']:.1f} [")  # chosen rate
    waiting = next(line for line in text.splitlines() if line.startswith("Learning-rate grids still running"))
    assert "adazeta: 3 of 6 grid runs ended" in waiting and "mezo_lora" not in waiting
    # What the study has spent counts every ended run, the waiting arm's grid runs too (6 + 3 = 9 runs of an hour)
    assert "- 9 runs ended (0 diverged), 9.0 core-hours by their wall times." in text
    assert "- CPUs: Test CPU" in text and "9 runs" in text
