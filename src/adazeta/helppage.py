"""``adazeta-run --help``: one page a person reads, not a config dump.

The page's text is the Hydra help template (conf/hydra/help/adazeta.yaml, so that ``hydra.help.*`` overrides still
apply); this module fills in the config groups a user picks, each with a line saying what it chooses and its
options, the one the command would use starred; then the method's parts (``adapter``, ``optimizer``), each with
every option, swapped whole with ``adapter@method.adapter=OPTION``; then any other group the config tree (or
``--config-dir``) holds, so that no option goes unlisted. Internal groups (``experiment_method/*``, composed by an
experiment and a method together, and Hydra's ``hydra/*``) are left out.
"""

from __future__ import annotations

import string
import textwrap
from pathlib import Path
from typing import Any

from adazeta.overrides import Source

# (group, what choosing it means): the groups a user picks, in the order a command names them.
USER_GROUPS = (
    ("model", "the backbone (tiny-llama, tiny-roberta: random, built in memory, no file)"),
    ("task", "the dataset, its prompt template and metric"),
    ("method", "what trains and how: brings its adapter, optimizer and default schedule"),
    ("schedule", "ZO queries per step over training (a method's default unless given)"),
    ("experiment", "a block of the paper for -m: model, tasks, methods, grid and seeds"),
)
# The method's parts: (group, its key in Hydra's choices, what choosing it means).
METHOD_PARTS = (
    ("adapter", "adapter@method.adapter", "what a method trains; swap it: adapter@method.adapter=lora"),
    ("optimizer", "optimizer@method.optimizer", "how it trains; swap it: optimizer@method.optimizer=zo_adam"),
)
# Groups no command picks: composed by an experiment and a method together, and Hydra's own.
INTERNAL_GROUPS = ("experiment_method", "hydra")
WIDTH = 116


def _compose(source: Source, overrides: list[str]) -> Any:
    """The command's composed config with Hydra's node; the defaults' when the overrides do not compose."""
    try:
        return source.compose(overrides, hydra=True)
    except Exception:  # a mistyped override: the page is still printed (a run would report it in one line)
        return source.compose([], hydra=True)


def config_groups(source: Source) -> list[str]:
    """Every group a command can pick: each folder of option files in the config tree or ``--config-dir``, the
    internal ones aside."""
    dirs = [Path(source.config_dir)] + ([Path(source.extra_dir)] if source.extra_dir else [])
    return sorted({p.name for d in dirs if d.is_dir() for p in d.iterdir()
                   if p.is_dir() and p.name not in INTERNAL_GROUPS and any(p.glob("*.yaml"))})


def groups_text(source: Source, choices: dict[str, Any]) -> str:
    """Each user group: its name and meaning, then its options (wrapped), the chosen one starred; the method's
    parts; then the tree's other groups, so that every option of every group is listed."""
    known = [(g, g, m) for g, m in USER_GROUPS] + list(METHOD_PARTS)
    named = {g for g, _, _ in known}
    others = [(g, next((k for k in choices if k.startswith(f"{g}@")), g), f"one option per file in {g}/")
              for g in config_groups(source) if g not in named]
    lines = []
    for group, key, meaning in known + others:
        chosen = choices.get(key)
        options = [f"*{o}" if o == chosen else o for o in source.options(group)]
        if chosen is None:
            options.append("*null")
        lines.append(f"  {group:<12}{meaning}")
        lines += textwrap.wrap(", ".join(options), WIDTH, initial_indent=" " * 14, subsequent_indent=" " * 14,
                               break_on_hyphens=False)
    return "\n".join(lines) + "\n"


def render(source: Source, overrides: list[str]) -> str:
    """The help page for ``adazeta-run --help [overrides]``."""
    cfg = _compose(source, overrides)
    choices = dict(cfg.hydra.runtime.choices)
    template = string.Template(str(cfg.hydra.help.template))
    return template.safe_substitute(APP_CONFIG_GROUPS=groups_text(source, choices), CONFIG="", FLAGS_HELP="",
                                    HYDRA_CONFIG_GROUPS="")
