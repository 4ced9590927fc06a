"""Marked tests on the real SmolLM2-135M (GGUF from ../shared/models) and real data from ../shared/data."""

from __future__ import annotations

import csv

import pytest

from adazeta.run import run
from helpers import SHARED_DATA, SHARED_MODELS, compose_cfg, needs_shared_data, needs_shared_model

pytestmark = [pytest.mark.slow, needs_shared_data, needs_shared_model]


def test_adazeta_on_smollm2_with_real_rte(tmp_path):
    cfg = compose_cfg(
        [
            "model=smollm2-135m",
            "task=rte",
            "method=adazeta",
            f"model.model_dir={SHARED_MODELS}",
            f"data.dir={SHARED_DATA}",
            "data.num_train=32",
            "data.num_dev=16",
            "data.num_eval=32",
            "train.batch_size=4",
            "train.max_steps=3",
            "train.eval_every=3",
            "wandb.mode=disabled",
        ]
    )
    record = run(cfg, tmp_path)
    assert record["status"] == "finished"
    assert record["model_source"]["kind"] == "local" and record["model_source"]["gguf_file"]
    assert record["trainable_params"] == 179_100  # 90 adapters with the reference code's shapes
    assert record["total_params"] == 134_515_008 + 179_100
    assert 0.0 <= record["dev_accuracy"] <= 1.0 and 0.0 <= record["test_accuracy"] <= 1.0
    with open(tmp_path / "eval.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["split"] for r in rows] == ["dev", "dev", "test"]
    assert all(float(r["loss"]) > 0 for r in rows)


def test_the_gguf_conversion_bar_shows_only_when_verbose(tmp_path, capfd):
    overrides = ["model=smollm2-135m", "method=zero_shot", "task=sst2", f"model.model_dir={SHARED_MODELS}",
                 f"data.dir={SHARED_DATA}", "data.num_train=8", "data.num_dev=8", "data.num_eval=8",
                 "wandb.mode=disabled"]
    run(compose_cfg(overrides), tmp_path / "quiet")
    assert "Converting and de-quantizing GGUF" not in capfd.readouterr().err
    run(compose_cfg([*overrides, "verbose=true"]), tmp_path / "verbose")
    assert "Converting and de-quantizing GGUF" in capfd.readouterr().err
