"""Statistics of the reports and planned comparisons: intervals (Student's t, Wilson's, Newcombe's paired
one), McNemar's exact test, Holm's correction, group-sequential thresholds, a paired test clustered by
problem, and the minimum detectable effect. Pure functions (docs/design/evaluation.md, 'Planned comparisons';
`verispec.evaluation.summary` applies them to a sweep's rows).

The paired test is the cluster-robust paired t-test on cluster means: each problem's difference
(row minus baseline) is averaged over its seeds, and the mean of those per-problem differences is
tested with Student's t on (problems - 1) degrees of freedom. Why: seeds of one problem share its
difficulty, so (problem x seed) units are not independent, and a test over units would be too
liberal; the problem is the independent unit. On balanced data (every problem with the same seeds)
the estimate equals the pooled mean over units, and its variance is the cluster-robust (CR1-free)
variance of that mean; with one seed it is the ordinary paired t-test. It needs no resampling (the
same rows give the same p), and with the 164 HumanEval problems the t reference is accurate even for
0/1 scores (tests/test_stats.py measures its false-positive rate under an exchangeable null).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass
from statistics import NormalDist, mean, stdev
from typing import Sequence

import numpy as np

_NORMAL = NormalDist()


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979): sort ascending, the j-th smallest (j from 0) is
    multiplied by (m - j), made non-decreasing along the order and capped at 1. Reject a hypothesis at
    family-wise level alpha when its adjusted p is <= alpha. NaN p-values are passed through and do not
    count in m."""
    finite = [(p, i) for i, p in enumerate(p_values) if not math.isnan(p)]
    if any(not 0 <= p <= 1 for p, _ in finite):
        raise ValueError(f"p-values must lie in [0, 1], got {list(p_values)}")
    out = [math.nan] * len(p_values)
    m, running = len(finite), 0.0
    for j, (p, i) in enumerate(sorted(finite)):
        running = max(running, min(1.0, (m - j) * p))
        out[i] = running
    return out


def holm_levels(p_values: Sequence[float], alpha: float = 0.05) -> list[float]:
    """The level each hypothesis is tested at in Holm's step-down order: alpha / (m - j) for the j-th
    smallest p-value (j from 0); NaN for a NaN p-value."""
    finite = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    out = [math.nan] * len(p_values)
    for j, (_, i) in enumerate(finite):
        out[i] = alpha / (len(finite) - j)
    return out


# ---------------------------------------------------------------------------- group-sequential designs

BOUNDARIES = ("pocock", "obf")


def _boundary_shape(kind: str, looks: int) -> np.ndarray:
    """Critical values on the z scale per unit constant, at equally spaced looks: Pocock's are flat,
    O'Brien-Fleming's fall as sqrt(K / k) (Jennison & Turnbull 2000, sections 2.4-2.5)."""
    k = np.arange(1, looks + 1)  # [K]
    return np.ones(looks) if kind == "pocock" else np.sqrt(looks / k)


def _simpson(bound: float, step: float) -> tuple[np.ndarray, np.ndarray]:
    """A grid on [-bound, bound] (an even number of intervals of width about `step`) and its Simpson
    weights."""
    intervals = 2 * max(1, math.ceil(bound / step))
    grid = np.linspace(-bound, bound, intervals + 1)  # [G]
    h = 2 * bound / intervals
    weights = np.full(intervals + 1, 2.0)
    weights[1::2] = 4.0
    weights[[0, -1]] = 1.0
    return grid, weights * h / 3


def crossing_probability(z_bounds: Sequence[float], step: float = 0.05) -> float:
    """P(|Z_k| >= z_bounds[k-1] for some look k) under the null, for looks at equally spaced
    information (Z_k = S_k / sqrt(k), S_k a sum of k independent N(0, 1)): the recursive numerical
    integration of Armitage, McPherson & Rowe (1969), Simpson's rule on a grid of S of width `step`."""
    density, grid, weights = None, None, None
    for k, z in enumerate(z_bounds, start=1):
        new_grid, new_weights = _simpson(z * math.sqrt(k), step)
        if density is None:
            density = np.exp(-new_grid**2 / 2) / math.sqrt(2 * math.pi)  # [G]
        else:
            diff = new_grid[:, None] - grid[None, :]  # [G_new, G_old]
            density = (np.exp(-diff**2 / 2) / math.sqrt(2 * math.pi)) @ (density * weights)  # [G_new]
        grid, weights = new_grid, new_weights
    return 1.0 - float(density @ weights)


