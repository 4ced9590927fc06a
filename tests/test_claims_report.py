"""The claims endpoints (adazeta.tools.endpoints.claims) on hand-made run files: each endpoint's verdict follows the committed decision rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from adazeta.errors import ConfigError
from adazeta.tools.endpoints import claims
from adazeta.tools.experiment import Job, load
from helpers import ROOT, study_pages

CONFIG, DESIGN = load("cpu_zo_claims")


def write_run(arm: str, seed: int, losses: list[float], correct: np.ndarray, status: str = "finished",
              every: int = 200, experiment: str = "cpu_zo_claims") -> None:
    """A run whose dev loss is ``losses[i]`` after i x ``every`` forward passes (Q = 1: 2 forwards a step)."""
    design = DESIGN if experiment == "cpu_zo_claims" else load(experiment)[1]
    run_dir = Job(arm, design.arms[arm].lrs[0], seed, experiment, []).run_dir
    (run_dir / "predictions").mkdir(parents=True)
    steps = [i * every // 2 for i in range(len(losses))]
    with open(run_dir / "metrics.csv", "w") as f:
        f.write("step,epoch,loss,n_queries,forward_passes,lr,step_time_s,peak_mem_mb,param_norm\n")
        for s in range(1, steps[-1] + 1):
            f.write(f"{s},0,0.5,1,{2 * s},0.001,0.5,1000,1.0\n")
    with open(run_dir / "eval.csv", "w") as f:
        f.write("step,split,loss,accuracy,tied\n")
        for s, loss in zip(steps, losses):
            f.write(f"{s},dev,{loss},0.7,0.0\n")
        f.write(f"{steps[-1]},test,0.5,{correct.mean()},0.0\n")
    with open(run_dir / "predictions" / "test.csv", "w") as f:
        f.write("index,row,gold,pred,correct,score_0,score_1\n")
        for i, c in enumerate(correct):
            f.write(f"{i},{1000 + i},1,{int(c)},{int(c)},-1.0,-0.5\n")
    best = int(np.argmin(losses))
    (run_dir / "result.json").write_text(json.dumps({
        "status": status, "reason": "dev loss above 1.5 x best" if status == "diverged" else None,
        "dev_accuracy": 0.7, "dev_loss": min(losses), "test_accuracy": float(correct.mean()),
        "forward_passes": steps[-1] * 2, "peak_mem_mb": 1000.0, "wall_time_s": 3000.0, "best_step": steps[best],
        "steps": steps[-1],
        "git": {"commit": "abcdef0123", "dirty": False}}))


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_verdicts_follow_the_preregistered_rules(results):
    rng = np.random.default_rng(0)
    n = 872
    base = (rng.random(n) < 0.70).astype(float)
    slow = [1.0 - 0.03 * i for i in range(16)]          # MeZO-LoRA: still falling, plateau = mean of its last 3
    fast = [1.0, 0.5] + [0.45] * 14                        # reaches the plateau after 200 forwards: r = 200 / F_ref
    drifting = [1.0, 0.6, 0.5] + [0.5 + 0.1 * i for i in range(1, 5)]  # the divergence rule stopped it
    for seed in range(4):
        write_run("mezo_lora", seed, slow, base)
        better = base.copy()
        better[np.flatnonzero(base == 0)[:60]] = 1.0       # +6.9 points on the same examples
        write_run("ada_official", seed, fast, better)
        write_run("ada_paper", seed, fast, better)
        write_run("tt_q1", seed, drifting, base, status="diverged")
    write_run("zero_shot", 0, [1.0], (rng.random(n) < 0.5).astype(float))
    path = claims.report("cpu_zo_claims", results / "results")
    text = path.read_text()
    # (a) target = mean(last 3) = 1 - 0.03 * 14 = 0.58 reached by MeZO-LoRA at 2,800 forwards; the fast arms at 200
    assert "| ada_official | 0 | 0.5800 | 1.05 | 2800 | 200 | 0.07 |" in text
    assert "(a) speed, `ada_official`: **confirmed**: r <= 0.333 at 4 of 4 seeds (one-sided sign test p = 0.062" in text
    # tt_q1 reaches 0.58 at 400 forwards too (0.5 < 0.58): r = 0.14
    assert "(a) speed, `tt_q1`: **confirmed**" in text
    # (b) every tt_q1 run diverged, no adaptive run did: Fisher p = 1 / 70
    assert "(b) stability, `ada_official` vs `tt_q1`: **confirmed**: unstable 0/4 vs 4/4 (one-sided Fisher p = 0.014)" in text
    # tt_q1 stopped at ada_official's 1,500 steps: the divergence rule had stopped every run by step 300
    assert ("Stopped at the same seed's `ada_official` step count, `tt_q1` would end at final / best dev loss 1.800 "
            "and be unstable at 4 of 4 seeds: fewer steps alone do not explain the difference.") in text
    # (c) +6.9 points on every seed
    assert "(c) accuracy, `ada_official` >= `mezo_lora`: **confirmed**: +6.9 points" in text
    assert "(c) accuracy, `tt_q1` >= `mezo_lora`: **unresolved**" in text  # identical predictions: p = 1
    assert "| ada_official | mezo_lora | +6.9 [" in text and "| 240 / 0, < 0.001 | +6.9, +6.9, +6.9, +6.9 | 0.125 |" in text
    assert "The strongest training-free baseline on dev is `zero_shot`" in text
    assert (results / "results" / "figures" / "cpu_zo_claims_curves.png").stat().st_size > 1000


def test_a_refuted_speed_claim_and_an_unstable_adaptive_arm_are_reported_as_refuted(results):
    rng = np.random.default_rng(1)
    base = (rng.random(100) < 0.7).astype(float)
    for seed in range(4):
        write_run("mezo_lora", seed, [1.0, 0.6] + [0.5] * 14, base)       # plateau 0.5 reached at 400
        write_run("ada_official", seed, [1.0] * 10 + [0.5] * 6, base)      # at 2,000: r = 5
        write_run("tt_q1", seed, [1.0, 0.5, 0.5, 0.5, 0.7], base, status="diverged" if seed == 0 else "finished")
        write_run("ada_paper", seed, [1.0, 0.5, 0.9, 1.0, 1.0], base)     # drifts: final / best 2.0 on every seed
    text = claims.report("cpu_zo_claims", results / "results").read_text()
    assert "(a) speed, `ada_official`: **refuted**: r <= 0.333 at 0 of 4 seeds" in text
    assert "(b) stability, `ada_paper` vs `tt_q1`: **refuted**: unstable 4/4 vs 4/4" in text


def test_a_verdict_with_seeds_still_to_run_says_interim_for_every_endpoint(results):
    """0/3 against 4/4 unstable is p = 0.029, but a fourth adaptive seed that drifts would undo it: interim."""
    rng = np.random.default_rng(3)
    base = (rng.random(50) < 0.7).astype(float)
    for seed in range(4):
        write_run("tt_q1", seed, [1.0, 0.9, 0.8, 0.5, 0.9], base, status="diverged")  # best at step 300
        if seed < 3:
            write_run("ada_official", seed, [1.0, 0.6, 0.5], base)                      # 200 steps in all
            write_run("mezo_lora", seed, [1.0, 0.6] + [0.5] * 6, base)
    text = claims.report("cpu_zo_claims", results / "results").read_text()
    assert ("(b) stability, `ada_official` vs `tt_q1`: **confirmed (interim: `ada_official` 3 of 4 seeds)**: "
            "unstable 0/3 vs 4/4 (one-sided Fisher p = 0.029)") in text
    assert "(a) speed, `ada_official`: **refuted (interim: `ada_official` 3 of 4 seeds, `mezo_lora` 3 of 4 seeds)**" in text
    assert "(c) accuracy, `ada_official` >= `tt_q1`: **unresolved (interim: `ada_official` 3 of 4 seeds)**" in text
    # ada_official stops at 200 steps, before any tt_q1 run reached its best (step 300): fewer steps, not steadier
    assert ("Steps: `ada_official` takes 200 steps in its forward budget; `tt_q1`'s best dev state comes at step 300, "
            "its drift after it. Stopped at the same seed's `ada_official` step count, `tt_q1` would end at final / "
            "best dev loss 1.000 and be unstable at 0 of 3 seeds: fewer steps alone would give the difference: this "
            "endpoint cannot tell a steadier step from fewer steps.") in text


def test_the_constant_arm_is_judged_at_the_adaptive_arms_step_count_seed_by_seed(results):
    """tt_q1 has drifted by step 300 (ada_official's last) at seeds 0-1, and only after it at seeds 2-3."""
    base = (np.random.default_rng(5).random(50) < 0.7).astype(float)
    for seed in range(4):
        write_run("tt_q1", seed, [1.0, 0.5, 0.5, 0.8] if seed < 2 else [1.0, 0.5, 0.5, 0.5, 0.5, 0.9], base)
        write_run("ada_official", seed, [1.0, 0.6, 0.5, 0.5], base)
        write_run("ada_paper", seed, [1.0, 0.6, 0.5, 0.5], base)
        write_run("mezo_lora", seed, [1.0, 0.6, 0.5, 0.5], base)
    text = claims.report("cpu_zo_claims", results / "results").read_text()
    assert ("Stopped at the same seed's `ada_official` step count, `tt_q1` would end at final / best dev loss "
            "1.000-1.600 and be unstable at 2 of 4 seeds: fewer steps alone would give the difference at the other "
            "2.") in text


def test_a_drifted_reference_and_a_ratio_of_exactly_a_third_are_pointed_out(results):
    """The registered rule is applied as written; the report says when its target is a drifted level and when a
    ratio sits on the 1/3 boundary (200 / 600 forwards), so a reader does not take either at face value."""
    base = (np.random.default_rng(4).random(50) < 0.7).astype(float)
    write_run("mezo_lora", 0, [1.0, 0.9, 0.8, 0.5, 0.75, 0.75, 0.75], base)  # best 0.5, "plateau" 0.75: 1.5x
    write_run("ada_official", 0, [1.0, 0.7, 0.6], base)                        # reaches 0.75 at 200 forwards
    text = claims.report("cpu_zo_claims", results / "results").read_text()
    assert "| ada_official | 0 | 0.7500 | 1.50 | 600 | 200 | 0.33 |" in text
    assert ("At seed 0 `mezo_lora`'s last 3 evaluations average 1.50x its best dev loss: the target is a level it "
            "drifted back up to, which it first passed on its way down, not a plateau.") in text
    assert ("`ada_official` at seed 0: r = 200 / 600, a third to float rounding, counts as above the registered "
            "0.3333333333") in text
    assert "(a) speed, `ada_official`: **refuted (interim:" in text  # as registered: r > max_ratio at 1 of 1 seeds
    assert "its seeds' targets or ratios carry notes: see (a) below" in text


def test_the_speed_follow_up_targets_the_references_best_and_counts_a_third_exactly(results):
    """cpu_zo_speed registers MeZO-LoRA's best dev loss as the target (a diverged reference keeps it) and
    "at most 1/3" as an exact fraction of forward counts: 200 / 600 counts for the claim, 400 / 600 does not."""
    _, design = load("cpu_zo_speed")
    assert list(design.seeds) == [4, 5, 6, 7]
    base = (np.random.default_rng(5).random(50) < 0.7).astype(float)
    for seed in design.seeds:
        # best 0.5 at 600 forwards, then the divergence rule stops it: no plateau, but a best
        write_run("mezo_lora", seed, [1.0, 0.9, 0.8, 0.5, 0.9, 0.9, 0.9], base, status="diverged",
                  experiment="cpu_zo_speed")
        write_run("ada_official", seed, [1.0, 0.5, 0.5], base, experiment="cpu_zo_speed")       # 200: r = 1/3
        write_run("ada_paper", seed, [1.0, 0.6, 0.49], base, experiment="cpu_zo_speed")         # 400: r = 2/3
        write_run("tt_q1", seed, [1.0, 0.6, 0.6, 0.6] if seed < 6 else [1.0, 0.4], base,       # never / 200
                  experiment="cpu_zo_speed")
    text = claims.report("cpu_zo_speed", results / "results").read_text()
    assert "Target per seed: `mezo_lora`'s best dev loss" in text and "the claim: r <= 1/3." in text
    assert "| ada_official | 4 | 0.5000 | 1.00 | 600 | 200 | 0.33 |" in text
    assert "(a) speed, `ada_official`: **confirmed**: r <= 1/3 at 4 of 4 seeds (one-sided sign test p = 0.062" in text
    assert "(a) speed, `ada_paper`: **refuted**: r <= 1/3 at 0 of 4 seeds" in text
    assert "| tt_q1 | 4 | 0.5000 | 1.00 | 600 | never | ∞ |" in text
    assert "(a) speed, `tt_q1`: **unresolved**: r <= 1/3 at 2 of 4 seeds" in text
    assert "without a target" not in text and "a third to float rounding" not in text
    assert "This experiment registers no training-free baseline." in text


def test_a_speed_target_other_than_plateau_or_best_or_a_bad_fraction_is_refused(results):
    with pytest.raises(ConfigError, match="endpoints.speed.target is 'last'; use plateau or best"):
        claims.speed({}, {"reference": "mezo_lora", "arms": [], "target": "last", "max_ratio": [1, 3]})
    for bad in ([1, 0], [1, 3, 5], [0.5, 1], [-1, 3]):
        with pytest.raises(ConfigError, match=r"max_ratio is .*; write a fraction as \[numerator, denominator\]"):
            claims.speed({}, {"reference": "mezo_lora", "arms": [], "max_ratio": bad})


def test_unpaired_runs_are_refused(results):
    rng = np.random.default_rng(2)
    write_run("mezo_lora", 0, [1.0, 0.5], (rng.random(10) < 0.5).astype(float))
    write_run("mezo_lora", 1, [1.0, 0.5], (rng.random(10) < 0.5).astype(float))
    other = Job("mezo_lora", 1e-3, 1, "cpu_zo_claims", []).run_dir / "predictions" / "test.csv"
    other.write_text(other.read_text().replace(",1000,", ",9999,"))
    with pytest.raises(ConfigError, match="not paired"):
        claims.report("cpu_zo_claims", results / "results")


def test_the_readme_cpu_zo_table_is_the_reports():
    """The cpu_zo page's numbers are checked against results/tables/cpu_zo_report.md, which is generated from
    the committed run files (make report NAME=cpu_zo: studies/cpu_zo/report.py)."""
    import re

    report = (ROOT / "results" / "tables" / "cpu_zo_report.md").read_text()
    readme = study_pages()
    readme = readme[readme.index("## The experiment: `experiment=cpu_zo`"):readme.index("MeZO's grid first held")]
    rows = {}
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"[a-z_0-9]+", cells[0]) and cells[0] != "arm":
            rows[cells[0]] = cells
    checked = 0
    for line in readme.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 5 or not cells[0]:
            continue
        arm = cells[0].split()[0].rstrip(",")
        if arm in rows and rows[arm][3] == "0":
            start_best = rows[arm][4]
            assert cells[1] == start_best or cells[1] == start_best.split(" ->")[0], (arm, cells[1], start_best)
            assert cells[2] == rows[arm][5] or (arm == "zero_shot" and cells[2] == rows[arm][5].split(" [")[0])
            assert cells[3] == ("" if arm == "zero_shot" else rows[arm][6])
            checked += 1
    assert checked == 7


