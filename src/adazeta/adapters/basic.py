"""The two trivial trainable sets: every weight (MeZO, full fine-tuning) and none (zero-shot); and the LM head as
the reference RoBERTa code treats it (``untie_head``, ``head_module``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from adazeta.adapters import ADAPTERS, AdapterCapabilities


@dataclass
class FullConfig(AdapterCapabilities):
    """Train every parameter of the model (embeddings, norms and head included), as MeZO and FT do.

    ``freeze_head``: the LM head is untied from the input embeddings (its own copy of the pretrained output
    matrix) and frozen, everything else trains: AdaZeta's RoBERTa prompt model (medium_models/run.py 1046-1049:
    every ``lm_head.*`` parameter frozen for MODE=ft, the head built untied in models.py 185-196).
    """

    trains_backbone: ClassVar[bool] = True
    replicable: ClassVar[bool] = False
    freeze_head: bool = False

    def count_trainable(self, backbone: nn.Module) -> int:
        """Every weight once; with ``freeze_head``, less those only the head holds (a tied matrix also trains as
        the input embeddings)."""
        sizes = {id(p): p.numel() for p in backbone.parameters()}
        if not self.freeze_head:
            return sum(sizes.values())
        head = {id(m) for m in head_module(backbone).modules()}
        outside = {id(p) for m in backbone.modules() if id(m) not in head for p in m.parameters(recurse=False)}
        return sum(n for key, n in sizes.items() if key in outside)


@dataclass
class NoneConfig(AdapterCapabilities):
    """Train nothing: training-free methods."""

    trains: ClassVar[bool] = False
    replicable: ClassVar[bool] = False


@ADAPTERS.register("full", FullConfig)
def train_all(model: nn.Module, cfg: FullConfig) -> nn.Module:
    model.requires_grad_(True)
    if cfg.freeze_head:
        untie_head(model)
        head_module(model).requires_grad_(False)
    return model


def head_module(model: nn.Module) -> nn.Module:
    """The LM head: ``lm_head`` (RoBERTa's dense + norm + decoder, Llama's projection), else the output embeddings."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = getattr(base, "lm_head", None)
    return head if isinstance(head, nn.Module) else base.get_output_embeddings()


def untie_head(model: nn.Module) -> None:
    """Give the output projection its own copy of the weights it shares with the input embeddings (if tied), so
    that training one never moves the other; the model's config records that they are no longer tied."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out, inp = base.get_output_embeddings(), base.get_input_embeddings()
    if out is not None and inp is not None and out.weight is inp.weight:
        out.weight = nn.Parameter(inp.weight.detach().clone(), requires_grad=inp.weight.requires_grad)
    if getattr(base.config, "tie_word_embeddings", False):
        base.config.tie_word_embeddings = False


@ADAPTERS.register("none", NoneConfig)
def train_nothing(model: nn.Module, cfg: NoneConfig) -> nn.Module:
    model.requires_grad_(False)
    return model
