"""HiZOO (Zhao et al., "Second-Order Fine-Tuning without Pain for LLMs: A Hessian Informed Zeroth-Order
Optimizer", ICLR 2025): ZO-SGD preconditioned by a diagonal Hessian Sigma, estimated from the same forwards.

With Sigma (one entry per trained weight, ones at the start, kept and checkpointed), a = ``hessian_smooth``, and
z_q the engine's seeded Gaussian directions, a step of Q queries takes 2Q + 1 forwards:

    L0 = L(w),  L_q+ = L(w + eps Sigma^{-1/2} z_q),  L_q- = L(w - eps Sigma^{-1/2} z_q)
    Sigma' = (1 - a) Sigma + a (1/Q) sum_q |L_q+ + L_q- - 2 L0| / (2 eps^2) * Sigma * z_q * z_q
    g = (1/Q) sum_q (L_q+ - L_q-) / (2 eps) * z_q / sqrt(Sigma')
    w <- w - lr (g + wd w)

Source: the paper's Algorithm 1 and its public code (``HiZOOtrainer.zo_Hessian_step_update``, as copied in
OPTML-Group/ZO-Muon ``llm/HiZOOtrainer.py``); a = 1e-8 is the README's HiZOO command (``constant1e-8``).
Where this implementation differs, and why:

- Q > 1 (the reference takes one query a step): every query is evaluated with the step's starting Sigma, Sigma is
  updated once with the mean of the queries' estimates, and the update is the mean of the g's, each divided by
  the new Sigma's root (``reduction=sum``: their sum; Sigma still takes the mean, being an average).
- Sigma is kept in at least float32 (the reference keeps it in the weights' dtype, fp16 in its scripts, where
  the a * estimate term of 1e-8 rounds away).
- z is the engine's seeded stream (``method.optimizer.noise``) from local generators, not ``torch.manual_seed``
  of the global RNG; the weights are restored exactly after each perturbation (``own_directions``) instead of by
  the +1, -2, +1 perturbation sequence.
- The reference evaluates one more forward after the update, only to return a loss to log; here the step logs
  the mean of its 2Q + 1 losses, as every ZO step does, and ``forwards(q)`` counts 2Q + 1.
- Weight decay applies to the parameter groups that decay (``decay_groups``: not biases or norms), as in the
  reference's MeZO update; the reference's HiZOO update decays every parameter.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Iterable, Sequence

import torch

from adazeta.errors import ConfigError
from adazeta.optim import OPTIMIZERS
from adazeta.optim.engine import Queries, Step, UpdateRule, decay_
from adazeta.optim.memory import TrainedSet, draw_bytes, piece_bytes
from adazeta.optim.own_directions import OwnDirections, OwnDirectionsConfig, work_dtype
from adazeta.optim.spsa import NoiseLayout, each_draw, decay_groups, projected_gradient
from adazeta.optim.zo_sgd import ZOSGD

Piece = Callable[[int, int, torch.Tensor, torch.Tensor], None]  # (parameter index, first entry, flat view, z)


def _each_piece(layout: NoiseLayout, seed: int, kept: list[torch.Tensor] | None, fn: Piece) -> None:
    """``fn(i, start, view, z)`` for every piece of z drawn from ``seed`` (the engine's stream), or of ``kept``."""
    if kept is not None:
        for i, z in enumerate(kept):
            fn(i, 0, layout.flat[i], z)
        return

    def apply(index: list[int], views: list[torch.Tensor], zs: list[torch.Tensor]) -> None:
        for i, view, z in zip(index, views, zs):
            fn(i, (view.data_ptr() - layout.flat[i].data_ptr()) // view.element_size(), view, z)

    each_draw(layout, seed, None, apply)


def curvatures(losses: torch.Tensor, eps: float) -> torch.Tensor:
    """|L_q+ + L_q- - 2 L0| / (2 eps^2) per query from HiZOO's losses [L0, L_1+, L_1-, L_2+, ...] (Algorithm 1)."""
    return (losses[1::2] + losses[2::2] - 2 * losses[0]).abs() / (2 * eps * eps)


class HessianRule(UpdateRule):
    """Sigma' from the step's curvatures, then w <- w - lr (g / sqrt(Sigma') + wd w); Sigma is its state."""

    name = "hizoo"
    buffers = 1

    def __init__(self, smooth: float):
        super().__init__()
        self.smooth = smooth

    def sigma(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Sigma of each parameter, flat (ones before the first step)."""
        out = []
        for slot, p in zip(self.slots(params), params):
            if "hessian" not in slot:
                slot["hessian"] = torch.ones(p.shape, dtype=work_dtype(p), device=p.device)
            out.append(slot["hessian"].view(-1))
        return out

    @torch.no_grad()
    def update_(self, opt: Any, step: Step) -> int:
        params, layout, cache = step.params, step.layout, step.cache
        sigma = self.sigma(params)
        h = curvatures(step.losses, opt.eps)
        q = len(step.seeds)
        scale = 1.0 / q if step.reduction == "mean" else 1.0
        # sum_q h_q z_q^2 and sum_q g_q z_q, entry by entry, over the queries (two temporaries of the set's size)
        curv = [torch.zeros_like(s) for s in sigma]
        grad = [torch.zeros_like(s) for s in sigma]
        for seed, h_q, g_q in zip(step.seeds, h, step.grads):
            def accumulate(i: int, start: int, view: torch.Tensor, z: torch.Tensor, h_q=h_q, g_q=g_q) -> None:
                z = z.reshape(-1).to(sigma[i].dtype)
                end = start + z.numel()
                curv[i][start:end].addcmul_(z, z * h_q.to(z.device, z.dtype))
                grad[i][start:end].add_(z * g_q.to(z.device, z.dtype))

            _each_piece(layout, seed, cache.peek(seed), accumulate)
        decay_(params, step.lrs, step.wds)  # w (1 - lr wd) - lr g: the same as w - lr (g + wd w), g not a function of w
        for p, s, c, g, lr in zip(params, sigma, curv, grad, step.lrs):
            s.mul_(c.mul_(self.smooth / q).add_(1.0 - self.smooth))  # Sigma ((1 - a) + a/Q sum_q h_q z_q^2)
            p.view(-1).add_(g.mul_(scale).div_(s.sqrt()), alpha=-lr)
        return 0


class HessianEstimator(OwnDirections):
    """HiZOO's 2Q + 1 forwards: L(w), then central differences along Sigma^{-1/2} z_q, Sigma from ``rule``."""

    name = "hizoo"

    def __init__(self, rule: HessianRule):
        self.rule = rule

    def forwards(self, queries: int) -> int:
        return 2 * queries + 1

    def along(self, opt: Any, queries: Queries) -> tuple[torch.Tensor, torch.Tensor]:
        cache = queries.cache
        layout = cache.layout
        sigma = self.rule.sigma(queries.params)

        def draw(seed: int) -> tuple[int, list[torch.Tensor] | None]:
            return seed, cache.get(seed)  # z kept for the update when the set is small, else redrawn on every pass

        def move_(d: tuple[int, list[torch.Tensor] | None], scale: float) -> None:
            def piece(i: int, start: int, view: torch.Tensor, z: torch.Tensor) -> None:
                s = sigma[i][start : start + z.numel()]
                view.add_(z.reshape(-1).to(s.dtype).div(s.sqrt()).mul_(scale))  # w + scale Sigma^{-1/2} z

            _each_piece(layout, d[0], d[1], piece)

        losses = self.evaluate(opt, queries, draw, move_, baseline=True, central=True)
        return losses, projected_gradient(losses[1::2], losses[2::2], opt.eps)


@dataclasses.dataclass
class HiZOOConfig(OwnDirectionsConfig):
    """HiZOO: central differences along Sigma^{-1/2} z, an EMA of the diagonal Hessian, a preconditioned SGD step."""

    kind: ClassVar[str] = "hizoo"

    # a in Sigma <- (1 - a) Sigma + a * estimate: the reference's HiZOO command (``constant1e-8``); 0 keeps Sigma = 1
    # (ZO-SGD with one more forward a step)
    hessian_smooth: float = 1e-8

    def forwards(self, queries: int) -> int:
        return 2 * queries + 1  # L(w), then L(w + eps Sigma^-1/2 z_q) and L(w - eps Sigma^-1/2 z_q)

    @property
    def forwards_per_query(self) -> int:
        return 2

    def state_bytes(self, entries: int, width: int) -> float:
        return entries * max(width, 4) * HessianRule.buffers  # Sigma, in at least float32

    def estimate_bytes(self, trained: TrainedSet, queries: int) -> float:
        # ZO-SGD's (a copy of w, the z alive), and a piece's z in Sigma's dtype, sqrt(Sigma) and their quotient
        pieces = (3 if trained.width < 4 else 2) * piece_bytes(trained, self.kept_directions(trained, queries) > 0)
        return super().estimate_bytes(trained, queries) + pieces

    def update_bytes(self, trained: TrainedSet, kept: bool) -> float:
        # sum_q h_q z_q^2 and sum_q g_q z_q, whole, beside a pass's noise and a piece's z in Sigma's dtype, z h_q
        # and z g_q, then beside a tensor's sqrt(Sigma')
        pieces = (3 if trained.width < 4 else 2) * piece_bytes(trained, kept)
        return 2 * trained.work + max((0 if kept else draw_bytes(trained)) + pieces, trained.largest_work)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.hessian_smooth <= 1.0:
            raise ConfigError(f"method.optimizer.hessian_smooth={self.hessian_smooth!r} must be in [0, 1]")


@OPTIMIZERS.register("hizoo", HiZOOConfig)
def build_hizoo(named_params: Iterable[tuple[str, torch.Tensor]], cfg: HiZOOConfig, seed: int) -> ZOSGD:
    rule = HessianRule(cfg.hessian_smooth)
    return ZOSGD(decay_groups(named_params, cfg.weight_decay), cfg, seed=seed, estimator=HessianEstimator(rule),
                 rule=rule)
