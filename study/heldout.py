"""Held-out statistics for the re-scoring scripts: each planned comparison computed with scipy by
code written apart from the report's (`verispec.evaluation.stats`), so that a published estimate and p
are reproduced by other code, not only re-read. Conventions follow the report's where they are a choice:
fewer than two problems give NaN, no spread gives p = 1 for a zero mean and 0 otherwise, and Holm leaves
NaN p-values out of its count. (Which configurations pair, and their names, come from
`verispec.evaluation.comparisons`: a pairing defect there would be repeated here, not caught.)
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
from scipy import stats

Scores = dict[tuple[str, str, int], float]  # (config, problem, seed) -> score


def unit_differences(scores: Scores, a: str, b: str) -> dict[tuple[str, int], float]:
    """(problem, seed) -> A - B, on the units both configurations have."""
    return {(p, s): v - scores[(b, p, s)]
            for (c, p, s), v in scores.items() if c == a and (b, p, s) in scores}


def problem_differences(scores: Scores, a: str, b: str) -> dict[str, float]:
    """problem -> the mean of A - B over its seeds (the problem is the cluster)."""
    diffs: dict[str, list[float]] = defaultdict(list)
    for (p, _), d in unit_differences(scores, a, b).items():
        diffs[p].append(d)
    return {p: float(np.mean(v)) for p, v in diffs.items()}


def paired_by_problem(scores: Scores, a: str, b: str) -> tuple[float, float, float, float]:
    """A - B clustered by problem: (mean, 95% t interval low, high, one-sample t-test p) by scipy, on
    problems - 1 degrees of freedom."""
    diffs = np.array(list(problem_differences(scores, a, b).values()))
    if len(diffs) == 0:
        return math.nan, math.nan, math.nan, math.nan
    mean = float(diffs.mean())
    if len(diffs) < 2:
        return mean, math.nan, math.nan, math.nan
    if np.all(diffs == diffs[0]):
        return mean, mean, mean, 1.0 if mean == 0 else 0.0
    half = float(stats.t.ppf(0.975, len(diffs) - 1) * diffs.std(ddof=1) / np.sqrt(len(diffs)))
    return mean, mean - half, mean + half, float(stats.ttest_1samp(diffs, 0.0).pvalue)


def paired_text(scores: Scores, a: str, b: str) -> str:
    """`paired_by_problem` with the exact McNemar test on the (problem, seed) pairs (for scores not 0/1:
    the sign test, the same binomial test of wins against losses), as one line."""
    pairs = unit_differences(scores, a, b)
    mean, low, high, t_p = paired_by_problem(scores, a, b)
    wins, losses = sum(d > 0 for d in pairs.values()), sum(d < 0 for d in pairs.values())
    mcnemar = stats.binomtest(wins, wins + losses, 0.5).pvalue if wins + losses else 1.0
    binary = all(v in (0.0, 1.0) for (c, _, _), v in scores.items() if c in (a, b))
    problems = len({problem for problem, _ in pairs})
    return (f"{mean:+.3f} [{low:+.3f}, {high:+.3f}] t-test p {t_p:.3g}; "
            f"{'McNemar' if binary else 'sign test'} +{wins}/-{losses} p {mcnemar:.3g} "
            f"({problems} problems, {len(pairs)} pairs)")


def holm_adjusted(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979), in the input's order; NaN stays NaN and is not
    counted. Written here, apart from `verispec.evaluation.stats.holm`, for the held-out check."""
    finite = [i for i, p in enumerate(p_values) if not math.isnan(p)]
    order = sorted(finite, key=lambda i: p_values[i])
    adjusted, running = [math.nan] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted
