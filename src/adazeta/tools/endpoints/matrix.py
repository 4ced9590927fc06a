"""The report of a task-matrix experiment (arms x tasks, as cpu_table2): its table beside the paper's numbers,
its pre-registered endpoints with their verdicts, its budgets, cost and CPUs, and a figure per task.

    make report NAME=cpu_table2        (or make tables: every experiment that declares such endpoints)

It reads the experiment's config (``endpoints:`` with ``kind: matrix``) and whatever runs have ended; a cell or an
endpoint whose runs are missing says so. Every choice is made on dev (an arm's lr by the experiment driver, the
best ZO arm and the calibrated zero-shot row here); test is only reported. ``make tables`` runs it for every
experiment that declares such endpoints.

Endpoints (``endpoints:`` in the config):
  e1: {a, b}                     a - b per task and pooled over tasks (hierarchical bootstrap, sign-flip over tasks)
  e2: {references: [...]}        the best ZO arm per task against each reference (an arm, or ``calibrated``)
  e3 (fo_arms and zo_arms)       first-order at the ZO arm's training time and peak memory (reported, no verdict)
  e4: {paper_experiment, min_methods}   Kendall's tau with the paper's ranking per task (reported, no verdict)
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from adazeta import stats
from adazeta.errors import ConfigError
from adazeta.experiments import budget_at, compose_experiment, design_of
from adazeta.tools.plots import matrix_figure, plt, read_run, save_figure
from adazeta.runs.record import ENDED, read_record
from adazeta.runs.results import cpu_label
from adazeta.tools.tables import MISSING, correct_on_test, build_table, load_paper_numbers, load_results, select_on_dev

CALIBRATED = "calibrated"


@dataclass(eq=False)
class Cell:
    """One arm at one task: its dev-selected setting's runs."""

    arm: str
    task: str
    paths: list[str]
    dev: float
    test: float
    diverged: int

    @functools.cached_property
    def correct(self) -> np.ndarray | None:
        """(seeds x examples) test correctness, read once: every endpoint compares this cell."""
        return correct_on_test(self.paths)

    def matrix(self) -> np.ndarray | None:
        return self.correct


def _cells(selected: pd.DataFrame, results: pd.DataFrame, experiment: str) -> dict[tuple[str, str], Cell]:
    out = {}
    ours = selected[selected["experiment"] == experiment]
    for row in ours.itertuples():
        runs = results[(results["experiment"] == experiment) & (results["task"] == row.task)
                       & (results["method"] == row.method) & (results["setting"] == row.setting)
                       & results["status"].isin(list(ENDED))]
        out[row.method, row.task] = Cell(row.method, row.task, list(runs["path"]), float(row.dev_mean),
                                         float(row.test_mean), int(row.diverged))
    return out


def calibrated_row(cells: dict[tuple[str, str], Cell], candidates: list[str], tasks: list[str]) -> dict[str, str]:
    """Per task, which calibrated zero-shot arm has the higher dev accuracy (ties: the first listed)."""
    chosen = {}
    for task in tasks:
        have = [cells[a, task] for a in candidates if (a, task) in cells]
        if have:
            chosen[task] = max(have, key=lambda c: (c.dev, -candidates.index(c.arm))).arm
    return chosen


def _verdict(p: stats.Paired) -> str:
    """The verdict on a pre-registered "above": confirmed when the interval lies above 0, refuted below it."""
    if p.lo > 0:
        return "confirmed"
    if p.hi < 0:
        return "refuted"
    return "unresolved"


def _show(p: stats.Paired) -> str:
    return f"{100 * p.diff:+.1f} [{100 * p.lo:+.1f}, {100 * p.hi:+.1f}]"


