"""adazeta.tools.study_report: a study's declared predictions judged from its runs (cpu_zo_adaptive_lr's list on
hand-made runs): the dev-chosen rate, the two-level difference, stability, and interim verdicts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from adazeta.errors import ConfigError
from adazeta.tools import study_report
from adazeta.tools.endpoints import declared
from adazeta.tools.experiment import Job

NAME = "cpu_zo_adaptive_lr"


def write(arm: str, lr: float, seed: int, correct: np.ndarray, dev: float, losses: list[float],
          status: str = "finished", steps_per_eval: int = 100, step_time: float = 0.5, name: str = NAME) -> None:
    run = Job(arm, lr, seed, name, []).run_dir
    (run / "predictions").mkdir(parents=True)
    steps = [i * steps_per_eval for i in range(len(losses))]
    (run / "metrics.csv").write_text("step,forward_passes,step_time_s\n" + "".join(
        f"{s},{2 * s},{step_time}\n" for s in range(1, steps[-1] + 1)))
    (run / "eval.csv").write_text("step,split,loss,accuracy,tied\n" + "".join(
        f"{s},dev,{loss},{dev},0.0\n" for s, loss in zip(steps, losses)))
    (run / "predictions" / "test.csv").write_text("index,row,gold,pred,correct\n" + "".join(
        f"{i},{i},1,{int(c)},{int(c)}\n" for i, c in enumerate(correct)))
    (run / "result.json").write_text(json.dumps({
        "status": status, "dev_accuracy": dev, "dev_loss": min(losses), "test_accuracy": float(correct.mean()),
        "steps": steps[-1], "best_step": steps[int(np.argmin(losses))], "git": {"commit": "abc", "dirty": False}}))


def correct(accuracy: float, seed: int, n: int = 600) -> np.ndarray:
    easy = np.random.default_rng(0).random(n)
    return ((easy + np.random.default_rng(seed).normal(0, 0.02, n)) < accuracy).astype(float)


@pytest.fixture
def runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_declared_predictions_are_judged_from_the_runs(runs):
    steady = [1.0, 0.7, 0.6, 0.58, 0.57]
    for lr, dev in ((3e-4, 0.70), (1e-3, 0.76), (3e-3, 0.60)):  # ada_official's grid: 1e-3 wins on dev
        write("ada_official", lr, 0, correct(0.80, 0), dev, steady)
    for lr, dev in ((3e-4, 0.72), (1e-3, 0.70), (3e-3, 0.50)):  # ada_paper keeps 3e-4
        write("ada_paper", lr, 0, correct(0.74, 0), dev, steady)
    text = study_report.report(NAME, runs / "out").read_text()
    assert "- P1, `ada_official`'s dev-chosen rate above 0.0003: **confirmed**: 0.001" in text
    assert "- P1, `ada_paper`'s dev-chosen rate above 0.0003: **refuted**: 0.0003" in text
    assert "- P2, `ada_official` above `tt_q1`: **unresolved** (runs missing)" in text
    for seed in (1, 2, 3):
        write("ada_official", 1e-3, seed, correct(0.80 + 0.005 * seed, seed), 0.76, steady)
        write("ada_paper", 3e-4, seed, correct(0.74, seed), 0.72, steady)
    drifting = [1.0, 0.6, 0.5, 0.7, 0.9]  # final / best 1.8: unstable
    for seed in range(4):
        write("tt_q1", 3e-4, seed, correct(0.74, 10 + seed), 0.72, drifting)
    text = study_report.report(NAME, runs / "out").read_text()
    p2 = next(line for line in text.splitlines() if line.startswith("- P2, `ada_official`"))
    assert "**confirmed**" in p2 and "over seeds and examples" in p2 and "(sign-flip p = 0.125; 4 vs 4 seeds)" in p2
    assert "**unresolved**" in next(line for line in text.splitlines() if line.startswith("- P2, `ada_paper`"))
    assert "- P3, stability, `ada_official` vs `tt_q1`: **confirmed**: unstable 0/4 vs 4/4" in text
    assert "| ada_official | 0.001 | 4 of 4 |" in text


def test_an_interim_verdict_says_which_seeds_are_missing_and_a_bad_test_is_one_line(runs, monkeypatch):
    for lr in (3e-4, 1e-3, 3e-3):
        write("ada_official", lr, 0, correct(0.80, 0), 0.70 + lr, [1.0, 0.6])
    write("tt_q1", 3e-4, 0, correct(0.70, 1), 0.7, [1.0, 0.6])
    text = study_report.report(NAME, runs / "out").read_text()
    assert "(interim: `ada_official` 1 of 4 seeds)" in text
    from adazeta.tools import experiment

    config, design = experiment.load(NAME)
    config["endpoints"]["list"] = [{"id": "X", "test": "speed"}]
    monkeypatch.setattr(declared, "load_experiment", lambda name: (config, design))
    with pytest.raises(ConfigError, match="endpoint 'X' has test 'speed'; known: difference, chosen_lr, stability"):
        study_report.report(NAME, runs / "out")


def test_time_to_target_compares_training_time_to_a_fixed_drop_per_seed(runs):
    """cpu_bf16_speed's S1: each run's time to lower its own first dev loss by 80 % of the reference's drop."""
    name = "cpu_bf16_speed"
    fp32 = [0.80, 0.70, 0.62, 0.60, 0.58]  # drop 0.22: the target is 0.176 below each run's own first loss
    for seed in range(3):
        write("ada_fp32", 3e-4, seed, correct(0.74, seed), 0.72, fp32, step_time=1.0, name=name)
        # bf16 starts from its own (rounded) loss and needs one more evaluation, at half the step time: faster
        write("ada_bf16", 3e-4, seed, correct(0.74, 20 + seed), 0.72, [0.81, 0.72, 0.66, 0.63, 0.62],
              step_time=0.5, name=name)
    text = study_report.report(name, runs / "out").read_text()
    s1 = next(line for line in text.splitlines() if line.startswith("- S1"))
    assert "**unresolved** (runs missing)" not in s1 and "(interim: `ml_bf16` 0 of 3 seeds, `ml_fp32` 0 of 3" in s1
    assert "faster at 3 of 3 seed pairs (exact one-sided sign test p = 0.125)" in s1 and "per pair 0.75, 0.75, 0.75" in s1
    # fp32 reaches 0.624 (0.80 - 0.176) at step 200 (200 s, 400 forwards); bf16 its 0.634 at step 300 (150 s)
    row = next(line for line in text.splitlines() if line.startswith("| ada_bf16 | ada_fp32 | 0 |"))
    assert row == "| ada_bf16 | ada_fp32 | 0 | 0.1760 | 150 (600) | 200 (400) | 0.75 |", row
    for seed in range(3):  # MeZO-LoRA in bf16 never gets there: slower at every seed of that pair
        write("ml_fp32", 1e-3, seed, correct(0.74, 30 + seed), 0.72, fp32, step_time=1.0, name=name)
        write("ml_bf16", 1e-3, seed, correct(0.60, 40 + seed), 0.60, [0.80, 0.79, 0.78, 0.77, 0.76],
              step_time=0.5, name=name)
    text = study_report.report(name, runs / "out").read_text()
    s1 = next(line for line in text.splitlines() if line.startswith("- S1"))
    assert "**unresolved**: faster at 3 of 6 seed pairs (sign test: not every pair faster)" in s1 and "inf" in s1
    a2 = next(line for line in text.splitlines() if line.startswith("- A2"))
    assert a2.startswith("- A2, `ml_bf16` within 3 points of `ml_fp32`: **refuted**")


