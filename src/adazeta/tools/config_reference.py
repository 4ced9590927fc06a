"""The configuration reference, generated from the config tree: every group, option and key with its default and
its description.

    python -m adazeta.tools.config_reference docs     docs/configuration.md, optimizers.md, tasks.md (make docs)
    python -m adazeta.tools.config_reference --check                    exit 1 naming every key without a description

A key's description is its comment in the option file (on its line, or the comment lines right above it); where the
file has none, the comment of the field it fills in the typed config (``TaskSpec``, ``ModelConfig``, an optimizer's,
adapter's or schedule's registered dataclass, ...), so that a key shared by every option is described once. Keys
inside a free-form map (a model's ``architecture``, ``placements`` and ``tt_shapes``) are data that their map's
description covers. Experiment configs are designs, each described by its own header: they are listed, not their
keys. The test suite fails when a key has no description, and when docs/configuration.md is not this tool's output.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adazeta.paths import config_dir

KEY = re.compile(r"^(\s*)([A-Za-z_][\w@.-]*):(?:\s+(.*?))?\s*$")
FREE_MAPS = {"model": {"architecture", "placements", "tt_shapes"}}  # their children are data, not keys
RUN_BLOCKS = ("train", "data", "divergence", "eval", "guard", "distributed", "wandb")
GROUPS = ("model", "task", "method", "adapter", "optimizer", "schedule")

# Keys every method option has, which no dataclass holds (a method is its options' composition).
METHOD_KEYS = {
    "name": "the method's name: labels the run, its folder and its table row (an experiment arm renames it)",
    "optimizer": "the optimizer option composed at method.optimizer (conf/optimizer/); null: the method trains nothing",
    "adapter": "the trainable set composed at method.adapter (conf/adapter/): its options override the adapter's",
    "calibration": "none | contextual (content-free inputs, Zhao et al. 2021) | prior (a bias per candidate fitted "
                   "on dev): adazeta/scoring/calibration.py",
    "demonstrations": "in-context demonstrations: how many, their separator, their seed and protocol",
    "probe": "the linear probe: its C grid on dev, standardisation, iterations and variant",
}
RUN_LEVEL = {"train": "the loop: length, batch, evaluations, checkpoints, what is kept",
             "data": "the data sample: sizes, seed, local folder, k-shot protocol",
             "divergence": "when a run is recorded as diverged", "eval": "method=eval: which saved run it scores",
             "guard": "numerical guards on the update", "distributed": "one run on several processes",
             "wandb": "the wandb sink (offline without credentials)", "hydra": "Hydra's own settings (run folders)"}


@dataclass
class Key:
    path: str  # dotted, within the option (e.g. causal.template)
    default: str
    description: str | None


def comments_of(text: str) -> list[tuple[str, str, str | None]]:
    """(dotted key, its value as written, its comment) for every mapping key of a YAML file, in file order; the keys
    of a top-level ``defaults:`` list are left out. A comment is the one on the key's line (with the comment-only
    lines indented under it that continue it) or the comment lines directly above the key; the file's header (the
    comments before its first key) describes the file, not its first key."""
    out: list[tuple[str, str, str | None]] = []
    stack: list[tuple[int, str]] = []
    above: list[str] = []
    in_defaults = seen_key = False
    last_inline: tuple[int, int] | None = None  # (index in out, indent of its key) while its comment may continue
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            above, last_inline = [], None
            continue
        if stripped.startswith("#"):
            indent = len(line) - len(line.lstrip())
            if last_inline is not None and indent > last_inline[1] + 2:  # a continuation of the comment above
                i = last_inline[0]
                key, value, comment = out[i]
                out[i] = (key, value, f"{comment} {stripped.lstrip('#').strip()}")
            elif seen_key:
                above.append(stripped.lstrip("#").strip())
                last_inline = None
            continue
        match = KEY.match(line)
        if stripped.startswith("-") or match is None:
            above, last_inline = [], None
            continue
        seen_key = True
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3) or ""
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if indent == 0:
            in_defaults = key == "defaults"
        stack.append((indent, key))
        value, _, comment = _split_comment(rest)
        last_inline = None
        if not in_defaults:
            out.append((".".join(k for _, k in stack), value, comment or (" ".join(above) if above else None) or None))
            if comment:
                last_inline = (len(out) - 1, indent)
        above = []
    return out


def _split_comment(rest: str) -> tuple[str, str, str]:
    """``value  # comment`` -> (value, '#', comment), a # inside quotes kept in the value."""
    quote = None
    for i, char in enumerate(rest):
        if char in "'\"" and (quote is None or quote == char):
            quote = None if quote == char else char
        elif char == "#" and quote is None and (i == 0 or rest[i - 1].isspace()):
            return rest[:i].strip(), "#", rest[i + 1:].strip()
    return rest.strip(), "", ""


