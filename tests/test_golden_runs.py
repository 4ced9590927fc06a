"""Behaviour does not change: eleven tiny runs (every kind of method) give the numbers the code that made the
committed experiments gave.

tests/data/golden_runs.json was written by ``python tests/test_golden_runs.py OUT`` with the code of commit 5a65df9
(the code that ran results/runs/cpu_zo) and its conf/, on the fixture data of ``helpers.write_fixture_data``. Today's
code reproduced it byte for byte on the machine that wrote it; the test allows a relative 1e-6 on the floats so that
another CPU's kernels (other vector units, other summation orders) do not fail it, which is still far below what a
change of algorithm, noise stream, data order or schedule moves after a few steps.
"""

from __future__ import annotations

import csv
import json
import sys
import tempfile
from pathlib import Path

import pytest

GOLDEN = Path(__file__).with_name("data") / "golden_runs.json"
BASE = ["model=tiny-llama", "task=rte", "data.num_train=32", "data.num_dev=16", "data.num_eval=16",
        "train.batch_size=4", "train.max_steps=6", "train.eval_every=3", "wandb.mode=disabled"]


def numbers(conf_dir: str, data_dir: Path, cases: dict[str, list[str]]) -> dict[str, dict]:
    """Run each case with the adazeta on sys.path and ``conf_dir``; the numbers its CSVs and record hold."""
    from hydra import compose, initialize_config_dir

    from adazeta.run import run

    out = {}
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        for name, extra in cases.items():
            with tempfile.TemporaryDirectory() as tmp:
                cfg = compose(config_name="config", overrides=[*BASE, f"data.dir={data_dir}", *extra])
                record = run(cfg, Path(tmp))

                def rows(name: str) -> list[dict[str, str]]:
                    path = Path(tmp) / name
                    return list(csv.DictReader(open(path))) if path.exists() else []

                out[name] = {
                    "overrides": extra,
                    "train_loss": [r["loss"] for r in rows("metrics.csv")],
                    "n_queries": [r["n_queries"] for r in rows("metrics.csv")],
                    "param_norm": [r["param_norm"] for r in rows("metrics.csv")],
                    "eval": [[r["step"], r["split"], r["loss"], r["accuracy"]] for r in rows("eval.csv")],
                    "record": {k: record.get(k) for k in ("status", "steps", "best_step", "forward_passes",
                                                          "dev_loss", "test_loss", "test_accuracy",
                                                          "trainable_params", "mean_queries")},
                }
    return out


def _close(a, b) -> bool:
    try:
        return float(a) == pytest.approx(float(b), rel=1e-6, abs=1e-9)
    except (TypeError, ValueError):
        return a == b


def _same(new, old) -> bool:
    if isinstance(old, dict):
        return new.keys() == old.keys() and all(_same(new[k], old[k]) for k in old)
    if isinstance(old, list):
        return len(new) == len(old) and all(_same(x, y) for x, y in zip(new, old))
    if isinstance(old, bool) or old is None or isinstance(old, str) and not _is_number(old):
        return new == old
    return _close(new, old)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def test_every_kind_of_method_gives_the_numbers_it_gave_before(tmp_path):
    from helpers import CONF, write_fixture_data

    golden = json.loads(GOLDEN.read_text())
    cases = {name: case["overrides"] for name, case in golden.items()}
    now = numbers(str(CONF), write_fixture_data(tmp_path / "data"), cases)
    changed = [name for name in golden if not _same(now[name], golden[name])]
    assert not changed, f"runs whose numbers changed: {changed}; first: {now[changed[0]]} vs {golden[changed[0]]}"


CASES = {
    "adazeta_adaptive_official_budget": ["method=adazeta", "schedule=adaptive_official", "train.max_steps=1000",
                                         "train.max_forward_passes=40", "train.eval_every_forwards=20"],
    "adazeta_identity_constant_q2": ["method=adazeta", "schedule=constant", "schedule.q=2",
                                     "method.adapter.init=identity", "method.optimizer.lr=1e-3"],
    "adazeta_batched_q3": ["method=adazeta", "schedule=constant", "schedule.q=3",
                           "method.optimizer.batched_queries=true", "method.optimizer.eps=5e-2"],
    "mezo_lora": ["method=mezo_lora", "method.optimizer.lr=1e-3"],
    "mezo": ["method=mezo", "method.optimizer.lr=1e-4"],
    "sparse_mezo": ["method=sparse_mezo", "method.optimizer.lr=1e-4"],
    "mezo_adapter": ["method=mezo_adapter"],
    "tt_adapter_fo": ["method=tt_adapter", "method.optimizer.lr=1e-3"],
    "lora_fo": ["method=lora", "method.optimizer.lr=1e-2"],
    "ft": ["method=ft", "method.optimizer.lr=1e-4"],
    "zero_shot": ["method=zero_shot"],
}

if __name__ == "__main__":  # python tests/test_golden_runs.py OUT [CONF_DIR]: write the golden numbers
    from helpers import CONF, write_fixture_data

    target = Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        result = numbers(sys.argv[2] if len(sys.argv) > 2 else str(CONF), write_fixture_data(Path(tmp)), CASES)
    target.write_text(json.dumps(result, indent=1) + "\n")
