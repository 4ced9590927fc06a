"""How far a run's trained set travelled from where it started, parameter group by parameter group.

    python -m adazeta.tools.displacement RUN_DIR [RUN_DIR ...] [--folder adapter|adapter_last] [--last N]
        [--out CSV]

For each run folder, rebuilds the trainable set as the run built it at step 0 (the run's recorded config, the same
seed, the same calls in the same order as ``adazeta.run``: ``seed_everything``, ``load_model``, the adapter), loads
the saved adapters of ``RUN_DIR/<folder>`` into it, and prints, for each parameter group (a parameter's name with
its layer indices as ``*``; with ``--last N``, its last N parts only): its entries, the RMS of an entry at step 0
and in the saved state, the RMS of an entry's displacement, and that displacement over sqrt(steps), where steps
are the saved state's (the best-dev step for ``adapter`` when the run kept its best state, the last step for
``adapter_last``).

The last column tells drift from a random walk. A rule that moves each entry by +-lr a step in directions that do
not agree from step to step (ZO-SGD-Sign, the first steps of ZO-Adam) ends at RMS displacement lr sqrt(steps), so
the column reads lr; a consistent direction makes it grow like lr sqrt(steps). A group that starts at zero (the
identity init's last ``up`` core and ``up`` bias, LoRA's B) has displacement equal to its saved RMS.

Runs of methods that train the backbone save no adapters and are refused in one line; so is a run folder whose
recorded config, model or saved adapters cannot be found. ``--set key=value`` overrides a recorded config value
(``--set model.model_dir=/models`` when the model has moved since the run).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from adazeta.errors import ConfigError
from adazeta.tools import one_line_errors
from adazeta.tools.offline import use_shared

COLUMNS = ["run", "group", "entries", "rms_start", "rms_saved", "rms_displacement", "per_sqrt_step", "steps"]


@dataclass(frozen=True)
class Group:
    name: str
    entries: int
    rms_start: float
    rms_saved: float
    rms_displacement: float


def group_name(param: str, last: int | None = None) -> str:
    """A parameter's name with its layer indices as ``*`` (``model.layers.*.mlp.up_proj.adapter.up.cores.5``):
    the numbers that follow ``layers`` / ``h`` / ``blocks``, not a core's place in its train. ``last``: keep only
    the name's last ``last`` parts (3: ``up.cores.5``, ``lora_B.default.weight``), pooling every site."""
    name = re.sub(r"(\.(?:layers|h|blocks|layer)\.)\d+(?=\.)", r"\1*", param)
    return ".".join(name.split(".")[-last:]) if last else name


def run_settings(run_dir: Path, assignments: list[str]) -> Any:
    """The run's settings: its recorded config (``.hydra/config.yaml``) over today's defaults for the same
    command (``.hydra/overrides.yaml``), so that a key added since the run takes its default."""
    from omegaconf import OmegaConf

    from adazeta.build import compose_config
    from adazeta.settings import parse

    hydra = run_dir / ".hydra"
    if not (hydra / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} has no .hydra/config.yaml; point at a run folder that adazeta-run wrote")
    command = [str(o) for o in OmegaConf.load(hydra / "overrides.yaml")] if (hydra / "overrides.yaml").is_file() else []
    command = [o for o in command if not o.lstrip("+~").startswith("hydra.")]
    recorded = OmegaConf.load(hydra / "config.yaml")
    cfg = OmegaConf.merge(compose_config(command), recorded, OmegaConf.from_dotlist(assignments))
    return parse(cfg)


@dataclass(frozen=True)
class Saved:
    """A run folder's saved state, checked: its settings, its weights file and the step it holds."""
    settings: Any
    weights: Path
    steps: int


def check(run_dir: Path, folder: str = "adapter", assignments: Sequence[str] = ()) -> Saved:
    """Everything ``start_and_saved`` needs from the files, before any model is loaded: one line if it is missing."""
    from adazeta.runs.saving import ADAPTER_WEIGHTS

    result = run_dir / "result.json"
    s = run_settings(run_dir, list(assignments))
    if not result.is_file():
        raise ConfigError(f"{run_dir} has no result.json; the run has not ended")
    record = json.loads(result.read_text())
    if s.adapter.config.trains_backbone:
        raise ConfigError(f"{run_dir}: method {s.method!r} trains the backbone and saves no adapters; this tool "
                          "measures adapter runs")
    weights = run_dir / folder / ADAPTER_WEIGHTS  # adazeta's and peft's name alike
    if not weights.is_file():
        raise ConfigError(f"{run_dir / folder} holds no saved adapters; run with train.save=best (the default), last "
                          "or both, or pick the other folder with --folder")
    best = folder == "adapter" and s.train.keep_best and record.get("best_step") is not None
    return Saved(s, weights, int(record["best_step"] if best else record.get("steps", 0)))


