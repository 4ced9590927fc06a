"""The claims endpoints (``speed``, ``stability``, ``accuracy`` in an ``endpoints:`` block, as ``cpu_zo_claims``
and ``cpu_zo_speed`` declare them): forwards to a target against a reference arm, stability at equal steps and at
equal forwards, paired test accuracy with a margin, and the paper's own baselines; each verdict beside its table.

Reads only the run files under results/runs/<experiment>/ (result.json, eval.csv, metrics.csv,
predictions/test.csv) and the experiment's config (the decision rules committed before the first run), and writes
<out>/tables/<experiment>_report.md and <out>/figures/<experiment>_curves.png. Whatever has not run yet is reported
as missing and its endpoint as unresolved, so the report can be made at any point of the experiment. Test is read
only at each run's best-dev state; nothing here selects on it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from adazeta import stats
from adazeta.errors import ConfigError
from adazeta.experiments import Design
from adazeta.tools.endpoints.runs import (
    MISSING, CONFIRMED, REFUTED, UNRESOLVED, Run, load_runs, planned, correctness, fmt, fmt_p, p_is, first_at_or_below, interim, cpu_note,
)
from adazeta.tools.experiment import load as load_experiment


# A reference whose last evaluations sit this far above its best has drifted: its "plateau" is not one (the same
# ratio the stability endpoint calls unstable).
DRIFTED = 1.2


def ratio_limit(value) -> tuple[float, tuple[int, int] | None, str]:
    """A registered ``max_ratio``: a float (r <= it) or a fraction ``[num, den]`` compared exactly on the
    forward counts (F_arm * den <= F_ref * num), so that "at most 1/3" includes 1/3. (value, fraction, as text)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or not all(isinstance(v, int) for v in value) or value[0] < 0 or value[1] <= 0:
            raise ConfigError(f"endpoints.speed.max_ratio is {list(value)}; write a fraction as "
                             "[numerator, denominator] with whole numbers and a positive denominator, e.g. [1, 3]")
        num, den = value
        return num / den, (num, den), f"{num}/{den}"
    return float(value), None, f"{float(value):.3g}"


