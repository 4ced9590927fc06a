"""Shared fixtures: no network, fixture data files, the reference adapter sites. Plain helpers are in helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import CONF, write_fixture_data


@pytest.fixture(autouse=True)
def _no_network_no_env(monkeypatch):
    """Tests never reach the Hub and never inherit a user's offline directories or wandb settings."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("ADAZETA_DATA_DIR", raising=False)
    monkeypatch.delenv("ADAZETA_MODEL_DIR", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


@pytest.fixture
def fixture_data(tmp_path: Path) -> Path:
    return write_fixture_data(tmp_path / "data")


@pytest.fixture
def reference_targets():
    """``(model_type, placement) -> targets``: the reference adapter sites, read from conf/model/hf.yaml."""
    from omegaconf import OmegaConf

    table = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "hf.yaml"))["placements"]
    return lambda model_type, placement="official": table[model_type][placement]
