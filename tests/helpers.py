"""Plain helpers and constants the tests share: paths, markers for the real files, fixture data, Hydra
composition. Tests import them with ``from helpers import ...`` (the tests folder is on sys.path)."""

from __future__ import annotations

import csv
import json
import os
import random
import signal
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import adazeta  # noqa: F401  (registers ${experiment_sweep:}, which experiment configs compose with)
from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SHARED = ROOT.parent / "shared"
SHARED_DATA = SHARED / "data"
SHARED_MODELS = SHARED / "models"

needs_shared_data = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data is not present")
needs_shared_model = pytest.mark.skipif(
    not (SHARED_MODELS / "SmolLM2-135M-Instruct").is_dir(), reason="../shared/models is not present"
)

WORDS = "the a movie film plot actor good bad great terrible fine dull bright story scene music long short".split()


def write_fixture_data(root: Path, n_train: int = 120, n_eval: int = 40, seed: int = 0) -> Path:
    """Small RTE-shaped (JSON lines) and SST-2-shaped (TSV) files in the local layout the task specs expect."""
    rng = random.Random(seed)
    rte = root / "superglue" / "RTE"
    rte.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.jsonl", n_train), ("val.jsonl", n_eval)):
        with open(rte / name, "w") as f:
            for i in range(n):
                premise = " ".join(rng.choices(WORDS, k=rng.randint(5, 12)))
                label = rng.choice(["entailment", "not_entailment"])
                hypothesis = premise.split()[0] + " is here" if label == "entailment" else "nothing"
                f.write(json.dumps({"premise": premise, "hypothesis": hypothesis, "label": label, "idx": i}) + "\n")
    sst = root / "glue" / "SST-2"
    sst.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.tsv", n_train), ("dev.tsv", 10), ("test.tsv", n_eval)):
        with open(sst / name, "w") as f:
            f.write("sentence\tlabel\n")
            for _ in range(n):
                label = rng.randint(0, 1)
                word = "great" if label else "bad"
                f.write(" ".join(rng.choices(WORDS, k=rng.randint(3, 8)) + [word]) + f"\t{label}\n")
    # Masked LMs read SST-2 in the LM-BFF k-shot layout (16 per class, data seed 13: the data.k/kshot_seed defaults).
    kshot = root / "lm-bff" / "k-shot" / "SST-2" / "16-13"
    kshot.mkdir(parents=True, exist_ok=True)
    for name, per_class in (("train.tsv", 16), ("dev.tsv", 16), ("test.tsv", n_eval // 2)):
        rows = [
            " ".join(rng.choices(WORDS, k=rng.randint(3, 8)) + [word]) + f"\t{label}"
            for label, word in ((0, "bad"), (1, "great"))
            for _ in range(per_class)
        ]
        (kshot / name).write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    return root


def compose_cfg(overrides: list[str]) -> DictConfig:
    """The config `adazeta-run` would build from these command-line overrides."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=False)


def tiny_overrides(data_dir: Path, *extra: str) -> list[str]:
    """A few-second run on tiny-llama with fixture data, no wandb."""
    return [
        "model=tiny-llama",
        "task=rte",
        f"data.dir={data_dir}",
        "data.num_train=32",
        "data.num_dev=16",
        "data.num_eval=16",
        "train.max_steps=4",
        "train.eval_every=2",
        "train.batch_size=4",
        "wandb.mode=disabled",
        *extra,
    ]


# Columns that measure the machine, not the computation: they differ between any two runs.
TIMING = {"step_time_s", "peak_mem_mb"}


def rows(path: Path, drop: set[str] = frozenset()) -> list[dict[str, str]]:
    """A CSV's rows, without the columns in ``drop``."""
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if k not in drop} for r in csv.DictReader(f)]


def signal_at_step(monkeypatch, step: int, signum: int = signal.SIGTERM, times: int = 1) -> None:
    """Send ``signum`` (``times`` times in a row) to this process right after the loop has logged ``step``, inside
    that step (a real signal, real handler)."""
    from adazeta.tracking import Tracker

    log_step = Tracker.log_step

    def log_and_signal(self, row):
        log_step(self, row)
        if row["step"] == step:
            for _ in range(times):
                os.kill(os.getpid(), signum)

    monkeypatch.setattr(Tracker, "log_step", log_and_signal)


STUDY_ORDER = ["cpu_zo", "cpu_zo_claims", "cpu_zo_speed", "cpu_zo_optimizers", "cpu_zo_optimizers_recentred",
               "cpu_zo_optimizers_lora_recentred", "grad_fidelity"]


def study_pages() -> str:
    """The studies' pages (studies/<name>/README.md) one after the other: what the tests hold to the reports."""
    root = Path(__file__).resolve().parents[1] / "studies"
    return "\n".join((root / name / "README.md").read_text() for name in STUDY_ORDER)


def study_script(name: str):
    """A study's own report module (studies/<name>/report.py), imported from its file: it is not in the package."""
    import importlib.util

    path = ROOT / "studies" / name / "report.py"
    spec = importlib.util.spec_from_file_location(f"study_{name}_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
