"""docs/fidelity.md names only what exists: every project file, every test and every config key it cites, and a
key cited with a value has that value in at least one arm of the table experiment its section describes."""

from __future__ import annotations

import re

import pytest
import yaml
from omegaconf import OmegaConf

from helpers import ROOT, compose_cfg

PAGE = ROOT / "docs" / "fidelity.md"
PROJECT_ROOTS = ("conf", "src", "tests", "docs", "results", "studies")
CONFIG_GROUPS = ("train", "data", "divergence", "guard", "method", "schedule")
SECTIONS = {"## Table 1": "table1_roberta", "## Table 2": "table2_llama"}


def cited(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def sections() -> dict[str, str]:
    """The page's text per table experiment (the part under its '## Table' heading)."""
    page = PAGE.read_text()
    starts = sorted((page.index(h), e) for h, e in SECTIONS.items())
    ends = [s for s, _ in starts[1:]] + [len(page)]
    return {e: page[s:end] for (s, e), end in zip(starts, ends)}


def config_keys(text: str) -> list[tuple[str, str | None]]:
    """(dotted key, value or None) for each cited `group.key`, `group.key: value` or `group.key=value`."""
    out = []
    for span in cited(text):
        m = re.fullmatch(r"([a-z_]+(?:\.[a-z_]+)+)(?:\s*[:=]\s*(.+))?", span)
        file_name = re.search(r"\.(tsv|jsonl?|csv|py|sh|md|txt|yaml)$", span)
        if m and m.group(1).split(".")[0] in CONFIG_GROUPS and not file_name:
            out.append((m.group(1), m.group(2)))
    return out


def arm_configs(experiment: str) -> list[dict]:
    from adazeta.experiments import compose_experiment, design_of

    design = design_of(compose_experiment(experiment), experiment)
    return [OmegaConf.to_container(compose_cfg([f"experiment={experiment}", *arm.overrides]), resolve=True)
            for arm in design.arms.values()]


def lookup(config: dict, key: str):
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


def test_every_project_file_the_page_cites_exists():
    paths = [s for s in cited(PAGE.read_text()) if re.fullmatch(rf"(?:{'|'.join(PROJECT_ROOTS)})/[\w./-]+", s)]
    assert len(paths) >= 10
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing


def test_every_test_the_page_cites_exists():
    names = [s for s in cited(PAGE.read_text()) if re.fullmatch(r"test(_[a-z0-9]+){3,}", s)]  # not `test_acc`
    defined = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    assert names and not [n for n in names if f"def {n}(" not in defined]


@pytest.mark.parametrize("experiment", SECTIONS.values())
def test_every_config_key_the_page_cites_exists_with_its_value(experiment):
    keys = config_keys(sections()[experiment])
    assert len(keys) >= 8
    configs = arm_configs(experiment)
    for key, value in keys:
        found = []
        for config in configs:
            try:
                found.append(lookup(config, key))
            except KeyError:
                continue
        assert found, f"{key} is in no arm of {experiment}"
        if value is not None:
            assert yaml.safe_load(value) in found, f"{key}: {value} is not what any arm of {experiment} composes"


def test_a_key_that_no_arm_composes_is_caught():
    assert config_keys("`train.no_such_key: 3`, `probe.x`, `train.tsv`") == [("train.no_such_key", "3")]
    with pytest.raises(KeyError):
        lookup(arm_configs("table1_roberta")[0], "train.no_such_key")