def test_one_report_reads_every_committed_studys_endpoints_by_their_form():
    """Every experiment with an ``endpoints:`` block is read by the one report, in the form it was registered."""
    from adazeta.experiments import compose_experiment
    from adazeta.tools import endpoints
    from helpers import ROOT

    forms = {}
    for path in sorted((ROOT / "conf" / "experiment").glob("*.yaml")):
        ends = compose_experiment(path.stem).get("endpoints") or {}
        if ends:
            forms[path.stem] = endpoints.form(ends)
    assert forms["cpu_zo_claims"] == forms["cpu_zo_speed"] == "claims"
    assert forms["cpu_zo_optimizers"] == forms["cpu_zo_optimizers_lora_recentred"] == "optimizers"
    assert forms["cpu_zo_prompt"] == forms["cpu_zo_adaptive_lr"] == "declared"
    assert forms["cpu_table2"] == "matrix"
    assert set(forms.values()) <= set(endpoints.FORMS)
    assert "cpu_zo" not in forms and (ROOT / "studies" / "cpu_zo" / "report.py").is_file()  # its own report


@pytest.mark.parametrize("ends, words", [
    ({"kind": "bayes"}, "endpoints.kind 'bayes' has no report; use declared"),
    ({"margin": 3}, "endpoints declares margin, none of which a report reads; write `kind: declared`"),
])
def test_an_endpoints_block_no_report_reads_is_one_line(ends, words):
    from adazeta.tools import endpoints

    with pytest.raises(ConfigError, match=words):
        endpoints.form(ends)


def test_a_study_without_endpoints_runs_the_report_beside_its_page(runs, monkeypatch):
    """cpu_zo declares no endpoints: the one report runs studies/cpu_zo/report.py, which is not in the package."""
    script = runs / "studies" / "cpu_zo" / "report.py"
    script.parent.mkdir(parents=True)
    script.write_text("import sys, pathlib\npathlib.Path('ran.txt').write_text(' '.join(sys.argv[1:]))\n")
    assert study_report.report("cpu_zo", runs / "out") is None
    assert (runs / "ran.txt").read_text() == "--experiment cpu_zo"
