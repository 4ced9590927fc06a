"""The cpu_zo study's own report: lr grids, chosen settings, curves against forward passes, the claims' verdicts.

    make report NAME=cpu_zo          (python studies/cpu_zo/report.py [--experiment cpu_zo] [--target 0.75])

The first study, run before studies declared their endpoints: its report lives here, beside its page, not in the
package (``adazeta.tools.study_report`` runs it for a study that declares no endpoints).

Reads results/runs/<experiment>/ and <experiment>_stress/ (result.json, eval.csv, metrics.csv of each run) and
writes results/tables/<experiment>_report.md and results/figures/<experiment>.png, all under the current
directory. Learning rates are the ones adazeta.tools.experiment chose on dev at the selection seed; test numbers are
read only for the chosen runs. Whatever has not run yet is reported as missing, so the report can be made at any
point of the experiment.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path


from adazeta.tools import one_line_errors
from adazeta.tools.twins import read_csv
from adazeta import stats
from adazeta.runs.record import read_record
from adazeta.tools.experiment import UNDECIDED, Job, chosen_lr
from adazeta.tools.experiment import load as load_experiment

MISSING = "—"


def load(run_dir: Path) -> dict | None:
    rec = read_record(run_dir)
    if rec is None or rec.get("status") not in ("finished", "diverged"):
        return None
    forwards = {int(r["step"]): int(r["forward_passes"]) for r in read_csv(run_dir / "metrics.csv")}
    forwards[0] = 0
    curve = [(forwards.get(int(r["step"]), math.nan), float(r["loss"]), float(r["accuracy"]))
             for r in read_csv(run_dir / "eval.csv") if r["split"] == "dev"]
    rec["curve"] = curve
    rec["run_dir"] = str(run_dir)
    return rec


def first_reaching(curve, value: float, index: int, below: bool) -> float:
    """Forward passes at the first dev evaluation whose loss (index 1) is <= value or accuracy (2) >= value."""
    for point in curve:
        if (point[index] <= value) if below else (point[index] >= value):
            return point[0]
    return math.nan


def mean_std(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return MISSING
    text = f"{scale * statistics.mean(values):.{digits}f}"
    if len(values) > 1:
        text += f" ({scale * statistics.stdev(values):.{digits}f})"  # sample std, ddof = 1
    return text


def grids(name: str, order: list[str], arms: dict, select_seed: int) -> tuple[list[str], dict]:
    """The learning-rate grid table at the selection seed, and each arm's chosen lr (UNDECIDED until its grid ran)."""
    width = max(len(a.lrs) for a in arms.values())
    lines = [
        "## Learning-rate grids (seed %d): dev accuracy (dev loss), status" % select_seed,
        "",
        "| arm | " + " | ".join(f"lr {i + 1}" for i in range(width)) + " | chosen |",
        "|---|" + "---|" * (width + 1),
    ]
    chosen = {}
    for arm in order:
        cells = []
        for lr in arms[arm].lrs:
            rec = load(Job(arm, lr, select_seed, name, []).run_dir)
            tag = "" if lr is None else f"{lr:g}: "
            if rec is None:
                cells.append(f"{tag}{MISSING}")
            else:
                mark = "" if rec["status"] == "finished" else f" **{rec['status']}**"
                cells.append(f"{tag}{rec['dev_accuracy']:.3f} ({rec['dev_loss']:.3f}){mark}")
        lr = chosen_lr(name, arms[arm], select_seed)
        chosen[arm] = lr
        cells += [""] * (width - len(cells))
        pick = "not yet" if lr is UNDECIDED else ("—" if lr is None else f"{lr:g}")
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {pick} |")
    return lines, chosen


