"""Sparse-MeZO (Liu et al. 2024): ZO-SGD that perturbs and updates only a subset of each weight tensor.

Two masks, per tensor, each moving the ``1 - sparsity`` fraction of its entries:

- ``magnitude`` (the published method): the entries whose |w| lies at or below the ``1 - sparsity`` quantile of
  the weights *at the start of training*. Computed once and kept as one boolean per trainable entry (a quarter of
  the fp32 weights), the method's only optimizer state, saved with it so that a resumed run keeps it.
- ``random`` (the AdaZeta reference code's Sparse-MeZO baseline, which moves 25 %: ``sparsity`` 0.75): a new
  random mask every step, drawn from the step's seed (``mask_seed(seed, step)``) and shared by the step's +eps,
  -eps and update passes and by all its queries. It is never stored: each pass redraws it parameter by parameter.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from adazeta.errors import ConfigError
from adazeta.optim import OPTIMIZERS
from adazeta.optim import spsa
from adazeta.optim.memory import TrainedSet
from adazeta.optim.spsa import MASK_SLICE, Masks, PackedMask, RandomMask, decay_groups, mask_seed
from adazeta.optim.zo_sgd import ZOSGD, ZOSGDConfig

MASK_KINDS = ("magnitude", "random")


@torch.no_grad()
def kth_smallest_abs(p: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th smallest |w| of ``p`` (1-based) in fp32: ``p.abs().float().flatten().kthvalue(k)``'s value.

    kthvalue copies the whole tensor (and more): for a 28 M-entry embedding that peak was ~3x its fp32 size.
    Here a radix select reads ``p`` a slice at a time: non-negative floats order like their bit patterns, so one
    pass counts entries per top-16-bit bucket, and the k-th value is the kthvalue of its bucket's few entries.
    """
    flat = p.detach().reshape(-1)
    if not 1 <= k <= flat.numel():
        raise ValueError(f"k={k} is outside 1..{flat.numel()}")

    def buckets(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = part.abs().float()
        return values, values.view(torch.int32) >> 15  # sign bit clear: buckets 0 .. 65535

    counts = torch.zeros(1 << 16, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), MASK_SLICE):
        counts += torch.bincount(buckets(flat[start : start + MASK_SLICE])[1], minlength=1 << 16)
    cumulative = counts.cumsum(0)
    bucket = int(torch.searchsorted(cumulative, torch.tensor(k, device=flat.device)))
    below = int(cumulative[bucket - 1]) if bucket else 0
    members = []
    for start in range(0, flat.numel(), MASK_SLICE):
        values, ids = buckets(flat[start : start + MASK_SLICE])
        members.append(values[ids == bucket])
    return torch.cat(members).kthvalue(k - below).values


def magnitude_threshold(p: torch.Tensor, density: float) -> torch.Tensor | None:
    """The |w| at or below which the ``ceil(density * numel)`` smallest entries of ``p`` lie; None: every entry."""
    k = max(1, int(np.ceil(density * p.numel())))
    return None if k >= p.numel() else kth_smallest_abs(p, k)


@torch.no_grad()
def magnitude_mask(p: torch.Tensor, density: float) -> torch.Tensor:
    """Boolean mask of the ``ceil(density * numel)`` smallest |w| of ``p`` (ties at the threshold included)."""
    threshold = magnitude_threshold(p, density)
    return torch.ones_like(p, dtype=torch.bool) if threshold is None else p.detach().abs().float() <= threshold


@torch.no_grad()
def packed_magnitude_mask(p: torch.Tensor, density: float) -> PackedMask:
    """``magnitude_mask`` packed as bits, computed a slice at a time (no full-size temporary)."""
    threshold = magnitude_threshold(p, density)
    if threshold is None:
        return PackedMask.pack(torch.ones(p.shape, dtype=torch.bool, device=p.device))
    flat = p.detach().reshape(-1)
    bits = []
    for start in range(0, flat.numel(), MASK_SLICE):  # a multiple of 8 entries: slices pack into whole bytes
        bits.append(PackedMask.pack(flat[start : start + MASK_SLICE].abs().float() <= threshold).bits)
    return PackedMask(torch.cat(bits), p.shape)


def sparse_masks(params: Sequence[torch.Tensor], sparsity: float) -> list[PackedMask]:
    """The magnitude mask of every parameter: the ``1 - sparsity`` fraction of its entries that ZO-SGD may move."""
    return [packed_magnitude_mask(p, 1.0 - sparsity) for p in params]


