"""Adapters a run saved, loaded onto the model to evaluate them (``method=eval eval.from=<run dir>``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from torch import nn

from adazeta.adapters import ADAPTERS, AdapterCapabilities
from adazeta.errors import ConfigError


def saved_folder(source: str) -> Path:
    """The folder of saved adapters ``source`` names: an ``adapter/`` folder itself, or the run directory that holds
    one."""
    from adazeta.saving import ADAPTER_CONFIG

    path = Path(source).expanduser()
    for folder in (path, path / "adapter"):
        if (folder / ADAPTER_CONFIG).is_file() or (folder / "adapter_config.json").is_file():
            return folder
    if not path.exists():
        raise ConfigError(f"eval.from={source}: no such folder; point it at a run directory or its adapter/ folder")
    raise ConfigError(f"eval.from={source} holds no saved adapters (neither it nor {path / 'adapter'} has "
                      f"{ADAPTER_CONFIG} or peft's adapter_config.json); the run may have had train.save=none, or "
                      "trained the whole model (train.save_model=true writes model/: use it as model.path)")


@dataclass
class SavedConfig(AdapterCapabilities):
    """The adapters saved in ``source`` (a run directory or its ``adapter/`` folder); nothing trains."""

    trains: ClassVar[bool] = False
    replicable: ClassVar[bool] = False

    source: str | None = None

    def check_ready(self) -> None:
        if not self.source:
            raise ConfigError("method=eval needs eval.from=<run directory or its adapter/ folder>")
        saved_folder(self.source)  # checked before any model loads


@ADAPTERS.register("saved", SavedConfig)
def load_saved(model: nn.Module, cfg: SavedConfig) -> nn.Module:
    from adazeta.saving import load_adapters

    cfg.check_ready()

    model = load_adapters(model, saved_folder(cfg.source))
    model.requires_grad_(False)
    return model