def check_verdict_table(section: str, report: str) -> None:
    """Each row of the study page's verdict table is one of the report's verdicts, word for word (its evidence
    may quote the report's in parts, split at "; "), and every verdict of the report has its row."""
    import re

    verdicts = {m.group(1): (m.group(2), m.group(3)) for m in
                re.finditer(r"^- (\(.\) [^:]+): \*\*([^*]+)\*\*: (.*)$", report, re.M)}
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| (")]
    assert verdicts and {r[0] for r in rows} == set(verdicts), "the page lists every verdict, and no other"
    for endpoint, verdict, evidence in rows:
        assert verdict == verdicts[endpoint][0], endpoint
        for part in evidence.split("; "):
            assert part in verdicts[endpoint][1], (endpoint, part)


def test_the_readme_cpu_zo_speed_verdicts_and_state_are_the_reports():
    """The cpu_zo_speed page against results/tables/cpu_zo_speed_report.md: its verdict table, and the
    runs it says are in (the report's arm table: finished + diverged of planned)."""
    import re

    report = (ROOT / "results" / "tables" / "cpu_zo_speed_report.md").read_text()
    readme = study_pages()
    section = readme[readme.index("# cpu_zo_speed:"):
                     readme.index("# grad_fidelity:")]
    check_verdict_table(section, report)
    done = sum(int(m.group(1)) + int(m.group(2)) for m in re.finditer(r"^\| [a-z_0-9]+ \| (\d+) / (\d+) of \d+ \|",
                                                                          report, re.M))
    planned = sum(int(m.group(1)) for m in re.finditer(r"^\| [a-z_0-9]+ \| \d+ / \d+ of (\d+) \|", report, re.M))
    state = re.search(r"\*\*Where it stands: ([^*]+)\.\*\*", section).group(1)
    assert state == ("complete" if done == planned else f"{done} of {planned} runs in"), state


def test_the_readme_cpu_zo_claims_verdicts_and_numbers_are_the_reports():
    """The cpu_zo_claims page against results/tables/cpu_zo_claims_report.md (generated from the
    committed runs): each row of its verdict table is one of the report's verdicts, word for word, and the
    baselines' and ZO arms' test accuracies it quotes are the report's."""
    import re

    report = (ROOT / "results" / "tables" / "cpu_zo_claims_report.md").read_text()
    readme = study_pages()
    section = readme[readme.index("# cpu_zo_claims:"):
                     readme.index("# cpu_zo_speed:")]
    check_verdict_table(section, report)
    accuracy = {}
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"[a-z_0-9]+", cells[0]) and cells[0] != "arm" and cells[2] != "—":
            accuracy[cells[0]] = float(cells[2].split()[0])
    section = section.replace("\n  ", " ")  # the bullets' wrapped lines
    for arm in ("lp", "zero_shot_p2"):
        assert f"{accuracy[arm]:.1f}" in section, arm
    icl = next(line for line in report.splitlines() if line.startswith("| icl |")).split("|")[3].strip()
    assert f"scores {icl} over its" in section.replace("\n  ", " ")  # mean [95 % t interval] over its seeds
    for arm, words in (("zero_shot", "raw zero-shot ({})"), ("zero_shot_p2_prior", "{} with the dev-fitted"),
                       ("zero_shot_cc", "raw zero-shot to {}"), ("zero_shot_prior", "class prior to {}")):
        assert words.format(f"{accuracy[arm]:.1f}") in section, arm
    zo = [accuracy[a] for a in ("mezo_lora", "ada_official", "ada_paper", "tt_q1")]
    assert f"test at {min(zo):.1f}-{max(zo):.1f} on average over seeds" in section


