"""The command line checked before Hydra runs it: one line with the fix instead of Hydra's report.

Over 400 lines: one check of the whole command line (flags, options, keys, values, output folder) before Hydra.

Hydra reports a mistyped group option (``method=adazet``) or an unknown key (``train.foo=1``) in several lines and
exits 1, prints its usage for a bad flag, and one bad value in a sweep list refuses the whole sweep. Here the
flags are read with Hydra's own parser and every override is composed first, the way ``adazeta-run`` would
compose it: a mistake in a single run is one line and exit status 2; in a sweep, the values that cannot compose
are left out (one line each) and the rest of the sweep runs. A run's composed config (each point's, in a sweep)
is also resolved (``${...}``) and parsed into its typed settings here (``adazeta.settings.parse``), so that a bad
value is reported before Hydra creates the run directory, and not once per job of a sweep.
"""

from __future__ import annotations

import argparse
import ast
import copy
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MULTIRUN = {"-m", "--multirun"}
# Handed to Hydra as typed: its version, and shell completion (whose arguments, install=bash, are no overrides).
HANDED_OVER = {"--version", "--shell-completion", "-sc"}
# Hydra runs one of these per command.
MODES = {"run": "--run", "multirun": "--multirun", "cfg": "--cfg", "info": "--info",
         "shell_completion": "--shell-completion"}
# Names the reference scripts (MeZO's and AdaZeta's Hugging Face Trainer arguments) give to the keys here.
ALIASES = {
    "learning_rate": "method.optimizer.lr", "lr": "method.optimizer.lr", "zo_eps": "method.optimizer.eps",
    "eps": "method.optimizer.eps", "weight_decay": "method.optimizer.weight_decay",
    "per_device_train_batch_size": "train.batch_size", "batch_size": "train.batch_size",
    "max_steps": "train.max_steps", "eval_steps": "train.eval_every", "train_set_seed": "data.seed",
    "num_train": "data.num_train", "num_dev": "data.num_dev", "num_eval": "data.num_eval",
    "lora_r": "method.adapter.r", "lora_alpha": "method.adapter.alpha", "model_name": "model",
    "task_name": "task", "q": "schedule.q",
}


@dataclass
class Checked:
    """The command line to hand to Hydra, and the problems found (each one line)."""

    argv: list[str]
    errors: list[str] = field(default_factory=list)  # a run cannot start: exit 2
    dropped: list[str] = field(default_factory=list)  # sweep values left out: the sweep runs without them
    sweep_dir: Path | None = None  # a sweep's directory, where its jobs report the points that failed
    settings: Any = None  # a single run's typed settings, parsed here once (``adazeta.settings.Settings``)


@dataclass
class Source:
    """Where Hydra will read the config from: the config tree, the primary config, an extra search dir."""

    config_dir: str
    config_name: str = "config"
    extra_dir: str | None = None  # --config-dir
    _composed: dict[tuple[str, ...], Any] = field(default_factory=dict, repr=False, compare=False)

    def compose(self, overrides: list[str], hydra: bool = False) -> Any:
        """The config these overrides compose to, with Hydra's own node if ``hydra``; a copy: each command line is
        composed once per check (without the node, it is that composition less ``hydra``, as Hydra's compose
        returns it)."""
        from hydra import compose, initialize_config_dir
        from omegaconf import open_dict

        key = tuple(overrides)
        if key not in self._composed:
            if self.extra_dir is not None:
                overrides = [*overrides, f"hydra.searchpath=[file://{self.extra_dir}]"]
            with initialize_config_dir(config_dir=self.config_dir, version_base="1.3"):
                self._composed[key] = compose(config_name=self.config_name, overrides=overrides,
                                              return_hydra_config=True)
        cfg = copy.deepcopy(self._composed[key])
        if not hydra and "hydra" in cfg:
            with open_dict(cfg):
                del cfg["hydra"]
        return cfg

    def options(self, group: str) -> list[str]:
        dirs = [self.config_dir] + ([self.extra_dir] if self.extra_dir else [])
        found = {p.stem for d in dirs for p in (Path(d) / group).glob("*.yaml")}
        if group.startswith("hydra/"):  # Hydra's own groups and its plugins' (hydra/launcher=joblib) are not files here
            found |= set(self._hydra_loader(lambda loader: loader.get_group_options(group)))
        return sorted(found)

    def hydra_groups(self, parent: str = "hydra") -> list[str]:
        """Hydra's config groups below ``parent`` (``hydra/launcher``, ``hydra/sweeper``, ...), from its search path."""
        return sorted(f"{parent}/{name}" for name in self._hydra_loader(lambda loader: loader.list_groups(parent)))

    def _hydra_loader(self, read: Any) -> list[str]:
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        try:
            with initialize_config_dir(config_dir=self.config_dir, version_base="1.3"):
                return list(read(GlobalHydra.instance().config_loader()))
        except Exception:  # no answer from Hydra: the folders alone
            return []

    def is_group(self, name: str) -> bool:
        dirs = [self.config_dir] + ([self.extra_dir] if self.extra_dir else [])
        return name.startswith("hydra/") or any((Path(d) / name).is_dir() for d in dirs)


