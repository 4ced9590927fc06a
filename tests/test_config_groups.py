"""The composed configs stay what they were: a snapshot of representative compositions, compared key for key.

``tests/composed_configs.json`` holds, for each case, the command-line overrides and the parts of the composed,
resolved config that the case is about (``method`` and ``schedule`` for a method, ``model`` for a model, ...;
the first case holds the whole default config). The config files may be reorganised (groups, defaults lists,
shared options), but every case must compose to the same values. A change of a recorded value is a change of
behaviour. A new method, model or experiment is added to the snapshot (the recorded cases stay as they are) by

    PYTHONPATH=src python tests/test_config_groups.py

and a change of a recorded value that is meant is recorded with ``--rewrite`` (review the diff: every changed
line is a changed setting).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import CONF, compose_cfg  # noqa: E402

SNAPSHOT = Path(__file__).resolve().parent / "composed_configs.json"

# Command-line overrides that reach into the composed method (README, conf/experiment/cpu_zo.yaml).
OVERRIDES = [
    ["method=adazeta", "method.adapter.rank=8"],
    ["method=adazeta", "method.optimizer.lr=3e-4"],
    ["method=adazeta", "method.optimizer.noise=flat"],
    ["method=mezo_lora", "method.optimizer.batched_queries=true", "method.optimizer.query_chunk=auto"],
    ["method=mezo", "method.optimizer.estimator=one_sided"],
    ["method=ft", "method.optimizer=null"],
    ["method=lora", "method.adapter.target_modules=[q_proj,k_proj,v_proj]"],
]
TASKS = ["rte", "copa", "record", "squad", "sst5"]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _experiment_points() -> list[list[str]]:
    """Each experiment with each of its arms (adazeta.experiments: a table's arms are its methods)."""
    from adazeta.experiments import compose_experiment, design_of

    points = []
    for name in _options("experiment"):
        design = design_of(compose_experiment(name), name)
        points += [[f"experiment={name}", *arm.overrides] for arm in (design.arms.values() if design else [])]
    return points


def cases() -> list[tuple[list[str], list[str]]]:
    """(overrides, the top-level keys to compare): the representative compositions."""
    out: list[tuple[list[str], list[str]]] = [([], [])]  # [] keys: the whole config
    out += [([f"method={m}"], ["method", "schedule"]) for m in _options("method")]
    out += [(ov, ["method", "schedule", "train"]) for ov in _experiment_points()]
    out += [([f"model={m}", "method=adazeta"], ["model", "method"]) for m in _options("model")]
    out += [([f"task={t}"], ["task"]) for t in TASKS]
    out += [(ov, ["method", "schedule"]) for ov in OVERRIDES]
    return out


def composed(overrides: list[str], keys: list[str]) -> dict:
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose_cfg(overrides), resolve=True)
    return cfg if not keys else {k: cfg[k] for k in keys}


def write_snapshot(rewrite: bool = False) -> None:
    """Record the cases missing from the snapshot (every case with ``rewrite``), keeping the recorded ones."""
    for var in ("ADAZETA_DATA_DIR", "ADAZETA_MODEL_DIR"):  # as under the tests: no user directories
        os.environ.pop(var, None)
    recorded = {} if rewrite else {json.dumps(e["overrides"]): e for e in _recorded()}
    entries = list(recorded.values())
    added = [ov for ov, _ in cases() if json.dumps(ov) not in recorded]
    entries += [{"overrides": ov, "config": composed(ov, keys)} for ov, keys in cases() if ov in added]
    SNAPSHOT.write_text("[\n" + ",\n".join(_compact(e, 1) for e in entries) + "\n]\n")
    print(f"{SNAPSHOT}: {len(added)} case(s) recorded, {len(entries)} in all")


def _compact(value: object, depth: int = 0) -> str:
    """JSON with one line per mapping key, and a mapping or list on one line where it fits in 100 characters."""
    flat = json.dumps(value)
    if not isinstance(value, (dict, list)) or len(flat) + depth <= 100:
        return " " * depth + flat
    pad = " " * depth
    if isinstance(value, list):
        return pad + "[\n" + ",\n".join(_compact(v, depth + 1) for v in value) + "\n" + pad + "]"
    items = [_compact(v, depth + 1) for v in value.values()]
    lines = [f"{pad} {json.dumps(k)}: {text.lstrip()}" for k, text in zip(value, items)]
    return pad + "{\n" + ",\n".join(lines) + "\n" + pad + "}"


def _recorded() -> list[dict]:
    return json.loads(SNAPSHOT.read_text()) if SNAPSHOT.is_file() else []


@pytest.mark.parametrize("entry", _recorded(), ids=lambda e: " ".join(e["overrides"]) or "defaults")
def test_composed_config_is_unchanged(entry):
    keys = [] if not entry["overrides"] else list(entry["config"])
    assert composed(entry["overrides"], keys) == entry["config"]


def test_snapshot_covers_every_method_model_and_experiment_point():
    recorded = [e["overrides"] for e in _recorded()]
    missing = [ov for ov, _ in cases() if ov not in recorded]
    assert not missing, f"not in {SNAPSHOT.name} (write it again, see the module docstring): {missing}"


def _method_parts(method: str) -> dict:
    """The adapter and optimizer options a method file names, following the methods it extends (``- mezo_lora``)."""
    spec = yaml.safe_load((CONF / "method" / f"{method}.yaml").read_text())
    parts: dict = {}
    for entry in spec.get("defaults", []):
        if isinstance(entry, str) and entry in _options("method"):
            parts.update(_method_parts(entry))
        elif isinstance(entry, dict):
            for part in ("adapter", "optimizer"):
                if f"/{part}@{part}" in entry:
                    parts[part] = entry[f"/{part}@{part}"]
    if "optimizer" in spec and spec["optimizer"] is None:  # training-free
        parts["optimizer"] = None
    return parts


def test_methods_compose_their_adapter_and_optimizer_from_the_groups():
    """Every method takes its adapter from conf/adapter/ and its optimizer from conf/optimizer/ (or has none)."""
    for method in _options("method"):
        parts = _method_parts(method)
        assert parts.get("adapter") in _options("adapter"), method
        assert "optimizer" in parts, f"{method}: name an optimizer option, or set optimizer: null"
        assert parts["optimizer"] is None or parts["optimizer"] in _options("optimizer"), method


@pytest.mark.parametrize("group", ["adapter", "optimizer"])
def test_every_adapter_and_optimizer_option_parses_into_its_registered_config(group):
    from omegaconf import OmegaConf

    from adazeta.adapters import ADAPTERS
    from adazeta.optim import OPTIMIZERS

    registry = {"adapter": ADAPTERS, "optimizer": OPTIMIZERS}[group]
    for option in _options(group):
        values = OmegaConf.to_container(compose_cfg([f"{group}@method.{group}={option}"]).method[group])
        kind = values.pop("kind")
        registry.config(kind, values)


if __name__ == "__main__":
    write_snapshot(rewrite="--rewrite" in sys.argv[1:])