def field_comments(cls: type) -> dict[str, str]:
    """A dataclass's field comments, from its source: ``name: type = default  # comment`` or comment lines above."""
    out: dict[str, str] = {}
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return out
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    above: list[str] = []
    for line in source.splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        match = re.match(r"^\s+(\w+)\s*:[^=#]*(?:=[^#]*)?(?:#\s*(.*))?$", line)
        if match and match.group(1) in names:
            text = match.group(2) or " ".join(above)
            if text:
                out.setdefault(match.group(1), text)
        above = []
    for base in cls.__mro__[1:]:
        if dataclasses.is_dataclass(base):
            for name, text in field_comments(base).items():
                out.setdefault(name, text)
    return out


def _catalogue(group: str, values: dict[str, str]) -> dict[str, str]:
    """Descriptions from the typed config that ``group``'s option fills, by dotted key."""
    import adazeta.settings  # noqa: F401  (registers every optimizer, adapter and schedule)
    from adazeta.registry import ADAPTERS, OPTIMIZERS, SCHEDULES

    out: dict[str, str] = {}

    def add(prefix: str, cls: type) -> None:
        for name, text in field_comments(cls).items():
            out.setdefault(f"{prefix}{name}", text)

    if group == "task":
        from adazeta.tasks.spec import HubSource, LocalSource, MaskedData, PromptFormat, TaskSpec

        add("", TaskSpec)
        for prefix, cls in (("hub.", HubSource), ("local.", LocalSource), ("causal.", PromptFormat),
                            ("masked.", PromptFormat), ("masked_data.", MaskedData),
                            ("masked_data.local.", LocalSource), ("masked_data.hub.", HubSource)):
            add(prefix, cls)
    elif group == "model":
        from adazeta.models import ModelConfig

        add("", ModelConfig)
        defaults = Path(config_dir()) / "model_defaults.yaml"
        for key, _, text in comments_of(defaults.read_text()):
            if text:
                out.setdefault(key, text)
    elif group in ("optimizer", "adapter", "schedule"):
        registry = {"optimizer": OPTIMIZERS, "adapter": ADAPTERS, "schedule": SCHEDULES}[group]
        kind = values.get("kind") or values.get("name")
        if kind and kind in registry:
            add("", registry.get(kind).config_cls)
        out.setdefault("kind", f"which registered {group} this option builds")
        out.setdefault("name", f"which registered {group} this option builds")
    elif group == "method":
        out.update(METHOD_KEYS)
    return out


def option_keys(group: str, path: Path) -> list[Key]:
    entries = comments_of(path.read_text())
    values = {k: v for k, v, _ in entries}
    catalogue = _catalogue(group, values)
    free = FREE_MAPS.get(group, set())
    keys = []
    for key, value, text in entries:
        top = key.split(".")[0]
        if top in free and "." in key:
            continue  # data inside a free-form map: its map's description covers it
        keys.append(Key(key, value, text or catalogue.get(key)))
    return keys


def run_level_keys(path: Path) -> list[Key]:
    keys = []
    for key, value, text in comments_of(path.read_text()):
        if key.split(".")[0] == "hydra" and key != "hydra":
            continue  # Hydra's own settings: its documentation's
        keys.append(Key(key, value, text or RUN_LEVEL.get(key)))
    return keys


def _header(path: Path) -> str:
    """The first comment paragraph of a file (its own description)."""
    lines = []
    for line in path.read_text().splitlines():
        if line.startswith("# @package"):
            continue
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines).split(" PRE-REGISTERED")[0].strip()


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ") if text not in (None, "") else ""


