"""Sparse-MeZO (Liu et al. 2024): ZO-SGD that perturbs and updates only a fixed subset of each weight tensor.

The published method perturbs the *small-magnitude* weights: per tensor, the entries whose |w| lies at or below
the ``1 - sparsity`` quantile. The AdaZeta reference code's Sparse-MeZO baseline used a random mask instead
(25 % of the entries, i.e. ``sparsity`` 0.75); ``mask: random`` reproduces that. Masks are computed once, from
the weights at the start of training (seeded for ``random``), and kept as one boolean per trainable entry: a
memory cost of 1 byte per parameter, a quarter of the fp32 weights, and the method's only optimizer state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from adazeta.errors import ConfigError
from adazeta.optim import OPTIMIZERS
from adazeta.optim.spsa import Masks, decay_groups
from adazeta.optim.zo_sgd import ZOSGD, ZOSGDConfig

MASK_KINDS = ("magnitude", "random")


@torch.no_grad()
def magnitude_mask(p: torch.Tensor, density: float) -> torch.Tensor:
    """Boolean mask of the ``ceil(density * numel)`` smallest |w| of ``p`` (ties at the threshold included)."""
    flat = p.detach().abs().reshape(-1).float()
    k = max(1, int(np.ceil(density * flat.numel())))
    if k >= flat.numel():
        return torch.ones_like(p, dtype=torch.bool)
    threshold = flat.kthvalue(k).values
    return p.detach().abs().float() <= threshold


@torch.no_grad()
def random_mask(p: torch.Tensor, density: float, generator: torch.Generator) -> torch.Tensor:
    """Boolean mask with each entry kept with probability ``density``, drawn from ``generator`` (on CPU)."""
    return (torch.rand(p.shape, generator=generator) < density).to(p.device)


def sparse_masks(params: Sequence[torch.Tensor], sparsity: float, kind: str, seed: int) -> list[torch.Tensor]:
    """One boolean mask per parameter: the ``1 - sparsity`` fraction of its entries that ZO-SGD may move."""
    density = 1.0 - sparsity
    if kind == "magnitude":
        return [magnitude_mask(p, density) for p in params]
    # A local generator: the mask never consumes (nor depends on) the global RNG.
    generator = torch.Generator().manual_seed(seed)
    return [random_mask(p, density, generator) for p in params]


class SparseZOSGD(ZOSGD):
    """ZO-SGD whose perturbations and updates are restricted to fixed per-parameter masks (Sparse-MeZO)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        sparsity: float = 0.75,
        mask: str = "magnitude",
        **kwargs: Any,
    ):
        super().__init__(params, **kwargs)
        if not 0.0 <= sparsity < 1.0:
            raise ConfigError(f"SparseZOSGD sparsity={sparsity!r} must be in [0, 1)")
        if mask not in MASK_KINDS:
            raise ConfigError(f"SparseZOSGD mask={mask!r} must be one of {', '.join(MASK_KINDS)}")
        self.sparsity, self.mask_kind = sparsity, mask
        self._params = [p for group in self.param_groups for p in group["params"]]
        # Computed once, from the starting weights: the set of moving entries never changes during training.
        self._masks = sparse_masks(self._params, sparsity, mask, self.seed)

    def masks(self, params: Sequence[torch.Tensor]) -> Masks:
        if len(params) != len(self._params) or any(a is not b for a, b in zip(params, self._params)):
            raise ValueError("SparseZOSGD.masks got parameters other than the ones it was built with")
        return self._masks

    def param_masks(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, mask) pairs in the optimizer's parameter order."""
        return list(zip(self._params, self._masks))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        # The magnitude mask depends on the *starting* weights: resuming must reuse it, not recompute it.
        state["sparse_masks"] = [m.cpu() for m in self._masks]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        masks = state_dict.pop("sparse_masks", None)
        super().load_state_dict(state_dict)
        if masks is not None:
            self._masks = [m.to(p.device) for m, p in zip(masks, self._params)]


@dataclasses.dataclass
class SparseZOSGDConfig(ZOSGDConfig):
    """ZO-SGD hyper-parameters plus the mask: which fraction of each tensor stays still, chosen how."""

    lr: float = 1e-6  # SPEC §5: 1e-6, like MeZO on all weights
    # Fraction of each tensor's entries that are never perturbed nor updated (Sparse-MeZO's "sparsity"):
    # 0.75 moves the 25 % smallest-magnitude entries (or a random 25 % with mask=random).
    sparsity: float = 0.75
    mask: str = "magnitude"  # magnitude: Sparse-MeZO's small-|w| mask; random: the AdaZeta reference baseline

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.sparsity < 1.0:
            raise ConfigError(f"optimizer.sparsity={self.sparsity!r} must be in [0, 1) (the fraction left unperturbed)")
        if self.mask not in MASK_KINDS:
            raise ConfigError(f"optimizer.mask={self.mask!r} must be one of {', '.join(MASK_KINDS)}")
        if self.weight_decay != 0:
            # zo_update_ decays whole tensors, which would move the entries the mask keeps still.
            raise ConfigError(
                f"optimizer.weight_decay={self.weight_decay!r}: Sparse-MeZO moves only masked entries; set it to 0"
            )


@OPTIMIZERS.register("sparse_zo_sgd", SparseZOSGDConfig)
def build_sparse_zo_sgd(
    named_params: Iterable[tuple[str, torch.Tensor]], cfg: SparseZOSGDConfig, seed: int
) -> SparseZOSGD:
    # Every ZO-SGD setting passes through under its own name, so new ZO-SGD options reach Sparse-MeZO too.
    zo = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ZOSGDConfig)}
    groups = decay_groups(named_params, cfg.weight_decay)
    return SparseZOSGD(groups, sparsity=cfg.sparsity, mask=cfg.mask, seed=seed, **zo)
