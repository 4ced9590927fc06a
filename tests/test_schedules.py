"""Query-count schedules (AdaZeta's paper and reference code): the values a run's cost and stability depend on."""

import math

import pytest

from adazeta.errors import ConfigError
from adazeta.schedules import (
    SCHEDULES,
    AdaptiveConfig,
    AdaptiveOfficialConfig,
    ConstantConfig,
    adaptive_official_q,
    adaptive_q,
    constant_q,
    mean_queries,
    official_beta,
    run_epochs,
)

# floor(0.85 * e^0.45), at least 1, at most 20; worked out by hand:
# 10^0.45 = 2.818 -> 2.40; 100^0.45 = 7.94 -> 6.75; 1000^0.45 = 22.4 -> 19.03; 10000^0.45 = 63.1 -> 53.6 (capped)
ADAPTIVE_DEFAULTS = [(0, 1), (1, 1), (2, 1), (5, 1), (10, 2), (100, 6), (1000, 19), (10000, 20)]


@pytest.mark.parametrize(("epoch", "expected"), ADAPTIVE_DEFAULTS)
def test_adaptive_q_with_paper_defaults(epoch: int, expected: int) -> None:
    assert adaptive_q(epoch) == expected


def test_adaptive_q_is_capped_and_never_decreases() -> None:
    qs = [adaptive_q(e, q_max=5) for e in range(300)]
    assert max(qs) == 5
    assert all(a <= b for a, b in zip(qs, qs[1:]))


def test_registered_adaptive_schedule_matches_the_formula() -> None:
    schedule = SCHEDULES.get("adaptive").builder(AdaptiveConfig(alpha=2.0, beta=0.5, q_max=7), 100.0)
    assert [schedule(e) for e in (0, 1, 4, 9, 16)] == [1, 2, 4, 6, 7]


@pytest.mark.parametrize("q", [1, 4])
def test_constant_schedule(q: int) -> None:
    schedule = SCHEDULES.get("constant").builder(ConstantConfig(q=q), 160.0)
    assert [schedule(e) for e in (0, 1, 50, 1000)] == [q] * 4
    assert constant_q(7, q) == q


def test_official_schedule_on_the_reference_llama_setup() -> None:
    # 1,000 train examples, batch 16, 10,000 steps, q_target 20, cap 15 (the reference code's Llama runs).
    num_epochs = run_epochs(max_steps=10_000, num_train=1_000, batch_size=16)
    assert num_epochs == 160.0
    beta = official_beta(0.85, 20, num_epochs)
    assert beta == pytest.approx(0.62, abs=0.01)
    assert 0.85 * num_epochs**beta == pytest.approx(20)  # the uncapped curve reaches q_target at the end

    schedule = SCHEDULES.get("adaptive_official").builder(AdaptiveOfficialConfig(), num_epochs)
    assert schedule(0) == 1
    assert schedule(159) == 15  # the cap, not q_target, is the effective maximum
    mean_q = mean_queries(schedule, steps_per_epoch=1_000 / 16, max_steps=10_000)
    assert mean_q == pytest.approx(11.0121, abs=1e-4)
    assert abs(mean_q - 11) <= 0.5


def test_official_schedule_on_a_run_shorter_than_an_epoch() -> None:
    assert official_beta(0.85, 20, 0.5) == 0.0
    assert official_beta(0.85, 20, 1.0) == 0.0
    assert adaptive_official_q(0, 0.85, 20, 15, num_epochs=0.5) == 1


def test_mean_queries_weights_epochs_by_their_steps() -> None:
    # 2.5 steps per epoch over 5 steps: epochs 0, 0, 0, 1, 1 -> Q = 1, 1, 1, 2, 2.
    assert mean_queries(lambda e: e + 1, steps_per_epoch=2.5, max_steps=5) == pytest.approx(7 / 5)
    assert math.isclose(mean_queries(lambda e: 3, steps_per_epoch=10, max_steps=7), 3.0)


@pytest.mark.parametrize(
    ("name", "values", "message"),
    [
        ("constant", {"q": 0}, "schedule.q=0 must be >= 1"),
        ("adaptive", {"q_max": 0}, "schedule.q_max=0 must be >= 1"),
        ("adaptive", {"alpha": -1.0}, "schedule.alpha=-1.0 must be > 0"),
        ("adaptive", {"beta": -0.5}, "schedule.beta=-0.5 must be >= 0"),
        ("adaptive_official", {"q_cap": 0}, "schedule.q_cap=0 must be >= 1"),
        ("adaptive_official", {"q_target": 0.5}, "schedule.q_target=0.5 must be >= alpha"),
    ],
)
def test_bad_values_fail_naming_the_field(name: str, values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SCHEDULES.config(name, values)


def test_unknown_schedule_lists_known_names() -> None:
    assert {"constant", "adaptive", "adaptive_official"} <= set(SCHEDULES.names())
    with pytest.raises(ConfigError, match="adaptive_official"):
        SCHEDULES.get("adaptiv")
