"""The manual and the documentation site: the README stays a manual, the generated reference pages are the config
tree's and the optimizers' own text, every key is described, and the site builds with no broken link."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT

SECTIONS = ["## Install", "## Quick start", "## Methods", "## Optimizers", "## Tasks", "## Models",
            "## Keeping what you train", "## Scaling out", "## What the studies found", "## Documentation", "## Tests"]


def test_the_readme_is_a_manual_of_at_most_300_lines_with_its_sections_and_short_findings():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    positions = [text.index(section) for section in SECTIONS]
    assert positions == sorted(positions)
    findings = text.split("## What the studies found")[1].split("\n## ")[0]
    assert len(findings.strip().splitlines()) <= 25
    for link in re.findall(r"\]\(([^)#]+)", text):  # every relative link of the README points at a file
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link
    for command in ("make demo", "make test", "dry_run=true", "adazeta-run -m", "make tables", "model=hf",
                    "method=eval", "adazeta.export", "ZOTrainer", "lm_eval", "torchrun"):
        assert command in text, command


def test_make_help_lists_at_most_15_targets_and_every_one_exists():
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    targets = [m.group(1) for m in re.finditer(r"^make ([a-z-]+)", out, re.M)]
    assert 5 <= len(targets) <= 15, targets
    phony = re.search(r"^\.PHONY: (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()
    assert set(targets) <= set(phony) and "study" in targets and "report" in targets and "docs" in targets


def test_every_config_key_has_a_description():
    from adazeta.tools.config_reference import missing

    assert missing() == []


def test_a_key_without_a_comment_is_caught(tmp_path, monkeypatch):
    """The check can fail: a copy of the config tree with one new undescribed key is refused, naming the key."""
    from adazeta.tools import config_reference

    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    with open(conf / "schedule" / "constant.yaml", "a") as f:
        f.write("warmup: 3\n")
    monkeypatch.setenv("ADAZETA_CONFIG_DIR", str(conf))
    assert config_reference.missing() == ["schedule/constant.yaml: warmup"]
    # a comment on its line, or the comment line above it, describes it
    text = (conf / "schedule" / "constant.yaml").read_text().replace("warmup: 3\n", "# steps at Q = 1 first\nwarmup: 3\n")
    (conf / "schedule" / "constant.yaml").write_text(text)
    assert config_reference.missing() == []


def test_the_generated_pages_are_the_generators_output():
    """docs/configuration.md, optimizers.md and tasks.md never drift from the config tree and the code."""
    from adazeta.tools.config_reference import PAGES

    for name, make in PAGES.items():
        assert (ROOT / "docs" / name).read_text() == make(), f"docs/{name} is stale: run make docs"


def test_the_comment_reader_takes_inline_above_and_continued_comments_but_not_the_file_header():
    from adazeta.tools.config_reference import comments_of

    text = ("# the file's header\nname: x\nlr: 1.0e-4   # the step\n             # size, continued\n# above it\n"
            "eps: 1.0e-3\ndefaults:\n  - a: b\nq: '#1'\n")
    assert comments_of(text) == [("name", "x", None), ("lr", "1.0e-4", "the step size, continued"),
                                 ("eps", "1.0e-3", "above it"), ("q", "'#1'", None)]


@pytest.mark.skipif(shutil.which("mkdocs", path=os.path.dirname(sys.executable)) is None,
                    reason="mkdocs is not installed (pip install -e .[docs])")
def test_the_site_builds_strictly(tmp_path):
    """mkdocs build --strict: a broken link, a missing page or a page left out of the nav fails the build."""
    mkdocs = shutil.which("mkdocs", path=os.path.dirname(sys.executable))
    out = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()
    assert (tmp_path / "site" / "studies" / "cpu_zo_claims" / "index.html").is_file()
    # a broken link fails it (on a copy of the site's sources: the checkout is left alone)
    shutil.copytree(ROOT / "docs", tmp_path / "docs", symlinks=False)
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "models.md", "a") as f:
        f.write("\n[gone](no-such-page.md)\n")
    broken = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "s2")], cwd=tmp_path,
                            capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert broken.returncode != 0 and "no-such-page.md" in broken.stderr


def test_an_optimizer_the_docs_call_stateless_declares_no_state_memory():
    """README's optimizer table and docs/optimizers.md say "none" only where the config's state_bytes is 0."""
    from adazeta.optim import OPTIMIZERS
    from adazeta.tools.config_reference import STATE

    readme = (ROOT / "README.md").read_text()
    rows = {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `(\w+)` \|.*\| ([^|]*) \|$", readme, re.M)}
    for kind in OPTIMIZERS.names():
        declared = OPTIMIZERS.config(kind, {}).state_bytes(10, 4)
        if STATE.get(kind) == "none" or rows.get(kind) == "none":
            assert declared == 0, (kind, declared)
