"""The optimizer-comparison endpoints (``share``, ``goal``, ``reproduces``, ``accuracy`` in an ``endpoints:`` block, as
``cpu_zo_optimizers`` and its follow-ups declare them): forwards to the reference optimizer's final dev loss as a
share of its own, a dev-accuracy goal within the budget, reproduction of a twin run, and paired test accuracy
against the reference on the same adapters (Holm-adjusted).

Reads only the run files under results/runs/<experiment>/ and the experiment's config. Each arm's learning rate is
the one its seed-0 grid chose on dev (``adazeta.tools.experiment.chosen_lr``; test never looked at); an arm whose
grid has not finished is reported as undecided. Writes <out>/tables/<experiment>_report.md and
<out>/figures/<experiment>_curves.png.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from adazeta.errors import ConfigError
from adazeta.experiments import Design
from adazeta.tools import twins
from adazeta.tools.endpoints.claims import compare, equal_budget, figure, overview
from adazeta.tools.endpoints.runs import MISSING, Run, load_run, fmt, fmt_p, first_at_or_below
from adazeta.tools.experiment import UNDECIDED, Job, chosen_lr
from adazeta.tools.experiment import load as load_experiment


def holm(pvalues: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (step-down, monotone), in the input's order."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted, running = [math.nan] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def unmoved(run: Run) -> float | None:
    """Where the run's dev accuracy stayed at its step-0 value at every evaluation (too small a rate to change a
    prediction within the budget), its best dev loss's change from step 0 as a fraction; else None."""
    if not run.curve or run.curve[0].forwards != 0 or any(p.accuracy != run.curve[0].accuracy for p in run.curve):
        return None
    return run.rec["dev_loss"] / run.curve[0].loss - 1.0


def edge(lrs: Sequence[float], lr: float | None) -> str | None:
    """'lowest' or 'highest' where ``lr`` is an end of a grid of several points, else None."""
    if lr is None or len(lrs) < 2:
        return None
    return "lowest" if lr == min(lrs) else "highest" if lr == max(lrs) else None


def load(name: str, design: Design) -> tuple[dict[str, float | None], dict[str, dict[int, Run]], list[str]]:
    """(each arm's chosen lr or None, its runs at that lr by seed, the grid table's lines and its notes)."""
    select = design.select_seed
    chosen: dict[str, float | None] = {}
    runs: dict[str, dict[int, Run]] = {}
    still: list[str] = []
    codes: set[str] = set()
    spread: dict[str, list[float]] = {}
    lines = ["| arm | lr | status | dev accuracy | best dev loss | final dev loss | s / forward | chosen | code |",
             "|---|---:|---|---:|---:|---:|---:|---|---|"]
    for arm, spec in design.arms.items():
        lr = chosen_lr(name, spec, select)
        chosen[arm] = None if lr is UNDECIDED else lr
        for point in spec.lrs:
            run = load_run(arm, select, Job(arm, point, select, name, []).run_dir)
            if run is None:
                lines.append(f"| {arm} | {point:g} | {MISSING} | | | | | | |")
                continue
            if (change := unmoved(run)) is not None:
                still.append(f"{arm} {point:g} (dev loss {100 * change:+.1f} %)")
            at = edge(spec.lrs, point) if point == chosen[arm] else None
            mark = "" if point != chosen[arm] else "**yes**" + (f" ({at} point)" if at else "")
            lines.append(f"| {arm} | {point:g} | {run.rec['status']} | {100 * run.rec['dev_accuracy']:.1f} | "
                         f"{run.rec['dev_loss']:.4f} | {fmt(run.curve[-1].loss, 4) if run.curve else MISSING} | "
                         f"{fmt(run.seconds_per_forward(), 2)} | {mark} | {run.code()} |")
            codes.add(run.code())
            spread.setdefault(arm, []).append(run.rec["dev_loss"])
        runs[arm] = {}
        if chosen[arm] is None:
            continue
        for seed in design.seeds:
            if spec.runs_at(seed):
                run = load_run(arm, seed, Job(arm, chosen[arm], seed, name, []).run_dir)
                if run is not None:
                    runs[arm][seed] = run
    edges = [f"{a} ({edge(design.arms[a].lrs, lr)})" for a, lr in chosen.items() if edge(design.arms[a].lrs, lr)]
    if len(codes) > 1:
        lines += ["", f"The grid's runs come from {len(codes)} code versions ({', '.join(sorted(codes))}): **mixed "
                      "versions** (their seconds per forward also carry the machine's load when each ran)."]
    lines += ["",
              "Chosen at an end of its grid (the best rate may lie beyond it; the grids were fixed before the first "
              f"run and are not extended in this experiment): {', '.join(edges) or 'none'}.",
              "",
              "Grid points whose dev accuracy never left its step-0 value (too small a rate to change a prediction "
              f"within the budget): {', '.join(still) or 'none'}.",
              "",
              "Spread of the best dev loss over each grid (largest minus smallest, over the points that ran; does the "
              "rate matter?): " + (", ".join(f"{a} {max(v) - min(v):.4f} ({len(v)} of {len(design.arms[a].lrs)})"
                                             for a, v in spread.items() if len(v) > 1) or "none") + "."]
    return chosen, runs, lines