def chosen_settings(order: list[str], arms: dict, runs: dict, chosen: dict, seeds: list[int], target: float,
                    zero_test: float, lora_target: float, lora_cost: float) -> tuple[list[str], list, list]:
    """The table of each arm's chosen setting over seeds, and what the claims section reads off it: (gain over
    zero-shot, arm) per ZO arm, and (arm, mean forwards to MeZO-LoRA's final dev loss, runs reaching it, runs)."""
    lines = [
        f"## Chosen settings over seeds {seeds}: test accuracy as mean [95 % Student-t interval over seeds]; the other "
        "columns mean (std over seeds, ddof = 1)",
        "",
        f"`to dev acc {target}`: forward passes until the first dev evaluation at or above it (runs that never "
        "get there are counted in `reached`). `to MeZO-LoRA's final dev loss`: forward passes until dev loss "
        f"<= {lora_target:.4f}, the mean final dev loss of MeZO-LoRA's chosen runs after {lora_cost:g} forward passes.",
        "",
        "| arm | lr | runs | diverged | dev loss start -> best | test acc x100 | vs zero-shot | "
        f"to dev acc {target} (reached) | to MeZO-LoRA's final dev loss (reached) | mean Q |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    verdict_gain, verdict_speed = [], []
    for arm in order:
        rs = runs[arm]
        lr = chosen[arm]
        if not rs:
            lines.append(f"| {arm} | {'not chosen' if lr is UNDECIDED else lr} | 0 | | | | | | | |")
            continue
        tests = [r["test_accuracy"] for r in rs]
        reach = [first_reaching(r["curve"], target, 2, below=False) for r in rs]
        hit = [first_reaching(r["curve"], lora_target, 1, below=True) for r in rs]
        start = statistics.mean(r["initial_dev_loss"] for r in rs)
        best = statistics.mean(r["dev_loss"] for r in rs)
        gain = 100 * (statistics.mean(tests) - zero_test)
        lines.append(
            f"| {arm} | {'—' if lr is None else f'{lr:g}'} | {len(rs)} | {sum(r['status'] == 'diverged' for r in rs)} | "
            f"{start:.3f} -> {best:.3f} | {stats.t_interval(tests, bounds=(0.0, 1.0)).show(100)} | {gain:+.1f} | "
            f"{mean_std(reach, digits=0)} ({sum(not math.isnan(x) for x in reach)}/{len(rs)}) | "
            f"{mean_std(hit, digits=0)} ({sum(not math.isnan(x) for x in hit)}/{len(rs)}) | "
            f"{mean_std([r.get('forward_passes', 0) / max(2 * r.get('steps', 1), 1) for r in rs], digits=2) if not arms[arm].first_order and lr is not None else '—'} |"
        )
        if lr is not None and not arms[arm].first_order:
            verdict_gain.append((gain, arm))
            if arm.startswith("adazeta") and not math.isnan(lora_cost):
                verdict_speed.append((arm, statistics.mean(hit) if all(not math.isnan(x) for x in hit) else math.nan,
                                      sum(not math.isnan(x) for x in hit), len(rs)))
    return lines, verdict_gain, verdict_speed


def stress_runs(name: str, order: list[str], arms: dict, design, chosen: dict) -> list[str]:
    """Each ZO arm at the stress multiples of its chosen lr (a grid run where the lr is a grid point)."""
    stress = []
    for factor in design.stress:
        for arm in order:
            lr = chosen[arm]
            if lr is UNDECIDED or lr is None or arms[arm].first_order:
                continue
            rec = load(Job(arm, lr * float(factor), design.select_seed, f"{name}_stress", []).run_dir)
            source = "stress run"
            if rec is None:  # the same lr may be a grid point: the same run (config, seed), already made
                same = [g for g in arms[arm].lrs if g is not None and math.isclose(g, lr * float(factor), rel_tol=1e-6)]
                rec = load(Job(arm, same[0], design.select_seed, name, []).run_dir) if same else None
                source = "grid run"
            stress.append((arm, factor, lr * float(factor), rec, source))
    lines = [f"## Stability: each ZO arm at {' and '.join(f'{f:g}x' for f in design.stress)} its "
             f"chosen lr (seed {design.select_seed})", "", "| arm | factor | lr | status | reason | best dev loss | from |",
             "|---|---:|---:|---|---|---:|---|"]
    for arm, factor, lr, rec, source in stress:
        if rec is None:
            lines.append(f"| {arm} | {factor:g}x | {lr:g} | {MISSING} | | | |")
        else:
            lines.append(f"| {arm} | {factor:g}x | {lr:g} | {rec['status']} | {rec.get('reason') or ''} | "
                         f"{rec['dev_loss']:.3f} | {source} |")
    return lines


def claims(verdict_gain: list, verdict_speed: list, zero_test: float, lora_target: float,
           lora_cost: float) -> list[str]:
    """The claims as measured: the best ZO arm's gain over zero-shot, and AdaZeta's forwards to MeZO-LoRA's loss."""
    lines = []
    if verdict_gain and not math.isnan(zero_test):
        best_gain, best_arm = max(verdict_gain)
        ok = "met" if best_gain >= 20 else "NOT met"
        lines.append(f"- At least one ZO arm raises test accuracy by >= 20 points over zero-shot "
                     f"({100 * zero_test:.1f}): {ok} (best: {best_arm}, {best_gain:+.1f} points).")
    else:
        lines.append("- Gain over zero-shot: not measurable yet (zero-shot or ZO runs missing).")
    for arm, cost, reached, n in verdict_speed:
        if math.isnan(cost):
            lines.append(f"- {arm} reaches MeZO-LoRA's final dev loss ({lora_target:.4f}) in {reached}/{n} runs: "
                         f"the claim (at most 1/3 of MeZO-LoRA's {lora_cost:g} forwards) is NOT confirmed.")
        else:
            verdict = "confirmed" if cost <= lora_cost / 3 else "NOT confirmed"
            lines.append(f"- {arm} reaches MeZO-LoRA's final dev loss ({lora_target:.4f}) after {cost:.0f} forward "
                         f"passes, {cost / lora_cost:.2f}x MeZO-LoRA's {lora_cost:g}: the 1/3 claim is {verdict}.")
    if not verdict_speed:
        lines.append("- AdaZeta against MeZO-LoRA: not measurable yet.")
    return lines


@one_line_errors
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default="cpu_zo")
    parser.add_argument("--target", type=float, default=0.75, help="dev accuracy whose cost in forwards is reported")
    args = parser.parse_args()
    name = args.experiment
    config, design = load_experiment(name)
    arms, select_seed, seeds, order = design.arms, design.select_seed, list(design.seeds), list(design.order)
    budget = config["train"]["max_forward_passes"]

    grid_lines, chosen = grids(name, order, arms, select_seed)
    runs = {arm: [r for s in seeds if chosen[arm] is not UNDECIDED
                  for r in [load(Job(arm, chosen[arm], s, name, []).run_dir)] if r is not None] for arm in order}
    zero = [r["test_accuracy"] for r in runs.get("zero_shot", [])]
    zero_test = statistics.mean(zero) if zero else math.nan
    mezo_lora_final = [r["curve"][-1][1] for r in runs.get("mezo_lora", []) if r["curve"]]
    lora_target = statistics.mean(mezo_lora_final) if mezo_lora_final else math.nan
    lora_cost = statistics.mean(r["forward_passes"] for r in runs["mezo_lora"]) if runs.get("mezo_lora") else math.nan
    chosen_lines, verdict_gain, verdict_speed = chosen_settings(order, arms, runs, chosen, seeds, args.target,
                                                                zero_test, lora_target, lora_cost)
    lines = [
        f"# {name}: SmolLM2-135M on SST-2, {budget} forward passes per ZO run",
        "",
        f"Made by `make report NAME={name}` (studies/{name}/report.py) from results/runs/{name}/ "
        f"(`python -m adazeta.tools.experiment {name}`).",
        f"Learning rates chosen on dev accuracy (200 dev examples; ties: dev loss) at seed {select_seed}; test = the",
        "872 SST-2 validation sentences, read only for the chosen lr. Forward passes count every loss evaluation of",
        "the ZO estimator (2Q a step); the first-order arm counts one per step (each also runs a backward pass).",
        "",
        *grid_lines,
        "",
        *chosen_lines,
        "",
        *stress_runs(name, order, arms, design, chosen),
        "",
        "## The claims, as measured",
        "",
        *claims(verdict_gain, verdict_speed, zero_test, lora_target, lora_cost),
        "",
        "## What these numbers cannot show",
        "",
        *limits(config, [r for rs in runs.values() for r in rs]),
    ]
    out = Path("results", "tables", f"{name}_report.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    plot(name, order, runs, arms, zero_test, Path("results", "figures", f"{name}.png"), args.target)
    plot_grids(name, order, arms, select_seed, Path("results", "figures", f"{name}_grid.png"))


def limits(config: dict, records: list[dict]) -> list[str]:
    """The report's own caveats, read from the config and the records: data samples, code versions, seeds."""
    out = []
    if (config.get("data") or {}).get("seed") is None:
        out.append("- The train / dev sample follows the run seed (data.seed unset): each seed trains and selects on "
                   "a different sample, so a target pooled over seeds mixes dev sets, and runs of different arms are "
                   "paired only at the same seed. `cpu_zo_claims` fixes one sample for every arm and seed.")
    commits = {(r.get("git") or {}).get("commit") for r in records}
    dirty = sum(bool((r.get("git") or {}).get("dirty")) for r in records)
    if len(commits) > 1 or dirty:
        out.append(f"- Provenance: these {len(records)} chosen runs come from {len(commits)} code versions, and "
                   f"{dirty} ran from a tree with uncommitted changes (`git.dirty` in result.json).")
    if not any((Path(r.get("run_dir", "")) / "predictions").is_dir() for r in records):
        out.append("- No run kept per-example predictions, so arms can only be compared over seeds (Welch-type), not "
                   "example by example; with 3 seeds a difference of a few points is not resolvable.")
    return out or ["- Nothing recorded limits these comparisons."]


def plot_grids(name, order, arms, seed, path: Path):
    """Every grid point at the selection seed: dev loss and accuracy against forward passes, one column per arm.

    The loss row's scale is set by the runs that did not diverge: a diverged run (MeZO at lr 1e-4: dev loss 31)
    is cut at the top, marked ^ with the highest loss it reached, instead of flattening every other curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from adazeta.tools.plots import loss_limits, plot_clipped, save_figure

    shown = [a for a in order if any(load(Job(a, lr, seed, name, []).run_dir) for lr in arms[a].lrs)]
    if not shown:
        return None
    points = {arm: [(lr, rec) for lr in arms[arm].lrs
                    if (rec := load(Job(arm, lr, seed, name, []).run_dir)) is not None and rec["curve"]]
              for arm in shown}
    curves = [(rec["status"] == "diverged", [c[1] for c in rec["curve"]]) for ps in points.values() for _, rec in ps]
    limits = None
    if any(diverged for diverged, _ in curves):
        limits = loss_limits([c for diverged, c in curves if not diverged], [c for diverged, c in curves if diverged])
    fig, axes = plt.subplots(2, len(shown), figsize=(3.2 * len(shown), 5.5), squeeze=False, sharey="row")
    for col, arm in enumerate(shown):
        for lr, rec in points[arm]:
            xs, losses, accs = zip(*rec["curve"])
            label = ("—" if lr is None else f"lr {lr:g}") + ("" if rec["status"] == "finished" else f" ({rec['status']})")
            line = plot_clipped(axes[0][col], xs, losses, limits[1] if limits else None, label=label)
            axes[1][col].plot(xs, accs, label=label, color=line.get_color())
        axes[0][col].set_title(arm, fontsize=9)
        axes[0][col].legend(fontsize=7)
        axes[1][col].set_xlabel("forward passes")
    if limits is not None:
        axes[0][0].set_ylim(*limits)
    axes[0][0].set_ylabel("dev loss" + (" (^: diverged, cut)" if limits is not None else ""))
    axes[1][0].set_ylabel("dev accuracy")
    fig.suptitle(f"{name}: learning-rate grids at seed {seed}", fontsize=10)
    fig.tight_layout()
    print(f"{'wrote' if save_figure(fig, path, dpi=110) else 'unchanged'} {path}")
    return fig


def plot(name, order, runs, arms, zero_test, path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from adazeta.tools.plots import method_colors, save_figure

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = method_colors(order)  # one colour per arm, the same in every chart
    for arm in order:
        rs = [r for r in runs.get(arm, []) if r["curve"] and r.get("steps")]
        if not rs:
            continue
        label = arm + (" (x: steps, forward + backward)" if arms[arm].first_order else "")
        color = colors[arm]
        for i, r in enumerate(rs):
            xs, losses, accs = zip(*r["curve"])
            style = dict(lw=1.6 if i == 0 else 0.7, alpha=1.0 if i == 0 else 0.5, label=label if i == 0 else None)
            line, = axes[0].plot(xs, losses, color=color, **style)
            color = line.get_color()
            axes[1].plot(xs, accs, color=color, **style)
    if not math.isnan(zero_test):
        axes[1].axhline(zero_test, color="grey", ls=":", lw=1, label="zero-shot (test)")
    axes[1].axhline(target, color="grey", ls="--", lw=0.6)
    axes[0].set(xlabel="forward passes", ylabel="dev loss", title=f"{name}: dev loss (thick: seed 0)")
    axes[1].set(xlabel="forward passes", ylabel="dev accuracy", title="dev accuracy")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    print(f"{'wrote' if save_figure(fig, path) else 'unchanged'} {path}")


if __name__ == "__main__":
    main()
