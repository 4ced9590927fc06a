"""Result tables: collect result records, select hyper-parameters on dev, aggregate test over seeds (SPEC §7-8).

Selection never looks at test: for each (experiment, model, task, method) the hyper-parameter setting with the
best mean dev metric over its seeds is chosen, and only then is its test metric reported, as mean and standard
deviation over seeds, with the number of runs that diverged.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

# Keys that say which run it is (seeds) or where things live, not which hyper-parameters were used.
SEED_KEYS = {"seed", "data.seed", "data.kshot_seed"}
IGNORED_KEYS = {"force", "dry_run", "experiment_name", "data.dir", "model.model_dir", "train.eval_batch_size"}
IGNORED_PREFIXES = ("wandb.", "hydra.")
GROUP = ["experiment", "model", "task", "method"]
MISSING = "—"


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def setting_of(config: dict[str, Any]) -> dict[str, Any]:
    """The hyper-parameters of a run: its flattened config without seeds, paths and logging keys."""
    flat = flatten(config)
    return {
        k: v
        for k, v in sorted(flat.items())
        if k not in SEED_KEYS and k not in IGNORED_KEYS and not k.startswith(IGNORED_PREFIXES)
    }


def setting_id(setting: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(setting, sort_keys=True, default=str).encode()).hexdigest()[:10]


def load_results(paths: Iterable[Path]) -> pd.DataFrame:
    """One row per result.json under the given folders (or files)."""
    rows = []
    for root in paths:
        root = Path(root)
        files = [root] if root.is_file() else sorted(root.rglob("result.json"))
        for path in files:
            record = json.loads(path.read_text())
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
                    "dev": record.get("dev_accuracy"),
                    "dev_loss": record.get("dev_loss"),
                    "test": record.get("test_accuracy"),
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
    done = results[results["status"].isin(["finished", "diverged"])]
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
                "test_std": chosen["test"].std(ddof=0) if len(chosen) > 1 else float("nan"),
                "peak_mem_mb": chosen["peak_mem_mb"].max(),
            }
        )
    return pd.DataFrame(out)


def load_paper_numbers(path: Path) -> pd.DataFrame:
    return pd.read_csv(path, dtype={"std": float})


def _cell(mean: float, std: float, diverged: int) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return MISSING
    text = f"{100 * mean:.1f}"
    if not math.isnan(std):
        text += f" ({100 * std:.1f})"
    if diverged:
        text += f" †{diverged}"
    return text


def build_table(
    selected: pd.DataFrame,
    paper: pd.DataFrame,
    experiment: str,
    methods: list[str] | None = None,
    tasks: list[str] | None = None,
) -> pd.DataFrame:
    """Methods x tasks: ours as "mean (std) †diverged" beside the paper's number; missing cells are "—"."""
    ours = selected[selected["experiment"] == experiment] if len(selected) else selected
    theirs = paper[paper["table"] == experiment] if len(paper) else paper
    methods = methods or sorted(set(ours.get("method", [])) | set(theirs.get("method", [])))
    tasks = tasks or sorted(set(ours.get("task", [])) | set(theirs.get("task", [])))
    rows = []
    for method in methods:
        row: dict[str, str] = {"method": method}
        for task in tasks:
            hit = ours[(ours["method"] == method) & (ours["task"] == task)] if len(ours) else ours
            if len(hit):
                r = hit.iloc[0]
                row[task] = _cell(r["test_mean"], r["test_std"], int(r["diverged"]))
            else:
                row[task] = MISSING
            ref = theirs[(theirs["method"] == method) & (theirs["task"] == task)] if len(theirs) else theirs
            row[f"{task} (paper)"] = f"{ref.iloc[0]['value']:.1f}" if len(ref) else MISSING
        rows.append(row)
    return pd.DataFrame(rows, columns=["method"] + [c for t in tasks for c in (t, f"{t} (paper)")])


def to_markdown(table: pd.DataFrame) -> str:
    header = "| " + " | ".join(table.columns) + " |"
    rule = "|" + "|".join("---" for _ in table.columns) + "|"
    body = ["| " + " | ".join(str(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join([header, rule, *body]) + "\n"


def to_latex(table: pd.DataFrame, caption: str) -> str:
    def esc(text: Any) -> str:
        return str(text).replace("_", r"\_").replace("†", r"$^\dagger$").replace("—", "--")

    cols = "l" + "r" * (len(table.columns) - 1)
    lines = [r"\begin{table}[t]", r"\centering", rf"\caption{{{esc(caption)}}}", rf"\begin{{tabular}}{{{cols}}}",
             r"\toprule", " & ".join(esc(c) for c in table.columns) + r" \\", r"\midrule"]
    lines += [" & ".join(esc(v) for v in row) + r" \\" for row in table.itertuples(index=False)]
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines) + "\n"
