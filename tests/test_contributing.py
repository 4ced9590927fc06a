"""CONTRIBUTING.md is true of the code: what it names exists, and what it says of the code holds.

Every path, module, name and command the guide names is looked up; the files its worked examples would create (a
code block headed ``# <path>``) are the only ones allowed to be missing. Each claim about the code that can be
read without running a model (where the registries live, what the capabilities declare, which packages import
their modules) is checked here; the claims a test elsewhere holds name that test (an option YAML listing every
key of its dataclass: ``tests/test_config.py``; the import rules: ``tests/test_layout.py``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT

GUIDE = (ROOT / "CONTRIBUTING.md").read_text()
CODE_BLOCK = re.compile(r"^ *```(\w*)\n(.*?)^ *```", re.M | re.S)
# The data layout the guide describes lives in $ADAZETA_DATA_DIR, not in the checkout (written here by
# tests/helpers.py:write_fixture_data), and ``adazeta/conf`` is where an installed package ships conf/.
OUTSIDE_CHECKOUT = {"glue/MRPC/train.tsv", "glue/MRPC/dev.tsv", "superglue/RTE/train.jsonl", "val.jsonl",
                    "adazeta/conf", "config.json"}


def code_blocks() -> list[tuple[str, str]]:
    """Each fenced block of the guide: (language, text with its indent removed)."""
    blocks = []
    for lang, body in CODE_BLOCK.findall(GUIDE):
        lines = body.splitlines()
        indent = min((len(x) - len(x.lstrip()) for x in lines if x.strip()), default=0)
        blocks.append((lang, "\n".join(x[indent:] for x in lines)))
    return blocks


def example_files() -> set[str]:
    """The files the worked examples add: each block headed ``# <path>`` (``(abridged)`` shows a real file)."""
    heads = (re.match(r"# ([\w./-]+\.(?:py|yaml))\s*$", text.splitlines()[0]) for _, text in code_blocks() if text)
    return {h.group(1) for h in heads if h}


def example_names() -> set[str]:
    """The classes and functions the worked examples define (``NormsConfig``, ``LinearConfig``, ...)."""
    return {m for _, text in code_blocks() for m in re.findall(r"^(?:class|def) (\w+)", text, re.M)}


def named_paths() -> list[str]:
    """Every file or folder the guide names in backticks."""
    found = re.findall(r"`([\w./<>:-]*(?:/|\.py|\.yaml|\.json|\.sh|\.md|\.jsonl|\.tsv)(?::\w+)?)`", GUIDE)
    return sorted({p for p in found if "<" not in p and "NAME" not in p and not p.startswith("-")})


def resolve(path: str) -> Path | None:
    """Where a path the guide names lives: from the checkout's root, the package or its tools, conf/, scripts/,
    or a study's folder (``report.py``)."""
    bases = [ROOT, ROOT / "src", ROOT / "src" / "adazeta", ROOT / "src" / "adazeta" / "tools", ROOT / "conf",
             ROOT / "scripts"]
    for base in bases:
        if (base / path).exists():
            return base / path
    return next(iter(sorted((ROOT / "studies").glob(f"*/{path}"))), None)


def test_every_path_the_guide_names_exists():
    """A file the guide points a contributor to (``src/adazeta/tasks/hooks.py``, ``tests/test_schedules.py``,
    ``scoring/__init__.py``) is there; only the files its examples create, and the data layout outside the
    checkout, are not."""
    paths = named_paths()
    assert {"src/adazeta/registry.py", "tests/test_layout.py", "conf/model/hf.yaml"} <= set(paths)  # read at all
    missing = [p for p in paths
               if p not in example_files() | OUTSIDE_CHECKOUT and resolve(p.partition(":")[0]) is None]
    assert not missing, f"CONTRIBUTING.md names paths that do not exist: {missing}"
    for path in paths:  # ``file.py:name``: the name is defined in that file
        if ":" in path:
            file, _, name = path.partition(":")
            assert re.search(rf"^(def|class) {name}\b", resolve(file).read_text(), re.M), path


def test_the_data_layout_it_describes_is_what_the_fixture_writes(tmp_path):
    """``tests/helpers.py:write_fixture_data`` writes a folder in the layout of ``ADAZETA_DATA_DIR``:
    ``superglue/RTE/train.jsonl``, ``val.jsonl``, ..."""
    from helpers import write_fixture_data

    root = write_fixture_data(tmp_path)
    assert (root / "superglue" / "RTE" / "train.jsonl").is_file() and (root / "superglue" / "RTE" / "val.jsonl").is_file()


