"""Result tables: collect result records, select hyper-parameters on dev, aggregate test over seeds.

Selection never looks at test: for each (experiment, model, task, method) the hyper-parameter setting with the
best mean dev metric over its seeds is chosen, and only then is its test metric reported, as mean and sample
standard deviation (ddof = 1) over seeds, with the number of runs that diverged.

Published numbers sit beside ours with their provenance: every number carries a footnote mark naming the
publication, the table in it, the model it was measured on and whether it was checked against the publication
itself, and a legend under the table spells the marks out. A row whose numbers come from more than one source
says so.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import pandas as pd

from adazeta import stats
from adazeta.errors import ConfigError
from adazeta.runs.record import main_score, read_record
from adazeta.runs.rundir import flatten, result_settings

if TYPE_CHECKING:
    import numpy as np

# Keys that say which run it is (seeds) or how it is labelled, not which hyper-parameters were used; paths,
# logging keys and the rest that never change a number are left out by ``rundir.result_settings``.
SEED_KEYS = {"seed", "data.seed", "data.kshot_seed"}
LABEL_KEYS = {"experiment_name"}

GROUP = ["experiment", "model", "task", "method"]
MISSING = "—"


# Settings added after runs were recorded, with the value that reproduces the older behaviour: a record without
# the key and one with this value are the same setting (as ``rundir.config_differences`` treats them).
ADDED_DEFAULTS = {"train.select_on": "loss", "train.select_from": 0, "train.lm_reduction": "example",
                  "method.calibration": "none", "method.adapter.freeze_head": False, "method.adapter.train_head": False,
                  "train.gradient_checkpointing": False, "eval.from": None,
                  "method.demonstrations.protocol": "shared", "method.optimizer.grad_clip": None,
                  "data.dev_at_most_half": True, "method.optimizer.divide_by_rank": True}


def setting_of(config: dict[str, Any]) -> dict[str, Any]:
    """The hyper-parameters of a run: what decides its numbers (``rundir.result_settings``: no paths, logging
    keys, experiment plan or the other model family's prompt format), without its seeds and label, and without
    later-added keys at their old-behaviour value (``ADDED_DEFAULTS``)."""
    return {k: v for k, v in sorted(result_settings(config).items())
            if k not in SEED_KEYS | LABEL_KEYS and not (k in ADDED_DEFAULTS and v == ADDED_DEFAULTS[k])}


def setting_id(setting: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(setting, sort_keys=True, default=str).encode()).hexdigest()[:10]


def load_results(paths: Iterable[Path]) -> pd.DataFrame:
    """One row per result.json under the given folders (or files)."""
    rows = []
    for root in paths:
        root = Path(root)
        files = [root] if root.is_file() else sorted(root.rglob("result.json"))
        for path in files:
            record = read_record(path)
            if record is None:
                continue
            config = record.get("config") or {}
            setting = setting_of(config)
            flat = flatten(config)
            rows.append(
                {
                    "experiment": record.get("experiment") or "adhoc",
                    "model": record.get("model"),
                    "task": record.get("task"),
                    "method": record.get("method"),
                    "seed": record.get("seed"),
                    "data_seed": flat.get("data.kshot_seed", flat.get("data.seed")),
                    "status": record.get("status"),
                    "dev": main_score(record, "dev"),
                    "dev_loss": record.get("dev_loss"),
                    "test": main_score(record, "test"),
                    "peak_mem_mb": record.get("peak_mem_mb"),
                    "forward_passes": record.get("forward_passes"),
                    "setting": setting_id(setting),
                    "commit": (record.get("git") or {}).get("commit"),
                    "path": str(path.parent),
                }
            )
    columns = GROUP + ["seed", "data_seed", "status", "dev", "dev_loss", "test", "peak_mem_mb", "forward_passes", "setting",
                       "commit", "path"]
    return pd.DataFrame(rows, columns=columns)


def select_on_dev(results: pd.DataFrame) -> pd.DataFrame:
    """Per group: the setting with the best mean dev metric, its test mean/std over seeds, and divergences.

    Settings are compared on the seeds they all ran (a grid run at one seed, then the chosen setting at more
    seeds, is selected on that one seed, not on the chosen setting's later seeds); ties go to the lower mean
    dev loss, then to the setting listed first.
    """
    done = results[results["status"].isin(["finished", "diverged", "stalled"])]
    out = []
    for key, group in done.groupby(GROUP, sort=True):
        seeds = [set(g["seed"]) for _, g in group.groupby("setting")]
        shared = set.intersection(*seeds)
        compared = group[group["seed"].isin(shared)] if shared else group
        by_setting = compared.groupby("setting", sort=False).agg(dev=("dev", "mean"), dev_loss=("dev_loss", "mean"))
        ranked = by_setting.assign(neg=-by_setting["dev"]).sort_values(["neg", "dev_loss"], kind="stable", na_position="last")
        best = ranked.index[0]
        chosen = group[group["setting"] == best]
        out.append(
            {
                **dict(zip(GROUP, key)),
                "setting": best,
                "settings_tried": len(by_setting),
                "runs": len(chosen),
                "diverged": int((chosen["status"] == "diverged").sum()),
                "diverged_all": int((group["status"] == "diverged").sum()),
                "dev_mean": chosen["dev"].mean(),
                "test_mean": chosen["test"].mean(),
                # ddof = 1: the seeds sample the runs one could make; with 3-5 of them ddof = 0 understates the spread
                "test_std": chosen["test"].std(ddof=1) if len(chosen) > 1 else float("nan"),
                **_intervals(chosen),
                "peak_mem_mb": chosen["peak_mem_mb"].max(),
            }
        )
    return pd.DataFrame(out)


def _intervals(chosen: pd.DataFrame) -> dict[str, Any]:
    """95 % intervals of a cell's test metric and its code versions. Where every run kept its per-example
    predictions on the same examples, the headline interval (test_lo, test_hi) resamples seeds, then examples
    within them (``stats.hierarchical_interval``), and test_boot_* is the examples-only bootstrap (seeds held
    fixed); otherwise the headline is the Student-t interval over seeds (``interval`` says which)."""
    t = stats.t_interval(list(chosen["test"]), bounds=(0.0, 1.0))
    boot = stats.Interval(float("nan"), float("nan"), float("nan"), 0)
    lo, hi, kind = t.lo, t.hi, "t"
    matrix = correct_on_test(list(chosen["path"]))
    if matrix is not None:
        boot = stats.bootstrap_interval(matrix, n_boot=2000, seed=0)
        both = stats.hierarchical_interval(matrix, n_boot=2000, seed=0)
        lo, hi, kind = both.lo, both.hi, "seeds+examples"
    commits = sorted({str(c)[:7] for c in chosen["commit"] if c})
    return {"test_lo": lo, "test_hi": hi, "interval": kind, "test_t_lo": t.lo, "test_t_hi": t.hi,
            "test_boot_lo": boot.lo, "test_boot_hi": boot.hi, "commits": " ".join(commits)}


def correct_on_test(paths: list[str]) -> "np.ndarray | None":
    """(runs x examples) per-example test scores (correct 0/1, or F1) from predictions/test.csv; None unless every
    run has them and they cover the same examples."""
    import numpy as np

    rows, values = None, []
    for path in paths:
        try:
            with open(Path(path) / "predictions" / "test.csv", newline="") as f:
                kept = list(csv.DictReader(f))
        except OSError:
            return None
        these = [r["row"] for r in kept]
        if not kept or (rows is not None and these != rows):
            return None
        rows = these
        column = "f1" if "f1" in kept[0] else "correct"
        values.append([float(r[column]) for r in kept])
    return np.array(values) if values else None


# The published-numbers file (results/paper_numbers.csv): one number per row, with where it was read.
PAPER_COLUMNS = {
    "experiment": "the table of ours it goes beside (conf/experiment/<name>.yaml), or 'memory'",
    "model": "the model it was measured on",
    "task": "the task's name here",
    "method": "the method's name here",
    "value": "the published number (x100 for accuracy and F1)",
    "std": "the published standard deviation; empty where the source gives none",
    "metric": "accuracy, f1, peak_mem_gb, ...",
    "source": "the publication",
    "table": "where in it ('Table 18'; 'table not known')",
    "confirmed": "yes: read from the publication itself; no: from a secondary summary or off a plot",
    "note": "how an unconfirmed number was obtained, the source's own row names, ...; may be empty",
}
OPTIONAL_COLUMNS = {"std", "note"}
# One footnote mark per source in a table (Unicode has no superscript q).
MARKS = "ᵃᵇᶜᵈᵉᶠᵍʰⁱʲᵏˡᵐⁿᵒᵖʳˢᵗᵘᵛʷˣʸᶻ"
MARK_LETTERS = "abcdefghijklmnoprstuvwxyz"


def paper_numbers_file() -> Path:
    """results/paper_numbers.csv under the current folder (a checkout), else the copy an installed package ships
    (``adazeta/reference``, setup.py)."""
    here = Path("results", "paper_numbers.csv")
    packaged = Path(__file__).resolve().parents[1] / "reference" / "paper_numbers.csv"
    return here if here.is_file() or not packaged.is_file() else packaged


def load_paper_numbers(path: Path) -> pd.DataFrame:
    """The published numbers, checked row by row: a bad row stops with one line naming the file and its line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such paper-numbers file (pass --paper PATH)")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        if sorted(header) != sorted(PAPER_COLUMNS):
            raise ConfigError(f"{path} line 1: the header must name the columns {','.join(PAPER_COLUMNS)}, "
                              f"got {','.join(header) or 'nothing'}")
        rows: list[dict[str, Any]] = []
        first_line: dict[tuple[str, ...], int] = {}
        for raw in reader:
            where = f"{path} line {reader.line_num}"
            row = _paper_row(raw, where)
            key = tuple(row[c] for c in ("experiment", "model", "task", "method", "source", "table"))
            if key in first_line:
                raise ConfigError(f"{where}: repeats line {first_line[key]} (same experiment, model, task, method, "
                                  f"source and table)")
            first_line[key] = reader.line_num
            rows.append(row)
    return pd.DataFrame(rows, columns=list(PAPER_COLUMNS))


def _paper_row(raw: dict[str | None, Any], where: str) -> dict[str, Any]:
    if None in raw or None in raw.values():
        raise ConfigError(f"{where}: expected {len(PAPER_COLUMNS)} fields ({','.join(PAPER_COLUMNS)})")
    row: dict[str, Any] = {k: v.strip() for k, v in raw.items()}
    for column, meaning in PAPER_COLUMNS.items():
        if column not in OPTIONAL_COLUMNS and not row[column]:
            raise ConfigError(f"{where}: {column} is empty; it holds {meaning}")
    if row["confirmed"] not in ("yes", "no"):
        raise ConfigError(f"{where}: confirmed must be 'yes' or 'no', got {row['confirmed']!r}")
    if row["confirmed"] == "no" and not row["note"]:
        raise ConfigError(f"{where}: an unconfirmed number needs a note saying how it was obtained")
    row["confirmed"] = row["confirmed"] == "yes"
    row["value"] = _paper_number(row, "value", where)
    row["std"] = _paper_number(row, "std", where) if row["std"] else float("nan")
    return row


def _paper_number(row: dict[str, Any], column: str, where: str) -> float:
    try:
        number = float(row[column])
    except ValueError:
        number = float("nan")
    if not math.isfinite(number) or (column == "std" and number < 0):
        raise ConfigError(f"{where}: {column} must be a finite number{' >= 0' if column == 'std' else ''}, "
                          f"got {row[column]!r}")
    return number


@dataclass(frozen=True)
class Source:
    """Where a published number was read; each distinct source in a table gets one footnote mark."""

    source: str
    table: str
    model: str
    confirmed: bool
    note: str

    def describe(self) -> str:
        text = f"{self.source}, {self.table}, {self.model}: {'confirmed' if self.confirmed else 'unconfirmed'}"
        return f"{text} ({self.note})" if self.note else text


@dataclass
class Table:
    """A methods x tasks grid of cell texts, and the sources its marks stand for (sources[i] is MARKS[i])."""

    cells: pd.DataFrame
    sources: list[Source]

    def legend(self) -> list[str]:
        lines = ["Ours: test mean of the setting selected on dev [95 % interval that resamples seeds, then test "
                 "examples within each (a two-level bootstrap), where every run kept its predictions; marked t: a "
                 "Student-t interval over the seeds alone, clipped to the metric's range, where they did not]; n: "
                 "runs (seeds); †n: n of them diverged; ‡: its runs come from more than one code version; **bold**: "
                 "the best mean of its column, only where its interval lies above every other method's; —: no "
                 "result."]
        if not self.sources:
            return lines + ["No published numbers for this experiment."]
        lines.append("(paper): the published value (its std where the source gives one); the mark names where it "
                     "was read. paper sources: the marks of the row; 'mixed' when they are more than one.")
        return lines + [f"{MARKS[i]} {source.describe()}" for i, source in enumerate(self.sources)]


def _cell(r: Any, bold: bool = False) -> str:
    """``mean [interval] n=runs †diverged ‡`` (``_intervals``: seeds then examples, or ``[..]t`` over seeds), the mean in bold
    when the column's ranking supports it (``_supported_best``)."""
    mean = r["test_mean"]
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return MISSING
    text = f"**{100 * mean:.1f}**" if bold else f"{100 * mean:.1f}"
    if not math.isnan(r.get("test_lo", math.nan)):
        text += f" [{100 * r['test_lo']:.1f}, {100 * r['test_hi']:.1f}]" + ("t" if r.get("interval") == "t" else "")
    text += f" n={int(r['runs'])}"
    if r["diverged"]:
        text += f" †{int(r['diverged'])}"
    if len(str(r.get("commits") or "").split()) > 1:
        text += " ‡"
    return text


def _supported_best(cells: pd.DataFrame) -> str | None:
    """The method whose mean is the column's best only when its interval over seeds lies above every other
    method's (both intervals need two or more seeds); otherwise no method is marked best."""
    ranked = cells.dropna(subset=["test_mean"]).sort_values("test_mean", ascending=False)
    if len(ranked) < 2:
        return None
    top, rest = ranked.iloc[0], ranked.iloc[1:]
    if math.isnan(top.get("test_lo", math.nan)) or rest["test_hi"].isna().any():
        return None
    return top["method"] if (top["test_lo"] > rest["test_hi"]).all() else None


def _published(value: float, std: float) -> str:
    return f"{value:.1f}" + ("" if math.isnan(std) else f" ({std:.1f})")


def build_table(
    selected: pd.DataFrame,
    paper: pd.DataFrame,
    experiment: str,
    methods: list[str] | None = None,
    tasks: list[str] | None = None,
) -> Table:
    """Methods x tasks: ours as "mean (std) †diverged" beside every published number for the cell, each marked.

    A cell with numbers from several sources lists the confirmed ones first; missing cells are "—". Without any
    published number for the experiment the paper columns are left out.
    """
    ours = selected[selected["experiment"] == experiment] if len(selected) else selected
    theirs = paper[paper["experiment"] == experiment] if len(paper) else paper
    methods = methods or sorted(set(ours.get("method", [])) | set(theirs.get("method", [])))
    tasks = tasks or sorted(set(ours.get("task", [])) | set(theirs.get("task", [])))
    sources: list[Source] = []
    rows = []
    shown = ours[ours["method"].isin(methods)] if len(ours) else ours
    best = {task: _supported_best(shown[shown["task"] == task]) if len(shown) else None for task in tasks}
    for method in methods:
        row: dict[str, str] = {"method": method}
        used: set[int] = set()
        for task in tasks:
            hit = ours[(ours["method"] == method) & (ours["task"] == task)] if len(ours) else ours
            if len(hit):
                row[task] = _cell(hit.iloc[0], bold=best[task] == method)
            else:
                row[task] = MISSING
            ref = theirs[(theirs["method"] == method) & (theirs["task"] == task)] if len(theirs) else theirs
            texts = []
            for r in ref.sort_values("confirmed", ascending=False, kind="stable").itertuples():
                source = Source(r.source, r.table, r.model, bool(r.confirmed), r.note)
                if source not in sources:
                    if len(sources) == len(MARKS):
                        raise ConfigError(f"{experiment}: more than {len(MARKS)} sources of published numbers in "
                                          f"one table")
                    sources.append(source)
                used.add(sources.index(source))
                texts.append(_published(r.value, r.std) + MARKS[sources.index(source)])
            row[f"{task} (paper)"] = "; ".join(texts) or MISSING
        marks = " ".join(MARKS[i] for i in sorted(used))
        row["paper sources"] = (marks + " mixed" if len(used) > 1 else marks) or MISSING
        rows.append(row)
    columns = ["method"] + [c for t in tasks for c in (t, f"{t} (paper)")] + ["paper sources"]
    if not sources:
        columns = ["method", *tasks]
    return Table(pd.DataFrame(rows, columns=columns), sources)


def to_markdown(table: Table) -> str:
    cells = table.cells
    header = "| " + " | ".join(cells.columns) + " |"
    rule = "|" + "|".join("---" for _ in cells.columns) + "|"
    body = ["| " + " | ".join(str(v) for v in row) + " |" for row in cells.itertuples(index=False)]
    legend = [f"- {line}" for line in table.legend()]
    return "\n".join([header, rule, *body, "", *legend]) + "\n"


def to_latex(table: Table, caption: str) -> str:
    def esc(text: Any) -> str:
        text = str(text)
        for char in "&%#_":
            text = text.replace(char, "\\" + char)
        text = text.replace("†", r"$^\dagger$").replace("—", "--")
        for mark, letter in zip(MARKS, MARK_LETTERS):
            text = text.replace(mark, rf"$^{{\mathrm{{{letter}}}}}$")
        return text

    cells = table.cells
    cols = "l" + "r" * (len(cells.columns) - 1)
    lines = [r"\begin{table}[t]", r"\centering", rf"\caption{{{esc(caption)}}}", rf"\begin{{tabular}}{{{cols}}}",
             r"\toprule", " & ".join(esc(c) for c in cells.columns) + r" \\", r"\midrule"]
    lines += [" & ".join(esc(v) for v in row) + r" \\" for row in cells.itertuples(index=False)]
    lines += [r"\bottomrule", r"\end{tabular}", r"\par\smallskip\footnotesize\raggedright"]
    lines += [esc(line) + r"\par" for line in table.legend()]
    lines += [r"\end{table}"]
    return "\n".join(lines) + "\n"