def speed(runs: dict[str, dict[int, Run]], cfg: dict,
          plan: dict[str, int] | None = None) -> tuple[list[str], list[str]]:
    """Endpoint (a): forwards to the reference's target dev loss, per seed, as a share of the reference's own.

    The target is the reference's plateau (``target: plateau``, the default: the mean of its last
    ``plateau_evals`` dev losses; a reference run that diverged has none) or its best dev loss (``target: best``:
    the lowest of its evaluations, which a run the divergence rule stopped still has)."""
    ref, k = cfg["reference"], int(cfg.get("plateau_evals", 3))
    limit, fraction, limit_text = ratio_limit(cfg["max_ratio"])
    kind = cfg.get("target", "plateau")
    if kind not in ("plateau", "best"):
        raise ConfigError(f"endpoints.speed.target is {kind!r}; use plateau or best")
    what = (f"the mean of `{ref}`'s last {k} dev losses (its plateau, on the same dev set)" if kind == "plateau" else
            f"`{ref}`'s best dev loss (the lowest of its evaluations, on the same dev set; a run the divergence rule "
            "stopped keeps the best it reached)")
    lines = [f"Target per seed: {what}; r = forwards for the arm to reach it / forwards for `{ref}` to reach it; "
             f"the claim: r <= {limit_text}.", "",
             f"| arm | seed | target ({kind}) | target / ref. best dev loss | ref. reaches at | arm reaches at | r |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    verdicts, notes = [], {}
    for arm in cfg["arms"]:
        ratios, hits, skipped = [], 0, 0
        for seed, r_ref in sorted(runs.get(ref, {}).items()):
            run = runs.get(arm, {}).get(seed)
            if run is None:
                continue
            if kind == "plateau" and (r_ref.rec["status"] != "finished" or len(r_ref.curve) < k):
                skipped += 1
                continue
            losses = [p.loss for p in r_ref.curve if not math.isnan(p.loss)]
            if not losses:
                skipped += 1
                continue
            best_ref = min(losses)
            target = float(np.mean([p.loss for p in r_ref.curve[-k:]])) if kind == "plateau" else best_ref
            f_ref, f_arm = first_at_or_below(r_ref.curve, target), first_at_or_below(run.curve, target)
            ratio = f_arm / f_ref
            ratios.append(ratio)
            hit = (f_arm * fraction[1] <= f_ref * fraction[0]) if fraction else ratio <= limit
            hits += hit
            above = target / best_ref
            if above > DRIFTED:  # the rule stands as registered; the reader is told what the target was
                notes[("drift", seed)] = (
                    f"At seed {seed} `{ref}`'s last {k} evaluations average {above:.2f}x its best dev loss: the target "
                    "is a level it drifted back up to, which it first passed on its way down, not a plateau.")
            if not hit and math.isclose(ratio, limit, rel_tol=1e-6):
                notes[("edge", arm, seed)] = (
                    f"`{arm}` at seed {seed}: r = {f_arm:.0f} / {f_ref:.0f}, a third to float rounding, counts as above "
                    f"the registered {cfg['max_ratio']} (the claim's words, 'at most 1/3', would count it).")
            lines.append(f"| {arm} | {seed} | {target:.4f} | {above:.2f} | {f_ref:.0f} | "
                         f"{'never' if math.isinf(f_arm) else f'{f_arm:.0f}'} | {'∞' if math.isinf(ratio) else f'{ratio:.2f}'} |")
        n = len(ratios)
        if n == 0:
            verdict = UNRESOLVED + " (no paired seeds yet)"
        elif hits == n and n >= 2:
            verdict = CONFIRMED
        elif n - hits > n / 2:
            verdict = REFUTED
        else:
            verdict = UNRESOLVED
        verdict += interim(runs, [arm, ref], plan) if n else ""
        finite = [r for r in ratios if not math.isinf(r)]
        geo = math.exp(np.mean(np.log(finite))) if finite and len(finite) == n else math.nan
        verdicts.append(f"- (a) speed, `{arm}`: **{verdict}**: r <= {limit_text} at {hits} of {n} seeds "
                        f"(one-sided sign test {p_is(stats.sign_test(hits, n))}; geometric mean r = {fmt(geo, 2)})"
                        + (f"; {skipped} seed(s) without a target (`{ref}` diverged)" if skipped else "")
                        + ("; its seeds' targets or ratios carry notes: see (a) below"
                           if any(key[0] == "drift" or key[1] == arm for key in notes) and n else ""))
    lines += [line for note in notes.values() for line in ("", note)]
    return verdicts, lines


def stability(runs: dict[str, dict[int, Run]], cfg: dict, alpha: float,
              plan: dict[str, int] | None = None) -> tuple[list[str], list[str]]:
    """Endpoint (b): unstable runs (diverged, collapsed, or final / best dev loss above drift_ratio)."""
    constant, drift_limit = cfg["constant"], float(cfg["drift_ratio"])

    def unstable(run: Run) -> bool:
        return run.unstable_reason is not None or run.drift() > drift_limit

    lines = ["| arm | seed | status | steps | step of best dev | final / best dev loss | unstable |",
             "|---|---:|---|---:|---:|---:|---|"]
    for arm in [constant, *cfg["adaptive"]]:
        for seed, run in sorted(runs.get(arm, {}).items()):
            lines.append(f"| {arm} | {seed} | {run.rec['status']} | {run.rec.get('steps', MISSING)} | "
                         f"{run.rec.get('best_step', MISSING)} | {run.drift():.3f} | "
                         f"{'yes' if unstable(run) else 'no'}{': ' + run.unstable_reason if run.unstable_reason else ''} |")
    verdicts = []
    base = runs.get(constant, {})
    bad_c = sum(unstable(r) for r in base.values())
    for arm in cfg["adaptive"]:
        mine = runs.get(arm, {})
        bad_a = sum(unstable(r) for r in mine.values())
        p = stats.fisher_less(bad_a, len(mine), bad_c, len(base))
        shared = sorted(set(mine) & set(base))
        flip = stats.sign_flip([mine[s].drift() - base[s].drift() for s in shared]) if shared else math.nan
        if not mine or not base:
            verdict = UNRESOLVED + " (runs missing)"
        elif bad_c == 0:
            verdict = UNRESOLVED + f" (no `{constant}` run was unstable: nothing to stabilise)"
        elif bad_a < bad_c and p < alpha:
            verdict = CONFIRMED
        elif bad_a >= bad_c:
            verdict = REFUTED
        else:
            verdict = UNRESOLVED
        verdict += interim(runs, [arm, constant], plan) if mine and base else ""
        drift_diff = np.mean([mine[s].drift() - base[s].drift() for s in shared]) if shared else math.nan
        verdicts.append(f"- (b) stability, `{arm}` vs `{constant}`: **{verdict}**: unstable {bad_a}/{len(mine)} vs "
                        f"{bad_c}/{len(base)} (one-sided Fisher {p_is(p)}); final/best dev loss "
                        f"{fmt(drift_diff)} vs `{constant}` paired by seed (sign-flip {p_is(flip)}, {len(shared)} seeds)")
    # The same forwards buy an adaptive arm fewer steps (Q queries a step): the constant arm's runs, stopped at the
    # same seed's adaptive step count, tell a reader whether fewer steps alone would give the difference.
    best = [r.rec["best_step"] for r in base.values() if isinstance(r.rec.get("best_step"), int)]

    def span(values: list, form: str = "{}") -> str:
        lo, hi = form.format(min(values)), form.format(max(values))
        return lo if lo == hi else f"{lo}-{hi}"

    for arm in cfg["adaptive"]:
        mine = runs.get(arm, {})
        pairs = [(base[s], mine[s].rec["steps"]) for s in sorted(set(mine) & set(base))
                 if isinstance(mine[s].rec.get("steps"), int)]
        if not pairs or not best:
            continue
        cut = [run.drift(until=steps) for run, steps in pairs]
        bad = sum(run.stopped_by(steps) or d > drift_limit for (run, steps), d in zip(pairs, cut))
        reading = ("fewer steps alone would give the difference: this endpoint cannot tell a steadier step from "
                   "fewer steps" if bad == 0 else "fewer steps alone do not explain the difference" if bad == len(pairs)
                   else f"fewer steps alone would give the difference at the other {len(pairs) - bad}")
        lines += ["", f"Steps: `{arm}` takes {span([st for _, st in pairs])} steps in its forward budget; "
                      f"`{constant}`'s best dev state comes at step {span(best)}, its drift after it. Stopped at the "
                      f"same seed's `{arm}` step count, `{constant}` would end at final / best dev loss "
                      f"{span(cut, '{:.3f}')} and be unstable at {bad} of {len(pairs)} seeds: {reading}."]
    return verdicts, lines


def compare(a: Run | dict[int, Run], b: dict[int, Run], n_boot: int) -> dict | None:
    """Paired comparison of two arms' test correctness: bootstrap over examples, McNemar pooled, sign-flip by seed."""
    ca, rows_a = correctness(a)
    cb, rows_b = correctness(b)
    if ca is None or cb is None:
        return None
    if rows_a != rows_b:
        raise ConfigError("two arms were tested on different examples: not a paired comparison")
    boot = stats.paired_bootstrap(ca, cb, n_boot=n_boot)
    shared = sorted(set(a) & set(b))
    if len(cb) == 1:  # a training-free baseline (one seed): every seed of a is paired with its one row
        pooled_b, per_seed = np.repeat(cb, len(ca), axis=0), [float(x.mean() - cb[0].mean()) for x in ca]
        pooled_a = ca
    else:
        keep_a = [s for s in sorted(a) if a[s].test_correct is not None and s in shared]
        pooled_a = np.stack([a[s].test_correct for s in keep_a]) if keep_a else ca
        pooled_b = np.stack([b[s].test_correct for s in keep_a]) if keep_a else cb
        per_seed = [float(a[s].test_correct.mean() - b[s].test_correct.mean()) for s in keep_a]
    mc = stats.mcnemar(pooled_a, pooled_b)
    both = stats.hierarchical_difference(ca, cb, n_boot=n_boot)  # seeds, then examples: the headline
    return {"boot": boot, "both": both, "mcnemar": mc, "per_seed": per_seed,
            "flip": stats.sign_flip(per_seed) if per_seed else math.nan, "seeds": (len(ca), len(cb))}


def accuracy(runs: dict[str, dict[int, Run]], cfg: dict, n_boot: int, alpha: float,
             plan: dict[str, int] | None = None) -> tuple[list[str], list[str]]:
    """Endpoint (c): test accuracy at the best-dev state, paired per example and per seed."""
    lines = ["The headline interval and p resample each arm's seeds, then the test examples (a two-level bootstrap): "
             "they hold the seed-to-seed spread. The per-example paired bootstrap and McNemar's test beside them hold "
             "the seeds fixed, so they are conditional on the seeds that ran. The verdict reads the two-level test.", "",
             "| first arm | second arm | difference (points) [95 % CI, seeds and examples] | two-level p | "
             "given these seeds: [95 % CI], paired bootstrap p | McNemar (first only / second only, p) | "
             "per-seed differences | sign-flip p |", "|---|---|---|---:|---|---|---|---:|"]
    verdicts = []
    for first, second in cfg["pairs"]:
        c = compare(runs.get(first, {}), runs.get(second, {}), n_boot)
        if c is None:
            verdicts.append(f"- (c) accuracy, `{first}` >= `{second}`: **{UNRESOLVED}** (runs missing)")
            continue
        b, h, m = c["boot"], c["both"], c["mcnemar"]
        if h.diff > 0 and h.p < alpha:
            verdict = CONFIRMED
        elif h.diff < 0 and h.p < alpha:
            verdict = REFUTED
        else:
            verdict = UNRESOLVED
        lines.append(f"| {first} | {second} | {100 * h.diff:+.1f} [{100 * h.lo:+.1f}, {100 * h.hi:+.1f}] | "
                     f"{fmt_p(h.p)} | [{100 * b.lo:+.1f}, {100 * b.hi:+.1f}], {fmt_p(b.p)} | "
                     f"{m.a_only} / {m.b_only}, {fmt_p(m.p)} | "
                     f"{', '.join(f'{100 * d:+.1f}' for d in c['per_seed'])} | {fmt_p(c['flip'])} |")
        # seeds still to run: an arm with one seed so far is paired with every seed of the other
        verdict += interim(runs, [first, second], plan)
        verdicts.append(f"- (c) accuracy, `{first}` >= `{second}`: **{verdict}**: {100 * h.diff:+.1f} points "
                        f"[{100 * h.lo:+.1f}, {100 * h.hi:+.1f}] over seeds and examples, two-level bootstrap "
                        f"{p_is(h.p)}; given these seeds [{100 * b.lo:+.1f}, {100 * b.hi:+.1f}], paired bootstrap "
                        f"{p_is(b.p)} ({c['seeds'][0]} vs {c['seeds'][1]} seeds)")
    return verdicts, lines


def baselines(runs: dict[str, dict[int, Run]], cfg: dict, zo_arms: list[str], n_boot: int) -> list[str]:
    """Every ZO arm against the training-free baseline with the best dev accuracy (chosen on dev, never test)."""
    if not cfg.get("baselines"):
        return ["This experiment registers no training-free baseline."]
    candidates = [(np.mean([r.rec["dev_accuracy"] for r in runs[a].values()]), a) for a in cfg["baselines"]
                  if runs.get(a)]
    if not candidates:
        return ["No training-free baseline has run yet."]
    best_dev, best = max(candidates)
    lines = [f"The strongest training-free baseline on dev is `{best}` (dev accuracy {100 * best_dev:.1f}); every ZO "
             "arm against it and against raw `zero_shot` on test:", "",
             "| arm | vs | difference (points) [95 % CI] | paired bootstrap p | McNemar p |", "|---|---|---|---:|---:|"]
    for arm in zo_arms:
        for base in dict.fromkeys([best, "zero_shot"]):
            c = compare(runs.get(arm, {}), runs.get(base, {}), n_boot)
            if c is None:
                continue
            b = c["boot"]
            lines.append(f"| {arm} | {base} | {100 * b.diff:+.1f} [{100 * b.lo:+.1f}, {100 * b.hi:+.1f}] | "
                         f"{fmt_p(b.p)} | {fmt_p(c['mcnemar'].p)} |")
    return lines


# --- tables and figure -----------------------------------------------------------------------------------------


def overview(runs: dict[str, dict[int, Run]], config: dict, design: Design, n_boot: int) -> list[str]:
    lines = ["| arm | runs (finished / diverged of planned) | test accuracy: mean over seeds [95 % t CI] | "
             "[95 % bootstrap CI over examples] | dev accuracy at best | best dev loss | forwards | peak MiB | "
             "minutes a run | code |", "|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    for arm in config["arms"]:
        got, plan = runs.get(arm, {}), planned(design, arm)
        if not got:
            lines.append(f"| {arm} | 0 / 0 of {len(plan)} | {MISSING} | {MISSING} | | | | | | |")
            continue
        recs = [r.rec for r in got.values()]
        finished = sum(r["status"] == "finished" for r in recs)
        t = stats.t_interval([r["test_accuracy"] for r in recs], bounds=(0.0, 1.0))
        mat, _ = correctness(got)
        boot = stats.bootstrap_interval(mat, n_boot=n_boot).show(100) if mat is not None else MISSING
        commits = sorted({run.code() for run in got.values()})
        lines.append(
            f"| {arm} | {finished} / {len(recs) - finished} of {len(plan)} | {t.show(100)} | {boot} | "
            f"{100 * np.mean([r['dev_accuracy'] for r in recs]):.1f} | {np.mean([r['dev_loss'] for r in recs]):.3f} | "
            f"{np.mean([r.get('forward_passes', 0) for r in recs]):.0f} | {np.mean([r['peak_mem_mb'] for r in recs]):.0f} | "
            f"{np.mean([r['wall_time_s'] for r in recs]) / 60:.0f} | {', '.join(commits)}"
            + (" (**mixed versions**)" if len(commits) > 1 else "") + " |")
    return lines


def equal_budget(runs: dict[str, dict[int, Run]], arms: list[str], marks: list[float], axis: str = "forwards",
                 label=lambda m: f"{m:g}", cost: bool = False) -> list[str]:
    """Mean dev loss / accuracy of each arm at equal budgets on ``axis`` (``forwards`` or ``wall_s``): each run's
    last evaluation at or before the mark, for the runs that got that far. ``cost``: a first column with the
    training seconds per forward pass (mean over the arm's runs)."""
    lines = ["| arm | " + ("s / forward | " if cost else "") + " | ".join(label(m) for m in marks) + " |",
             "|---|" + "---:|" * (len(marks) + cost)]
    for arm in arms:
        cells = []
        for m in marks:
            vals = []
            for run in runs.get(arm, {}).values():
                before = [p for p in run.curve if getattr(p, axis) <= m]
                if before and getattr(run.curve[-1], axis) >= m:
                    vals.append((before[-1].loss, before[-1].accuracy))
            cells.append(f"{np.mean([v[0] for v in vals]):.3f} / {100 * np.mean([v[1] for v in vals]):.0f}"
                         if vals else MISSING)
        if cost:
            per = [r.seconds_per_forward() for r in runs.get(arm, {}).values()]
            per = [x for x in per if not math.isnan(x)]
            cells.insert(0, f"{np.mean(per):.2f}" if per else MISSING)
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def figure(runs: dict[str, dict[int, Run]], arms: list[str], path: Path) -> None:
    """Dev loss of every arm's seeds against forward passes and training minutes (``plots.loss_curves_figure``)."""
    from adazeta.tools.plots import loss_curves_figure

    curves = {arm: [[(p.forwards, p.wall_s / 60, p.loss) for p in run.curve]
                    for run in sorted(runs[arm].values(), key=lambda r: r.seed)]
              for arm in arms if runs.get(arm)}
    loss_curves_figure(curves, path)


def report(name: str, out: Path) -> Path:
    config, design = load_experiment(name)
    ends = config.get("endpoints")
    if not ends:
        raise ConfigError(f"experiment {name} declares no `endpoints:`; it is not a claims experiment")
    alpha, n_boot = float(ends.get("alpha", 0.05)), int(ends.get("bootstrap", 10000))
    runs = load_runs(name, design)
    zo = [ends["speed"]["reference"], *ends["speed"]["arms"]]  # the arms on the forward-pass budget
    budget = int(config["train"]["max_forward_passes"])
    every = int(config["train"]["eval_every_forwards"])
    plan = {arm: len(planned(design, arm)) for arm in config["arms"]}
    v_a, t_a = speed(runs, ends["speed"], plan)
    v_b, t_b = stability(runs, ends["stability"], alpha, plan)
    v_c, t_c = accuracy(runs, ends["accuracy"], n_boot, alpha, plan)
    seeds = list(design.seeds)
    text = [
        f"# {name}: the pre-registered test of AdaZeta's claims",
        "",
        f"Generated by `make report NAME={name}` (`python -m adazeta.tools.study_report`) from the run files; design and decision rules: "
        f"`conf/experiment/{name}.yaml` (committed before the first run). SmolLM2-135M, SST-2, one data sample "
        f"(data.seed {config['data']['seed']}: {config['data']['num_train']} train, {config['data']['num_dev']} dev, "
        f"{config['data']['num_eval']} test), seeds {seeds}, budget {budget} forward passes for every ZO arm, dev every "
        f"{every}. Learning rates were fixed in the config (chosen on dev in cpu_zo); nothing here is tuned on test. "
        f"Intervals are 95 % (a t interval over seeds is clipped to 0-100, an accuracy's range); paired bootstrap "
        f"{n_boot} resamples over test examples; alpha {alpha}.",
        "",
        "## Verdicts",
        "",
        *v_a, *v_b, *v_c,
        "",
        "## Arms",
        "",
        *overview(runs, config, design, n_boot),
        "",
        "## Equal budgets: mean dev loss / accuracy (%) at equal forward passes",
        "",
        *equal_budget(runs, zo, list(range(every, budget + 1, every * 2))),
        "",
        "At equal training time (minutes of steps, evaluations excluded; one thread a run, two runs at a time; "
        f"{cpu_note(runs)}):",
        "",
        *equal_budget(runs, zo, [60.0 * m for m in (5, 10, 20, 30, 40, 50)], "wall_s", label=lambda m: f"{m / 60:.0f} min"),
        "",
        f"Curves against forward passes and against training time: `figures/{name}_curves.png`. Peak memory per arm is "
        "in the table above (the whole process, MiB).",
        "",
        "## (a) Speed",
        "",
        *t_a,
        "",
        "## (b) Stability",
        "",
        *t_b,
        "",
        "## (c) Test accuracy, paired",
        "",
        *t_c,
        "",
        "## Against the paper's own baselines",
        "",
        *baselines(runs, ends["accuracy"], zo, n_boot),
        "",
    ]
    path = out / "tables" / f"{name}_report.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(text))
    figure(runs, zo, out / "figures" / f"{name}_curves.png")
    return path