@functools.lru_cache(maxsize=256)
def sequential_constant(kind: str, looks: int, alpha: float = 0.05) -> float:
    """The constant c of a two-sided group-sequential design with `looks` equally spaced looks and
    overall type I error `alpha`: Pocock's bounds are c at every look, O'Brien-Fleming's c sqrt(K / k)
    (Jennison & Turnbull 2000, Tables 2.1 and 2.3: Pocock K = 5 gives 2.413, OBF K = 5 gives 2.040)."""
    if kind not in BOUNDARIES:
        raise ValueError(f"group-sequential boundary must be one of {', '.join(BOUNDARIES)}, got {kind!r}")
    if isinstance(looks, bool) or not isinstance(looks, int) or not 1 <= looks <= 20:
        raise ValueError(f"planned looks must be an integer in 1..20, got {looks!r}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")
    shape = _boundary_shape(kind, looks)
    # the constant lies between the fixed design's and Bonferroni's over the looks; the crossing
    # probability falls as it grows: regula falsi (Illinois variant) to 1e-6
    lo, hi = _NORMAL.inv_cdf(1 - alpha / 2), _NORMAL.inv_cdf(1 - alpha / (2 * looks)) * shape.max()
    f_lo, f_hi = crossing_probability(lo * shape) - alpha, crossing_probability(hi * shape) - alpha
    side = 0
    for _ in range(60):
        mid = hi - f_hi * (hi - lo) / (f_hi - f_lo) if f_hi != f_lo else (lo + hi) / 2
        f_mid = crossing_probability(mid * shape) - alpha
        if abs(f_mid) < 1e-9 or hi - lo < 1e-6:
            return mid
        if (f_mid > 0) == (f_lo > 0):
            lo, f_lo = mid, f_mid
            f_hi = f_hi / 2 if side == -1 else f_hi
            side = -1
        else:
            hi, f_hi = mid, f_mid
            f_lo = f_lo / 2 if side == 1 else f_lo
            side = 1
    return mid


def sequential_threshold(kind: str, looks: int, look: int, alpha: float = 0.05) -> float:
    """The nominal two-sided p-value threshold at look `look` (1..looks) of the design: reject at
    that look when p < threshold. One look is the fixed design (threshold alpha)."""
    if not 1 <= look <= looks:
        raise ValueError(f"look must be in 1..{looks}, got {look}")
    if looks == 1:
        return alpha
    z = sequential_constant(kind, looks, alpha) * _boundary_shape(kind, looks)[look - 1]
    return 2 * (1 - _NORMAL.cdf(z))


def parse_sequential(text: str) -> tuple[str, int]:
    """`pocock:K` or `obf:K` -> (kind, planned looks), checked."""
    kind, _, looks = str(text).partition(":")
    try:
        count = int(looks)
    except ValueError:
        raise ValueError(f"--sequential takes KIND:LOOKS with KIND one of {', '.join(BOUNDARIES)} and LOOKS "
                         f"the number of planned looks, e.g. obf:3; got {text!r}") from None
    sequential_constant(kind, count)  # validates kind and count
    return kind, count


# ----------------------------------------------------------------------- Student t (stdlib only)


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (Lentz; Numerical Recipes 6.4)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h


def t_two_sided_p(t: float, df: int) -> float:
    """Two-sided p-value of Student's t with `df` degrees of freedom: I_{df/(df+t^2)}(df/2, 1/2)."""
    if math.isnan(t) or df < 1:
        return math.nan
    if math.isinf(t):
        return 0.0
    if t == 0:
        return 1.0
    x, one_minus_x = df / (df + t * t), t * t / (df + t * t)  # both exact, also for tiny or huge t
    a, b = df / 2, 0.5
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log(one_minus_x))
    if x < (a + 1) / (a + b + 2):
        return min(1.0, front * _betacf(a, b, x) / a)
    return min(1.0, 1 - front * _betacf(b, a, 1 - x) / b)


@functools.lru_cache(maxsize=1024)
def t_quantile(q: float, df: int) -> float:
    """The q-quantile of Student's t (bisection on `t_two_sided_p`), for q in (0.5, 1)."""
    lo, hi = 0.0, 1e3
    for _ in range(64):
        mid = (lo + hi) / 2
        if t_two_sided_p(mid, df) / 2 > 1 - q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# ------------------------------------------------------------------------------ clustered paired test


@dataclass(frozen=True)
class PairedEstimate:
    estimate: float  # mean difference (row - baseline), or a slope (`clustered_slope`)
    low: float  # 95% interval
    high: float
    p_value: float  # two-sided
    se: float  # standard error of the estimate
    clusters: int  # problems
    units: int  # (problem, seed) pairs


