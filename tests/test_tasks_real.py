"""Marked: zero-shot SmolLM2-135M on 100 real examples each of RTE, CB, COPA and SST-2 (../shared)."""

from __future__ import annotations

import csv
import json

import pytest

import adazeta.build as build_module
import adazeta.run as run_module
from helpers import SHARED_DATA, SHARED_MODELS, compose_cfg, needs_shared_data, needs_shared_model

pytestmark = [pytest.mark.slow, needs_shared_data, needs_shared_model]


def test_zero_shot_smollm2_records_accuracy_on_four_real_tasks(tmp_path, monkeypatch):
    loaded = []
    load_model = build_module.load_model

    def load_once(cfg, seed=0):  # zero-shot leaves the model untouched: the four runs can share one load
        if not loaded:
            loaded.append(load_model(cfg, seed=seed))
        return loaded[0]

    monkeypatch.setattr(build_module, "load_model", load_once)
    accuracies = {}
    for task in ("rte", "cb", "copa", "sst2"):
        out = tmp_path / task
        cfg = compose_cfg([
            "method=zero_shot", f"task={task}", "model=smollm2-135m", f"model.model_dir={SHARED_MODELS}",
            f"data.dir={SHARED_DATA}", "data.num_dev=4", "task.num_dev=null", "data.num_eval=100",
            "wandb.mode=disabled",
        ])
        record = run_module.run(cfg, out)
        saved = json.loads((out / "result.json").read_text())
        assert saved["status"] == "finished" and saved["task"] == task and saved["metric"] == "accuracy"
        assert saved["num_eval"] == (56 if task == "cb" else 100)  # CB's validation split has 56 rows
        with open(out / "eval.csv") as f:
            rows = list(csv.DictReader(f))
        assert [r["split"] for r in rows] == ["dev", "test"]
        assert float(rows[-1]["accuracy"]) == pytest.approx(saved["test_accuracy"])
        accuracies[task] = record["test_accuracy"]
    print("zero-shot SmolLM2-135M test accuracy:", accuracies)
    assert all(0.0 <= a <= 1.0 for a in accuracies.values())
