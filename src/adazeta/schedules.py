"""Query-count schedules: how many random directions Q the ZO estimator averages at a given epoch.

Each schedule is a pure function of the epoch index (counted from 0; Q changes only at epoch starts). The
registry ``SCHEDULES`` maps a name to a typed config and a builder ``(cfg, num_epochs) -> (epoch -> Q)`` so
that every method can run with every schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, ClassVar

from adazeta.errors import ConfigError
from adazeta.registry import SCHEDULES

Schedule = Callable[[int], int]



def constant_q(epoch: int, q: int) -> int:
    """Q_k = q for every epoch (q = 1 is MeZO)."""
    return q


def adaptive_q(epoch: int, alpha: float = 0.85, beta: float = 0.45, q_max: int = 20) -> int:
    """Paper's schedule, Q_k = min(alpha * e_k^beta, Q_max), floored and kept >= 1 (AdaZeta §3.2)."""
    return min(max(math.floor(alpha * epoch**beta), 1), q_max)


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


def run_epochs(max_steps: int, num_train: int, batch_size: int) -> float:
    """E = max_steps / (num_train / batch_size), the (fractional) number of epochs of a run (reference code)."""
    return max_steps / (num_train / batch_size)


def epoch_of(step: int, steps_per_epoch: float) -> int:
    """e_k = floor(k / steps_per_epoch), the 0-based epoch index of step k."""
    return int(step // steps_per_epoch)


def mean_queries(schedule: Schedule, steps_per_epoch: float, max_steps: int) -> float:
    """Mean of Q_k over the steps k = 0 .. max_steps - 1 of a run (the run's cost in forwards is 2 * this * K)."""
    if max_steps <= 0:
        raise ValueError(f"max_steps={max_steps} must be >= 1")
    return sum(schedule(epoch_of(k, steps_per_epoch)) for k in range(max_steps)) / max_steps


def budget_steps(
    build: Callable[[float], Schedule],
    loop_steps_per_epoch: int,
    epoch_steps: float,
    budget: int,
    forwards: Callable[[int], int],
    max_steps: int,
) -> int:
    """Steps K of a run that a forward-pass budget ends, when the schedule itself depends on K.

    ``build(E)`` gives the schedule for a run of E epochs, E = K / ``epoch_steps``; the loop's epoch of step k
    (from 0) is ``k // loop_steps_per_epoch`` and a step at Q queries costs ``forwards(Q)``. The run stops at the
    first step whose cumulative forwards reach ``budget``. Returns the largest K such that a schedule built for
    K steps ends the run at step K: starting from the most steps the budget allows, K only shrinks (more epochs
    mean a flatter schedule, so more steps), so the iteration stops at that fixed point.
    """

    def steps_until_budget(schedule: Schedule) -> int:
        spent = 0
        for k in range(max_steps):
            spent += forwards(schedule(k // loop_steps_per_epoch))
            if spent >= budget:
                return k + 1
        return max_steps

    steps = min(max_steps, -(-budget // forwards(1)))
    while True:
        nxt = steps_until_budget(build(steps / epoch_steps))
        if nxt >= steps:
            return steps
        steps = nxt


def _fail(field: str, value: object, allowed: str) -> None:
    raise ConfigError(f"schedule.{field}={value!r} must be {allowed}")


class ScheduleConfig:
    """What the wiring may ask of a schedule, declared on its config class (every registered schedule's base).

    ``uses_run_epochs``: its builder reads the run's length E (``num_epochs``), so a run with a forward-pass
    budget builds it for the epochs the budget reaches (``adazeta.build.run_length``); a schedule of the epoch
    index alone leaves it False. ``max_queries``: the most queries a step takes (the dry run's memory estimate
    sizes a step by it).
    """

    uses_run_epochs: ClassVar[bool] = False

    @property
    def max_queries(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must declare max_queries")


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
            _fail("q", self.q, ">= 1")


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
            _fail("alpha", self.alpha, "> 0")
        if self.beta < 0:
            _fail("beta", self.beta, ">= 0")
        if self.q_max < 1:
            _fail("q_max", self.q_max, ">= 1")


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
            _fail("alpha", self.alpha, "> 0")
        if self.q_target < self.alpha:
            # q_target < alpha would give a negative beta: Q would shrink over training.
            _fail("q_target", self.q_target, f">= alpha ({self.alpha})")
        if self.q_cap < 1:
            _fail("q_cap", self.q_cap, ">= 1")


@SCHEDULES.register("constant", ConstantConfig)
def build_constant(cfg: ConstantConfig, num_epochs: float) -> Schedule:
    return functools.partial(constant_q, q=cfg.q)


@SCHEDULES.register("adaptive", AdaptiveConfig)
def build_adaptive(cfg: AdaptiveConfig, num_epochs: float) -> Schedule:
    return functools.partial(adaptive_q, alpha=cfg.alpha, beta=cfg.beta, q_max=cfg.q_max)


@SCHEDULES.register("adaptive_official", AdaptiveOfficialConfig)
def build_adaptive_official(cfg: AdaptiveOfficialConfig, num_epochs: float) -> Schedule:
    return functools.partial(
        adaptive_official_q, alpha=cfg.alpha, q_target=cfg.q_target, q_cap=cfg.q_cap, num_epochs=num_epochs
    )