def _table(keys: list[Key]) -> list[str]:
    rows = ["| key | default | description |", "|---|---|---|"]
    rows += [f"| `{k.path}` | `{_cell(k.default)}` | {_cell(k.description) or '**undescribed**'} |" if k.default
             else f"| `{k.path}` | | {_cell(k.description) or '**undescribed**'} |" for k in keys]
    return rows + [""]


def missing() -> list[str]:
    """Every key (file: key) without a description."""
    conf = Path(config_dir())
    out = [f"config.yaml: {k.path}" for k in run_level_keys(conf / "config.yaml") if not k.description]
    for group in GROUPS:
        for path in sorted((conf / group).glob("*.yaml")):
            out += [f"{group}/{path.name}: {k.path}" for k in option_keys(group, path) if not k.description]
    return out


def render() -> str:
    conf = Path(config_dir())
    lines = ["# Configuration reference", "",
             "Generated from the config tree by `python -m adazeta.tools.config_reference` (`make docs`): every "
             "group, option and key, with its default and its description. Change a key's comment in its YAML file "
             "(or the field's comment in its typed config), not this page: a test fails when they differ.", "",
             "Compose with `group=option` on the command line and change any key with `key=value` "
             "(`adazeta-run method=adazeta method.optimizer.lr=3e-4 train.max_steps=200`); "
             "`adazeta-run --cfg job ...` prints the composed result.", "",
             "## Run-level keys (`conf/config.yaml`)", "", *_table(run_level_keys(conf / "config.yaml"))]
    for group in GROUPS:
        options = sorted((conf / group).glob("*.yaml"))
        lines += [f"## `{group}`", "", f"Options: {', '.join(f'`{p.stem}`' for p in options)}. Composed at "
                  f"`{'method.' + group if group in ('adapter', 'optimizer') else group}`.", ""]
        for path in options:
            lines += [f"### `{group}={path.stem}`", ""]
            header = _header(path)
            if header:
                lines += [header, ""]
            lines += _table(option_keys(group, path))
    experiments = sorted((conf / "experiment").glob("*.yaml"))
    lines += ["## `experiment`", "", "A block of the paper or a study: its arms, grid, seeds and endpoints "
              "(`adazeta.experiments`). Each file's header is its design; the studies are in `studies/`.", "",
              "| option | what it is |", "|---|---|"]
    lines += [f"| `{p.stem}` | {_cell(_header(p)[:300])}{'...' if len(_header(p)) > 300 else ''} |" for p in experiments]
    return "\n".join(lines) + "\n"


# What each optimizer keeps between steps, beside the weights (the dry run's ``optimizer_state`` estimates it; its
# ``step_temporaries``, what one step holds while it runs).
STATE = {"zo_sgd": "none: each direction is regenerated from its seed", "zo_sign": "none",
         "zo_momentum": "one buffer the size of the trained weights",
         "zo_cons": "none kept between steps; during a step, a copy of the trained weights (the point the "
                    "candidates return to)",
         "zo_adam": "two buffers the size of the trained weights (at least float32) and a step count",
         "es": "none", "forward_grad": "none (a jvp's tangents live only during the step)",
         "hizoo": "one buffer (the diagonal Hessian) the size of the trained weights, at least float32",
         "lozo": "none: V is redrawn from (seed, window) each step",
         "zo_muon": "none: the subspace P is redrawn from (seed, window) each step",
         "sparse_zo_sgd": "the magnitude mask, one bit per trained weight (none for the random mask)",
         "adamw": "two buffers the size of the trained weights and a step count"}
ZO_SGD = """MeZO's zeroth-order SGD (Malladi et al., NeurIPS 2023; reference code princeton-nlp/MeZO, and the AdaZeta
reference code yifanycc/AdaZeta for Q > 1): Q seeded Gaussian directions z_q on one minibatch,

    g_q = (L(w + eps z_q) - L(w - eps z_q)) / (2 eps)            (one_sided: (L(w + eps z_q) - L(w)) / eps)
    w <- w - lr ((1/Q) sum_q g_q z_q + wd w)                     (reduction=sum: the sum over queries)

with the seed trick (directions regenerated from (run seed, step, query), never stored), in-place perturbation,
and optionally batched queries (one forward over Q replicas). Deviations from the reference: the directions come
from local generators seeded per query rather than the global RNG; the mean over queries is the AdaZeta code's
reduction (its paper writes a sum)."""
ADAMW = """First-order AdamW (torch's), for FT, LoRA and the adapters: the global gradient norm clipped to ``grad_clip``
first when it is set (the Hugging Face Trainer's max_grad_norm 1.0), decoupled weight decay on weights only."""


