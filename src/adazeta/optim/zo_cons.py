"""ZO-SGD-Cons (ZO-Bench, Zhang et al. ICML 2024, ``zo_conserv``): ZO-SGD that only moves to a point no worse
than where it stands. With d = lr (g_hat + wd w), the step evaluates the minibatch loss at three candidates and
keeps the best, breaking ties as ZO-Bench's code does:

    L0 = L(w), L1 = L(w - d), L2 = L(w + d)
    L1 > L0:  w if L0 < L2, else w + d;      otherwise:  w - d if L1 < L2, else w + d

Three forwards a step beyond the estimate's. The candidates are evaluated on the whole minibatch by this process,
so the optimizer runs on one process (a shard's loss would compare other candidates on every rank).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from adazeta.optim import OPTIMIZERS
from adazeta.optim.engine import Step, UpdateRule, as_loss, dense_bytes
from adazeta.optim.memory import TrainedSet
from adazeta.optim.spsa import decay_groups
from adazeta.optim.zo_sgd import ZOSGD, ZOSGDConfig


class ConservativeRule(UpdateRule):
    name = "conservative"
    candidates = 3  # forwards a step evaluates beyond its estimate: L0, L1, L2

    @torch.no_grad()
    def update_(self, opt: ZOSGD, step: Step) -> int:
        if step.closure is None:
            raise ValueError("ZO-SGD-Cons needs the step's closure to compare its candidates")
        g = step.dense()  # also undoes a pending perturbation: the weights are w
        params = step.params
        start = [p.detach().clone() for p in params]  # exact returns to w (the set is copied once)
        moves = [lr * (g_i + wd * w) if wd > 0 else lr * g_i for g_i, w, lr, wd in zip(g, start, step.lrs, step.wds)]

        def place(sign: float) -> None:
            for p, w, d in zip(params, start, moves):
                p.copy_((w.to(d.dtype) + sign * d).to(p.dtype) if sign else w)

        loss0 = as_loss(step.closure())
        place(-1.0)
        loss1 = as_loss(step.closure())
        place(+1.0)
        loss2 = as_loss(step.closure())
        if bool(loss1 > loss0):
            chosen = 0.0 if bool(loss0 < loss2) else +1.0
        else:
            chosen = -1.0 if bool(loss1 < loss2) else +1.0
        if chosen != +1.0:
            place(chosen)
        return self.candidates


@dataclasses.dataclass
class ZOConsConfig(ZOSGDConfig):
    """ZO-SGD-Cons: ZO-SGD's estimate; the step is taken, reversed or skipped, whichever loss is lowest."""

    def forwards(self, queries: int) -> int:
        return super().forwards(queries) + ConservativeRule.candidates

    @property
    def parallel_modes(self) -> tuple[str, ...]:
        return ()

    def update_bytes(self, trained: TrainedSet, kept: bool) -> float:
        # beside g_hat, the copy of w the candidates return to and the move d (whole, through the candidates'
        # forwards), and a tensor's w in d's dtype, +-d and their sum, cast to the weights' dtype
        held = trained.nbytes + trained.work
        return dense_bytes(trained, kept, then=held + 3 * trained.largest_work + trained.cast)


@OPTIMIZERS.register("zo_cons", ZOConsConfig)
def build_zo_cons(named_params: Iterable[tuple[str, torch.Tensor]], cfg: ZOConsConfig, seed: int) -> ZOSGD:
    return ZOSGD(decay_groups(named_params, cfg.weight_decay), cfg, seed=seed, rule=ConservativeRule())
