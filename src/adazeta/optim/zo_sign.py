"""ZO-SGD-Sign (ZO-SignSGD; Liu et al. 2019, benchmarked by ZO-Bench, Zhang et al. ICML 2024): the sign of the
ZO gradient estimate, w <- w - lr (sign(g_hat) + wd w).

Deviation: ZO-Bench's code (``zo_sign_opt``) steps along ``sign(g_q) * z_q``, the sign of the scalar projection
times a Gaussian z, which is ZO-SGD with |g_q| dropped. This is the paper's rule, the coordinate-wise sign of the
whole estimate: every moved entry moves by exactly lr. Masked entries (Sparse-MeZO masks) have g_hat = 0 and
sign 0: they stay.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from adazeta.optim import OPTIMIZERS
from adazeta.optim.engine import Step, UpdateRule, decay_, dense_bytes
from adazeta.optim.memory import TrainedSet
from adazeta.optim.spsa import decay_groups
from adazeta.optim.zo_sgd import ZOSGD, ZOSGDConfig


class SignRule(UpdateRule):
    """w <- w (1 - lr wd) - lr sign(g_hat)."""

    name = "sign"

    @torch.no_grad()
    def update_(self, opt: ZOSGD, step: Step) -> int:
        g = step.dense()
        decay_(step.params, step.lrs, step.wds)
        for p, g_i, lr in zip(step.params, g, step.lrs):
            p.add_(torch.sign(g_i).to(p.dtype), alpha=-lr)
        return 0


@dataclasses.dataclass
class ZOSignConfig(ZOSGDConfig):
    """ZO-SGD-Sign: ZO-SGD's estimate, the sign of it as the step; no state."""

    lr: float = 1e-5  # each moved entry moves by lr: far below ZO-SGD's rates

    def update_bytes(self, trained: TrainedSet, kept: bool) -> float:
        return dense_bytes(trained, kept, then=trained.largest_work + trained.cast)  # sign(g_i), in the weights' dtype


@OPTIMIZERS.register("zo_sign", ZOSignConfig)
def build_zo_sign(named_params: Iterable[tuple[str, torch.Tensor]], cfg: ZOSignConfig, seed: int) -> ZOSGD:
    return ZOSGD(decay_groups(named_params, cfg.weight_decay), cfg, seed=seed, rule=SignRule())