def family(arm: str, references: dict[str, str]) -> str | None:
    """The adapter an arm trains (``tt_...`` -> tt), whose reference it is measured against."""
    prefix = arm.split("_", 1)[0]
    return prefix if prefix in references else None


def shares(runs: dict[str, dict[int, Run]], references: dict[str, str]) -> list[str]:
    """Endpoint (a): forwards to the reference's final dev loss, per seed, as a share of the reference's own."""
    lines = ["| arm | seed | target (reference's final dev loss) | reference reaches at | arm reaches at | share |",
             "|---|---:|---:|---:|---:|---:|"]
    summary = ["| arm | seeds | shares | median share [95 % bootstrap CI over seeds] |", "|---|---:|---|---|"]
    for arm, by_seed in runs.items():
        ref = references.get(family(arm, references) or "")
        if ref is None or arm == ref:
            continue
        got = []
        for seed, run in sorted(by_seed.items()):
            base = runs.get(ref, {}).get(seed)
            if base is None or not base.curve:
                continue
            target = base.curve[-1].loss
            f_ref, f_arm = first_at_or_below(base.curve, target), first_at_or_below(run.curve, target)
            share = f_arm / f_ref if f_ref > 0 else math.nan
            got.append(share)
            lines.append(f"| {arm} | {seed} | {target:.4f} | {f_ref:.0f} | "
                         f"{'never' if math.isinf(f_arm) else f'{f_arm:.0f}'} | "
                         f"{'∞' if math.isinf(share) else f'{share:.2f}'} |")
        if got:
            finite = np.array([min(s, 1e9) for s in got])
            lo, hi = (np.quantile([np.median(np.random.default_rng(i).choice(finite, len(finite))) for i in range(2000)],
                                  [0.025, 0.975]) if len(finite) > 1 else (math.nan, math.nan))
            show = lambda x: "∞" if x >= 1e9 else f"{x:.2f}"  # noqa: E731
            summary.append(f"| {arm} | {len(got)} | {', '.join(show(s) for s in got)} | {show(np.median(finite))} "
                           f"[{MISSING if math.isnan(lo) else show(lo)}, {MISSING if math.isnan(hi) else show(hi)}] |")
    return summary + ["", *lines]


def goal(runs: dict[str, dict[int, Run]], cfg: dict, budget: int) -> list[str]:
    """Endpoint (b): dev accuracy >= the goal at some evaluation within the budget, on at least min_seeds seeds."""
    target, need = float(cfg["dev_accuracy"]), int(cfg["min_seeds"])
    lines = [f"| arm | seeds reaching dev accuracy {target:.2f} within {budget} forwards | first reached at (forwards) "
             "| met |", "|---|---|---|---|"]
    for arm, by_seed in runs.items():
        if not by_seed:
            continue
        firsts = []
        for _, run in sorted(by_seed.items()):
            hits = [p.forwards for p in run.curve if p.accuracy >= target and p.forwards <= budget]
            firsts.append(min(hits) if hits else math.inf)
        reached = sum(not math.isinf(f) for f in firsts)
        lines.append(f"| {arm} | {reached} of {len(firsts)} | "
                     f"{', '.join('never' if math.isinf(f) else f'{f:.0f}' for f in firsts)} | "
                     f"{'**yes**' if reached >= need else 'no'} |")
    return lines


