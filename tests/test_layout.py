"""The layout's import rules (CONTRIBUTING.md, Layout): the library never imports a tool; tools import the library;
outside ``adazeta.scoring`` (its ``__init__``) examples are scored through ``Scorer`` alone; a task reaches the loaders bound to its family.

Read from the source with ``ast`` (nothing is imported), so a run's dependencies cannot grow a bench or a report
without this failing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import adazeta
import adazeta.tools

PACKAGE = Path(adazeta.__file__).parent
TOOLS = PACKAGE / "tools"
# Commands that stay in the library: the run's entry point, and the export of a trained run (a user's command whose
# exported README names it; not a bench, report or driver).
LIBRARY_COMMANDS = {"adazeta.cli", "adazeta.export"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module ``source`` (the text of ``module``) imports, relative imports resolved, with each name taken
    from a package as a module too (``from adazeta import tools`` -> ``adazeta.tools``); and the constant
    targets of ``importlib.import_module`` / ``__import__`` calls."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = import_target(node, package)
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return found


def import_target(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` reads, a relative one resolved against ``package``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def module_imports(source: str, module: str, modules: set[str], is_package: bool = False) -> set[str]:
    """The ``modules`` that ``source`` (the text of ``module``) imports when it is imported: every import outside a
    function body, ``if TYPE_CHECKING:`` blocks included (a circle there is a circle of the design, and breaks a
    checker's run); ``from P import x`` reads the module ``P.x`` where there is one, else ``P``. Not ``module``
    itself (``from adazeta import cli`` in ``adazeta.cli``'s ``__main__`` block is no circle)."""
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
             for n in ast.walk(f)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in local:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = import_target(node, package)
            found.update(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names)
    return (found & modules) - {module}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle of imports in ``graph`` (module -> the modules it imports), each as its modules in order, the
    sorted by name (each strongly connected component of two or more)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return cycles


def import_graph() -> dict[str, set[str]]:
    """adazeta's modules, each with the adazeta modules it imports when imported (``module_imports``)."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: module_imports(path.read_text(), name, set(paths), path.name == "__init__.py")
            for name, path in paths.items()}


def test_no_import_circle_among_the_modules():
    """No two of adazeta's modules import each other, directly or around a circle (``if TYPE_CHECKING:`` imports
    count): the estimators once lived half in ``optim/zo_sgd.py`` and half in ``optim/engine.py``, each importing
    the other; a piece that two modules share belongs in a third both import."""
    cycles = import_cycles(import_graph())
    assert not cycles, "; ".join(" <-> ".join(c) for c in cycles) + ": move what they share into a module of its own"


def test_the_cycle_reader_sees_a_circle():
    """The rule's reader: a circle through a TYPE_CHECKING import and a three-module circle are found; a function-
    local import (taken when called, not when imported), a module of a package read through the package, and a
    one-way chain are not."""
    sources = {
        "adazeta.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from adazeta.b import B",
        "adazeta.b": "from adazeta import a",
        "adazeta.c": "import adazeta.d",
        "adazeta.d": "from .e import f",
        "adazeta.e": "from adazeta.c import g",
        "adazeta.f": "def lazy():\n    from adazeta.g import h",
        "adazeta.g": "from adazeta.f import lazy\nfrom adazeta.h import x",
        "adazeta.h": "import torch",
        "adazeta": "from adazeta import h",
        "adazeta.i": "from adazeta import h",
    }
    graph = {m: module_imports(src, m, set(sources), m == "adazeta") for m, src in sources.items()}
    assert graph["adazeta.a"] == {"adazeta.b"} and graph["adazeta.f"] == set()
    assert graph["adazeta.i"] == {"adazeta.h"} and graph["adazeta.h"] == set()
    assert import_cycles(graph) == [["adazeta.a", "adazeta.b"], ["adazeta.c", "adazeta.d", "adazeta.e"]]


def is_tools(name: str) -> bool:
    return name == "adazeta.tools" or name.startswith("adazeta.tools.")


def library_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if TOOLS not in p.parents)


def test_the_library_never_imports_a_tool():
    assert len(library_modules()) > 30  # the whole library is read, not an empty folder
    offenders = {}
    for path in library_modules():
        names = imported_modules(path.read_text(), module_name(path), path.name == "__init__.py")
        if bad := sorted(n for n in names if is_tools(n)):
            offenders[str(path.relative_to(PACKAGE))] = bad
    assert not offenders, f"library modules importing adazeta.tools (the library never imports a tool): {offenders}"


@pytest.mark.parametrize("source,module,imports_tools", [
    ("from adazeta.tools import bench", "adazeta.run", True),
    ("import adazeta.tools.experiment as driver", "adazeta.run", True),
    ("from adazeta import tools", "adazeta.runs.results", True),
    ("from .tools.bench import common", "adazeta.run", True),
    ("from . import tools", "adazeta", True),
    ("def f():\n    from adazeta.tools.make_tables import main", "adazeta.train", True),
    ("importlib.import_module('adazeta.tools.sweep')", "adazeta.run", True),
    ("from adazeta import stats, tables", "adazeta.run", False),
    ("from .optim import spsa", "adazeta.run", False),
    ("from adazeta.toolsmith import x", "adazeta.run", False),
])
def test_the_import_reader_sees_every_form_of_import(source, module, imports_tools):
    """The rule's reader: a top-level, function-local, relative or importlib import of a tool is seen."""
    assert any(is_tools(n) for n in imported_modules(source, module, module == "adazeta")) == imports_tools


def test_every_tool_is_listed_and_no_command_is_left_in_the_library():
    """adazeta.tools' docstring lists each tool; a command (``__main__`` guard) outside tools/, at the root or in a
    subpackage, is one of the two the library keeps, so a new bench, report or driver lands in tools/."""
    tools = {p.stem for p in TOOLS.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in TOOLS.iterdir() if (p / "__init__.py").is_file()}
    assert {"bench", "experiment", "make_tables", "study_report", "endpoints"} <= tools
    listed = set(re.findall(r"^    (\w+) ", adazeta.tools.__doc__, re.MULTILINE))
    assert tools == listed, f"tools/ holds {sorted(tools - listed)} not listed, lists {sorted(listed - tools)} absent"
    commands = {module_name(p) for p in library_modules()
                if re.search(r"^if __name__ == .__main__.:", p.read_text(), re.M)}
    assert commands == LIBRARY_COMMANDS, f"commands in the library: {sorted(commands)} (tools go in tools/)"


def test_a_module_over_400_lines_says_why():
    """CONTRIBUTING's rule: a long module states its reason at the top of its docstring (``Over 400 lines: ...``)."""
    import ast as _ast
    from pathlib import Path as _Path

    src = _Path(__file__).resolve().parents[1] / "src" / "adazeta"
    silent = []
    for path in sorted(src.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 420:
            doc = _ast.get_docstring(_ast.parse(text)) or ""
            if "Over 400 lines:" not in "\n".join(doc.splitlines()[:4]):
                silent.append(str(path.relative_to(src)))
    assert not silent, f"modules over ~400 lines without a reason at the top of their docstring: {silent}"


# What adazeta.scoring (scoring/__init__.py) does on its own: encoding, laying out and scoring examples for a given family. Every other module
# goes through ``Scorer``, which holds the family, the tokenizer, the pad and mask ids and the objective.
SCORING_ENTRY_POINTS = {"encode", "collate", "batch_loss", "candidate_scores", "replica_losses", "lm_parts",
                        "_hidden_states"}


def scoring_entry_points(source: str, module: str, is_package: bool = False) -> list[str]:
    """The scoring entry points ``source`` imports from ``adazeta.scoring`` (by name, ``*``, or the module itself,
    whose attributes would reach them)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name == "adazeta.scoring"]
        elif isinstance(node, ast.ImportFrom):
            target = import_target(node, package)
            if target == "adazeta.scoring":
                found += [a.name for a in node.names if a.name in SCORING_ENTRY_POINTS or a.name == "*"]
            elif target == "adazeta":
                found += ["adazeta.scoring" for a in node.names if a.name == "scoring"]
    return found


def test_only_scoring_py_calls_the_scoring_entry_points():
    """``Scorer`` is the one scoring API: a module that imported ``encode`` or ``batch_loss`` would pass a family
    (or a pad id, an objective) by hand again, as the benches once passed a literal "causal"."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "scoring" / "__init__.py":
            continue
        for name in scoring_entry_points(path.read_text(), module_name(path), path.name == "__init__.py"):
            offenders.append(f"{path.relative_to(PACKAGE)} imports {name} from adazeta.scoring")
    assert not offenders, ("; ".join(offenders) + ": score through Scorer (Scorer.of(model, tokenizer, family) or "
                           "Built.scorer: encode, collate, loss, scores, replica_losses, parts) instead")


@pytest.mark.parametrize("source,module,found", [
    ("from adazeta.scoring import Batch, Encoded, Scorer, gold_lengths", "adazeta.scoring.evaluate", []),
    ("from adazeta.scoring import Scorer, batch_loss", "adazeta.tools.bench.common", ["batch_loss"]),
    ("def f():\n    from adazeta.scoring import lm_parts", "adazeta.tools.diagnose_zo", ["lm_parts"]),
    ("from .scoring import encode", "adazeta.build", ["encode"]),
    ("from ..scoring import collate", "adazeta.tools.bench_memory", ["collate"]),
    ("from adazeta.scoring import *", "adazeta.probe", ["*"]),
    ("from adazeta import scoring", "adazeta.probe", ["adazeta.scoring"]),
    ("import adazeta.scoring as sc", "adazeta.probe", ["adazeta.scoring"]),
])
def test_the_scoring_import_reader_sees_every_form(source, module, found):
    assert scoring_entry_points(source, module) == found


FAMILY_BOUND = ("tasks/loaders.py", "scoring/calibration.py", "tasks/demonstrations.py")


def test_loaders_calibration_and_icl_take_the_task_bound_to_its_family():
    """A task reaches them as ``TaskSpec.for_family``'s ``BoundTask``, its family's sources and format resolved once:
    a ``family`` parameter would let a caller ask the spec for them again, or pass another family."""
    offenders = []
    for rel in FAMILY_BOUND:
        for node in ast.walk(ast.parse((PACKAGE / rel).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x is not None]
                if "family" in names:
                    offenders.append(f"{rel}: {getattr(node, 'name', 'lambda')}")
    assert not offenders, (f"functions taking a `family` parameter: {', '.join(offenders)}; take the task bound "
                           "to its family (TaskSpec.for_family) instead")


def private_reaches(source: str, module: str, is_package: bool = False) -> list[str]:
    """What ``source`` (the text of ``module``) takes of another adazeta module's private names: a ``from ...
    import _name``, an ``alias._name`` read on an imported adazeta module, an assignment to any attribute of one
    (a patch at run time), and ``x._name(...)`` calls of a project method on an object (an optimizer's private
    estimate, say). Dunder names and a class's own ``self._x`` / ``cls._x`` / ``super()._x`` are its own business."""
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> the adazeta module it is
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = import_target(node, package)
            if target.startswith("adazeta"):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__") and target != module:
                        found.append(f"from {target} import {a.name}")
                    aliases[a.asname or a.name] = f"{target}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("adazeta"):
                    aliases[a.asname or a.name.split(".")[0]] = a.asname and a.name or a.name.split(".")[0]
    private = re.compile(r"^_(?!_)")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner = node.value.id
            if owner in aliases and private.match(node.attr):
                found.append(f"{owner}.{node.attr}")
            elif (owner in aliases and isinstance(node.ctx, ast.Store)):
                found.append(f"{owner}.{node.attr} = ...")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and private.match(node.func.attr)
                and not (isinstance(node.func.value, ast.Name) and node.func.value.id in ("self", "cls", "torch"))
                and not (isinstance(node.func.value, ast.Call) and getattr(node.func.value.func, "id", "") == "super")
                and node.func.attr in PROJECT_METHODS):
            found.append(f"._{node.func.attr[1:]}()")
    return found


def project_private_methods() -> set[str]:
    """Every private method name a class of the package defines (``_estimate``, ``_reset``, ...)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names.update(f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                             and f.name.startswith("_") and not f.name.startswith("__"))
    return names


PROJECT_METHODS = project_private_methods()


def test_no_module_reaches_a_private_name_of_another_or_patches_one():
    """A module's private names are its own: another module importing one, reading it through the module, calling
    an object's private method, or patching a module's attribute at run time couples the two behind the names
    their docstrings promise (the bench once swapped ``spsa``'s draw functions for counters)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for reach in private_reaches(path.read_text(), module_name(path), path.name == "__init__.py"):
            offenders.append(f"{path.relative_to(PACKAGE)}: {reach}")
    assert not offenders, "; ".join(offenders) + ": make the name public (documented) or keep the use in its module"


@pytest.mark.parametrize("source,found", [
    ("from adazeta.optim.spsa import _each_draw, perturb_", ["from adazeta.optim.spsa import _each_draw"]),
    ("from .zo_sgd import ZOSGD, _as_loss", ["from adazeta.optim.zo_sgd import _as_loss"]),
    ("from adazeta.optim import spsa\nspsa._each_draw(1)", ["spsa._each_draw"]),
    ("from adazeta.optim import spsa\nspsa.each_draw = None", ["spsa.each_draw = ..."]),
    ("import adazeta.runs.saving as saving\nsaving._load_into(m)", ["saving._load_into"]),
    ("def f(trainer):\n    return trainer._queries()", ["._queries()"]),
    ("def f(self):\n    return self._estimate(1)", []),
    ("def f(self):\n    return super()._queries()", []),  # an override calling its own base
    ("from adazeta.optim.spsa import each_draw\nimport torch\ntorch._foreach_add_(a, b)", []),
])
def test_the_private_name_reader_sees_every_form(source, found):
    assert private_reaches(source, "adazeta.optim.engine") == found


def family_comparisons(source: str) -> list[str]:
    """Each comparison of a value with the literal "causal" or "masked" (``==``, ``!=``, ``in``) in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op in operands:
                values = [op] + (list(op.elts) if isinstance(op, (ast.Tuple, ast.List, ast.Set)) else [])
                found += [f"line {node.lineno}: {v.value!r}" for v in values
                          if isinstance(v, ast.Constant) and v.value in ("causal", "masked")]
    return found


def test_the_family_is_an_object_no_module_compares_its_name():
    """``adazeta.tasks.family`` declares what each family decides (where the answer is read, packing, BOS, the
    auto class, its data): a module asks the Family, never compares its name, so a third family is one object."""
    offenders = [f"{path.relative_to(PACKAGE)} {hit}" for path in sorted(PACKAGE.rglob("*.py"))
                 if path != PACKAGE / "tasks" / "family.py" for hit in family_comparisons(path.read_text())]
    assert not offenders, "; ".join(offenders) + ": read the family's declared behaviour (adazeta.tasks.family)"


@pytest.mark.parametrize("source,hits", [
    ("if family == 'masked':\n    pass", 1),
    ("x = 'causal' != fam", 1),
    ("ok = f in ('causal', 'masked')", 2),
    ("if family.reads_mask:\n    pass", 0),
    ("name = 'causal'", 0),
])
def test_the_family_comparison_reader_sees_every_form(source, hits):
    assert len(family_comparisons(source)) == hits


# What the wiring asks of a piece is declared on its config's base class (``AdapterCapabilities``,
# ``OptimizerCapabilities``, ``ScheduleConfig``) and called directly; a probe would let a capability live on one
# config alone, undeclared, with a default the caller invents. A transformers model's own config (a
# PretrainedConfig, whose keys differ by architecture) is third-party and may be probed: these are the reviewed ones.
THIRD_PARTY_CONFIG_PROBES = {
    "models.py": {"module.config"},  # a loaded transformers model: is it quantized?
    "scoring/__init__.py": {"config"},  # the transformers model's config: may its rows be packed?
    "adapters/basic.py": {"base.config"},  # does the transformers model tie its head?
    "adapters/lora.py": {"model.config"},  # the transformers model type, for peft's default targets
}
CONFIG_TYPE = re.compile(r"\b\w*Config\b")


def _is_config_value(value: ast.AST) -> bool:
    """A ``<...>.config`` attribute chain, or a call of a ``*Config`` class."""
    if isinstance(value, ast.Attribute):
        return value.attr == "config"
    if isinstance(value, ast.Call):
        func = value.func
        return bool(re.fullmatch(r"\w*Config", func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")))
    return False


def config_names(tree: ast.AST) -> set[str]:
    """The names ``tree`` binds to a config: a parameter or variable annotated with a ``*Config`` type, or assigned
    a ``.config`` chain or a ``*Config(...)`` call (anywhere in the module: a name is read as one thing throughout)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            names.update(arg.arg for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
                         if arg is not None and arg.annotation is not None
                         and CONFIG_TYPE.search(ast.unparse(arg.annotation)))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if CONFIG_TYPE.search(ast.unparse(node.annotation)) or (node.value is not None
                                                                     and _is_config_value(node.value)):
                names.add(node.target.id)
        elif isinstance(node, (ast.Assign, ast.NamedExpr)) and _is_config_value(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def config_probes(source: str) -> list[tuple[str, str]]:
    """(the probed object as written, the call) of each ``hasattr(x, ...)`` and three-argument ``getattr(x, name,
    default)`` in ``source`` whose ``x`` is a config: an attribute chain ending in ``.config`` or a name bound to a
    config (``config_names``). A two-argument getattr reads a field it names; it invents no default."""
    tree = ast.parse(source)
    names = config_names(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
            continue
        if node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3):
            x = node.args[0]
            if (isinstance(x, ast.Attribute) and x.attr == "config") or (isinstance(x, ast.Name) and x.id in names):
                found.append((ast.unparse(x), ast.unparse(node)))
    return found


def test_the_wiring_asks_a_config_its_declared_capabilities_and_never_probes_one():
    """Every library module outside tools/ is read: the wiring proper (build, settings, dryrun, run, train, cli,
    hf, probe, ...) and the packages of pieces (adapters, optim, schedules, tasks), since a piece's module may wire
    another piece (LoRA's head, an optimizer's contract); tools/ are commands over runs and records, which no run
    imports. Probes on third-party objects are fine (a tokenizer's ``mask_token``, a transformers model, its
    PretrainedConfig in ``THIRD_PARTY_CONFIG_PROBES``); a config of ours declares the capability on its base class
    (``AdapterCapabilities.check_hidden``, ``OptimizerCapabilities.derivative_free``,
    ``ScheduleConfig.uses_run_epochs``) and the caller calls it."""
    offenders = []
    for path in library_modules():
        rel = path.relative_to(PACKAGE).as_posix()
        allowed = THIRD_PARTY_CONFIG_PROBES.get(rel, set())
        offenders += [f"{rel}: {call}" for obj, call in config_probes(path.read_text()) if obj not in allowed]
    assert not offenders, ("; ".join(offenders) + ": declare the capability on the config's base class (with its "
                           "default) and call it directly")
    # each reviewed third-party probe is still there: a stale entry would silently allow a probe of ours
    for rel, objects in THIRD_PARTY_CONFIG_PROBES.items():
        assert objects <= {obj for obj, _ in config_probes((PACKAGE / rel).read_text())}, rel


@pytest.mark.parametrize("source,found", [
    ("if hasattr(s.adapter.config, 'check_hidden'):\n    pass", ["hasattr(s.adapter.config, 'check_hidden')"]),
    ("x = getattr(s.optimizer.config, 'estimator', None)", ["getattr(s.optimizer.config, 'estimator', None)"]),
    ("lr = getattr(optimizer.config, 'lr', None)", ["getattr(optimizer.config, 'lr', None)"]),
    ("adapter = settings.adapter.config\nok = getattr(adapter, 'targets', False)", ["getattr(adapter, 'targets', False)"]),
    ("def f(cfg: ZOSGDConfig):\n    return hasattr(cfg, 'eps')", ["hasattr(cfg, 'eps')"]),
    ("def f(cfg: 'TTAdapterConfig | None'):\n    return hasattr(cfg, 'rank')", ["hasattr(cfg, 'rank')"]),
    ("cfg = LoraAdapterConfig(r=4)\nr = getattr(cfg, 'r', 8)", ["getattr(cfg, 'r', 8)"]),
    ("c: ScheduleConfig = make()\nu = getattr(c, 'uses_run_epochs', False)", ["getattr(c, 'uses_run_epochs', False)"]),
    ("if (c := s.schedule.config) and hasattr(c, 'q'):\n    pass", ["hasattr(c, 'q')"]),
    ("value = getattr(s.adapter.config, name)", []),  # two arguments: a named field, no invented default
    ("mask = getattr(tokenizer, 'mask_token', None)", []),  # a third-party object
    ("fn = getattr(module, 'forward_replicas', None)", []),
    ("if s.adapter.config.trains:\n    pass", []),
])
def test_the_config_probe_reader_sees_every_form(source, found):
    """The rule's reader: a probe of a ``.config`` chain, of a name annotated, assigned (or walrus-bound) a config,
    is seen; a two-argument getattr and probes of other objects are not."""
    assert [call for _, call in config_probes(source)] == found


ROOT_MODULE_LIMIT = 25


def test_the_package_root_holds_at_most_25_modules():
    """The root keeps what a run is wired from and what users call; modules that belong together live in a
    subpackage (``runs/``, ``scoring/``, ``tasks/``, ...), so that a newcomer reads the pipeline from the listing."""
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert "__init__.py" in root and "cli.py" in root  # the real package root is read
    assert len(root) <= ROOT_MODULE_LIMIT, (
        f"src/adazeta/ holds {len(root)} modules (at most {ROOT_MODULE_LIMIT}): {', '.join(root)}; "
        "move modules that belong together into a subpackage")
