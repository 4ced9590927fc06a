"""The reference code's schedule: the paper's curve with beta derived from the run's length, so that the
last epoch E reaches q_target (alpha * E^beta = q_target), under a hard cap."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

from adazeta.registry import SCHEDULES
from adazeta.schedules.base import Schedule, ScheduleConfig, fail


def official_beta(alpha: float, q_target: float, num_epochs: float) -> float:
    """Reference code's exponent: beta = ln(q_target / alpha) / ln(E), so that alpha * E^beta = q_target."""
    if num_epochs <= 1:
        # A run of at most one epoch only sees epoch 0, where Q = 1 whatever beta is; ln(E) <= 0 would make
        # beta infinite or negative (and 0 ** negative raises), so use the flat exponent instead.
        return 0.0
    return math.log(q_target / alpha) / math.log(num_epochs)


def adaptive_official_q(epoch: int, alpha: float, q_target: float, q_cap: int, num_epochs: float) -> int:
    """Reference code's schedule, Q = min(max(int(alpha * e^beta), 1), q_cap) with beta from official_beta."""
    beta = official_beta(alpha, q_target, num_epochs)
    return min(max(int(alpha * epoch**beta), 1), q_cap)


@dataclasses.dataclass
class AdaptiveOfficialConfig(ScheduleConfig):
    """The reference code's schedule: beta derived so that alpha * E^beta = q_target at the last epoch E."""

    # Its builder reads the run's length E (num_epochs): under a forward-pass budget the run derives E from the
    # steps the budget reaches (adazeta.build.run_length). A schedule of the epoch index alone leaves it False.
    uses_run_epochs: ClassVar[bool] = True
    alpha: float = 0.85  # scale, as in AdaptiveConfig
    q_target: float = 20  # Q the uncapped curve reaches at the last epoch; sets beta
    q_cap: int = 15  # hard cap; the reference Llama runs use 15, so the effective maximum is 15, not 20

    @property
    def max_queries(self) -> int:
        return self.q_cap

    def __post_init__(self) -> None:
        if self.alpha <= 0:
            fail("alpha", self.alpha, "> 0")
        if self.q_target < self.alpha:
            # q_target < alpha would give a negative beta: Q would shrink over training.
            fail("q_target", self.q_target, f">= alpha ({self.alpha})")
        if self.q_cap < 1:
            fail("q_cap", self.q_cap, ">= 1")


@SCHEDULES.register("adaptive_official", AdaptiveOfficialConfig)
def build_adaptive_official(cfg: AdaptiveOfficialConfig, num_epochs: float) -> Schedule:
    return functools.partial(
        adaptive_official_q, alpha=cfg.alpha, q_target=cfg.q_target, q_cap=cfg.q_cap, num_epochs=num_epochs
    )
