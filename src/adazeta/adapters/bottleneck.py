"""Dense bottleneck adapters (Houlsby et al. 2019), the AdaZeta paper's "Adapters" baselines (first-order and MeZO).

The module is the TT adapter's with dense projections: ``h -> h + up(act(down(h)))``, placed with the same
sites (``adazeta.adapters.sites``) and the same ``AdaptedLinear`` wrapper, so that the two differ only in how
``down`` and ``up`` are stored. ``up`` starts at zero, so the adapted model equals the backbone at step 0 (the
usual near-identity start of adapter tuning; the TT adapter's reference init is not the identity).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor, nn

from adazeta.adapters import ADAPTERS, AdapterCapabilities
from adazeta.adapters.sites import PLACEMENT_NAMES, check_targets, linear_features, resolve_sites
from adazeta.adapters.tt import ACTIVATIONS, INITS, AdaptedLinear
from adazeta.errors import ConfigError


@dataclasses.dataclass
class BottleneckAdapterConfig(AdapterCapabilities):
    """Config of the dense bottleneck adapter; validated on construction."""

    takes_sites: ClassVar[bool] = True  # conf/model/*.yaml's placements, unless `targets` names its own

    bottleneck: int = 64  # b: width of the adapter's hidden layer; 2*H*b + H + b parameters per adapter
    activation: str = "relu"  # the nonlinearity between down and up (ACTIVATIONS)
    # "paper": after the attention and feed-forward sub-layers (Houlsby's placement, the default here);
    # "official": the TT reference code's sites (Llama: gate/up inputs and down output). Ignored with `targets`.
    placement: str = "paper"
    # Sites: [{"pattern": regex searched in module names, "position": "input" or "output"}]. None: the model
    # config's placement table for its model_type, else the sites found from the module structure.
    targets: list[dict] | None = None
    # identity (default): `up` starts at zero, so the adapted model equals the backbone at step 0 (Houlsby's
    # near-identity start); reference: PyTorch's nn.Linear init on both projections, not the identity.
    init: str = "identity"

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ConfigError(f"method.adapter.init={self.init!r} is unknown; known: {', '.join(INITS)}")
        if self.bottleneck < 1:
            raise ConfigError(f"method.adapter.bottleneck={self.bottleneck} must be >= 1")
        if self.placement not in PLACEMENT_NAMES:
            raise ConfigError(f"method.adapter.placement={self.placement!r} is unknown; known: {', '.join(PLACEMENT_NAMES)}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"method.adapter.activation={self.activation!r} is unknown; known: {', '.join(ACTIVATIONS)}")
        if self.targets is not None:
            check_targets(self.targets, "method.adapter.targets")

    def count_trainable(self, backbone: nn.Module) -> int:
        """At each site of width H: down (H x b) and up (b x H) with their biases, 2 H b + H + b."""
        total = 0
        for base, position in resolve_sites(backbone, self.targets, self.placement).values():
            fan_in, fan_out = linear_features(base)
            features = fan_in if position == "input" else fan_out
            total += 2 * features * self.bottleneck + features + self.bottleneck
        return total

    def count_modules(self, model: nn.Module) -> int:
        return count_bottleneck_adapters(model)


class BottleneckAdapter(nn.Module):
    """``h -> h + up(act(down(h)))`` with dense fp32 projections, computed in fp32 whatever the dtype of h."""

    def __init__(
        self,
        features: int,
        bottleneck: int,
        activation: str = "relu",
        device: torch.device | None = None,
        init: str = "identity",
    ):
        super().__init__()
        if init not in INITS:
            raise ValueError(f"init={init!r}; known: {', '.join(INITS)}")
        self.down = nn.Linear(features, bottleneck, device=device, dtype=torch.float32)
        self.act = ACTIVATIONS[activation]()
        self.up = nn.Linear(bottleneck, features, device=device, dtype=torch.float32)
        if init == "identity" and self.up.weight.device.type != "meta":
            # Zero output projection: the adapter starts as the identity, so step 0 is the frozen model.
            nn.init.zeros_(self.up.weight)
            nn.init.zeros_(self.up.bias)

    def forward(self, h: Tensor) -> Tensor:
        x = h.float()
        return (x + self.up(self.act(self.down(x)))).to(h.dtype)


def count_bottleneck_adapters(model: nn.Module) -> int:
    return sum(isinstance(m, BottleneckAdapter) for m in model.modules())


def adapter_params(features: int, bottleneck: int) -> int:
    """Parameters of one adapter: two dense matrices and their biases."""
    return 2 * features * bottleneck + features + bottleneck


@ADAPTERS.register("bottleneck", BottleneckAdapterConfig)
def add_bottleneck_adapters(model: nn.Module, cfg: BottleneckAdapterConfig) -> nn.Module:
    """Freeze ``model`` and wrap each targeted linear layer in an AdaptedLinear; only the adapters train.

    Initialisation draws from the global RNG (seeded once by the runner), like any ``nn.Linear``.
    """
    model.requires_grad_(False)
    # The same placement table, matching rules and errors as the TT adapters.
    for name, (base, position) in resolve_sites(model, cfg.targets, cfg.placement).items():
        fan_in, fan_out = linear_features(base)
        features = fan_in if position == "input" else fan_out
        adapter = BottleneckAdapter(features, cfg.bottleneck, cfg.activation, device=base.weight.device, init=cfg.init)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, AdaptedLinear(base, adapter, position))
    from adazeta.runs.saving import refuse_save_pretrained

    refuse_save_pretrained(model)  # its keys are renamed now: adazeta.save_adapters keeps what trains
    return model