def compare(a: Cell | None, b: Cell | None, n_boot: int) -> tuple[stats.Paired, float] | None:
    """a - b on their shared test examples (hierarchical bootstrap) and the exact sign-flip p over the seeds they
    share; None where either has no per-example predictions."""
    if a is None or b is None:
        return None
    ma, mb = a.matrix(), b.matrix()
    if ma is None or mb is None or ma.shape[1] != mb.shape[1]:
        return None
    n = min(len(ma), len(mb))
    flip = stats.sign_flip(list(ma[:n].mean(axis=1) - mb[:n].mean(axis=1))) if n > 1 else float("nan")
    return stats.hierarchical_difference(ma, mb, n_boot=n_boot), flip


def pooled(pairs: list[tuple[Cell, Cell]], n_boot: int) -> tuple[stats.Paired, float] | None:
    matrices = [(a.matrix(), b.matrix()) for a, b in pairs]
    matrices = [(x, y) for x, y in matrices if x is not None and y is not None and x.shape[1] == y.shape[1]]
    if len(matrices) < 2:
        return None
    diffs = [float(x.mean() - y.mean()) for x, y in matrices]
    return stats.pooled_difference(matrices, n_boot=n_boot), stats.sign_flip(diffs)


def best_zo(cells: dict[tuple[str, str], Cell], zo_arms: list[str], task: str) -> Cell | None:
    """The ZO arm with the highest mean dev accuracy at ``task`` (never test); ties: the arm listed first."""
    have = [cells[a, task] for a in zo_arms if (a, task) in cells]
    return max(have, key=lambda c: (c.dev, -zo_arms.index(c.arm))) if have else None


def _train_time(path: str) -> float:
    run = read_run(Path(path))
    return float(run["metrics"]["step_time_s"].sum()) if len(run["metrics"]) else 0.0


def equal_time(fo: Cell, zo: Cell) -> tuple[float, float, float] | None:
    """(FO's mean dev accuracy at its last evaluation within ZO's mean training time, ZO's mean final dev
    accuracy, FO / ZO peak memory); None without curves."""
    budget = float(np.mean([_train_time(p) for p in zo.paths]))
    at = []
    for path in fo.paths:
        dev = read_run(Path(path))["dev"]
        within = dev[dev["wall_time_s"] <= budget]
        if len(within):
            at.append(float(within["accuracy"].iloc[-1]))
    if not at:
        return None
    memory = [read_record(Path(p)) or {} for p in fo.paths + zo.paths]
    fo_mem = max(m.get("peak_mem_mb") or 0 for m in memory[:len(fo.paths)])
    zo_mem = max(m.get("peak_mem_mb") or 0 for m in memory[len(fo.paths):])
    return float(np.mean(at)), zo.dev, (fo_mem / zo_mem if zo_mem else float("nan"))


def kendall(ours: dict[str, float], theirs: dict[str, float]) -> float:
    from scipy import stats as sps

    shared = sorted(set(ours) & set(theirs))
    return float(sps.kendalltau([ours[m] for m in shared], [theirs[m] for m in shared]).statistic)


