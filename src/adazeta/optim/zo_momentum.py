"""ZO-SGD-MMT (ZO-Bench, Zhang et al. ICML 2024): ZO-SGD's estimate with heavy-ball momentum, as torch's SGD
applies it (ZO-Bench hands the estimate to ``torch.optim.SGD(momentum=...)``):

    d = g_hat + wd w,   b <- mu b + d   (b = d on the first step),   w <- w - lr b

One buffer the size of the trained parameters (its state, checkpointed). Unlike ZO-SGD's update, which is
applied from the seeds, g_hat is materialised for the step.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from adazeta.errors import ConfigError
from adazeta.optim import OPTIMIZERS
from adazeta.optim.engine import Step, UpdateRule, dense_bytes
from adazeta.optim.memory import TrainedSet
from adazeta.optim.spsa import decay_groups
from adazeta.optim.zo_sgd import ZOSGD, ZOSGDConfig


class MomentumRule(UpdateRule):
    name = "momentum"
    buffers = 1

    def __init__(self, momentum: float):
        super().__init__()
        self.momentum = momentum

    @torch.no_grad()
    def update_(self, opt: ZOSGD, step: Step) -> int:
        g = step.dense()
        for slot, p, g_i, lr, wd in zip(self.slots(step.params), step.params, g, step.lrs, step.wds):
            d = g_i.add(p, alpha=wd) if wd > 0 else g_i
            buf = slot.get("momentum")
            if buf is None:
                buf = slot["momentum"] = d.clone()
            else:
                buf.mul_(self.momentum).add_(d)
            p.add_(buf.to(p.dtype), alpha=-lr)
        return 0


@dataclasses.dataclass
class ZOMomentumConfig(ZOSGDConfig):
    """ZO-SGD with momentum: ZO-SGD's estimate, torch SGD's heavy-ball update."""

    momentum: float = 0.9

    def state_bytes(self, entries: int, width: int) -> float:
        return entries * max(width, 4) * MomentumRule.buffers  # the buffer, kept in at least float32

    def update_bytes(self, trained: TrainedSet, kept: bool) -> float:
        # beside g_hat, a tensor's g + wd w (the last one's still referenced) and its buffer in the weights' dtype
        return dense_bytes(trained, kept, then=(2 * trained.largest_work if self.weight_decay else 0) + trained.cast)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"method.optimizer.momentum={self.momentum!r} must be in [0, 1)")


@OPTIMIZERS.register("zo_momentum", ZOMomentumConfig)
def build_zo_momentum(named_params: Iterable[tuple[str, torch.Tensor]], cfg: ZOMomentumConfig, seed: int) -> ZOSGD:
    return ZOSGD(decay_groups(named_params, cfg.weight_decay), cfg, seed=seed, rule=MomentumRule(cfg.momentum))