def _t_estimate(est: float, se: float, clusters: int, units: int, level: float) -> PairedEstimate:
    """An estimate with its standard error -> its t interval and two-sided p on (clusters - 1) df;
    no spread at all: p = 1 for a zero estimate, 0 otherwise."""
    if se == 0:
        return PairedEstimate(est, est, est, 1.0 if est == 0 else 0.0, 0.0, clusters, units)
    half = t_quantile(0.5 + level / 2, clusters - 1) * se
    return PairedEstimate(est, est - half, est + half, t_two_sided_p(est / se, clusters - 1), se, clusters,
                          units)


def clustered_paired(pairs: Sequence[tuple[str, float, float]], level: float = 0.95) -> PairedEstimate:
    """The cluster-robust paired t-test on (cluster, row score, baseline score) triples: per-cluster mean
    differences, their mean, its t interval and two-sided p on (clusters - 1) df (module docstring).
    Fewer than two clusters: the estimate alone (interval and p NaN); no spread at all: p = 1 for a
    zero estimate, 0 otherwise."""
    by_cluster: dict[str, list[float]] = defaultdict(list)
    for cluster, row, base in pairs:
        by_cluster[cluster].append(row - base)
    diffs = [mean(v) for v in by_cluster.values()]
    n = len(diffs)
    if n == 0:
        return PairedEstimate(math.nan, math.nan, math.nan, math.nan, math.nan, 0, 0)
    est = mean(diffs)
    if n < 2:
        return PairedEstimate(est, math.nan, math.nan, math.nan, math.nan, n, len(pairs))
    return _t_estimate(est, stdev(diffs) / math.sqrt(n), n, len(pairs), level)


def minimum_detectable_effect(se: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true difference a two-sided level-`alpha` test detects with probability `power`,
    for an estimate with standard error `se` (normal approximation): (z_{1-alpha/2} + z_{power}) se;
    2.80 se at alpha 0.05 and power 0.8 (e.g. Cohen 1988, ch. 2)."""
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"alpha and power must lie in (0, 1), got {alpha!r}, {power!r}")
    return (_NORMAL.inv_cdf(1 - alpha / 2) + _NORMAL.inv_cdf(power)) * se


# --------------------------------------------------------------------------- clustered trend (slope)


def clustered_slope(points: Sequence[tuple[str, float, float]], level: float = 0.95) -> PairedEstimate:
    """The least-squares slope of y on x from (cluster, x, y) triples, with its cluster-robust (CR1)
    standard error and a t interval and p on (clusters - 1) df (Cameron & Miller 2015, 'A practitioner's
    guide to cluster-robust inference', eq. 11 with the small-sample factor G/(G-1) (N-1)/(N-2)). With one
    point per cluster this is the heteroskedasticity-robust HC1 slope test. Used for a trend over
    difficulty: y a paired difference, x the difficulty of its problem. Fewer than two clusters or no
    spread in x: the estimate (or NaN) with NaN interval and p."""
    n = len(points)
    nan = PairedEstimate(math.nan, math.nan, math.nan, math.nan, math.nan, len({c for c, _, _ in points}), n)
    if n < 3:
        return nan
    x = np.array([p[1] for p in points], dtype=np.float64)  # [N]
    y = np.array([p[2] for p in points], dtype=np.float64)  # [N]
    xc = x - x.mean()
    sxx = float(xc @ xc)
    if sxx == 0:
        return nan
    slope = float(xc @ (y - y.mean())) / sxx
    resid = y - y.mean() - slope * xc  # [N]
    score: dict[str, float] = defaultdict(float)  # per cluster: sum of xc * residual
    for (cluster, _, _), s in zip(points, xc * resid):
        score[cluster] += float(s)
    g = len(score)
    if g < 2:
        return PairedEstimate(slope, math.nan, math.nan, math.nan, math.nan, g, n)
    factor = g / (g - 1) * (n - 1) / (n - 2)
    return _t_estimate(slope, math.sqrt(factor * sum(s * s for s in score.values())) / sxx, g, n, level)


def clustered_mean(points: Sequence[tuple[str, float]], level: float = 0.95) -> PairedEstimate:
    """The mean of (cluster, value) points weighted by point, not by cluster, with its cluster-robust
    (CR1) standard error and a t interval and p on (clusters - 1) df (the intercept-only case of
    `clustered_slope`). Use it where a cluster's number of points depends on its outcomes: a difficulty
    tier read from the other seeds holds a problem once when plain decoding solved it on the held-out
    seed alone and three times when it never did, so the mean of per-problem means (`clustered_paired`)
    would weight plain's held-out successes up (tests/test_difficulty.py measures that bias); weighting
    each point alike keeps every (problem, seed) pair's expectation. With one point per cluster it is the
    one-sample t-test."""
    n = len(points)
    clusters = {c for c, _ in points}
    if n == 0:
        return PairedEstimate(math.nan, math.nan, math.nan, math.nan, math.nan, 0, 0)
    est = sum(v for _, v in points) / n
    g = len(clusters)
    if g < 2:
        return PairedEstimate(est, math.nan, math.nan, math.nan, math.nan, g, n)
    score: dict[str, float] = defaultdict(float)
    for cluster, v in points:
        score[cluster] += v - est
    return _t_estimate(est, math.sqrt(g / (g - 1) * sum(s * s for s in score.values())) / n, g, n, level)


def t_quantile_975(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (`stats.t_quantile`, the one
    implementation)."""
    return t_quantile(0.975, df)


def t_interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval) of the finite values; half-width NaN for fewer than two.
    A caller whose values may be infinite decides what that means before calling (see `summarize`)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return math.nan, math.nan
    if len(vals) < 2:
        return vals[0], math.nan
    return mean(vals), t_quantile_975(len(vals) - 1) * stdev(vals) / math.sqrt(len(vals))


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95% Wilson score interval of a binomial proportion (Wilson 1927); (nan, nan) for n = 0. At 0
    (n) successes the lower (upper) bound is exactly 0 (1): centre - half cancels there only up to
    rounding, which put the bound a hair past the proportion (a negative error bar in the plot)."""
    if n == 0:
        return math.nan, math.nan
    phat = successes / n
    centre = (phat + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return min(low, phat), max(high, phat)


def mcnemar_exact(better: int, worse: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pair counts (row passes and its baseline
    fails: `better`; the other way round: `worse`): a binomial(better + worse, 1/2) test; 1.0 with none.
    Integer arithmetic to the last division (exactly rounded), so any number of pairs works."""
    n = better + worse
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(better, worse) + 1))
    return min(1.0, 2 * tail / 2**n)


