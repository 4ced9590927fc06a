"""The statistics every comparison in the tables and reports uses: intervals over seeds and over examples, and
paired tests between two arms evaluated on the same examples.

- ``t_interval``: a mean over seeds with its Student-t 95 % interval (ddof = 1), clipped to the score's range;
- ``bootstrap_interval``: the mean of per-example scores (seeds x examples) with a percentile interval from
  resampling examples, the same resample for every seed;
- ``paired_bootstrap``: the difference of two arms' means on the same examples (seeds x examples each), with its
  interval and a two-sided p-value from resampling examples jointly (Koehn 2004; Dror et al. 2018). It holds the
  seeds fixed: its interval is conditional on the seeds that ran;
- ``hierarchical_interval`` and ``hierarchical_difference``: the same means with intervals that resample seeds,
  then examples (a two-level bootstrap), so that seed-to-seed variance is in them; ``pooled_difference`` adds a
  level above, tasks, for a comparison over several tasks;
- ``mcnemar``: McNemar's exact test on the discordant pairs, pooled over seeds;
- ``sign_flip``: the exact paired permutation test on seed-wise differences (all 2^n sign assignments);
- ``sign_test`` and ``fisher_less``: exact one-sided tests for the pre-registered count endpoints.

Everything is exact or seeded: the same inputs always give the same numbers.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Interval:
    mean: float
    lo: float
    hi: float
    n: int  # seeds (t_interval) or examples (bootstrap)

    def show(self, scale: float = 1.0, digits: int = 1) -> str:
        """``mean [lo, hi]``; a single value when there is no interval (one seed)."""
        if math.isnan(self.lo):
            return f"{self.mean * scale:.{digits}f}"
        return f"{self.mean * scale:.{digits}f} [{self.lo * scale:.{digits}f}, {self.hi * scale:.{digits}f}]"


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE,
               bounds: tuple[float, float] | None = None) -> Interval:
    """Mean of ``values`` (one per seed) and its Student-t interval; no interval (NaN ends) from one value.

    ``bounds``: the range the score can take (``(0, 1)`` for an accuracy); the interval's ends are clipped to it,
    since with few seeds a t interval can reach past a score's range (two seeds at 76.7 and 78.0: [69.1, 85.6],
    two at 70 and 85: [-17.8, 172.8]) and no value there is possible."""
    from scipy import stats

    x = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=float)
    if len(x) == 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0)
    if len(x) == 1:
        return Interval(float(x[0]), float("nan"), float("nan"), 1)
    half = stats.t.ppf(0.5 + confidence / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    lo, hi = float(x.mean() - half), float(x.mean() + half)
    if bounds is not None:
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    return Interval(float(x.mean()), lo, hi, len(x))


def _as_matrix(scores: np.ndarray | Sequence) -> np.ndarray:
    m = np.asarray(scores, dtype=float)
    return m[None, :] if m.ndim == 1 else m


def _resamples(n: int, n_boot: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def bootstrap_interval(scores: np.ndarray | Sequence, n_boot: int = 10000, seed: int = 0,
                       confidence: float = CONFIDENCE) -> Interval:
    """Mean of per-example ``scores`` (seeds x examples, or one row) and its percentile bootstrap interval over
    examples: each resample draws examples with replacement, the same ones for every seed."""
    m = _as_matrix(scores)
    per_example = m.mean(axis=0)  # averaging over seeds first: the resample is over examples
    idx = _resamples(len(per_example), n_boot, seed)
    means = per_example[idx].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - confidence) / 2, (1 + confidence) / 2])
    return Interval(float(per_example.mean()), float(lo), float(hi), len(per_example))


@dataclass(frozen=True)
class Paired:
    diff: float  # mean(a) - mean(b)
    lo: float
    hi: float
    p: float  # two-sided
    n: int  # examples


def paired_bootstrap(a: np.ndarray | Sequence, b: np.ndarray | Sequence, n_boot: int = 10000, seed: int = 0,
                     confidence: float = CONFIDENCE) -> Paired:
    """Difference of two arms' mean per-example scores on the same examples (seeds x examples each; the seed rows
    need not pair up) with a percentile interval and a two-sided p-value, resampling examples jointly.

    p = 2 x min(share of resampled differences <= 0, share >= 0), with the add-one correction, at most 1.
    """
    da, db = _as_matrix(a).mean(axis=0), _as_matrix(b).mean(axis=0)
    if da.shape != db.shape:
        raise ValueError(f"paired_bootstrap: the arms were scored on different examples ({da.shape} vs {db.shape})")
    d = da - db
    idx = _resamples(len(d), n_boot, seed)
    means = d[idx].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - confidence) / 2, (1 + confidence) / 2])
    below, above = (np.sum(means <= 0) + 1) / (n_boot + 1), (np.sum(means >= 0) + 1) / (n_boot + 1)
    return Paired(float(d.mean()), float(lo), float(hi), float(min(1.0, 2 * min(below, above))), len(d))


def _seed_example_means(m: np.ndarray, n_boot: int, rng: np.random.Generator, shared: np.ndarray | None = None,
                        chunk: int = 256) -> np.ndarray:
    """``n_boot`` two-level resample means of a seeds x examples matrix: seeds with replacement, then examples with
    replacement within each drawn seed (``shared``: the same (n_boot, examples) example draw for every seed)."""
    n_s, n_e = m.shape
    out = np.empty(n_boot)
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        seeds = rng.integers(0, n_s, size=(b, n_s))
        if shared is None:
            examples = rng.integers(0, n_e, size=(b, n_s, n_e))
        else:
            examples = np.broadcast_to(shared[start:start + b, None, :], (b, n_s, n_e))
        out[start:start + b] = m[seeds[:, :, None], examples].mean(axis=(1, 2))
    return out


def hierarchical_interval(scores: np.ndarray | Sequence, n_boot: int = 10000, seed: int = 0,
                          confidence: float = CONFIDENCE) -> Interval:
    """Mean of per-example ``scores`` (seeds x examples) with a two-level percentile bootstrap interval: each
    resample draws the seeds with replacement, then the examples with replacement within each drawn seed, so the
    interval holds both seed-to-seed and example variance (one seed: examples only). ``n`` is the number of seeds."""
    m = _as_matrix(scores)
    means = _seed_example_means(m, n_boot, np.random.default_rng(seed))
    lo, hi = np.quantile(means, [(1 - confidence) / 2, (1 + confidence) / 2])
    return Interval(float(m.mean()), float(lo), float(hi), m.shape[0])


def _difference_draws(a: np.ndarray, b: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"the arms were scored on different examples ({a.shape[1]} vs {b.shape[1]})")
    shared = rng.integers(0, a.shape[1], size=(n_boot, a.shape[1]))
    return _seed_example_means(a, n_boot, rng, shared) - _seed_example_means(b, n_boot, rng, shared)


def _p_two_sided(draws: np.ndarray) -> float:
    n = len(draws)
    below, above = (np.sum(draws <= 0) + 1) / (n + 1), (np.sum(draws >= 0) + 1) / (n + 1)
    return float(min(1.0, 2 * min(below, above)))


def hierarchical_difference(a: np.ndarray | Sequence, b: np.ndarray | Sequence, n_boot: int = 10000, seed: int = 0,
                            confidence: float = CONFIDENCE) -> Paired:
    """mean(a) - mean(b) for two arms scored on the same examples (seeds x examples each; seeds need not pair up),
    with an interval that resamples each arm's seeds independently and the examples jointly (the same example
    draw for both arms and all their seeds), and the two-sided bootstrap p of ``paired_bootstrap``."""
    x, y = _as_matrix(a), _as_matrix(b)
    draws = _difference_draws(x, y, n_boot, np.random.default_rng(seed))
    lo, hi = np.quantile(draws, [(1 - confidence) / 2, (1 + confidence) / 2])
    return Paired(float(x.mean() - y.mean()), float(lo), float(hi), _p_two_sided(draws), x.shape[1])


def pooled_difference(pairs: Sequence[tuple[np.ndarray, np.ndarray]], n_boot: int = 10000, seed: int = 0,
                      confidence: float = CONFIDENCE) -> Paired:
    """The mean over tasks of mean(a) - mean(b), one (a, b) pair of seeds x examples matrices per task, with a
    three-level bootstrap: tasks with replacement, then within each task ``hierarchical_difference``'s draw. ``n``
    is the number of tasks. Pair it with ``sign_flip`` over the tasks' differences for an exact test."""
    rng = np.random.default_rng(seed)
    per_task = np.stack([_difference_draws(_as_matrix(a), _as_matrix(b), n_boot, rng) for a, b in pairs])
    picks = rng.integers(0, len(pairs), size=(n_boot, len(pairs)))
    draws = per_task[picks, np.arange(n_boot)[:, None]].mean(axis=1)
    lo, hi = np.quantile(draws, [(1 - confidence) / 2, (1 + confidence) / 2])
    diff = float(np.mean([_as_matrix(a).mean() - _as_matrix(b).mean() for a, b in pairs]))
    return Paired(diff, float(lo), float(hi), _p_two_sided(draws), len(pairs))