def start_and_saved(run_dir: Path, folder: str = "adapter",
                    assignments: Sequence[str] = ()) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """(the trainable tensors at step 0, the saved ones, the saved state's step), by name."""
    from safetensors.torch import load_file

    from adazeta.build import attach_adapter, seed_everything
    from adazeta.models import load_model
    from adazeta.runs.saving import HEAD_WEIGHTS, load_into, is_peft, trainable_tensors
    from adazeta.tracking import quiet_third_party

    saved = check(run_dir, folder, assignments)
    s = saved.settings
    quiet_third_party(s.verbose)
    seed_everything(s.seed)  # as adazeta.run: the seed, the model, then the adapter's draws
    loaded = load_model(s.model, seed=s.seed)
    model = attach_adapter(s, loaded.model)
    start = {name: t.clone() for name, t in trainable_tensors(model).items()}  # on the CPU, the same storage
    if is_peft(model):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(saved.weights)))
        head = saved.weights.parent / HEAD_WEIGHTS
        if head.is_file():
            load_into(model, load_file(str(head)), head)
    else:
        load_into(model, load_file(str(saved.weights)), saved.weights)
    return start, trainable_tensors(model), saved.steps


def groups(start: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], last: int | None = None) -> list[Group]:
    """Entries and RMS per parameter group (``group_name``), in the order the parameters first come."""
    sums: dict[str, list[float]] = {}
    for name, s0 in start.items():
        s0, s1 = s0.double(), saved[name].double()
        acc = sums.setdefault(group_name(name, last), [0, 0.0, 0.0, 0.0])
        acc[0] += s0.numel()
        acc[1] += float(s0.pow(2).sum())
        acc[2] += float(s1.pow(2).sum())
        acc[3] += float((s1 - s0).pow(2).sum())
    return [Group(g, int(n), math.sqrt(a / n), math.sqrt(b / n), math.sqrt(d / n)) for g, (n, a, b, d) in sums.items()]


def total(rows: list[Group]) -> Group:
    n = sum(g.entries for g in rows)
    mean_sq = lambda f: math.sqrt(sum(f(g) ** 2 * g.entries for g in rows) / n)  # noqa: E731
    return Group("all", n, mean_sq(lambda g: g.rms_start), mean_sq(lambda g: g.rms_saved),
                 mean_sq(lambda g: g.rms_displacement))


def per_sqrt_step(g: Group, steps: int) -> float | None:
    return g.rms_displacement / math.sqrt(steps) if steps > 0 else None


@one_line_errors
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run folders (each with .hydra/, result.json and adapters)")
    p.add_argument("--folder", default="adapter", choices=("adapter", "adapter_last"),
                   help="the saved state to measure: the tested one (adapter) or the last one (adapter_last)")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recorded config value, e.g. model.model_dir=/models")
    p.add_argument("--last", type=int, metavar="N",
                   help="group by the last N parts of a name only (3: up.cores.5 pooled over every site)")
    p.add_argument("--out", type=Path, help="also write the rows to this CSV file")
    args = p.parse_args()
    use_shared()
    for run in args.runs:  # every folder checked before the first model is loaded
        check(run, args.folder, args.assignments)
    table = []
    for run in args.runs:
        start, saved, steps = start_and_saved(run, args.folder, args.assignments)
        rows = groups(start, saved, args.last)
        print(f"\n{run} ({args.folder}, step {steps})\n")
        print("| group | entries | RMS at step 0 | RMS saved | RMS displacement | displacement / sqrt(steps) |")
        print("|---|---:|---:|---:|---:|---:|")
        for g in [*rows, total(rows)]:
            ratio = per_sqrt_step(g, steps)
            print(f"| {g.name} | {g.entries:,} | {g.rms_start:.3g} | {g.rms_saved:.3g} | {g.rms_displacement:.3g} | "
                  f"{'—' if ratio is None else f'{ratio:.3g}'} |")
            table.append([str(run), g.name, g.entries, g.rms_start, g.rms_saved, g.rms_displacement,
                          "" if ratio is None else ratio, steps])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as f:
            csv.writer(f, lineterminator="\n").writerows([COLUMNS, *table])  # \n line ends, as every CSV here
        print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