def render_optimizers() -> str:
    """The optimizers page: each registered optimizer's rule, source and deviations (its module's docstring) and
    what it keeps between steps."""
    import importlib

    import adazeta.settings  # noqa: F401
    from adazeta.registry import OPTIMIZERS

    lines = ["# Optimizers", "",
             "Generated by `python -m adazeta.tools.config_reference` from each optimizer's own documentation (its "
             "module's docstring: the update rule, the paper, the reference code and every declared deviation). "
             "Any method trains with any of them: `optimizer@method.optimizer=<kind>`; their keys and defaults are "
             "in the [configuration reference](configuration.md).", "",
             "| kind | module | state kept between steps |", "|---|---|---|"]
    kinds = OPTIMIZERS.names()
    modules = {k: OPTIMIZERS.get(k).builder.__module__ for k in kinds}
    lines += [f"| `{k}` | `{modules[k]}` | {STATE.get(k, 'see below')} |" for k in kinds]
    for kind in kinds:
        doc = {"zo_sgd": ZO_SGD, "adamw": ADAMW}.get(kind) or inspect.getdoc(importlib.import_module(modules[kind]))
        lines += ["", f"## `{kind}`", "", f"State: {STATE.get(kind, 'see the text')}.", "", doc or ""]
    return "\n".join(lines) + "\n"


def render_tasks() -> str:
    """The tasks page: each task's protocol, files, template, candidates and metric, from conf/task."""
    import yaml

    conf = Path(config_dir())
    lines = ["# Tasks", "", "Generated by `python -m adazeta.tools.config_reference` from `conf/task/`. A task is data: "
             "its files, template, candidates and metric; a template that needs code names a hook "
             "(`src/adazeta/tasks/hooks.py`). How prompts become tokens and the two protocols: "
             "[Methods](methods.md).", "",
             "Decoders follow MeZO's protocol: `data.num_train` (1,000) and `data.num_dev` (500; a task's `num_dev` "
             "overrides it) drawn from the train split with `data.seed`, up to `data.num_eval` (1,000) test examples "
             "from the validation split; a split smaller than asked is taken whole and the counts used are recorded. "
             "Masked LMs follow LM-BFF's: `data.k` examples per class for train and for dev, data seeds 13, 21, 42, "
             "87, 100.", "",
             "| task | metric | objective | decoder template | candidates | masked template | dev | local files |",
             "|---|---|---|---|---|---|---|---|"]
    for path in sorted((conf / "task").glob("*.yaml")):
        spec = yaml.safe_load(path.read_text())
        causal, masked = spec.get("causal") or {}, spec.get("masked") or {}
        template = causal.get("template") or (f"(hook: {causal['hook']})" if causal.get("hook") else "")
        local = (spec.get("local") or {}).get("dir") or ((spec.get("masked_data") or {}).get("local") or {}).get("dir")
        lines.append(" | ".join([f"| `{spec['name']}`", spec.get("metric", "accuracy"),
                                 spec.get("objective", "classification"), f"`{_cell(repr(template)[1:-1])}`" if template else "",
                                 _cell(", ".join(f"`{c!r}`" for c in causal.get("candidates") or [])),
                                 f"`{_cell(masked.get('template'))}`" if masked.get("template") else "",
                                 str(spec.get("num_dev") or "data.num_dev"), f"`{local}`" if local else "Hub only"]) + " |")
    return "\n".join(lines) + "\n"


PAGES = {"configuration.md": render, "optimizers.md": render_optimizers, "tasks.md": render_tasks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, help="the docs folder to write its generated pages in (docs)")
    parser.add_argument("--check", action="store_true", help="exit 1 naming every key without a description")
    args = parser.parse_args()
    gaps = missing()
    if args.check or gaps:
        for gap in gaps:
            print(f"config_reference: no description: {gap}", file=sys.stderr)
        if gaps:
            sys.exit(1)
    if args.out:
        for name, make in PAGES.items():
            (args.out / name).write_text(make())
            print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