class _Usage(Exception):
    """A command line Hydra's argument parser refuses."""


def _suggest(word: str, known: list[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


# --- flags -----------------------------------------------------------------------------------------------------


def _flag_parser() -> argparse.ArgumentParser:
    """Hydra's own parser, raising instead of printing its usage; abbreviated flags are not taken."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    parser.allow_abbrev = False
    parser.exit_on_error = False

    def error(message: str) -> None:
        raise _Usage(message)

    parser.error = error  # type: ignore[method-assign]
    return parser


def _choices(parser: argparse.ArgumentParser, flag: str) -> list[str]:
    action = next(a for a in parser._actions if flag in a.option_strings)
    return list(action.choices or [])


def _flag_message(err: Exception, parser: argparse.ArgumentParser) -> str:
    """One line for a flag Hydra's parser refuses, with the fix."""
    name = getattr(err, "argument_name", None) or ""
    flag = name.split("/")[0]
    text = getattr(err, "message", None) or str(err)
    choice = re.match(r"invalid choice: (.+?) \(choose from", text)
    if choice and flag in ("--cfg", "--info"):
        value = ast.literal_eval(choice.group(1))
        options = _choices(parser, flag)
        if "=" in value:
            how = ("write --cfg job before the overrides" if flag == "--cfg" else
                   "write --info all before the overrides, or --info after them")
            return (f"{flag} {value}: {flag} reads the next argument as its value ({', '.join(options)}), and "
                    f"{value} is an override; {how}")
        return f"{flag} {value}: {flag} takes one of {', '.join(options)}{_suggest(value, options)}"
    if "expected one argument" in text:
        if flag == "--cfg":
            return "--cfg needs a value: --cfg job prints the composed config (hydra: Hydra's config, all: both)"
        return f"{flag} needs a value; adazeta-run --hydra-help describes it"
    return f"{text}; adazeta-run --hydra-help lists Hydra's flags"


def _flags(ns: argparse.Namespace) -> list[str]:
    """The flags of a parsed command line, written out in full, to go before the overrides (Hydra's order)."""
    out: list[str] = []
    for key, flag in (("cfg", "--cfg"), ("package", "--package"), ("info", "--info"), ("config_name", "--config-name"),
                      ("config_dir", "--config-dir")):
        if getattr(ns, key) is not None:
            out += [flag, getattr(ns, key)]
    for key, flag in (("resolve", "--resolve"), ("run", "--run"), ("multirun", "--multirun")):
        if getattr(ns, key):
            out.append(flag)
    return out


def read_flags(argv: list[str], config_dir: str) -> tuple[argparse.Namespace, Source, str | None]:
    """(Hydra's parse of argv, where the config comes from, the one-line error or None)."""
    parser = _flag_parser()
    try:
        ns, extras = parser.parse_known_intermixed_args(argv)
    except (argparse.ArgumentError, _Usage) as err:
        return argparse.Namespace(), Source(config_dir), _flag_message(err, parser)
    source = Source(config_dir)
    if extras:
        known = sorted(s for a in parser._actions for s in a.option_strings if s.startswith("--"))
        return ns, source, (f"{extras[0]}: not a flag of adazeta-run (adazeta-run --hydra-help lists Hydra's "
                            f"flags){_suggest(extras[0], known)}")
    modes = [flag for key, flag in MODES.items() if getattr(ns, key, None)]
    if len(modes) > 1:
        return ns, source, (f"{modes[0]} and {modes[1]} cannot be combined: Hydra takes one of "
                            f"{', '.join(MODES.values())} per command")
    if ns.resolve and not ns.cfg:
        return ns, source, "--resolve resolves the config that --cfg prints: add --cfg job"
    if ns.package is not None and not ns.cfg:
        return ns, source, f"--package {ns.package} chooses the part of the config that --cfg prints: add --cfg job"
    if ns.experimental_rerun is not None:
        return ns, source, (f"--experimental-rerun {ns.experimental_rerun}: adazeta-run keeps no config pickle "
                            "(hydra.output_subdir=null); run the command again with the overrides in the run's "
                            ".hydra/overrides.yaml (a finished run is skipped, an interrupted one resumes)")
    if ns.config_path is not None:
        return ns, source, (f"--config-path {ns.config_path}: adazeta-run reads its config tree from "
                            "ADAZETA_CONFIG_DIR (default: conf/ beside src/); set ADAZETA_CONFIG_DIR="
                            f"{ns.config_path}, or add a folder of options with --config-dir")
    if ns.config_dir is not None:
        extra = Path(ns.config_dir).expanduser().resolve()
        if not extra.is_dir():
            return ns, source, f"--config-dir {ns.config_dir}: no such folder"
        source.extra_dir = str(extra)
    if ns.config_name is not None:
        name = ns.config_name[:-5] if ns.config_name.endswith(".yaml") else ns.config_name
        folders = [Path(config_dir)] + ([Path(source.extra_dir)] if source.extra_dir else [])
        if not name or not any((d / f"{name}.yaml").is_file() for d in folders):
            return ns, source, (f"--config-name {ns.config_name}: no primary config {name}.yaml in "
                                f"{', '.join(map(str, folders))}; adazeta-run's is config (choose a block of the "
                                "paper with experiment=NAME)")
        source.config_name = name
    return ns, source, None


# --- overrides ---------------------------------------------------------------------------------------------------


def _group_choice(source: Source, override: Any) -> str | None:
    """One line for a group option that is no option: empty, null, or a path out of its group's folder."""
    group = override.key_or_group
    if override.is_delete() or not source.is_group(group):
        return None
    values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
    known = source.options(group)
    for value in values:
        text = override.input_line
        if value is None or value == "":
            return f"{text}: {group} needs an option name; known: {', '.join(known)}"
        if not isinstance(value, str):
            continue
        parts = value.replace("\\", "/").split("/")
        if value.startswith(("/", "\\")) or "\\" in value or any(p in ("", ".", "..") for p in parts):
            return (f"{text}: {group} options are names in conf/{group}/, not paths ({value!r}); "
                    f"known: {', '.join(known)}")
    return None


def _deleted(override: Any, source: Source, base: list[str]) -> str | None:
    """One line for ``~key``: a run reads every key of its config and records the value it used."""
    if not override.is_delete():
        return None
    key = override.key_or_group
    if key == "hydra" or key.startswith(("hydra.", "hydra/")):
        return None
    text = override.input_line
    if source.is_group(key):
        path = override.package or key
        return (f"{text}: {path} cannot be deleted (every run reads it and records it); choose another option: "
                f"{override.get_key_element().lstrip('~')}=OPTION (known: {', '.join(source.options(key))})")
    why = f"{text}: {key} cannot be deleted (every run reads it and records the value it used)"
    try:
        from omegaconf import DictConfig, OmegaConf

        value = OmegaConf.select(source.compose(base), key)
    except Exception:
        value = None
    if isinstance(value, DictConfig):
        null = f", or {key}=null for none" if key.startswith("method.") else ""
        return f"{why}; set its keys instead ({key}.KEY=VALUE){null}"
    return f"{why}; set it instead: {key}=VALUE (now {_show(value)})"


def _paths(node: Any, prefix: str = "") -> list[str]:
    """Every key path of a plain (container) config, parents before their children."""
    out = []
    for key, value in (node.items() if isinstance(node, dict) else []):
        out.append(f"{prefix}{key}")
        out += _paths(value, f"{prefix}{key}.")
    return out


def nearest_key(word: str, cfg: Any) -> str | None:
    """The config key a user most likely meant by ``word``: the same leaf name, a reference script's name, close."""
    from omegaconf import OmegaConf

    paths = [p for p in _paths(OmegaConf.to_container(cfg, resolve=False)) if not p.startswith("hydra")]
    leaf = word.split(".")[-1]
    same = [p for p in paths if p.split(".")[-1] == leaf and p != word]
    if same:
        return same[0]
    alias = ALIASES.get(leaf.lower())
    if alias is not None and (alias in paths or alias.split(".")[0] in paths):
        return alias
    leaves = {p.split(".")[-1]: p for p in reversed(paths)}
    close = difflib.get_close_matches(leaf, list(leaves), n=1)
    if close:
        return leaves[close[0]]
    close = difflib.get_close_matches(word, paths, n=1)
    return close[0] if close else None


def _added_unknown(parsed: list[Any], source: Source, base: list[str]) -> str | None:
    """One line for ``+key=value`` that adds a top-level key nothing reads (it would be ignored)."""
    adds = [p for p in parsed if (p.is_add() or p.is_force_add()) and not source.is_group(p.key_or_group)
            and not p.key_or_group.startswith("hydra")]
    if not adds:
        return None
    without = [line for line in base if line not in {p.input_line for p in adds}]
    try:
        cfg = source.compose(without)
    except Exception:
        return None
    for add in adds:
        top = add.key_or_group.split(".")[0]
        if top not in cfg:
            near = nearest_key(add.key_or_group, cfg)
            hint = f"; did you mean {near}?" if near else ""
            return (f"{add.input_line}: the config has no key {top!r}, and a key added with + would be read by "
                    f"nothing{hint}")
    return None


def _yaml_error(error: BaseException | None) -> Any:
    """The YAML parser's error behind a composition error (Hydra wraps some), or None."""
    import yaml

    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, yaml.MarkedYAMLError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def explain(error: Exception, override: str, source: Source, base: list[str]) -> str:
    """One line for a composition error caused by ``override``."""
    from hydra.errors import MissingConfigException

    key = override.split("=", 1)[0].lstrip("+~")
    value = override.split("=", 1)[1] if "=" in override else ""
    text = str(error)
    broken = _yaml_error(error)
    if broken is not None:  # a config file that is not YAML: where, and what the parser wanted
        mark = broken.context_mark or broken.problem_mark  # where the broken construct began
        where = f"{mark.name} line {mark.line + 1}" if mark is not None else "a config file"
        what = "; ".join(p for p in (broken.context, broken.problem) if p)
        return f"{override}: {where} is not valid YAML ({what}); fix that file"
    group = key.split("@")[0]
    missing_group = (("/" in group and ("not in struct" in text or "Could not override" in text))  # hydra/launchr=
                     or "looks like a config group override, but config group" in text)  # optimzer@method.x=
    if isinstance(error, MissingConfigException) or "Could not find" in text or missing_group:
        options = [] if missing_group else source.options(group)
        if options:
            return f"{override}: {group} has no option {value!r}; known: {', '.join(options)}{_suggest(value, options)}"
        groups = source.hydra_groups() if group.startswith("hydra/") else _groups(source)
        return f"{override}: no config group {group!r}; known: {', '.join(groups)}{_suggest(group, groups)}"
    if "Could not override" in text and "@" not in key and _method_part(source.config_dir, key):
        return f"{override}: {key} is part of the method; choose it with {key}@method.{key}={value}"
    if "Could not append" in text and "already" in text:
        return f"{override}: {key} is already in the config; drop the + to change it: {key}={value}"
    if "not in struct" in text or "Could not override" in text or "Could not append" in text:
        parent, _, leaf = key.rpartition(".")
        known = _keys_at(source, base, parent)
        if known is not None and not parent:  # a top-level name: a key or a config group, misspelled
            groups = _groups(source)
            return (f"{override}: the config has no key or group {leaf!r}; keys: {', '.join(known)}; groups: "
                    f"{', '.join(groups)}{_suggest(leaf, [*known, *groups])}")
        if known is not None:
            return f"{override}: {parent} has no key {leaf!r}; known: {', '.join(known)}{_suggest(leaf, known)}"
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    return f"{override}: {first}"


def _method_part(config_dir: str, group: str) -> bool:
    """A group whose options a method places inside itself (``- /adapter@adapter: tt`` in conf/method/*.yaml)."""
    return any(f"/{group}@{group}:" in p.read_text() for p in (Path(config_dir) / "method").glob("*.yaml"))


def _groups(source: Source) -> list[str]:
    return sorted(p.name for p in Path(source.config_dir).iterdir() if p.is_dir())


def _keys_at(source: Source, base: list[str], path: str) -> list[str] | None:
    from omegaconf import DictConfig, OmegaConf

    try:
        cfg = source.compose(base)
        node = OmegaConf.select(cfg, path) if path else cfg
    except Exception:
        return None
    return sorted(str(k) for k in node.keys()) if isinstance(node, DictConfig) else None


def output_dir(source: Source, base: list[str], multirun: bool) -> Path | None:
    """The run (or sweep) directory the command will write to, resolved now; None if only Hydra can resolve it."""
    try:
        cfg = source.compose(base, hydra=True)
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
    # Try it: os.access says yes to root, where a read-only mount or a kernel folder (/proc) still refuses.
    import shutil
    import tempfile

    try:
        probe = tempfile.mkdtemp(prefix=".adazeta-probe-", dir=existing)
    except OSError as err:
        return (f"hydra.{key}={target}: cannot write the run directory: cannot create a folder in {existing} "
                f"({err.strerror or err}); choose another hydra.{key}")
    try:
        with open(os.path.join(probe, "probe"), "w") as f:
            f.write("probe")
    except OSError as err:
        return (f"hydra.{key}={target}: cannot write the run directory: cannot write a file in {existing} "
                f"({err.strerror or err}); choose another hydra.{key}")
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return None


def _compose_error(source: Source, overrides: list[str]) -> Exception | None:
    try:
        source.compose(overrides)
    except Exception as err:  # every Hydra/OmegaConf composition error
        return err
    return None


def _package(ns: argparse.Namespace, source: Source, base: list[str]) -> str | None:
    """One line for ``--cfg ... --package P`` when the printed config has nothing at P (Hydra: exit 1)."""
    from omegaconf import OmegaConf

    if ns.package in (None, "_global_"):
        return None
    try:
        cfg = source.compose(base, hydra=ns.cfg != "job")
        shown = OmegaConf.masked_copy(cfg, ["hydra"]) if ns.cfg == "hydra" else cfg
        if OmegaConf.select(shown, ns.package) is not None:
            return None
    except Exception:  # a value only Hydra can resolve (hydra.job.*): Hydra prints it
        return None
    known = sorted(str(k) for k in shown.keys())
    return (f"--package {ns.package}: the {ns.cfg} config has nothing at {ns.package!r}; known: {', '.join(known)}"
            f"{_suggest(ns.package, known)}")


def _unresolved(cfg: Any, parsed: list[Any]) -> str | None:
    """One line for an interpolation (``${...}``) of the composed config that cannot be resolved: a key that is not
    there, an unset environment variable, an unknown resolver (Hydra would fail in the run with a traceback)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import GrammarParseError, InterpolationResolutionError

    try:
        OmegaConf.to_container(cfg, resolve=True)
    except (InterpolationResolutionError, GrammarParseError) as err:
        key = str(getattr(err, "full_key", "") or "")
        blamed = next((p for p in parsed if p.key_or_group == key), None) or next(
            (p for p in parsed if "${" in p.input_line), None)
        where = _unescaped(blamed.input_line) if blamed is not None else key
        what = (getattr(err, "msg", None) or str(err)).splitlines()[0].strip()
        env = re.search(r"Environment variable '([^']+)' not found", what)
        if env:
            fix = (f"set {env.group(1)} in the environment, or give a default: ${{oc.env:{env.group(1)},VALUE}}")
        elif isinstance(err, GrammarParseError):
            fix = "write an interpolation as ${key.path} or ${resolver:args}, or quote the value"
        elif "Unsupported interpolation type" in what:
            from omegaconf.basecontainer import BaseContainer

            fix = f"known resolvers: {', '.join(sorted(BaseContainer._resolvers))}"
        else:
            found = re.search(r"key '([^']+)'", what)
            near = nearest_key(found.group(1), cfg) if found else None
            fix = f"name a key of the config{f' (did you mean ${{{near}}}?)' if near else ''}"
        return f"{where}: cannot resolve {key or 'an interpolation'} ({what}); {fix}"
    return None


def _settings_error(source: Source, parsed: list[Any], base: list[str], unused: bool = True) -> str | None:
    """One line for a run whose config has an interpolation that cannot be resolved, whose typed settings do not
    parse, or that sets a key its other settings ignore."""
    return _parsed_settings(source, parsed, base, unused)[0]


def _parsed_settings(source: Source, parsed: list[Any], base: list[str], unused: bool = True) -> tuple[str | None, Any]:
    """(``_settings_error``'s line or None, the typed settings when they parsed and nothing is wrong, else None)."""
    from adazeta.errors import ConfigError
    from adazeta.settings import parse, unused_keys

    try:
        cfg = source.compose(base)
    except Exception:
        return None, None
    problem = _unresolved(cfg, parsed)
    if problem:
        return problem, None
    try:
        settings = parse(cfg)
    except ConfigError as err:
        return str(err), None
    except Exception:  # not a user's mistake we can name here: the run reports it
        return None, None
    if not unused:
        return None, settings
    ignored = unused_keys(settings)
    for p in parsed:
        if p.is_delete() or p.key_or_group.startswith("hydra"):
            continue
        path = p.package if p.package and source.is_group(p.key_or_group) else p.key_or_group
        for key, why in ignored.items():
            if path == key or path.startswith(key + "."):
                return f"{p.input_line} is ignored: {why}", None
    return None, settings


def _unescaped(override: str) -> str:
    """An override as the user typed it: a sweep's values come back from Hydra's parser with ``\\`` before
    ``$``, ``{``, ``}`` and other special characters."""
    return re.sub(r"\\(.)", r"\1", override)


def _sweeper_params(source: Source, base: list[str]) -> bool:
    """Whether the config's sweeper adds a grid of its own (``hydra.sweeper.params``: an experiment's sweep)."""
    from omegaconf import OmegaConf

    try:
        sweeper = OmegaConf.to_container(source.compose(base, hydra=True).hydra.sweeper, resolve=False)
    except Exception:
        return True  # unknown: leave the points to the jobs
    return bool(sweeper.get("params"))


MAX_CHECKED_POINTS = 64  # a longer sweep has its first points checked (about 0.2 s each); the rest in their jobs


def _check_points(source: Source, parser: Any, base: list[str], grid: list[tuple[str, list[str]]]
                  ) -> tuple[list[tuple[str, list[str]]], list[str], list[str]]:
    """The settings of every point of a sweep, checked as a single run's are: (the grid without the values whose
    every point fails, one line per value left out, the lines that refuse the sweep when no point or not one value
    is at fault)."""
    import itertools

    points = list(itertools.islice(itertools.product(*[[f"{k}={v}" for v in values] for k, values in grid]),
                                   MAX_CHECKED_POINTS))
    failed: dict[tuple[str, ...], str] = {}
    for point in points:
        lines = base + list(point)
        parsed = [parser.parse_overrides([line])[0] for line in lines]
        problem = _settings_error(source, parsed, lines, unused=False)
        if problem:
            failed[point] = problem
    if not failed:
        return grid, [], []
    if len(failed) == len(points):  # nothing runs: the problem is the command's, not one value's
        return grid, [], list(dict.fromkeys(failed.values()))
    left_out, kept, bad = [], [], set()
    for key, values in grid:
        good = []
        for value in values:
            one = f"{key}={value}"
            mine = [p for p in points if one in p]
            if mine and all(p in failed for p in mine):  # this value is at fault: leave it out
                shown, why = _unescaped(one), failed[mine[0]]
                left_out.append(why if why.startswith(f"{shown}: ") else f"{shown}: {why}")
                bad.add(one)
            else:
                good.append(value)
        kept.append((key, good))
    rest = [f"{_unescaped(' '.join(p))}: {why}" for p, why in failed.items() if not bad & set(p)]
    if rest:  # points no single value explains: the sweep would fail them
        return grid, [], rest
    return kept, left_out, []


def _config_tree(config_dir: str) -> str | None:
    """One line when the config tree (``ADAZETA_CONFIG_DIR``, or the one shipped) is not a folder holding config.yaml."""
    import os

    from adazeta.paths import CONFIG_ENV

    named = f"{CONFIG_ENV}={os.environ[CONFIG_ENV]}" if os.environ.get(CONFIG_ENV) else f"the config tree {config_dir}"
    fix = f"point {CONFIG_ENV} at a conf/ folder holding config.yaml, or unset it to use the one shipped"
    path = Path(config_dir)
    if not path.exists():
        return f"{named}: no such folder; {fix}"
    if not path.is_dir():
        return f"{named}: a file, not a folder; {fix}"
    if not (path / "config.yaml").is_file():
        return f"{named}: the folder holds no config.yaml; {fix}"
    return None


def _blame(source: Source, base: list[str], error: Exception) -> str:
    """The line for a command whose overrides ``base`` fail to compose with ``error``: the first override that fails
    with the ones before it, explained."""
    for n in range(1, len(base) + 1):
        err = _compose_error(source, base[:n])
        if err is not None:
            return explain(err, base[n - 1], source, base[: n - 1])
    return explain(error, base[-1], source, base[:-1])


def _composing_values(source: Source, parser: Any, base: list[str], sweep: Any) -> tuple[list[str], list[str]]:
    """The values of a swept key that compose with ``base``, and a line for each that does not (an unknown group
    option, or a compose error)."""
    key = sweep.get_key_element()
    choice = _group_choice(source, sweep)
    good, bad = [], []
    for value in sweep.sweep_string_iterator():
        one = f"{key}={value}"
        one_problem = _group_choice(source, parser.parse_overrides([one])[0]) if choice else None
        err = None if one_problem else _compose_error(source, base + [one])
        if one_problem is None and err is None:
            good.append(value)
        else:
            bad.append(one_problem or explain(err, one, source, base))
    return good, bad


def check(argv: list[str], config_dir: str) -> Checked:
    """Read the flags, compose the overrides (each sweep value on its own) and report what would fail, one line each."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    problem = _config_tree(config_dir)
    if problem:
        return Checked(list(argv), errors=[problem])
    if any(a in HANDED_OVER for a in argv):
        return Checked(list(argv))
    ns, source, problem = read_flags(list(argv), config_dir)
    if problem:
        return Checked(list(argv), errors=[problem])
    if ns.hydra_help:
        return Checked(["--hydra-help"])  # Hydra's own help: overrides would only make it fail
    if ns.help:
        return Checked(["--help", *_flags(ns), *ns.overrides])  # the help stars the options these overrides choose
    flags = _flags(ns)
    overrides = list(ns.overrides)
    if not overrides:
        return Checked(flags)
    multirun = bool(ns.multirun)
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
    for p in parsed:
        problem = _group_choice(source, p) if not p.is_sweep_override() else None
        problem = problem or _deleted(p, source, [line for line in base if line != p.input_line])
        if problem:
            return Checked(list(argv), errors=[problem])
    error = _compose_error(source, base)
    if error is not None:
        return Checked(list(argv), errors=[_blame(source, base, error)])
    target = output_dir(source, base, multirun)  # the composition above, read from the cache
    problem = (_added_unknown(parsed, source, base) or (_package(ns, source, base) if ns.cfg else None)
               or _unwritable_output(target, multirun))
    if problem:
        return Checked(list(argv), errors=[problem])
    settings = None  # a single run's, handed to the run: its settings are parsed once
    if not multirun and not ns.cfg and not ns.info:
        problem, settings = _parsed_settings(source, parsed, base)
        if problem:
            return Checked(list(argv), errors=[problem])
    new_overrides, dropped = list(overrides), []
    grid: list[tuple[str, list[str]]] = []  # each swept key and the values that compose
    where: list[int] = []  # the position of each in the command line (a key may be swept twice: the last wins)
    for sweep in sweeps:
        key = sweep.get_key_element()
        good, bad = _composing_values(source, parser, base, sweep)
        dropped += bad
        if not good:
            return Checked(list(argv), errors=dropped)
        new_overrides[overrides.index(sweep.input_line)] = f"{key}={','.join(good)}"
        grid.append((key, good))
        where.append(overrides.index(sweep.input_line))
    if multirun and not ns.cfg and not ns.info and not _sweeper_params(source, base):
        # Every point the sweep will run, checked as a single run is: a bad value fails here, not in each job.
        # (An experiment's sweep adds its own grid, hydra.sweeper.params: its points are the experiment's to check.)
        grid, left_out, errors = _check_points(source, parser, base, grid)
        if errors:
            return Checked(list(argv), errors=dropped + errors)
        dropped += left_out
        for (key, good), index in zip(grid, where):
            new_overrides[index] = f"{key}={','.join(good)}"
    if multirun and target is not None:
        # Resolved once, here, so that the jobs and the summary at the end agree on it (``${now:...}`` moves on).
        new_overrides = [a for a in new_overrides if not a.startswith("hydra.sweep.dir=")]
        new_overrides.append(f"hydra.sweep.dir={target}")
    return Checked(flags + new_overrides, dropped=dropped, sweep_dir=target if multirun else None, settings=settings)
