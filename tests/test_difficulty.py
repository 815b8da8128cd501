"""The difficulty trend (issue 23): `stats.clustered_slope` against the HC1 slope test computed by hand
and against a null simulation (power-checked with the unclustered slope it replaces), and the report's
difficulty tiers (`comparisons.difficulty_tiers`, `comparisons.tier_table`) on constructed rows and on
the committed three-seed HumanEval sweep."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from verispec.evaluation import comparisons, stats
from verispec.evaluation.summary import baseline_of
from verispec.evaluation.store import has_rows, read_rows

SEEDS = Path(__file__).resolve().parents[1] / "study" / "sweeps" / "qwen-humaneval-sanitized-seeds"
GATE, HONEST = "speccascade:min_p=0.1,resample=target", "honest:speccascade:min_p=0.1,resample=target"


def test_slope_with_one_point_per_cluster_is_the_hc1_test():
    """One point per cluster: the slope is ordinary least squares and its standard error the
    heteroskedasticity-robust HC1 one, (X'X)^-1 X' diag(e^2) X (X'X)^-1 n / (n - 2), computed here with
    numpy from the design matrix; the p-value is Student t's on n - 1 df (scipy)."""
    rng = np.random.default_rng(3)
    x = rng.uniform(0, 1, 40)
    y = 0.3 * x + rng.normal(0, 0.2 + x, 40)  # heteroskedastic
    est = stats.clustered_slope([(str(i), float(a), float(b)) for i, (a, b) in enumerate(zip(x, y))])
    design = np.column_stack([np.ones_like(x), x])  # [N, 2]
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    bread = np.linalg.inv(design.T @ design)
    cov = bread @ (design.T * resid**2) @ design @ bread * 40 / 38
    assert est.estimate == pytest.approx(coef[1], rel=1e-12)
    assert est.se == pytest.approx(math.sqrt(cov[1, 1]), rel=1e-10)
    assert est.p_value == pytest.approx(2 * scipy_stats.t.sf(abs(coef[1]) / est.se, 39), rel=1e-6)
    assert (est.clusters, est.units) == (40, 40) and est.low < est.estimate < est.high


def test_slope_edges():
    assert math.isnan(stats.clustered_slope([("a", 0.0, 1.0), ("b", 1.0, 0.0)]).estimate)  # too few
    flat = stats.clustered_slope([("a", 0.5, 1.0), ("b", 0.5, 0.0), ("c", 0.5, 1.0)])
    assert math.isnan(flat.estimate) and math.isnan(flat.p_value)  # no spread in x
    one = stats.clustered_slope([("a", 0.0, 0.0), ("a", 1.0, 1.0), ("a", 2.0, 2.0)])
    assert one.estimate == pytest.approx(1.0) and math.isnan(one.p_value)  # one cluster: no test
    exact = stats.clustered_slope([(str(i), float(i), 2.0 * i) for i in range(5)])
    assert exact.estimate == pytest.approx(2.0) and exact.se == 0 and exact.p_value == 0.0


def null_trend(rng, problems: int, seeds: int) -> list[tuple[str, float, float]]:
    """No trend: each problem has a difficulty x (shared by its seeds) and its own mean gap, drawn
    independently of x; its seeds add independent noise. Seeds of one problem share both x and the
    gap, which is what an unclustered slope test ignores."""
    x = rng.choice([0.0, 0.5, 1.0], problems)
    gap = rng.normal(0, 0.3, problems)
    return [(str(g), float(x[g]), float(gap[g] + rng.normal(0, 0.3))) for g in range(problems)
            for _ in range(seeds)]


def test_slope_false_positive_rate_under_a_null_trend():
    """1000 null sweeps of 60 problems x 3 seeds: the clustered slope test rejects at 5% in 5% of them
    (binomial SE 0.0069; bound 0.022, about 3 SE); the unclustered one (each unit its own cluster) rejects
    clearly more often, so the bound has the power to tell a broken test apart."""
    rng = np.random.default_rng(2027)
    clustered, naive = [], []
    for _ in range(1000):
        data = null_trend(rng, 60, 3)
        clustered.append(stats.clustered_slope(data).p_value < 0.05)
        naive.append(stats.clustered_slope([(str(i), x, y) for i, (_, x, y) in enumerate(data)]).p_value
                     < 0.05)
    assert abs(np.mean(clustered) - 0.05) < 0.022, np.mean(clustered)
    assert np.mean(naive) > 0.05 + 0.05, np.mean(naive)


def row(rule: str, problem: str, score: float, seed: int) -> dict:
    return {"rule": rule, "k": 0 if rule == "plain" else 4, "temperature": 1.0, "prompt_id": problem,
            "seed": seed, "score": score, "tokens": 10, "finish": "eos"}


def test_tiers_leave_the_row_seed_out():
    """A unit's tier is the reference's score on the other seeds only: plain passes HumanEval/0 on seed 0
    alone, so seed 0's units are 'hard' (seeds 1 and 2 failed), seed 1's and seed 2's 'middle' (1 of 2)."""
    rows = [row("plain", "HumanEval/0", float(seed == 0), seed) for seed in range(3)]
    rows += [row(GATE, "HumanEval/0", 1.0, seed) for seed in range(3)]
    rate = comparisons.difficulty_tiers(rows)
    assert rate[("HumanEval/0", 0, 1.0)] == 0.0 and rate[("HumanEval/0", 1, 1.0)] == 0.5
    assert [comparisons.tier_name(rate[("HumanEval/0", s, 1.0)]) for s in range(3)] == ["hard", "middle",
                                                                                        "middle"]
    one_seed = [row("plain", "HumanEval/1", 1.0, 0), row(GATE, "HumanEval/1", 1.0, 0)]
    assert comparisons.difficulty_tiers(one_seed) == {}  # one seed: nothing left to tier by


def test_tier_table_on_constructed_rows():
    """Gate minus honest is -1 on hard problems (plain never solves them) and 0 on easy ones (plain
    always does), by construction: the table prints both, the trend is +1 per unit pass rate, and the
    held-out plain score is 0 and 1; lossless, scoring as plain does, reads 0 with no trend."""
    rows = []
    for n in range(8):
        easy = n % 2 == 0
        for seed in range(3):
            problem = f"HumanEval/{n}"
            rows += [row("plain", problem, float(easy), seed), row(HONEST, problem, 1.0, seed),
                     row(GATE, problem, 1.0 if easy else 0.0, seed),
                     row("lossless", problem, float(easy), seed)]
    table = comparisons.tier_table(rows, baseline_of)
    gate_line = next(line for line in table.splitlines() if line.startswith("speccascade"))
    assert "-1.000 [-1.000, -1.000] n=12" in gate_line and "+0.000 [+0.000, +0.000] n=12" in gate_line
    assert "+1.000 [+1.000, +1.000] p 0" in gate_line
    calibration = next(line for line in table.splitlines()
                       if line.startswith("lossless k=4 T=1 - plain (same law)"))
    assert calibration.count("+0.000 [+0.000, +0.000] n=12") == 2 and "p 1.000" in calibration
    plain_line = next(line for line in table.splitlines() if line.startswith("plain score"))
    assert "0.000 n=12" in plain_line and "1.000 n=12" in plain_line
    graded = [dict(r, prompt_id=f"graded-L1-{i:02d}") for i, r in enumerate(rows)]
    assert comparisons.tier_table(graded, baseline_of) == ""  # a graded suite has levels instead
    assert comparisons.tier_table([r for r in rows if r["rule"] != GATE], baseline_of) == ""  # no rule


def test_the_collaborative_rules_are_tiered_against_lossless():
    """A rule whose baseline is lossless SD (cos, lenience, budget) gets a tier line against lossless:
    here cos loses 1 on the hard problems only; a rule whose baseline has no rows gets none."""
    rows = []
    for n in range(8):
        easy = n % 2 == 0
        for seed in range(3):
            problem = f"HumanEval/{n}"
            rows += [row("plain", problem, float(easy), seed), row("lossless", problem, 1.0, seed),
                     row("cos:w=0.9", problem, 1.0 if easy else 0.0, seed)]
    table = comparisons.tier_table(rows, baseline_of)
    cos_line = next(line for line in table.splitlines() if line.startswith("cos:w=0.9 k=4 T=1 - lossless"))
    assert "-1.000 [-1.000, -1.000] n=12" in cos_line and "+0.000 [+0.000, +0.000] n=12" in cos_line
    assert "lossless k=4 T=1 - plain (same law)" in table
    no_lossless = [r for r in rows if r["rule"] != "lossless"]
    assert comparisons.tier_table(no_lossless, baseline_of) == ""  # cos's baseline has no rows
    at_another_t = [dict(r, temperature=0.7) if r["rule"] == "lossless" else r for r in rows]
    assert "cos:w=0.9" not in comparisons.tier_table(at_another_t, baseline_of)
    loglik = [dict(r, score=-1.5 + r["score"]) for r in rows]  # not a pass rate: no tiers
    assert comparisons.tier_table(loglik, baseline_of) == ""


@pytest.fixture(scope="module")
def seed_rows():
    if not has_rows(SEEDS / "results.jsonl"):
        pytest.skip(f"{SEEDS} is not in this checkout")
    return read_rows(SEEDS / "results.jsonl")  # references (store, same_as) resolved


def test_tiers_on_the_committed_seeds_sweep(seed_rows):
    """On the committed three-seed sweep the tiers are difficulty tiers: plain decoding's score on the
    held-out seed rises from hard to middle to easy; the per-tier gap and the trend are recomputed from
    the rows."""
    rate = comparisons.difficulty_tiers(seed_rows)
    held_out = {name: [r["score"] for r in seed_rows if r["rule"] == "plain"
                       and comparisons.tier_name(rate[(r["prompt_id"], r["seed"], r["temperature"])]) == name]
                for name in comparisons.TIERS}
    assert np.mean(held_out["hard"]) < np.mean(held_out["middle"]) < np.mean(held_out["easy"])
    by = {(r["rule"], r["prompt_id"], r["seed"]): r["score"] for r in seed_rows}
    points = [(p, rate[(p, s, 1.0)], by[(GATE, p, s)] - by[(HONEST, p, s)])
              for (rule, p, s) in by if rule == GATE and (HONEST, p, s) in by and (p, s, 1.0) in rate]
    hard = [d for _, x, d in points if x == 0]
    table = comparisons.tier_table(seed_rows, baseline_of)
    assert f"{np.mean(hard):+.3f}" in table and f"n={len(hard)}" in table  # weighted by pair
    slope = stats.clustered_slope(points)
    assert f"{slope.estimate:+.3f} [{slope.low:+.3f}, {slope.high:+.3f}]" in table


def tier_cells(rows: list[dict], estimator) -> dict[str, float]:
    """Lossless minus plain per tier with the given estimator of (problem, difference) points."""
    rate = comparisons.difficulty_tiers(rows)
    by = {(r["rule"], r["prompt_id"], r["seed"]): r["score"] for r in rows}
    out = {}
    for name in comparisons.TIERS:
        points = [(p, by[("lossless", p, s)] - by[("plain", p, s)]) for (p, s, _), x in rate.items()
                  if comparisons.tier_name(x) == name]
        out[name] = estimator(points)
    return out


@pytest.mark.slow
def test_tier_cells_weight_pairs_not_problems():
    """Plain and lossless as the same law (independent Bernoulli draws with each problem's pass rate), 3
    seeds, 60 problems, 300 sweeps: weighted by (problem, seed) pair (stats.clustered_mean, the report's
    estimator) the calibration cells average within 0.02 of 0 in every tier (a small ratio bias remains,
    -0.007 / +0.001 / +0.004 over 2000 sweeps, since a pair's own plain draw moves which tier the other
    seeds' pairs fall in) and its test rejects at 5% in 5% of sweeps (binomial SE 0.013; bound 0.04), as
    does the trend's slope test (1000 sweeps: 5.3%); the
    mean of per-problem means (stats.clustered_paired, the broken check) is biased by about -0.22 / +0.22
    in the hard / easy tier: a problem lands in the hard tier once when plain solved it on the held-out
    seed only and three times when plain never did (on SmolLM2's capitals it read -0.285 [-0.47, -0.10]
    for the hard tier)."""
    rng = np.random.default_rng(11)
    pair, per_problem, rejected = defaultdict(list), defaultdict(list), defaultdict(list)
    for _ in range(300):
        rate = rng.uniform(0.05, 0.95, 60)
        rows = [row(rule, f"p{g}", float(rng.random() < rate[g]), seed)
                for g in range(60) for seed in range(3) for rule in ("plain", "lossless")]
        weighted = tier_cells(rows, stats.clustered_mean)
        rate = comparisons.difficulty_tiers(rows)
        by = {(r["rule"], r["prompt_id"], r["seed"]): r["score"] for r in rows}
        slope = stats.clustered_slope([(p, x, by[("lossless", p, s)] - by[("plain", p, s)])
                                       for (p, s, _), x in rate.items()])
        rejected["trend"].append(slope.p_value < 0.05)
        broken = tier_cells(rows, lambda pts: stats.clustered_paired([(p, d, 0.0) for p, d in pts]).estimate)
        for name in comparisons.TIERS:
            pair[name].append(weighted[name].estimate)
            rejected[name].append(weighted[name].p_value < 0.05)
            per_problem[name].append(broken[name])
    for name in comparisons.TIERS:
        assert abs(np.mean(pair[name])) < 0.02, (name, np.mean(pair[name]))
        assert abs(np.mean(rejected[name]) - 0.05) < 0.04, (name, np.mean(rejected[name]))
    assert abs(np.mean(rejected["trend"]) - 0.05) < 0.04, np.mean(rejected["trend"])
    assert np.mean(per_problem["hard"]) < -0.05 and np.mean(per_problem["easy"]) > 0.05, (
        np.mean(per_problem["hard"]), np.mean(per_problem["easy"]))


def test_clustered_mean_against_hand_computation():
    """Weighted by point; its CR1 standard error by hand; one point per cluster: the one-sample t-test
    (scipy)."""
    points = [("a", 1.0), ("a", 1.0), ("a", 1.0), ("b", 0.0), ("c", -1.0), ("c", 0.0)]
    est = stats.clustered_mean(points)
    assert est.estimate == pytest.approx(2 / 6) and (est.clusters, est.units) == (3, 6)
    scores = [3 * (1 - 2 / 6), -2 / 6, (-1 - 2 / 6) + (0 - 2 / 6)]
    assert est.se == pytest.approx(math.sqrt(3 / 2 * sum(x * x for x in scores)) / 6)
    values = np.random.default_rng(1).normal(0.2, 1.0, 30)
    single = stats.clustered_mean([(str(i), float(v)) for i, v in enumerate(values)])
    assert single.p_value == pytest.approx(scipy_stats.ttest_1samp(values, 0.0).pvalue, rel=1e-6)
    assert math.isnan(stats.clustered_mean([("a", 1.0), ("a", 0.0)]).p_value)
    assert stats.clustered_mean([]).units == 0
