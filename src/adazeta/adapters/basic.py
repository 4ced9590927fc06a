"""The two trivial trainable sets: every weight (MeZO, full fine-tuning) and none (zero-shot)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from adazeta.adapters import ADAPTERS


@dataclass
class FullConfig:
    """Train every parameter of the model (embeddings, norms and head included), as MeZO and FT do."""


@dataclass
class NoneConfig:
    """Train nothing: training-free methods."""


@ADAPTERS.register("full", FullConfig)
def train_all(model: nn.Module, cfg: FullConfig) -> nn.Module:
    model.requires_grad_(True)
    return model


@ADAPTERS.register("none", NoneConfig)
def train_nothing(model: nn.Module, cfg: NoneConfig) -> nn.Module:
    model.requires_grad_(False)
    return model
