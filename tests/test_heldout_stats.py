"""benchmarks/common.py's held-out statistics (scipy, written apart from verispec.evaluation.stats) agree
with the report's on the same numbers: the check that a published p is reproduced by other code."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import load_benchmark

from verispec.evaluation import stats

common = load_benchmark("common")


def test_holm_adjusted_equals_the_reports_holm():
    rng = np.random.default_rng(0)
    for size in (1, 2, 3, 5):
        p_values = list(rng.uniform(0, 0.2, size))
        assert common.holm_adjusted(p_values) == pytest.approx(stats.holm(p_values))
    assert common.holm_adjusted([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])  # by hand


def test_paired_by_problem_equals_the_reports_clustered_test():
    rng = np.random.default_rng(1)
    scores, triples = {}, []
    for problem in range(30):
        for seed in range(3):
            a, b = float(rng.random() < 0.6), float(rng.random() < 0.5)
            scores[("A", f"p{problem}", seed)], scores[("B", f"p{problem}", seed)] = a, b
            triples.append((f"p{problem}", a, b))
    scores[("A", "p99", 0)] = 1.0  # no B row: not a pair
    mean, low, high, p = common.paired_by_problem(scores, "A", "B")
    ours = stats.clustered_paired(triples)
    assert (mean, low, high, p) == pytest.approx((ours.estimate, ours.low, ours.high, ours.p_value))
    assert "(30 problems, 90 pairs)" in common.paired_text(scores, "A", "B")
