"""Shared fixtures: no network, fixture data files, the reference adapter sites. Plain helpers are in helpers.py."""

from __future__ import annotations

import logging
import signal
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


def _drop_closed_log_handlers() -> None:
    for logger in (logging.getLogger(), logging.getLogger("adazeta")):
        for handler in list(logger.handlers):
            if getattr(getattr(handler, "stream", None), "closed", False):
                logger.removeHandler(handler)


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """An in-process adazeta-run that exits on a signal ignores further stop signals on its way out (a real process
    then ends); the test process gets its handlers back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.fixture(autouse=True)
def _no_stale_log_handlers():
    """An in-process adazeta-run configures logging (Hydra's job logging) on the streams of that test's capture;
    once the capture is closed, a handler left on them would print "Logging error" tracebacks into later tests."""
    _drop_closed_log_handlers()
    yield
    _drop_closed_log_handlers()


@pytest.fixture
def fixture_data(tmp_path: Path) -> Path:
    return write_fixture_data(tmp_path / "data")


@pytest.fixture
def reference_targets():
    """``(model_type, placement) -> targets``: the reference adapter sites, read from conf/model/hf.yaml."""
    from omegaconf import OmegaConf

    table = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "hf.yaml"))["placements"]
    return lambda model_type, placement="official": table[model_type][placement]