def newcombe_paired_interval(both: int, better: int, worse: int, neither: int,
                             z: float = 1.959964) -> tuple[float, float]:
    """95% interval of a paired difference of proportions, p(row passes) - p(baseline passes), from the
    2x2 table of pairs (both pass, only the row, only the baseline, neither): Newcombe's square-and-add
    interval from the two Wilson intervals and the pairs' (continuity-corrected) phi correlation
    (Newcombe 1998, Statistics in Medicine 17:2635, method 10). Unlike a t-interval on the 0/+-1
    differences it has width when no pair is discordant and keeps its coverage with few discordant
    pairs. (nan, nan) for no pairs."""
    n = both + better + worse + neither
    if n == 0:
        return math.nan, math.nan
    row, base = (both + better) / n, (both + worse) / n
    row_lo, row_hi = wilson_interval(both + better, n, z)
    base_lo, base_hi = wilson_interval(both + worse, n, z)
    margins = (both + better) * (worse + neither) * (both + worse) * (better + neither)
    cross = both * neither - better * worse
    # Newcombe's phi: a positive cross-product is shrunk by n/2 (a continuity correction), down to 0
    cross = cross - n / 2 if cross > n / 2 else (0.0 if cross >= 0 else cross)
    phi = cross / math.sqrt(margins) if margins else 0.0
    down = math.sqrt(max(0.0, (row - row_lo) ** 2 - 2 * phi * (row - row_lo) * (base_hi - base)
                         + (base_hi - base) ** 2))
    up = math.sqrt(max(0.0, (row_hi - row) ** 2 - 2 * phi * (row_hi - row) * (base - base_lo)
                       + (base - base_lo) ** 2))
    return max(-1.0, row - base - down), min(1.0, row - base + up)


def paired_table(paired: list[tuple[float, float]]) -> tuple[int, int, int, int]:
    """The 2x2 table of paired 0/1 scores (a, b): (both 1, only a, only b, neither), the counts
    McNemar's test and Newcombe's interval take."""
    both = sum(1 for a, b in paired if a == b == 1)
    only_a = sum(1 for a, b in paired if a > b)
    only_b = sum(1 for a, b in paired if a < b)
    return both, only_a, only_b, len(paired) - both - only_a - only_b


def percentile(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted values, linearly interpolated between order statistics (numpy's default;
    an infinite neighbour gives inf); NaN for none."""
    if not ordered:
        return math.nan
    at = q * (len(ordered) - 1)
    lo, frac = int(at), at - int(at)
    if frac == 0 or lo + 1 == len(ordered):
        return ordered[lo]
    if math.inf in (ordered[lo], ordered[lo + 1]):
        return math.inf
    return ordered[lo] + frac * (ordered[lo + 1] - ordered[lo])
