"""The paper's schedule (AdaZeta §3.2): Q_k = min(alpha * e_k^beta, Q_max), growing sub-linearly with the epoch."""

from __future__ import annotations

import dataclasses
import functools
import math

from adazeta.registry import SCHEDULES
from adazeta.schedules.base import Schedule, ScheduleConfig, fail


def adaptive_q(epoch: int, alpha: float = 0.85, beta: float = 0.45, q_max: int = 20) -> int:
    """Paper's schedule, Q_k = min(alpha * e_k^beta, Q_max), floored and kept >= 1 (AdaZeta §3.2)."""
    return min(max(math.floor(alpha * epoch**beta), 1), q_max)


@dataclasses.dataclass
class AdaptiveConfig(ScheduleConfig):
    """The paper's schedule Q_k = min(alpha * e_k^beta, Q_max); its Llama-2-7B values are the defaults."""

    alpha: float = 0.85  # scale; with alpha < 1, Q stays 1 for the first few epochs
    beta: float = 0.45  # growth exponent; < 1 keeps the growth sub-linear, as Theorem 1 needs
    q_max: int = 20  # hard cap on the queries per step (bounds the cost of a step)

    @property
    def max_queries(self) -> int:
        return self.q_max

    def __post_init__(self) -> None:
        if self.alpha <= 0:
            fail("alpha", self.alpha, "> 0")
        if self.beta < 0:
            fail("beta", self.beta, ">= 0")
        if self.q_max < 1:
            fail("q_max", self.q_max, ">= 1")


@SCHEDULES.register("adaptive", AdaptiveConfig)
def build_adaptive(cfg: AdaptiveConfig, num_epochs: float) -> Schedule:
    return functools.partial(adaptive_q, alpha=cfg.alpha, beta=cfg.beta, q_max=cfg.q_max)