def report(name: str, runs: Path, paper_path: Path, tables: Path, figures: Path | None) -> str:
    config = compose_experiment(name)
    design = design_of(config, name)
    ends = config.get("endpoints") or {}
    if design is None or ends.get("kind") != "matrix":
        raise ConfigError(f"experiment {name} declares no task-matrix endpoints (endpoints.kind: matrix)")
    tasks = [str(t) for t in design.grid.get("task", [])]
    n_boot = int(ends.get("bootstrap", 10000))
    results = load_results([runs / name]) if (runs / name).exists() else load_results([])
    every_run = results  # what the study has spent, grid runs of arms still selecting their rate included
    waiting = grids_running(design, results)
    if waiting and len(results):  # an arm's cells wait for its rate: a half-run grid chooses nothing yet
        results = results[~results["method"].isin(list(waiting))]
    selected = select_on_dev(results) if len(results) else results
    cells = _cells(selected, results, name) if len(results) else {}
    zo_arms, fo_arms = list(ends.get("zo_arms", [])), list(ends.get("fo_arms", []))
    calibrated = calibrated_row(cells, list(ends.get("calibrated", [])), tasks)
    for task, arm in calibrated.items():
        cells[CALIBRATED, task] = cells[arm, task]
    lines = [f"# {name}: report", "", f"Generated by `make tables` (`python -m adazeta.tools.make_tables`) from the runs "
             f"under {runs / name}; the design, budgets and endpoints are in conf/experiment/{name}.yaml "
             "(pre-registered).", ""]
    lines += _status(name, design, every_run, runs, tasks)
    if waiting:
        lines += ["Learning-rate grids still running (their arms' cells wait for the rate the grid chooses on dev): "
                  + "; ".join(f"{arm}: {done} of {total} grid runs ended" for arm, (done, total) in waiting.items())
                  + ".", ""]
    lines += _table(name, selected, cells, calibrated, paper_path, ends, tasks, tables)
    lines += _endpoints(cells, ends, tasks, zo_arms, fo_arms, n_boot, paper_path)
    if figures is not None:
        lines += _figures(name, results, selected, tasks, figures)
    text = "\n".join(lines) + "\n"
    tables.mkdir(parents=True, exist_ok=True)
    (tables / f"{name}_report.md").write_text(text)
    return text


def grids_running(design, results: pd.DataFrame) -> dict[str, tuple[int, int]]:
    """Arms whose lr grid has not ended at every selection point (its runs at ``design.select_seed``), with
    (grid runs ended, grid runs in all): until then no rate is chosen, so none of the arm's runs is a result."""
    ended = results[results["status"].isin(list(ENDED))] if len(results) else results
    waiting = {}
    for arm in design.arms.values():
        if len(arm.lrs) < 2:
            continue
        tasks = {str(p.get("task")) for p in design.points() if design.selects_at(p) and arm.runs_at_point(p)}
        have = set()
        if len(ended):
            mine = ended[(ended["method"] == arm.name) & (ended["seed"] == design.select_seed)]
            for task, path in zip(mine["task"], mine["path"]):
                lr = re.search(r"(?:^|[,/])lr=([^,/]+)", str(path))
                if lr:
                    have.add((str(task), float(lr.group(1))))
        total = len(tasks) * len(arm.lrs)
        done = sum((t, float(lr)) in have for t in tasks for lr in arm.lrs)
        if done < total:
            waiting[arm.name] = (done, total)
    return waiting


def _status(name: str, design, results: pd.DataFrame, runs: Path, tasks: list[str]) -> list[str]:
    lines = ["## Where it stands", ""]
    ended = results[results["status"].isin(list(ENDED))] if len(results) else results
    records = [read_record(Path(p)) or {} for p in (ended["path"] if len(ended) else [])]
    hours = sum(r.get("wall_time_s") or 0 for r in records) / 3600
    cpus: dict[str, int] = {}
    for record in records:
        label = cpu_label(record.get("device"))
        cpus[label] = cpus.get(label, 0) + 1
    diverged = int((ended["status"] == "diverged").sum()) if len(ended) else 0
    lines.append(f"- {len(ended)} runs ended ({diverged} diverged), {hours:.1f} core-hours by their wall times.")
    counts = [f"{label}: {n} run{'' if n == 1 else 's'}" for label, n in sorted(cpus.items())]
    lines.append("- CPUs: " + ("; ".join(counts) or "none yet")
                 + (" (the table mixes CPUs)" if len(cpus) > 1 else ""))
    if design.budget is not None:
        lines += ["", "| task | ZO budget (forwards) | by the pilot rule |", "|---|---|---|"]
        for task in tasks:
            b = budget_at(design.budget, task, runs)
            lines.append(f"| {task} | {b.forwards if b.forwards is not None else 'pending'} | {b.why} |")
    lines.append("")
    return lines