@dataclass(frozen=True)
class McNemar:
    a_only: int  # examples (x seeds) that a gets right and b wrong
    b_only: int
    p: float  # exact two-sided


def mcnemar(a: np.ndarray | Sequence, b: np.ndarray | Sequence) -> McNemar:
    """McNemar's exact test on 0/1 correctness, pooled over seeds: (seed, example) pairs that disagree."""
    from scipy import stats

    x, y = _as_matrix(a).astype(bool).ravel(), _as_matrix(b).astype(bool).ravel()
    if x.shape != y.shape:
        raise ValueError("mcnemar: the arms have different numbers of (seed, example) pairs")
    a_only, b_only = int(np.sum(x & ~y)), int(np.sum(~x & y))
    n = a_only + b_only
    p = 1.0 if n == 0 else float(stats.binomtest(a_only, n, 0.5).pvalue)
    return McNemar(a_only, b_only, p)


def sign_flip(diffs: Sequence[float]) -> float:
    """Exact two-sided paired permutation p-value of the mean of seed-wise ``diffs`` (all 2^n sign flips).

    With n seeds the smallest possible p is 2 / 2^n (0.125 at 4 seeds): a per-seed test alone cannot reach 0.05.
    """
    d = np.asarray([v for v in diffs if not math.isnan(v)], dtype=float)
    if len(d) == 0:
        return float("nan")
    observed = abs(d.mean())
    flips = np.array(list(itertools.product((1.0, -1.0), repeat=len(d))))
    return float(np.mean(np.abs((flips * d).mean(axis=1)) >= observed - 1e-12))


def sign_test(successes: int, n: int) -> float:
    """One-sided exact sign test: P(X >= successes) for X ~ Binomial(n, 1/2)."""
    if n == 0:
        return float("nan")
    return float(sum(math.comb(n, k) for k in range(successes, n + 1)) / 2**n)


def fisher_less(bad_a: int, n_a: int, bad_b: int, n_b: int) -> float:
    """One-sided Fisher exact p that arm a's rate of bad runs is lower than arm b's."""
    from scipy import stats

    if n_a == 0 or n_b == 0:
        return float("nan")
    table = [[bad_a, n_a - bad_a], [bad_b, n_b - bad_b]]
    return float(stats.fisher_exact(table, alternative="less").pvalue)
