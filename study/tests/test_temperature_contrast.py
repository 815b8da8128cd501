"""study/temperature_contrast.py: a rule's effect in one sweep minus its effect in another."""

from __future__ import annotations

import math
from statistics import mean, stdev

import pytest
from helpers import load_study

contrast_module = load_study("temperature_contrast")


def _row(rule: str, k: int, problem: str, seed: int, score: float, temperature: float) -> dict:
    return {"rule": rule, "k": k, "temperature": temperature, "tree": None, "prompt_id": problem,
            "seed": seed, "score": score, "tokens": 10}


def test_the_difference_in_differences_is_clustered_by_problem():
    scores_a = {("p0", 1): (1, 0), ("p0", 2): (1, 1), ("p1", 1): (0, 1), ("p1", 2): (1, 0),
                ("p2", 1): (1, 1), ("p2", 2): (0, 0)}  # (rule, lossless)
    scores_b = {("p0", 1): (0, 0), ("p0", 2): (0, 1), ("p1", 1): (1, 1), ("p1", 2): (1, 1),
                ("p2", 1): (0, 1), ("p2", 2): (1, 1)}
    rows_a = [_row(rule, 4, p, s, v[i], 1.0) for (p, s), v in scores_a.items()
              for i, rule in enumerate(("cos:w=0.9", "lossless"))]
    rows_b = [_row(rule, 4, p, s, v[i], 0.7) for (p, s), v in scores_b.items()
              for i, rule in enumerate(("cos:w=0.9", "lossless"))]
    rows_b.append(_row("cos:w=0.9", 4, "p9", 1, 1, 0.7))  # no lossless row, nor any in A: left out
    rows_b.append(_row("plain", 0, "p0", 1, 1, 0.7))  # plain is never a rule here
    out = contrast_module.contrast(rows_a, rows_b)
    assert list(out) == ["cos:w=0.9"]
    in_a, in_b, diff = out["cos:w=0.9"]
    per_problem = []
    for p in ("p0", "p1", "p2"):
        da = [scores_a[(p, s)][0] - scores_a[(p, s)][1] for s in (1, 2)]
        db = [scores_b[(p, s)][0] - scores_b[(p, s)][1] for s in (1, 2)]
        per_problem.append(mean(da) - mean(db))
    assert diff.estimate == pytest.approx(mean(per_problem))
    assert diff.se == pytest.approx(stdev(per_problem) / math.sqrt(3))
    assert (diff.clusters, diff.units) == (3, 6)
    assert in_a.estimate == pytest.approx(mean(a - b for a, b in scores_a.values()))
    assert in_b.estimate == pytest.approx(mean(a - b for a, b in scores_b.values()))
    only_seed_1 = contrast_module.contrast(rows_a, rows_b, seeds={1})["cos:w=0.9"][2]
    assert only_seed_1.units == 3


def test_plain_as_the_baseline_matches_any_k():
    rows_a = [_row("lossless", 4, "p0", 0, 1, 1.0), _row("plain", 0, "p0", 0, 0, 1.0),
              _row("lossless", 4, "p1", 0, 1, 1.0), _row("plain", 0, "p1", 0, 1, 1.0)]
    rows_b = [dict(r, temperature=0.7, score=0) for r in rows_a]
    in_a, in_b, diff = contrast_module.contrast(rows_a, rows_b, baseline="plain")["lossless"]
    assert (in_a.estimate, in_b.estimate, diff.estimate) == (0.5, 0.0, 0.5)


def test_missing_scores_several_temperatures_and_unmatched_rules():
    rows_a = [_row("lenience:l=0.25", 4, "p0", 0, None, 1.0), _row("lossless", 4, "p0", 0, 1, 1.0),
              _row("lenience:l=0.25", 4, "p1", 0, 1, 1.0), _row("lossless", 4, "p1", 0, 0, 1.0),
              _row("cos:w=0.9", 4, "p1", 0, 1, 1.0)]  # cos only in A
    rows_b = [dict(r, temperature=0.7, score=0) for r in rows_a[:4]]
    out = contrast_module.contrast(rows_a, rows_b)
    assert list(out) == ["lenience:l=0.25"] and out["lenience:l=0.25"][2].units == 1  # p0's None: out
    assert contrast_module.unmatched(rows_a, rows_b) == ["cos:w=0.9 k=4"]
    with pytest.raises(ValueError, match="several temperatures"):
        contrast_module.contrast(rows_a + rows_b, rows_b)


def test_the_baseline_is_read_as_the_report_spells_it():
    rule, base = "speccascade:min_p=0.1,resample=target", "honest:speccascade:min_p=0.1,resample=target"
    rows_a = [_row(rule, 4, "p0", 0, 1, 1.0), _row(base, 4, "p0", 0, 0, 1.0),
              _row(rule, 4, "p1", 0, 0, 1.0), _row(base, 4, "p1", 0, 0, 1.0)]
    rows_b = [dict(r, temperature=0.7) for r in rows_a]
    out = contrast_module.contrast(rows_a, rows_b, baseline="honest:speccascade:min_p=0.1")
    assert out[rule][0].estimate == 0.5