def _table(name, selected, cells, calibrated, paper_path, ends, tasks, tables: Path) -> list[str]:
    paper = load_paper_numbers(paper_path)
    source = str(ends.get("e4", {}).get("paper_experiment") or name)
    paper = paper[paper["experiment"] == source].assign(experiment=name)
    rows = selected[selected["experiment"] == name] if len(selected) else selected
    if len(rows) and calibrated:
        extra = [rows[(rows["method"] == arm) & (rows["task"] == task)].assign(method=CALIBRATED)
                 for task, arm in calibrated.items()]
        rows = pd.concat([rows, *extra], ignore_index=True)
    missing = [str(t) for t in ends.get("no_training_data", [])]
    methods = [m for m in [*ends.get("table_rows", [])] if m] or None
    table = build_table(rows, paper, name, methods, [*tasks, *missing])
    for task in missing:
        if task in table.cells:
            table.cells[task] = "no train data"
    header = f"{name}: test accuracy x100, SmolLM2-135M (paper: Llama-2-7B / OPT-13B)"
    legend = ["", f"- calibrated: per task, whichever of {', '.join(ends.get('calibrated', []))} has the higher dev "
              f"accuracy ({', '.join(f'{t}: {a}' for t, a in calibrated.items()) or 'none yet'}).",
              f"- no train data: {', '.join(missing)} have no training split offline (their loaders keep their "
              "fixture tests)."]
    sizes = _split_sizes(cells, tasks)
    if sizes:
        legend.append("- splits (train / dev / test): " + "; ".join(f"{t} {s}" for t, s in sizes.items()) + ".")
    from adazeta.tools.tables import to_latex, to_markdown

    markdown = f"# {header}\n\n" + to_markdown(table) + "\n".join(legend) + "\n"
    tables.mkdir(parents=True, exist_ok=True)
    (tables / f"{name}.md").write_text(markdown)
    (tables / f"{name}.tex").write_text(to_latex(table, header))
    return ["## The table", "", f"`results/tables/{name}.md` (and `.tex`), written by `make tables`:", "",
            *markdown.splitlines()[2:], ""]


def _split_sizes(cells: dict[tuple[str, str], Cell], tasks: list[str]) -> dict[str, str]:
    """train / dev / test examples per task, as its runs recorded them (one data sample for every arm)."""
    sizes = {}
    for task in tasks:
        for (_, t), cell in sorted(cells.items()):
            record = read_record(Path(cell.paths[0])) if t == task and cell.paths else None
            if record:
                sizes[task] = f"{record.get('num_train')} / {record.get('num_dev')} / {record.get('num_eval')}"
                break
    return sizes