def within(lo: float, hi: float, margin: float) -> str:
    """The margin's verdict on a difference's interval (fractions; ``margin`` in points): the arm is at most
    ``margin`` points worse than the reference (confirmed), more than that (refuted), or the interval says neither."""
    if 100 * lo > -margin:
        return "confirmed"
    return "refuted" if 100 * hi < -margin else "unresolved"


def reproduction(name: str, runs: dict[str, dict[int, Run]], chosen: dict[str, float | None],
                 cfg: dict) -> list[str]:
    """Each listed arm's runs against their twins in another experiment (same arm name, lr and seed), by
    ``adazeta.tools.twins``: the dev-loss difference at step 0 and the largest over the curve, the test predictions
    that differ, and the CPUs each ran on."""
    other, tol = str(cfg["experiment"]), float(cfg.get("tolerance", 1e-6))
    lines = [f"Each run of {', '.join(cfg['arms'])} against its twin in {other} (same arm, lr and seed; a twin "
             f"reproduces its run when every dev loss is within {tol:g} and every test prediction is the same):", "",
             "| arm | seed | lr | evaluations (here / twin) | step-0 dev-loss difference | largest dev-loss difference "
             "| test predictions that differ | CPU (here / twin) | reproduced |",
             "|---|---:|---:|---|---:|---:|---:|---|---|"]
    across = False
    for arm in cfg["arms"]:
        for seed, run in sorted(runs.get(arm, {}).items()):
            lr = chosen[arm]
            here_dir, twin_dir = Job(arm, lr, seed, name, []).run_dir, Job(arm, lr, seed, other, []).run_dir
            if not Job(arm, lr, seed, other, []).done():
                lines.append(f"| {arm} | {seed} | {lr:g} | {len(run.curve)} / {MISSING} | | | | {twins.cpu(run.rec)} "
                             f"/ {MISSING} | no twin |")
                continue
            t = twins.compare(here_dir, twin_dir)
            ok = t.reproduced(tol)
            across |= not t.same_cpu and not ok
            verdict = "**yes**" if ok else "no" if t.same_cpu else "no (CPUs differ)"
            lines.append(f"| {arm} | {seed} | {lr:g} | {t.evaluations[0]} / {t.evaluations[1]} | {t.start_gap:.2e} | "
                         f"{t.dev_gap:.2e} | {MISSING if t.predictions_differ is None else t.predictions_differ} | "
                         f"{t.cpus[0] if t.same_cpu else ' / '.join(t.cpus)} | {verdict} |")
    if across:
        lines += ["", "A run and its twin on different CPUs need not match to the bit: the two CPUs' matrix kernels "
                  "round differently, which the step-0 dev loss (the same weights, before any update) shows, and "
                  "each ZO step then carries the difference on. A same-CPU twin tests the code; these rows do not "
                  "(`python -m adazeta.tools.twins RUN TWIN` compares any two runs)."]
    return lines


