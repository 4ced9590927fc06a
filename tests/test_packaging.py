"""The package installs like a package: the built wheel, installed into an empty target folder, carries conf/ and
runs a tiny command from outside the checkout, and a user's own config folder (Hydra's --config-dir) adds a task
beside the packaged ones."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import ROOT

pytestmark = pytest.mark.skipif(not (ROOT / "setup.py").is_file(), reason="needs the source checkout")


def _setuptools_at_least(major: int) -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= major


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel built from this checkout, installed (without its dependencies, which this environment has) into a
    folder of its own: what `pip install adazeta-*.whl` puts in a fresh environment's site-packages."""
    out = tmp_path_factory.mktemp("wheel")
    # This environment's setuptools when it is recent enough (offline), else pip's isolated build (the registry).
    isolation = ["--no-build-isolation"] if _setuptools_at_least(68) else []
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", str(out), str(ROOT)],
                           check=True, capture_output=True, text=True)
    assert "Warning" not in built.stdout + built.stderr, (built.stdout + built.stderr)[-3000:]  # a quiet build
    wheel = next(out.glob("adazeta-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "adazeta/reference/paper_numbers.csv" in names  # make_tables' published numbers, outside a checkout
    shipped = {n.removeprefix("adazeta/conf/") for n in names if n.startswith("adazeta/conf/")}
    assert shipped == {str(p.relative_to(ROOT / "conf")) for p in (ROOT / "conf").rglob("*.yaml")}
    # The tools ship too (find_packages finds adazeta.tools and adazeta.tools.bench): every module of the checkout,
    # and no other (a module moved since an earlier build is not shipped again from build/lib: setup.py).
    modules = {str(p.relative_to(ROOT / "src")) for p in (ROOT / "src" / "adazeta").rglob("*.py")}
    assert modules == {n for n in names if n.endswith(".py")} and "adazeta/tools/bench/__main__.py" in modules
    target = out / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    return target


def run_installed(target: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ADAZETA_CONFIG_DIR", "PYTHONPATH")}
    # The installed copy first; this environment's site-packages for torch, transformers, hydra, ... (not its
    # editable adazeta: a path entry runs no .pth file).
    env["PYTHONPATH"] = os.pathsep.join([str(target), *site.getsitepackages()])
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "adazeta.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


TINY = ["model=tiny-llama", "train.max_steps=2", "train.eval_every=2", "train.batch_size=4", "data.num_train=16",
        "data.num_dev=8", "data.num_eval=8", "wandb.mode=disabled"]


def test_the_installed_wheel_runs_outside_the_checkout(installed, fixture_data, tmp_path):
    probe = run_installed(installed, tmp_path, "--cfg", "job", "task=rte")
    assert probe.returncode == 0, probe.stderr
    where = subprocess.run([sys.executable, "-c", "import adazeta.paths as p; print(p.__file__, p.config_dir())"],
                           cwd=tmp_path, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), *site.getsitepackages()])})
    module, conf = where.stdout.split()
    assert module.startswith(str(installed)) and conf == str(installed / "adazeta" / "conf")
    done = run_installed(installed, tmp_path, *TINY, "task=rte", f"data.dir={fixture_data}",
                         f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "finished"
    # the tables, outside the checkout: the published numbers come with the package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), *site.getsitepackages()])}
    tables = subprocess.run([sys.executable, "-m", "adazeta.tools.make_tables", "--results", str(tmp_path),
                             "--out", str(tmp_path / "tables"), "--figures", str(tmp_path / "figures")],
                            cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert tables.returncode == 0, tables.stderr[-2000:]


def test_a_users_config_folder_adds_a_task(installed, fixture_data, tmp_path):
    mine = tmp_path / "my-conf" / "task"
    mine.mkdir(parents=True)
    text = (ROOT / "conf" / "task" / "rte.yaml").read_text().replace("name: rte", "name: my_rte", 1)
    (mine / "my_rte.yaml").write_text(text)
    done = run_installed(installed, tmp_path, "--config-dir", str(tmp_path / "my-conf"), *TINY, "task=my_rte",
                         f"data.dir={fixture_data}", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "run" / "result.json").read_text())
    assert record["status"] == "finished" and record["task"] == "my_rte"


def test_the_installed_tools_run_by_module_path(installed, tmp_path):
    """``python -m adazeta.tools.bench`` (a package with ``__main__``) runs from the installed copy."""
    env = {k: v for k, v in os.environ.items() if k not in ("ADAZETA_CONFIG_DIR", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join([str(installed), *site.getsitepackages()])
    done = subprocess.run([sys.executable, "-m", "adazeta.tools.bench", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: python -m adazeta.tools.bench") and "--scaling-sizes" in done.stdout
