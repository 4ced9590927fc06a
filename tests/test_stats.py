"""adazeta.stats against hand computations: intervals, paired tests, exact count tests."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adazeta import stats


def test_t_interval_is_the_student_t_interval_over_seeds():
    values = [0.70, 0.74, 0.78, 0.72]
    iv = stats.t_interval(values)
    mean = sum(values) / 4
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 3)
    half = 3.182446305284263 * sd / 2  # t(0.975, 3 dof)
    assert (iv.mean, iv.lo, iv.hi, iv.n) == pytest.approx((mean, mean - half, mean + half, 4))
    one = stats.t_interval([0.5])
    assert one.mean == 0.5 and math.isnan(one.lo) and one.show(100) == "50.0"
    assert iv.show(100) == f"{mean * 100:.1f} [{(mean - half) * 100:.1f}, {(mean + half) * 100:.1f}]"


def test_t_interval_is_clipped_to_the_range_a_score_can_take():
    wide = stats.t_interval([0.70, 0.85])  # two seeds: t(0.975, 1 dof) = 12.7
    assert wide.lo < 0 and wide.hi > 1
    clipped = stats.t_interval([0.70, 0.85], bounds=(0.0, 1.0))
    assert (clipped.mean, clipped.lo, clipped.hi, clipped.n) == pytest.approx((0.775, 0.0, 1.0, 2))
    inside = stats.t_interval([0.70, 0.74, 0.78, 0.72], bounds=(0.0, 1.0))
    assert inside == stats.t_interval([0.70, 0.74, 0.78, 0.72])  # an interval inside the range is unchanged
    in_range = stats.t_interval([0.767, 0.780], bounds=(0.0, 1.0))
    assert in_range.lo == pytest.approx(0.6909, abs=1e-4) and in_range.hi == pytest.approx(0.8561, abs=1e-4)
    assert in_range.show(100) == "77.4 [69.1, 85.6]"


def test_bootstrap_interval_matches_the_normal_approximation_on_a_large_sample():
    rng = np.random.default_rng(1)
    correct = (rng.random((3, 2000)) < 0.7).astype(float)
    iv = stats.bootstrap_interval(correct, n_boot=4000, seed=0)
    per_example = correct.mean(axis=0)
    se = per_example.std(ddof=1) / math.sqrt(2000)
    assert iv.mean == pytest.approx(correct.mean())
    assert (iv.hi - iv.lo) == pytest.approx(2 * 1.96 * se, rel=0.1)
    assert iv == stats.bootstrap_interval(correct, n_boot=4000, seed=0)  # seeded: the same numbers


def test_paired_bootstrap_difference_interval_and_p_value():
    rng = np.random.default_rng(2)
    b = (rng.random((4, 872)) < 0.70).astype(float)
    same = stats.paired_bootstrap(b, b, n_boot=2000)
    assert same.diff == 0 and same.p == 1.0
    flipped = b.copy()
    wrong = np.argwhere(b == 0)[:400]  # a gets 100 more (seed, example) pairs right on average per seed
    flipped[tuple(wrong.T)] = 1.0
    better = stats.paired_bootstrap(flipped, b, n_boot=2000)
    assert better.diff == pytest.approx((flipped.mean() - b.mean()))
    assert better.lo > 0 and better.p < 0.001
    worse = stats.paired_bootstrap(b, flipped, n_boot=2000)
    assert worse.diff == pytest.approx(-better.diff) and worse.hi < 0
    with pytest.raises(ValueError, match="different examples"):
        stats.paired_bootstrap(b, b[:, :10])


def test_mcnemar_counts_discordant_pairs_pooled_over_seeds_and_is_exact():
    a = np.array([[1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    b = np.array([[1, 0, 0, 0, 1, 0], [0, 1, 1, 0, 0, 1]])
    m = stats.mcnemar(a, b)
    assert (m.a_only, m.b_only) == (4, 1)
    by_hand = min(1.0, 2 * sum(math.comb(5, k) for k in range(4, 6)) / 2**5)
    assert m.p == pytest.approx(by_hand)


def test_sign_flip_is_the_exact_permutation_test_over_seeds():
    assert stats.sign_flip([0.01, 0.02, 0.03, 0.04]) == pytest.approx(2 / 16)
    diffs = [0.05, -0.01, 0.02]
    mean = sum(diffs) / 3
    flips = [[s1 * diffs[0], s2 * diffs[1], s3 * diffs[2]] for s1 in (1, -1) for s2 in (1, -1) for s3 in (1, -1)]
    by_hand = sum(abs(sum(f) / 3) >= abs(mean) - 1e-12 for f in flips) / 8
    assert stats.sign_flip(diffs) == pytest.approx(by_hand)


def test_exact_count_tests():
    assert stats.sign_test(4, 4) == pytest.approx(1 / 16)
    assert stats.sign_test(3, 4) == pytest.approx(5 / 16)
    assert stats.fisher_less(0, 4, 4, 4) == pytest.approx(1 / 70)
    assert stats.fisher_less(2, 4, 2, 4) > 0.5


def _runs(seed_means, n=800, seed=0):
    """0/1 correctness of several seeds on the same n examples, each seed at its own accuracy: every arm and seed
    finds the same examples easy (as runs of one model on one test set do), up to a little noise of its own."""
    easy = np.random.default_rng(0).random(n)
    rng = np.random.default_rng(seed)
    return np.array([((easy + rng.normal(0, 0.02, n)) < m).astype(float) for m in seed_means])


def test_the_hierarchical_interval_holds_seed_to_seed_variance_the_example_bootstrap_leaves_out():
    spread = _runs([0.70, 0.78, 0.62, 0.74])  # seeds 16 points apart
    example_only = stats.bootstrap_interval(spread, n_boot=4000)
    both = stats.hierarchical_interval(spread, n_boot=4000)
    assert both.mean == pytest.approx(spread.mean()) and both.n == 4
    assert both.lo < example_only.lo and both.hi > example_only.hi
    assert (both.hi - both.lo) > 1.5 * (example_only.hi - example_only.lo)
    # one seed: examples only, as the example bootstrap (up to resampling noise)
    one = stats.hierarchical_interval(spread[:1], n_boot=4000)
    alone = stats.bootstrap_interval(spread[:1], n_boot=4000)
    assert one.lo == pytest.approx(alone.lo, abs=0.01) and one.hi == pytest.approx(alone.hi, abs=0.01)
    # seeded: the same numbers every time; a constant score has no width
    assert stats.hierarchical_interval(spread, n_boot=500, seed=3) == stats.hierarchical_interval(spread, 500, 3)
    flat = stats.hierarchical_interval(np.ones((3, 50)), n_boot=200)
    assert (flat.lo, flat.hi) == (1.0, 1.0)


def test_a_difference_that_two_seed_sets_disagree_on_is_not_called_by_the_seed_respecting_test():
    """Two arms at the same accuracy on average, whose seeds happen to fall apart: the per-example paired bootstrap
    (seeds held fixed) calls a difference, the hierarchical one does not."""
    a = _runs([0.82, 0.70], seed=1)  # its seeds 12 points apart; on average 3 above b
    b = _runs([0.73, 0.73], seed=2)
    fixed = stats.paired_bootstrap(a, b, n_boot=4000)  # the seeds held fixed: "a is better"
    assert fixed.lo > 0
    both = stats.hierarchical_difference(a, b, n_boot=4000)
    assert both.diff == pytest.approx(fixed.diff)
    assert both.lo < 0 < both.hi and both.p > 0.05
    # a real difference, seed after seed, is still called
    c = _runs([0.85, 0.86, 0.84, 0.85], seed=3)
    assert stats.hierarchical_difference(c, b, n_boot=4000).lo > 0.05
    with pytest.raises(ValueError, match="different examples"):
        stats.hierarchical_difference(c, b[:, :10])


def test_the_pooled_difference_resamples_tasks_above_seeds_and_examples():
    b = _runs([0.70, 0.70, 0.70], seed=4)
    up = _runs([0.80, 0.81, 0.79], seed=5)
    down = _runs([0.60, 0.61, 0.59], seed=6)
    consistent = stats.pooled_difference([(up, b), (up, b), (up, b)], n_boot=2000)
    assert consistent.n == 3 and consistent.lo > 0.05
    split = stats.pooled_difference([(up, b), (down, b), (up, b), (down, b)], n_boot=2000)
    assert split.lo < 0 < split.hi  # two tasks up, two down: no pooled verdict
    assert split.diff == pytest.approx(np.mean([up.mean() - b.mean(), down.mean() - b.mean()] * 2))
