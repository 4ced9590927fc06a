"""ZO-Adam (ZO-AdaMM, Chen et al. 2019; benchmarked by ZO-Bench, Zhang et al. ICML 2024): ZO-SGD's estimate
g = g_hat + wd w fed to Adam, as torch's ``Adam`` (ZO-Bench's ``zo_adam``) computes it:

    m <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2,   t <- t + 1
    w <- w - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + adam_eps)

Two buffers the size of the trained parameters (kept in at least float32) and a step count, checkpointed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import torch

from adazeta.errors import ConfigError
from adazeta.optim import OPTIMIZERS
from adazeta.optim.engine import Step, UpdateRule, dense_bytes
from adazeta.optim.memory import TrainedSet
from adazeta.optim.spsa import decay_groups
from adazeta.optim.zo_sgd import ZOSGD, ZOSGDConfig


class AdamRule(UpdateRule):
    name = "adam"
    buffers = 2

    def __init__(self, betas: tuple[float, float], eps: float):
        super().__init__()
        self.betas, self.eps = betas, eps

    @torch.no_grad()
    def update_(self, opt: ZOSGD, step: Step) -> int:
        b1, b2 = self.betas
        g = step.dense()
        for slot, p, g_i, lr, wd in zip(self.slots(step.params), step.params, g, step.lrs, step.wds):
            if wd > 0:
                g_i = g_i.add(p, alpha=wd)
            if not slot:
                slot["exp_avg"], slot["exp_avg_sq"] = torch.zeros_like(g_i), torch.zeros_like(g_i)
                slot["step"] = torch.zeros((), dtype=torch.float64)
            slot["step"] += 1
            t = float(slot["step"])
            m, v = slot["exp_avg"], slot["exp_avg_sq"]
            m.mul_(b1).add_(g_i, alpha=1 - b1)
            v.mul_(b2).addcmul_(g_i, g_i, value=1 - b2)
            denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(self.eps)
            p.add_((m / denom).to(p.dtype), alpha=-lr / (1 - b1**t))
        return 0


@dataclasses.dataclass
class ZOAdamConfig(ZOSGDConfig):
    """ZO-Adam: ZO-SGD's estimate, Adam's update (torch's, coupled L2 weight decay)."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8  # Adam's denominator guard (``eps`` is the ZO perturbation scale)

    def state_bytes(self, entries: int, width: int) -> float:
        return entries * max(width, 4) * AdamRule.buffers

    def update_bytes(self, trained: TrainedSet, kept: bool) -> float:
        # beside g_hat, a tensor's g + wd w, sqrt(v) and its quotient while the last tensor's denominator lives on,
        # then m / denom cast to the weights' dtype
        return dense_bytes(trained, kept, then=(4 if self.weight_decay else 3) * trained.largest_work + trained.cast)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.betas = tuple(self.betas)  # type: ignore[assignment]  # Hydra hands lists
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"method.optimizer.betas={list(self.betas)!r} must be two values in [0, 1)")
        if self.adam_eps <= 0:
            raise ConfigError(f"method.optimizer.adam_eps={self.adam_eps!r} must be > 0")


@OPTIMIZERS.register("zo_adam", ZOAdamConfig)
def build_zo_adam(named_params: Iterable[tuple[str, torch.Tensor]], cfg: ZOAdamConfig, seed: int) -> ZOSGD:
    return ZOSGD(decay_groups(named_params, cfg.weight_decay), cfg, seed=seed, rule=AdamRule(cfg.betas, cfg.adam_eps))
