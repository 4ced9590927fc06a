"""Command-line overrides checked before Hydra runs them: one line with "did you mean" instead of Hydra's report.

Hydra reports a mistyped group option (``method=adazet``) or an unknown key (``train.foo=1``) in several lines and
exits 1, and one bad value in a sweep list refuses the whole sweep. Here every override is composed first, the
way ``adazeta-run`` would compose it: a mistake in a single run is one line and exit status 2; in a sweep, the
values that cannot compose are left out (one line each) and the rest of the sweep runs.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path

FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                    "--config-dir", "-cd", "--info", "-i", "--experimental-rerun"}
MULTIRUN = {"-m", "--multirun"}


@dataclass
class Checked:
    """The command line to hand to Hydra, and the problems found (each one line)."""

    argv: list[str]
    errors: list[str] = field(default_factory=list)  # a run cannot start: exit 2
    dropped: list[str] = field(default_factory=list)  # sweep values left out: the sweep runs without them
    sweep_dir: Path | None = None  # a sweep's directory, where its jobs report the points that failed


def _suggest(word: str, known: list[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def split_args(argv: list[str]) -> tuple[list[str], list[int]]:
    """(the overrides, their positions in argv): everything that is not a flag or a flag's value."""
    overrides, where = [], []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in FLAGS_WITH_VALUE:
            skip = True
            continue
        if arg.startswith("-"):
            continue
        overrides.append(arg)
        where.append(i)
    return overrides, where


def explain(error: Exception, override: str, config_dir: str, base: list[str]) -> str:
    """One line for a composition error caused by ``override``."""
    from hydra.errors import MissingConfigException

    key = override.split("=", 1)[0].lstrip("+~")
    value = override.split("=", 1)[1] if "=" in override else ""
    if isinstance(error, MissingConfigException) or "Could not find" in str(error):
        group = key.split("@")[0]
        options = sorted(p.stem for p in (Path(config_dir) / group).glob("*.yaml"))
        if options:
            return f"{override}: {group} has no option {value!r}; known: {', '.join(options)}{_suggest(value, options)}"
        return f"{override}: no config group {group!r}{_suggest(group, _groups(config_dir))}"
    text = str(error)
    if "Could not override" in text and "@" not in key and _method_part(config_dir, key):
        return f"{override}: {key} is part of the method; choose it with {key}@method.{key}={value}"
    if "not in struct" in text or "Could not override" in text or "Could not append" in text:
        parent, _, leaf = key.rpartition(".")
        known = _keys_at(config_dir, base, parent)
        if known is not None:
            where = parent or "the config"
            return (f"{override}: {where} has no key {leaf!r}; known: {', '.join(known)}{_suggest(leaf, known)}")
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    return f"{override}: {first}"


def _method_part(config_dir: str, group: str) -> bool:
    """A group whose options a method places inside itself (``- /adapter@adapter: tt`` in conf/method/*.yaml)."""
    return any(f"/{group}@{group}:" in p.read_text() for p in (Path(config_dir) / "method").glob("*.yaml"))


def _groups(config_dir: str) -> list[str]:
    return sorted(p.name for p in Path(config_dir).iterdir() if p.is_dir())


def _keys_at(config_dir: str, base: list[str], path: str) -> list[str] | None:
    from hydra import compose, initialize_config_dir
    from omegaconf import DictConfig, OmegaConf

    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            cfg = compose(config_name="config", overrides=base)
        node = OmegaConf.select(cfg, path) if path else cfg
    except Exception:
        return None
    return sorted(str(k) for k in node.keys()) if isinstance(node, DictConfig) else None


def output_dir(config_dir: str, base: list[str], multirun: bool) -> Path | None:
    """The run (or sweep) directory the command will write to, resolved now; None if only Hydra can resolve it."""
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            cfg = compose(config_name="config", overrides=base, return_hydra_config=True)
            return Path(str(cfg.hydra.sweep.dir if multirun else cfg.hydra.run.dir))
    except Exception:  # a directory built from run-time values (hydra.job.*)
        return None


def _unwritable_output(target: Path | None, multirun: bool) -> str | None:
    """One line when the run (or sweep) directory cannot be created: Hydra would fail there with a traceback."""
    import os

    key = "sweep.dir" if multirun else "run.dir"
    if target is None:
        return None
    existing = next((p for p in [target, *target.parents] if os.path.lexists(p)), None)
    if existing is None:
        return None
    if not existing.is_dir():
        return f"hydra.{key}={target}: cannot write the run directory: {existing} is a file; choose another hydra.{key}"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"hydra.{key}={target}: cannot write the run directory: {existing} is not writable; choose another hydra.{key}"
    return None


def _compose_error(config_dir: str, overrides: list[str]) -> Exception | None:
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            compose(config_name="config", overrides=overrides)
    except Exception as err:  # every Hydra/OmegaConf composition error
        return err
    return None


def check(argv: list[str], config_dir: str) -> Checked:
    """Compose the command's overrides (each sweep value on its own) and report what would fail, in one line each."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if any(a in ("--help", "-h", "--hydra-help", "--version", "--shell-completion", "-sc") for a in argv):
        return Checked(list(argv))
    overrides, where = split_args(argv)
    if not overrides:
        return Checked(list(argv))
    multirun = any(a in MULTIRUN for a in argv)
    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            parsed.append(parser.parse_overrides([text])[0])
        except Exception as err:
            first = next((l.strip() for l in str(err).splitlines() if l.strip()), "cannot be parsed")
            return Checked(list(argv), errors=[f"{text}: {first}"])
    base = [p.input_line for p in parsed if not p.is_sweep_override()]
    sweeps = [p for p in parsed if p.is_sweep_override()]
    if sweeps and not multirun:
        return Checked(list(argv), errors=[f"{sweeps[0].input_line} lists several values: add -m to run each of them"])
    error = _compose_error(config_dir, base)
    if error is not None:
        # Find the override to blame: the first one that fails with the ones before it.
        for n in range(1, len(base) + 1):
            err = _compose_error(config_dir, base[:n])
            if err is not None:
                return Checked(list(argv), errors=[explain(err, base[n - 1], config_dir, base[: n - 1])])
        return Checked(list(argv), errors=[explain(error, base[-1], config_dir, base[:-1])])
    target = output_dir(config_dir, base, multirun)
    problem = _unwritable_output(target, multirun)
    if problem:
        return Checked(list(argv), errors=[problem])
    new_argv, dropped = list(argv), []
    for sweep, position in zip(sweeps, [where[overrides.index(s.input_line)] for s in sweeps]):
        key = sweep.get_key_element()
        good = []
        for value in sweep.sweep_string_iterator():
            one = f"{key}={value}"
            err = _compose_error(config_dir, base + [one])
            if err is None:
                good.append(value)
            else:
                dropped.append(explain(err, one, config_dir, base))
        if not good:
            return Checked(list(argv), errors=dropped)
        new_argv[position] = f"{key}={','.join(good)}"
    if multirun and target is not None:
        # Resolved once, here, so that the jobs and the summary at the end agree on it (``${now:...}`` moves on).
        new_argv = [a for a in new_argv if not a.startswith("hydra.sweep.dir=")] + [f"hydra.sweep.dir={target}"]
    return Checked(new_argv, dropped=dropped, sweep_dir=target if multirun else None)