def test_a_damaged_run_record_stops_the_report_with_one_line_naming_it(results):
    """A result.json cut while being written is not dropped from the verdicts in silence."""
    write_run("mezo_lora", 0, [1.0, 0.6, 0.5], np.ones(20))
    damaged = Job("mezo_lora", DESIGN.arms["mezo_lora"].lrs[0], 0, "cpu_zo_claims", []).run_dir / "result.json"
    damaged.write_text('{"status": "finished", "dev_accur')
    out = subprocess.run([sys.executable, "-m", "adazeta.tools.study_report", "cpu_zo_claims", "--out",
                          str(results / "out")], cwd=results, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                         capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        f"study_report: error: {damaged.resolve()} is not a run record (Unterminated string starting at: line 1 "
        "column 24 (char 23)); rerun that run (force=true) or move its folder away"]


@pytest.mark.parametrize("arms", [3, 17])
def test_loss_curves_stay_readable_with_many_arms_and_a_blow_up(tmp_path, arms):
    """Up to six arms share two charts; more get a panel each. Either way the y range ends at the highest starting
    loss, so one run blowing up to 3.56 at its last evaluation is cut at the edge and the others stay legible."""
    import matplotlib.image

    from adazeta.tools.plots import loss_curves_figure

    curves = {f"arm{i}": [[(f, f / 100, 1.07 - 0.4 * f / 1000 - 0.01 * i) for f in range(0, 1001, 100)]]
              for i in range(arms)}
    curves["arm0"][0][-1] = (1000, 10.0, 3.56)  # a last-evaluation blow-up
    path = tmp_path / "curves.png"
    low, high = loss_curves_figure(curves, path)
    assert 1.07 <= high < 1.2 and low < 0.67 - 0.01 * (arms - 1)
    height, width = matplotlib.image.imread(path).shape[:2]
    assert (width > height) if arms == 3 else (height > 0.6 * width)  # two charts side by side, or a grid