def accuracy(runs: dict[str, dict[int, Run]], references: dict[str, str], cfg: dict, n_boot: int) -> list[str]:
    """Endpoint (c): test accuracy at the best-dev state against the reference, paired, Holm over each adapter's
    arms; and the stability counts."""
    rows = []
    for arm in runs:
        ref = references.get(family(arm, references) or "")
        if ref is None or arm == ref:
            continue
        c = compare(runs[arm], runs.get(ref, {}), n_boot)
        if c is not None:
            rows.append((family(arm, references), arm, ref, c))
    adjusted: dict[str, float] = {}  # Holm over each adapter's arms, on the two-level p
    for fam in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == fam]
        for r, p in zip(mine, holm([r[3]["both"].p for r in mine]) if cfg.get("holm", True) else
                        [r[3]["both"].p for r in mine]):
            adjusted[r[1]] = p
    margin = cfg.get("margin")
    lines = ["The difference's interval and p resample each arm's seeds, then the test examples (a two-level "
             "bootstrap); the per-example paired bootstrap and McNemar's test beside them hold the seeds fixed "
             "(conditional on the seeds that ran). Holm and the margin read the two-level test.", "",
             "| arm | vs | difference (points) [95 % CI, seeds and examples] | two-level p | Holm p | given these "
             "seeds: [95 % CI], paired bootstrap p | McNemar (arm only / ref only, p) | per-seed differences | "
             "sign-flip p |" + (f" within {margin:g} points? |" if margin is not None else ""),
             "|---|---|---|---:|---:|---|---|---|---:|" + ("---|" if margin is not None else "")]
    for _, arm, ref, c in rows:
        b, h, m = c["boot"], c["both"], c["mcnemar"]
        lines.append(f"| {arm} | {ref} | {100 * h.diff:+.1f} [{100 * h.lo:+.1f}, {100 * h.hi:+.1f}] | {fmt_p(h.p)} | "
                     f"{fmt_p(adjusted[arm])} | [{100 * b.lo:+.1f}, {100 * b.hi:+.1f}], {fmt_p(b.p)} | "
                     f"{m.a_only} / {m.b_only}, {fmt_p(m.p)} | "
                     f"{', '.join(f'{100 * d:+.1f}' for d in c['per_seed'])} | {fmt_p(c['flip'])} |"
                     + (f" {within(h.lo, h.hi, float(margin))} |" if margin is not None else ""))
    uneven = [f"`{arm}` {c['seeds'][0]} against `{ref}`'s {c['seeds'][1]}" for _, arm, ref, c in rows
              if c["seeds"][0] != c["seeds"][1]]
    if uneven:
        lines += ["", f"Interim, seeds still to run: {', '.join(uneven)}. Such a row's difference and interval "
                      "compare the mean over each arm's seeds so far; its McNemar counts and per-seed differences use "
                      "the seeds both arms have."]
    if margin is not None:
        lines += ["", f"Within {margin:g} points: confirmed where the interval's lower end is above -{margin:g}, refuted "
                      f"where its upper end is below -{margin:g}, unresolved where it straddles -{margin:g}."]
    drift = float(cfg.get("drift_ratio", 1.2))
    lines += ["", f"Stability (final / best dev loss above {drift} counts as drift):", "",
              "| arm | runs | diverged | stalled | drifted | final / best dev loss (per seed) |",
              "|---|---:|---:|---:|---:|---|"]
    for arm, by_seed in runs.items():
        if not by_seed:
            continue
        status = [r.rec["status"] for r in by_seed.values()]
        drifts = [r.drift() for _, r in sorted(by_seed.items())]
        lines.append(f"| {arm} | {len(status)} | {status.count('diverged')} | {status.count('stalled')} | "
                     f"{sum(d > drift for d in drifts)} | {', '.join(fmt(d) for d in drifts)} |")
    return lines


def cpus(runs: dict[str, dict[int, Run]]) -> list[str]:
    """Which CPU each arm's runs ran on: a ZO run's last bits are its CPU's (``adazeta.tools.twins``), so two runs
    of one command on two CPUs are two nearby draws, not one run twice."""
    by_arm = {arm: {seed: twins.cpu(run.rec) for seed, run in sorted(seeds.items())} for arm, seeds in runs.items()}
    names = sorted({c for seeds in by_arm.values() for c in seeds.values()})
    if len(names) < 2:
        return []
    parts = [f"{c}: {', '.join(a for a, s in by_arm.items() if s and set(s.values()) == {c})}" for c in names]
    mixed = [f"{a} ({', '.join(f'seed {seed} {c}' for seed, c in s.items())})"
             for a, s in by_arm.items() if len(set(s.values())) > 1]
    return [f"The runs above ran on {len(names)} CPUs. A run's last bits are its CPU's: the same command gives "
            "dev losses that differ in their last digits at step 0 on two CPUs, and the ZO steps carry that on "
            "(`python -m adazeta.tools.twins RUN TWIN`). By arm: "
            + "; ".join([p for p in parts if not p.endswith(": ")] + ([f"both: {', '.join(mixed)}"] if mixed else []))
            + ".", ""]