class SparseZOSGD(ZOSGD):
    """ZO-SGD whose perturbations and updates are restricted to per-parameter masks (Sparse-MeZO)."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 config: "SparseZOSGDConfig | None" = None, **kwargs: Any):
        config = config if config is not None else SparseZOSGDConfig()
        super().__init__(params, config, **kwargs)
        self.sparsity, self.mask_kind = config.sparsity, config.mask
        self._params = [p for group in self.param_groups for p in group["params"]]
        # magnitude: computed once, from the starting weights; random: redrawn from each step's seed, never stored.
        self._masks = sparse_masks(self._params, self.sparsity) if self.mask_kind == "magnitude" else None

    def masks(self, params: Sequence[torch.Tensor]) -> Masks:
        """The masks of the coming step (``state_step``)."""
        if len(params) != len(self._params) or any(a is not b for a, b in zip(params, self._params)):
            raise ValueError("SparseZOSGD.masks got parameters other than the ones it was built with")
        if self._masks is None:
            return RandomMask(mask_seed(self.seed, self.state_step), 1.0 - self.sparsity)
        return self._masks

    def param_masks(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, mask) pairs of the coming step, in the optimizer's order (random masks are materialised)."""
        masks = self.masks(self._params)
        if isinstance(masks, RandomMask):
            return list(zip(self._params, masks.for_params(self._params)))
        return [(p, m.dense()) for p, m in zip(self._params, masks)]

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._masks is not None:
            # The magnitude mask depends on the *starting* weights: resuming must reuse it, not recompute it.
            # (A random mask needs nothing: it follows from the seed and the step count the base class saves.)
            state["sparse_masks"] = [m.to("cpu").bits for m in self._masks]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        masks = state_dict.pop("sparse_masks", None)
        super().load_state_dict(state_dict)
        if masks is not None and self._masks is not None:
            # bits (uint8), or the one bool per entry that checkpoints of earlier releases hold
            self._masks = [(PackedMask.pack(m) if m.dtype == torch.bool else PackedMask(m, p.shape)).to(p.device)
                           for m, p in zip(masks, self._params)]


@dataclasses.dataclass
class SparseZOSGDConfig(ZOSGDConfig):
    """ZO-SGD hyper-parameters plus the mask: which fraction of each tensor stays still, chosen how."""

    lr: float = 1e-6  # like MeZO on all weights
    # Fraction of each tensor's entries that are never perturbed nor updated (Sparse-MeZO's "sparsity"):
    # 0.75 moves the 25 % smallest-magnitude entries (or a random 25 %, redrawn each step, with mask=random).
    sparsity: float = 0.75
    # magnitude: Sparse-MeZO's small-|w| mask, fixed at the start; random: a new mask each step (AdaZeta reference)
    mask: str = "magnitude"

    def state_bytes(self, entries: int, width: int) -> float:
        # the magnitude mask is kept, one bit per entry (spsa.PackedMask); a random mask is redrawn, never kept
        return entries / 8 if self.mask == "magnitude" else 0.0

    def mask_bytes(self, trained: TrainedSet) -> int:
        """What masking a pass's noise holds. Random: the bools of a chunk's tensors or of the largest one, beside
        its uniform draw (``spsa._uniform_below``: on a CPU ``MASK_SLICE`` entries at a time). Magnitude: a slice's
        bits spread to z's dtype (``PackedMask.mul_into_``)."""
        if self.mask == "random":
            bools = min(trained.entries, max(spsa.CHUNK_BYTES // trained.width, trained.largest))
            uniform = min(trained.largest, spsa.MASK_SLICE) if trained.device == "cpu" else trained.largest
            return bools + 4 * uniform
        return min(trained.largest, spsa.MASK_SLICE) * (trained.width + 1)

    def estimate_bytes(self, trained: TrainedSet, queries: int) -> float:
        return super().estimate_bytes(trained, queries) + self.mask_bytes(trained)

    def update_bytes(self, trained: TrainedSet, kept: bool) -> float:
        return super().update_bytes(trained, kept) + self.mask_bytes(trained)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.sparsity < 1.0:
            raise ConfigError(f"method.optimizer.sparsity={self.sparsity!r} must be in [0, 1) (the fraction left unperturbed)")
        if self.mask not in MASK_KINDS:
            raise ConfigError(f"method.optimizer.mask={self.mask!r} must be one of {', '.join(MASK_KINDS)}")
        if self.weight_decay != 0:
            # zo_update_ decays whole tensors, which would move the entries the mask keeps still.
            raise ConfigError(
                f"method.optimizer.weight_decay={self.weight_decay!r}: Sparse-MeZO moves only masked entries; set it to 0"
            )


@OPTIMIZERS.register("sparse_zo_sgd", SparseZOSGDConfig)
def build_sparse_zo_sgd(
    named_params: Iterable[tuple[str, torch.Tensor]], cfg: SparseZOSGDConfig, seed: int
) -> SparseZOSGD:
    return SparseZOSGD(decay_groups(named_params, cfg.weight_decay), cfg, seed=seed)