def _endpoints(cells, ends, tasks, zo_arms, fo_arms, n_boot, paper_path) -> list[str]:
    lines = ["## Endpoints", "",
             "Differences in test points x100, 95 % intervals that resample each arm's seeds and the test examples "
             "(two-level bootstrap); p: exact sign-flip over the seeds (per task) or the tasks (pooled). With 3 "
             "seeds a per-task sign-flip p cannot go below 0.25: the per-task rows describe, the pooled row tests.",
             ""]
    e1 = ends.get("e1") or {}
    if e1:
        a, b = e1["a"], e1["b"]
        lines += [f"### E1: {a} - {b}", "", "| task | difference | seeds | sign-flip p |", "|---|---|---|---|"]
        pairs = []
        for task in tasks:
            got = compare(cells.get((a, task)), cells.get((b, task)), n_boot)
            if got is None:
                lines.append(f"| {task} | {MISSING} | | |")
                continue
            pairs.append((cells[a, task], cells[b, task]))
            lines.append(f"| {task} | {_show(got[0])} | {len(cells[a, task].paths)} / {len(cells[b, task].paths)} "
                         f"| {got[1]:.2f} |")
        both = pooled(pairs, n_boot)
        verdict = "pending (fewer than 2 tasks)" if both is None else _verdict(both[0])
        lines += ["", f"Pooled over {len(pairs)} tasks: " + (f"{_show(both[0])}, sign-flip p {both[1]:.3f}. "
                  if both else "") + f"H1 ({a} above {b}): **{verdict}**.", ""]
    e2 = ends.get("e2") or {}
    if e2:
        lines += ["### E2: the best ZO arm (chosen on dev) against the references", ""]
        for ref in e2.get("references", []):
            lines += [f"| task | best ZO arm | - {ref} |", "|---|---|---|"]
            pairs = []
            for task in tasks:
                best = best_zo(cells, zo_arms, task)
                got = compare(best, cells.get((ref, task)), n_boot)
                if got is None or best is None:
                    lines.append(f"| {task} | {best.arm if best else MISSING} | {MISSING} |")
                    continue
                pairs.append((best, cells[ref, task]))
                lines.append(f"| {task} | {best.arm} | {_show(got[0])} |")
            both = pooled(pairs, n_boot)
            lines += ["", f"Pooled over {len(pairs)} tasks: " + (f"{_show(both[0])}, sign-flip p {both[1]:.3f}. "
                      if both else "") + f"The best ZO arm above {ref}: **"
                      + (_verdict(both[0]) if both else "pending (fewer than 2 tasks)") + "**.", ""]
    if fo_arms and zo_arms:
        lines += ["### E3: first-order at the best ZO arm's training time and memory (no verdict)", "",
                  "| task | FO arm | FO dev acc. at ZO's time | ZO arm | its final dev acc. | peak memory FO / ZO |",
                  "|---|---|---|---|---|---|"]
        for task in tasks:
            zo = best_zo(cells, zo_arms, task)
            for arm in fo_arms:
                fo = cells.get((arm, task))
                got = equal_time(fo, zo) if fo and zo else None
                if got is not None:
                    lines.append(f"| {task} | {arm} | {100 * got[0]:.1f} | {zo.arm} | {100 * got[1]:.1f} | "
                                 f"{got[2]:.2f} |")
        lines.append("")
    e4 = ends.get("e4") or {}
    if e4:
        paper = load_paper_numbers(paper_path)
        paper = paper[paper["experiment"] == e4["paper_experiment"]]
        taus = []
        for task in tasks:
            theirs = {r.method: r.value for r in paper[paper["task"] == task].itertuples()}
            ours = {m: 100 * c.test for (m, t), c in cells.items() if t == task and m != CALIBRATED}
            if len(set(ours) & set(theirs)) >= int(e4.get("min_methods", 3)):
                taus.append((task, kendall(ours, theirs), len(set(ours) & set(theirs))))
        lines += ["### E4: ranking against the paper's (no verdict)", ""]
        if taus:
            lines += [f"- {t}: Kendall tau {tau:+.2f} over {n} methods" for t, tau, n in taus]
            lines.append(f"- mean tau {np.mean([t for _, t, _ in taus]):+.2f}; tau > 0 at "
                         f"{sum(t > 0 for _, t, _ in taus)} of {len(taus)} tasks")
        else:
            lines.append("- pending: no task has enough methods in both yet")
        lines.append("")
    return lines


def _figures(name, results, selected, tasks, figures: Path) -> list[str]:
    lines = ["## Figures", ""]
    figures.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        rows = selected[(selected["experiment"] == name) & (selected["task"] == task)] if len(selected) else selected
        runs = []
        for row in rows.itertuples() if len(rows) else []:
            paths = results[(results["task"] == task) & (results["method"] == row.method)
                            & (results["setting"] == row.setting)]["path"]
            runs += [read_run(Path(p)) for p in paths if (Path(p) / "metrics.csv").is_file()]
        runs = [r for r in runs if len(r["dev"]) > 1]
        if not runs:
            continue
        out = figures / f"{name}_{task}.png"
        fig = matrix_figure(runs, f"{name}: {task}")
        save_figure(fig, out)
        plt.close(fig)
        lines.append(f"- {task}: `{out}`")
    return lines + [""]
