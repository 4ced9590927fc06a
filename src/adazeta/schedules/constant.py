"""The constant schedule: the same number of queries Q at every step (Q = 1 is MeZO)."""

from __future__ import annotations

import dataclasses
import functools

from adazeta.registry import SCHEDULES
from adazeta.schedules.base import Schedule, ScheduleConfig, fail


def constant_q(epoch: int, q: int) -> int:
    """Q_k = q for every epoch (q = 1 is MeZO)."""
    return q


@dataclasses.dataclass
class ConstantConfig(ScheduleConfig):
    """A fixed number of queries per step."""

    q: int = 1  # queries per step; each costs two forwards

    @property
    def max_queries(self) -> int:
        """The most queries a step takes (the dry run's memory estimate sizes a step by it)."""
        return self.q

    def __post_init__(self) -> None:
        if self.q < 1:
            fail("q", self.q, ">= 1")


@SCHEDULES.register("constant", ConstantConfig)
def build_constant(cfg: ConstantConfig, num_epochs: float) -> Schedule:
    return functools.partial(constant_q, q=cfg.q)
