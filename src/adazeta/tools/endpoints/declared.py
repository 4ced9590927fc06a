"""The declared form: an ``endpoints:`` block with ``kind: declared`` and a list of predictions, each a test by
name; the form every new study uses, so that the next study needs a YAML block, not new Python.

    make report NAME=cpu_zo_prompt          (python -m adazeta.tools.study_report cpu_zo_prompt)

The config's ``endpoints:`` says ``kind: declared`` and lists its predictions, each one of these tests:

    - id: P1
      test: difference            # arm - reference in test accuracy, per arm (two-level bootstrap: each arm's
      arms: [a, b]                #   seeds, then the test examples; the exact sign-flip over shared seeds beside)
      best_on_dev: false          # true: only the listed arm with the best mean dev accuracy is judged
      reference: zero_shot        # an arm here, or {experiment: other, arm: lp} (a run of another experiment)
      hypothesis: above           # above: confirmed when the interval lies above 0, refuted below it;
      margin: 5                   # within: at most `margin` points below (the lower end above -margin), refuted
                                  #   when the upper end is below -margin; unresolved otherwise
    - id: P2
      test: chosen_lr             # the rate the driver chose on dev, per arm
      arms: [a, b]
      above: 3.0e-4               # confirmed when above this, refuted otherwise
    - id: P3
      test: stability             # the claims form's rule: diverged, collapsed, or final / best dev loss above
      constant: tt_q1             #   drift_ratio; an adaptive arm against the constant one (Fisher), and the
      adaptive: [a, b]            #   constant arm cut at each adaptive run's step count (equal steps)
      drift_ratio: 1.2
    - id: P4
      test: time_to_target        # training wall time to a fixed dev-loss drop, arm against reference, per seed:
      pairs: [[a, a_ref], [b, b_ref]]   # the reference run's drop D = share x (its first dev loss - its lowest);
      share: 0.8                  #   each run's time to lower its own dev loss by D below its own first one
                                  #   (its training steps' time, evaluations not counted); r = t_arm / t_ref.
                                  #   confirmed: r < 1 at every seed of every pair (exact one-sided sign test
                                  #   beside); refuted: r < 1 at fewer than half; unresolved otherwise.

Each verdict is confirmed / refuted / unresolved, with "(interim: ...)" while seeds are still to run. Arms with an
lr grid are read at the rate the driver chose on dev (never on test).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from adazeta import stats
from adazeta.errors import ConfigError
from adazeta.tools.endpoints.claims import stability
from adazeta.tools.endpoints.runs import (
    CONFIRMED, REFUTED, UNRESOLVED, Run, correctness, interim, load_run, p_is, planned,
)
from adazeta.tools.experiment import UNDECIDED, Job, chosen_lr
from adazeta.tools.experiment import load as load_experiment

TESTS = ("difference", "chosen_lr", "stability", "time_to_target")


def arm_runs(name: str, design: Any, arm: str) -> tuple[float | None | object, dict[int, Run]]:
    """(the arm's lr: its one rate, the dev-chosen one, or UNDECIDED; its ended runs at that rate by seed)."""
    spec = design.arms[arm]
    lr = spec.lrs[0] if len(spec.lrs) == 1 else chosen_lr(name, spec, design.select_seed)
    if lr is UNDECIDED:
        return lr, {}
    runs = {}
    for seed in planned(design, arm):
        run = load_run(arm, seed, Job(arm, lr, seed, name, []).run_dir)  # type: ignore[arg-type]
        if run is not None:
            runs[seed] = run
    return lr, runs


def reference_runs(name: str, design: Any, ref: Any) -> tuple[str, dict[int, Run]]:
    if isinstance(ref, dict):
        other, arm = str(ref["experiment"]), str(ref["arm"])
        _, other_design = load_experiment(other)
        return f"{other}/{arm}", arm_runs(other, other_design, arm)[1]
    return str(ref), arm_runs(name, design, str(ref))[1]


def judge(p: stats.Paired, hypothesis: str, margin: float) -> str:
    if hypothesis == "within":
        return CONFIRMED if 100 * p.lo > -margin else REFUTED if 100 * p.hi < -margin else UNRESOLVED
    return CONFIRMED if p.lo > 0 else REFUTED if p.hi < 0 else UNRESOLVED


def difference(name: str, design: Any, end: dict, n_boot: int, plan: dict[str, int]) -> list[str]:
    ref_label, ref = reference_runs(name, design, end["reference"])
    hypothesis, margin = str(end.get("hypothesis", "above")), float(end.get("margin", 0))
    arms = {arm: arm_runs(name, design, arm)[1] for arm in end["arms"]}
    if end.get("best_on_dev"):
        scored = [(np.mean([r.rec["dev_accuracy"] for r in runs.values()]), arm) for arm, runs in arms.items() if runs]
        arms = {max(scored)[1]: arms[max(scored)[1]]} if scored else {}
    out = []
    words = "above" if hypothesis == "above" else f"within {margin:g} points of"
    for arm, runs in arms.items():
        a, rows_a = correctness(runs)
        b, rows_b = correctness(ref)
        label = f"- {end['id']}, `{arm}` {words} `{ref_label}`"
        if a is None or b is None:
            out.append(f"{label}: **{UNRESOLVED}** (runs missing)")
            continue
        if rows_a != rows_b:
            raise ConfigError(f"{end['id']}: {arm} and {ref_label} were tested on different examples")
        p = stats.hierarchical_difference(a, b, n_boot=n_boot)
        shared = sorted(set(runs) & set(ref))
        per_seed = ([float(runs[s].test_correct.mean() - ref[s].test_correct.mean()) for s in shared]  # type: ignore[union-attr]
                    if len(ref) > 1 else [float(x.mean() - b[0].mean()) for x in a])
        flip = stats.sign_flip(per_seed) if len(per_seed) > 1 else math.nan
        verdict = judge(p, hypothesis, margin) + interim({**{arm: runs}}, [arm], plan)
        out.append(f"{label}: **{verdict}**: {100 * p.diff:+.1f} points [{100 * p.lo:+.1f}, {100 * p.hi:+.1f}] over "
                   f"seeds and examples, two-level bootstrap {p_is(p.p)}; per seed "
                   f"{', '.join(f'{100 * d:+.1f}' for d in per_seed)} (sign-flip {p_is(flip)}; {len(a)} vs {len(b)} "
                   "seeds)")
    return out


def chosen(name: str, design: Any, end: dict) -> list[str]:
    out = []
    for arm in end["arms"]:
        lr, _ = arm_runs(name, design, arm)
        label = f"- {end['id']}, `{arm}`'s dev-chosen rate above {float(end['above']):g}"
        if lr is UNDECIDED:
            out.append(f"{label}: **{UNRESOLVED}** (its grid has not finished)")
        else:
            out.append(f"{label}: **{CONFIRMED if lr > float(end['above']) else REFUTED}**: {lr:g}")  # type: ignore[operator]
    return out


def time_to(run: Run, drop: float) -> tuple[float, float]:
    """(training seconds, forwards) at the first dev evaluation where ``run``'s dev loss is ``drop`` or more below
    its first one; (inf, inf) where it never is."""
    start = run.curve[0].loss if run.curve else math.nan
    for p in run.curve:
        if p.loss <= start - drop + 1e-9:  # the reference reaches its own target exactly: float rounding
            return p.wall_s, p.forwards
    return math.inf, math.inf


def time_to_target(name: str, design: Any, end: dict, plan: dict[str, int]) -> tuple[list[str], list[str]]:
    """Per seed of each (arm, reference) pair: the wall-time ratio to the reference's fixed dev-loss drop."""
    share = float(end.get("share", 0.8))
    lines = ["| arm | reference | seed | drop D | arm: s (forwards) | reference: s (forwards) | r = time ratio |",
             "|---|---|---:|---:|---|---|---:|"]
    ratios: list[float] = []
    arms_of_verdict: list[str] = []
    runs_of: dict[str, dict[int, Run]] = {}
    for arm, ref in end["pairs"]:
        mine, base = arm_runs(name, design, arm)[1], arm_runs(name, design, ref)[1]
        runs_of[arm], runs_of[ref] = mine, base
        arms_of_verdict += [arm, ref]
        for seed in sorted(set(mine) & set(base)):
            losses = [p.loss for p in base[seed].curve]
            drop = share * (losses[0] - min(losses))
            (t_a, f_a), (t_r, f_r) = time_to(mine[seed], drop), time_to(base[seed], drop)
            r = t_a / t_r if t_r > 0 else math.nan
            ratios.append(r)
            lines.append(f"| {arm} | {ref} | {seed} | {drop:.4f} | {t_a:.0f} ({f_a:g}) | {t_r:.0f} ({f_r:g}) | "
                         f"{r:.2f} |")
    faster = sum(r < 1 for r in ratios)
    label = f"- {end['id']}, time to {share:g} of the reference's dev-loss drop, " + ", ".join(
        f"`{a}` against `{r}`" for a, r in end["pairs"])
    if not ratios:
        return [f"{label}: **{UNRESOLVED}** (runs missing)"], lines
    verdict = CONFIRMED if faster == len(ratios) else REFUTED if 2 * faster < len(ratios) else UNRESOLVED
    finite = [r for r in ratios if math.isfinite(r) and r > 0]
    geo = math.exp(sum(map(math.log, finite)) / len(finite)) if finite and len(finite) == len(ratios) else math.nan
    p = 0.5 ** faster if faster == len(ratios) else math.nan
    sign = f"exact one-sided sign test {p_is(p)}" if faster == len(ratios) else "sign test: not every pair faster"
    verdict += interim(runs_of, arms_of_verdict, plan)
    return [f"{label}: **{verdict}**: faster at {faster} of {len(ratios)} seed pairs ({sign}); time ratio "
            f"{'—' if math.isnan(geo) else f'{geo:.2f}'} (geometric mean), per pair "
            f"{', '.join(f'{r:.2f}' for r in ratios)}"], lines


def report(name: str, out: Path) -> Path:
    config, design = load_experiment(name)
    ends = config.get("endpoints") or {}
    if ends.get("kind") != "declared":
        raise ConfigError(f"experiment {name} declares no endpoint list (endpoints.kind: declared)")
    n_boot, alpha = int(ends.get("bootstrap", 10000)), float(ends.get("alpha", 0.05))
    plan = {arm: len(planned(design, arm)) for arm in design.arms}
    verdicts: list[str] = []
    details: list[str] = []
    for end in ends.get("list") or []:
        test = end.get("test")
        if test not in TESTS:
            raise ConfigError(f"{name}: endpoint {end.get('id')!r} has test {test!r}; known: {', '.join(TESTS)}")
        if test == "difference":
            verdicts += difference(name, design, end, n_boot, plan)
        elif test == "chosen_lr":
            verdicts += chosen(name, design, end)
        elif test == "time_to_target":
            v, lines = time_to_target(name, design, end, plan)
            verdicts += v
            details += ["", f"{end['id']}: time to the target, per seed", "", *lines]
        else:
            runs = {arm: arm_runs(name, design, arm)[1] for arm in [end["constant"], *end["adaptive"]]}
            v, lines = stability(runs, end, alpha, plan)
            verdicts += [line.replace("- (b) stability", f"- {end['id']}, stability") for line in v]
            details += lines
    overview = ["| arm | lr | runs (ended of planned) | test accuracy [95 % CI, seeds and examples] | dev accuracy |",
                "|---|---|---|---|---|"]
    for arm in design.arms:
        lr, runs = arm_runs(name, design, arm)
        mat, _ = correctness(runs)
        test = stats.hierarchical_interval(mat, n_boot=2000).show(100) if mat is not None else "—"
        dev = np.mean([r.rec["dev_accuracy"] for r in runs.values()]) if runs else math.nan
        overview.append(f"| {arm} | {'' if lr is None or lr is UNDECIDED else f'{lr:g}'} | {len(runs)} of "
                        f"{plan[arm]} | {test} | {'' if math.isnan(dev) else f'{100 * dev:.1f}'} |")
    text = [f"# {name}: its pre-registered endpoints", "",
            f"Generated by `make report NAME={name}` (`python -m adazeta.tools.study_report`) from the run files; the design and the "
            f"decision rules: `conf/experiment/{name}.yaml` (committed before its first run). Intervals are 95 %; "
            "differences resample each arm's seeds, then the test examples.", "", "## Verdicts", "", *verdicts, "",
            "## Arms", "", *overview, "", *details, ""]
    path = out / "tables" / f"{name}_report.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(text))
    return path