def report(name: str, out: Path) -> Path:
    config, design = load_experiment(name)
    ends = config.get("endpoints") or {}
    if "share" not in ends:
        raise ConfigError(f"experiment {name} declares no `endpoints.share`; not an optimizer "
                         "comparison")
    n_boot = int(ends.get("bootstrap", 10000))
    references = ends["share"]["references"]
    chosen, runs, grid_lines = load(name, design)
    budget, every = int(config["train"]["max_forward_passes"]), int(config["train"]["eval_every_forwards"])
    decided = [a for a in config["arms"] if chosen[a] is not None]
    text = [
        f"# {name}: the field's ZO optimizers at equal forward passes",
        "",
        f"Generated by `make report NAME={name}` (`python -m adazeta.tools.study_report`) from the run files; design and decision rules: "
        f"`conf/experiment/{name}.yaml` (committed before the first run). SmolLM2-135M, SST-2, one data sample "
        f"(data.seed {config['data']['seed']}: {config['data']['num_train']} train, {config['data']['num_dev']} dev, "
        f"{config['data']['num_eval']} test), seeds {config['design']['seeds']} at each arm's lr, chosen on dev "
        f"accuracy at seed {config['design']['select_seed']} (never on test); budget {budget} forward passes, dev "
        f"every {every}. Intervals are 95 % (a t interval over seeds is clipped to 0-100, an accuracy's range); "
        f"paired bootstrap {n_boot} resamples over test examples.",
        "",
        f"Arms with a chosen lr: {len(decided)} of {len(config['arms'])}"
        + (f" (undecided: {', '.join(a for a in config['arms'] if chosen[a] is None)})"
           if len(decided) < len(config["arms"]) else "") + ".",
        "",
        "## Arms at their chosen lr",
        "",
        *overview({a: runs[a] for a in decided}, {**config, "arms": {a: config["arms"][a] for a in decided}}, design,
                  n_boot),
        "",
        *cpus({a: runs[a] for a in decided}),
        "## (a) Forwards to reach ZO-SGD's final dev loss, as a share of ZO-SGD's (per seed, same dev set)",
        "",
        *shares(runs, references),
        "",
        f"## (b) The goal: dev accuracy {ends['goal']['dev_accuracy']} within {budget} forwards on "
        f"{ends['goal']['min_seeds']} seeds",
        "",
        *goal(runs, ends["goal"], budget),
        "",
        "## (c) Test accuracy against ZO-SGD on the same adapters, paired",
        "",
        *accuracy(runs, references, ends.get("accuracy", {}), n_boot),
        "",
        *(["## Reproduction", "", *reproduction(name, runs, chosen, ends["reproduces"]), ""]
          if ends.get("reproduces") else []),
        "## Equal budgets: mean dev loss / accuracy (%) at equal forward passes",
        "",
        *equal_budget(runs, decided, list(range(every * 2, budget + 1, every * 2))),
        "",
        "A forward is not the same cost for every optimizer: Forward-Grad's is a jvp (a forward carrying a tangent), "
        "and the optimizers differ in the work of a step beyond its forwards. Training seconds per forward (the steps' "
        "own time over their forward passes, evaluations excluded; one thread a run, two runs at a time on the same "
        "machine, so the figures carry the machine's load) and the same curves at equal training time:",
        "",
        *equal_budget(runs, decided, [60.0 * m for m in (2, 4, 6, 8, 10)], "wall_s",
                      label=lambda m: f"{m / 60:.0f} min", cost=True),
        "",
        "## The learning-rate grids (seed 0, dev only)",
        "",
        *grid_lines,
        "",
    ]
    path = out / "tables" / f"{name}_report.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(text))
    if any(runs[a] for a in decided):
        figure(runs, decided, out / "figures" / f"{name}_curves.png")
    return path