def lookup(dotted: str) -> object:
    """What ``adazeta.a.b.Name.attr`` names: a module, or an attribute reached from the longest importable module
    (``AttributeError`` / ``ModuleNotFoundError`` when it names nothing)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.util.find_spec(".".join(parts[:cut])) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            obj = importlib.import_module(".".join(parts[:cut]))
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            return obj
    raise ModuleNotFoundError(dotted)


def resolves(dotted: str) -> bool:
    try:
        lookup(dotted)
    except (AttributeError, ModuleNotFoundError):
        return False
    return True


def named_modules_and_names() -> list[str]:
    """Every ``adazeta.x.y`` the guide names, and every name its code blocks import from the package."""
    dotted = set(re.findall(r"\badazeta(?:\.[A-Za-z_]\w*)+", GUIDE))
    for module, names in re.findall(r"^ *from (adazeta[\w.]*) import ([\w, ]+)$", GUIDE, re.M):
        dotted |= {f"{module}.{n.strip()}" for n in names.split(",")}
    created = {f"adazeta.{Path(p).with_suffix('').as_posix().removeprefix('src/adazeta/').replace('/', '.')}"
               for p in example_files() if p.startswith("src/adazeta/")}
    return sorted(d for d in dotted if not any(d == c or d.startswith(c + ".") for c in created)
                  and d.rpartition(".")[2] not in example_names())


def test_every_module_and_name_the_guide_names_resolves():
    """``adazeta.optim.check_contract``, ``adazeta.tools.endpoints.declared``, the imports of its examples
    (``from adazeta.adapters import ADAPTERS, AdapterCapabilities``): each is importable as written."""
    names = named_modules_and_names()
    assert {"adazeta.scoring", "adazeta.optim.check_contract", "adazeta.adapters.AdapterCapabilities"} <= set(names)
    missing = [n for n in names if not resolves(n)]
    assert not missing, f"CONTRIBUTING.md names what the package does not have: {missing}"


@pytest.mark.parametrize("owner,attributes", [
    ("adazeta.scoring.Scorer", ["of", "encode", "collate", "loss", "scores", "replica_losses", "parts"]),
    ("adazeta.optim.OptimizerCapabilities",
     ["zeroth_order", "state_bytes", "step_bytes", "forwards", "batches_queries", "parallel_modes"]),
    ("adazeta.adapters.AdapterCapabilities", ["trains", "trains_backbone", "replicable", "takes_model_shapes"]),
    ("adazeta.optim.zo_sgd.ZOSGD", ["intended_update", "step", "zeroth_order"]),
    ("adazeta.optim.own_directions.OwnDirections", ["estimate", "forwards"]),
    ("adazeta.optim.differences", ["FiniteDifferences"]),
    ("adazeta.tasks.spec.TaskSpec", ["for_family"]),
    ("adazeta.tasks.spec.BoundTask", ["with_mask"]),
    ("adazeta.settings.Settings", ["bound_task"]),
    ("adazeta.tasks.family.CAUSAL", ["reads_mask", "packs", "kshot_data"]),
    ("adazeta.tasks.family", ["CAUSAL", "MASKED"]),
    ("adazeta.optim.engine", ["Estimator", "register_estimator", "UpdateRule", "Step", "Queries"]),
    ("adazeta.experiments", ["compose_experiment", "design_of"]),
    ("adazeta.schedules.base", ["Schedule", "ScheduleConfig", "fail"]),
    ("adazeta.schedules", ["SCHEDULES", "Schedule", "ScheduleConfig"]),
])
def test_what_the_guide_says_a_piece_has_it_has(owner, attributes):
    """The guide's lists of what an object offers (the Scorer's methods, the capabilities a config declares)."""
    obj = lookup(owner)
    fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
    missing = [a for a in attributes if not hasattr(obj, a) and a not in fields]
    assert not missing, f"{owner} has no {missing}"


def test_a_built_run_hands_its_scorer():
    """``Built.scorer``: the scorer a build wires, as the guide tells a tool to take it."""
    from adazeta.build import Built

    assert "scorer" in {f.name for f in dataclasses.fields(Built)}


def test_every_registry_lives_in_registry_py_and_takes_one_registration_style():
    """The registries the guide lists are the objects of ``adazeta.registry`` (the packages re-export them, never
    make their own); outside the registry every registration is ``@REGISTRY.register(name, Config)`` on a
    builder, but for estimators, which go through ``register_estimator``."""
    from adazeta.registry import Registry

    listed = re.search(r"Every registry lives in `src/adazeta/registry.py` \(([^)]*)\)", GUIDE).group(1)
    names = re.findall(r"`(\w+)`", listed)
    assert names == ["ADAPTERS", "OPTIMIZERS", "ESTIMATORS", "SCHEDULES", "HOOKS", "FLATTENERS"]
    registry = importlib.import_module("adazeta.registry")
    assert {n for n in vars(registry) if isinstance(getattr(registry, n), Registry)} == set(names)
    package = ROOT / "src" / "adazeta"
    elsewhere = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        decorators = {id(d) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                      for d in node.decorator_list}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Registry" \
                    and path.name != "registry.py":
                elsewhere.append(f"{path.relative_to(package)}: a Registry of its own")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "register" \
                    and getattr(node.func.value, "id", None) in names:
                is_decorator = id(node) in decorators and len(node.args) == 2
                if not is_decorator and not (node.func.value.id == "ESTIMATORS" and path.name == "engine.py"):
                    elsewhere.append(f"{path.relative_to(package)}:{node.lineno} {node.func.value.id}.register")
    assert not elsewhere, elsewhere


def test_the_adapters_and_optim_packages_import_every_module_in_them():
    """"A new file registers itself": importing ``adazeta.adapters`` and ``adazeta.optim`` imports each of their
    modules (a fresh process, so that no other test's import counts)."""
    package = ROOT / "src" / "adazeta"
    expected = sorted(f"adazeta.{sub}.{p.stem}" for sub in ("adapters", "optim")
                      for p in (package / sub).glob("*.py") if p.stem != "__init__")
    code = ("import sys, adazeta.adapters, adazeta.optim; "
            f"print([m for m in {expected!r} if m not in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip() == "[]", f"not imported by their package: {done.stdout.strip()}"


def test_every_command_the_guide_names_exists():
    """``make test-fast``, ``make study NAME=...``, ``python -m adazeta.tools.experiment``, ``adazeta-run``, and
    ``tests/test_config_groups.py`` as a script with ``--rewrite``."""
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    named = set(re.findall(r"`make ([\w-]+)", GUIDE)) | set(re.findall(r"^make ([\w-]+)", GUIDE, re.M))
    assert {"test-fast", "study", "report"} <= named and named <= targets, sorted(named - targets)
    modules = set(re.findall(r"python -m (adazeta(?:\.\w+)+)(?![.\w<])", GUIDE))
    assert modules and all(importlib.util.find_spec(m) for m in modules), modules
    assert 'adazeta-run = "adazeta.cli:main"' in (ROOT / "pyproject.toml").read_text()
    script = (ROOT / "tests" / "test_config_groups.py").read_text()
    assert "tests/test_config_groups.py" in GUIDE and "--rewrite" in GUIDE
    assert re.search(r'^if __name__ == "__main__":\n.*"--rewrite"', script, re.M)


@pytest.mark.parametrize("path", sorted(p for p in example_files() if p.endswith(".yaml") and (ROOT / p).is_file()))
def test_a_real_file_the_guide_shows_is_shown_as_it_is(path):
    """A YAML block headed by a file that exists (``conf/method/mezo_lora.yaml``) shows that file's lines
    (comments aside), so that the pattern a contributor copies is the one the code runs. (A Python block headed
    by an existing file is an addition to it, or says it is abridged.)"""
    def lines(text: str) -> list[str]:
        return [x for x in (re.sub(r"\s+#.*$", "", line).rstrip() for line in text.splitlines())
                if x and not x.lstrip().startswith("#")]

    shown = next(text for _, text in code_blocks() if text.startswith(f"# {path}\n"))
    assert lines(shown) == lines((ROOT / path).read_text())


@pytest.mark.slow  # a process of its own that imports torch and transformers (tens of seconds on a busy machine)
def test_the_model_example_counts_what_the_guide_says(tmp_path):
    """The guide's Qwen2.5-0.5B file, alone in a --config-dir, gives the dry run it quotes (no weights, no Hub)."""
    block = next(text for _, text in code_blocks() if text.startswith("# conf/model/qwen2.5-0.5b.yaml\n"))
    total, trained, adapters = re.search(r"counts\s+([\d,]+) parameters, ([\d,]+) of them in (\d+) TT adapters",
                                         GUIDE).groups()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "qwen2.5-0.5b.yaml").write_text(block + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ADAZETA_", "WANDB_"))}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    done = subprocess.run([sys.executable, "-m", "adazeta.cli", "--config-dir", str(tmp_path), "model=qwen2.5-0.5b",
                           "method=adazeta", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"total params     {total}" in done.stdout and f"trainable params {trained}" in done.stdout
    assert f"adapters         {adapters}" in done.stdout
