"""First-order baselines of the AdaZeta paper's tables (FT, LoRA-FO, adapters-FO): torch's AdamW behind the
optimizer registry."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Iterable

import torch

from adazeta.errors import ConfigError
from adazeta.optim import OPTIMIZERS, OptimizerCapabilities
from adazeta.optim.memory import TrainedSet
from adazeta.optim.spsa import decay_groups


@dataclasses.dataclass
class AdamWConfig(OptimizerCapabilities):
    """AdamW hyper-parameters; the reference FT runs on Llama-2-7B use lr 1e-5."""

    zeroth_order: ClassVar[bool] = False

    lr: float = 1e-5  # learning rate (the reference's FT rate on Llama-2-7B)
    weight_decay: float = 0.0  # decoupled decay on weights only, never on biases or norms
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8  # AdamW's denominator guard (not the ZO perturbation scale)
    grad_clip: float | None = None  # max global grad norm, applied by the training loop; None: no clipping

    def state_bytes(self, entries: int, width: int) -> float:
        return entries * 2.0 * width  # exp_avg and exp_avg_sq, in the trained parameters' dtype

    def step_bytes(self, trained: TrainedSet, queries: int) -> float:
        # torch's per-tensor path (a CPU): a tensor's sqrt(v) and its quotient while the last tensor's denominator
        # lives on; its multi-tensor path (a GPU): sqrt(v) of every tensor at once
        per_tensor = 3 * trained.largest * trained.width
        return per_tensor if trained.device == "cpu" else max(per_tensor, trained.nbytes)

    def __post_init__(self) -> None:
        # Hydra hands lists; a tuple keeps the config hashable and matches torch's signature.
        self.betas = tuple(self.betas)  # type: ignore[assignment]
        # lr > 0 is every optimizer's rule, checked once with the settings (``adazeta.settings``).
        if self.weight_decay < 0:
            raise ConfigError(f"method.optimizer.weight_decay={self.weight_decay!r} must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"method.optimizer.betas={list(self.betas)!r} must be two values in [0, 1)")
        if self.eps <= 0:
            raise ConfigError(f"method.optimizer.eps={self.eps!r} must be > 0")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError(f"method.optimizer.grad_clip={self.grad_clip!r} must be > 0 or null (no clipping)")


class AdamW(torch.optim.AdamW):
    """torch's AdamW that first clips the global gradient norm to ``grad_clip`` (None: no clipping).

    The first-order contract of the training loop: gradients are in ``.grad`` (the loop ran backward), then
    ``step()``; ``zeroth_order`` is False. Built from its config (checked when it was made).
    """

    zeroth_order = False

    def __init__(self, params, config: AdamWConfig):
        super().__init__(params, lr=config.lr, betas=config.betas, eps=config.eps)
        self.config = config
        self.grad_clip = config.grad_clip

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], self.grad_clip)
        return super().step(closure)


@OPTIMIZERS.register("adamw", AdamWConfig)
def build_adamw(named_params: Iterable[tuple[str, torch.Tensor]], cfg: AdamWConfig, seed: int) -> AdamW:
    # seed is unused: AdamW draws no randomness.
    return AdamW(decay_groups(named_params, cfg.weight_decay), cfg)
