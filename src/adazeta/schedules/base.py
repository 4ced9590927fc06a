"""What every query schedule shares: its config's base class (the capabilities the wiring reads), the one-line
error of a bad value, and the pure functions that turn a schedule into a run's epochs, mean queries and length.

A schedule is a pure function of the epoch index (counted from 0; Q changes only at epoch starts).
"""

from __future__ import annotations

from typing import Callable, ClassVar

from adazeta.errors import ConfigError

Schedule = Callable[[int], int]


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


def fail(field: str, value: object, allowed: str) -> None:
    """Raise the one-line ConfigError of a bad schedule setting: ``schedule.q=0 must be >= 1``."""
    raise ConfigError(f"schedule.{field}={value!r} must be {allowed}")


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
