"""`verispec.evaluation.stats` and `verispec.evaluation.comparisons`: Holm against a hand-computed
example, group-sequential constants against the published tables and a simulation, Student t against
scipy, the clustered paired test's false-positive rate under an exchangeable null (power-checked with
the unclustered test it replaces), and the minimum detectable effect against its formula and a
simulation of its power."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import diff_rows

from verispec.evaluation import comparisons, scorers, stats
from verispec.evaluation.store import has_rows, read_rows

CORE = Path(__file__).resolve().parents[1] / "study" / "sweeps" / "qwen-humaneval-core" / "results.jsonl"


def test_holm_hand_computed():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> made monotone: 0.06
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm_levels([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.05 / 3, 0.05, 0.025, 0.0125])
    assert stats.holm([0.5, math.nan, 0.9]) == pytest.approx([1.0, math.nan, 1.0], nan_ok=True)
    assert stats.holm([0.2]) == [0.2]
    with pytest.raises(ValueError, match="p-values must lie in"):
        stats.holm([1.5])


# Jennison & Turnbull (2000), Table 2.1 (Pocock C_P) and Table 2.3 (O'Brien-Fleming C_B), alpha = 0.05
POCOCK = {1: 1.960, 2: 2.178, 3: 2.289, 4: 2.361, 5: 2.413}
OBF = {1: 1.960, 2: 1.977, 3: 2.004, 4: 2.024, 5: 2.040}


def test_group_sequential_constants_match_the_tables():
    for looks, want in POCOCK.items():
        assert stats.sequential_constant("pocock", looks) == pytest.approx(want, abs=1.5e-3)
    for looks, want in OBF.items():
        assert stats.sequential_constant("obf", looks) == pytest.approx(want, abs=1.5e-3)
    assert stats.sequential_threshold("obf", 1, 1) == 0.05
    # OBF spends almost nothing early, Pocock the same at every look
    assert stats.sequential_threshold("obf", 3, 1) < 0.001 < stats.sequential_threshold("obf", 3, 3)
    flat = stats.sequential_threshold("pocock", 3, 1)
    assert flat == pytest.approx(stats.sequential_threshold("pocock", 3, 3))
    for bad in ("pocock:0", "wald:3", "obf", "obf:x"):
        with pytest.raises(ValueError):
            stats.parse_sequential(bad)


def test_thresholds_and_p_print_two_significant_figures_below_001():
    """obf:2's look-1 thresholds at Holm's four levels, as the report prints them: 0.00146 (level 0.025)
    once printed as 0.001, a third below itself; two significant figures under 0.01, three decimals above."""
    printed = [comparisons._p(stats.sequential_threshold("obf", 2, 1, level))
               for level in (0.05 / 4, 0.05 / 3, 0.05 / 2, 0.05)]
    assert printed == ["0.0004", "0.00069", "0.0015", "0.0052"]
    assert [comparisons._p(x) for x in (5.2e-8, 0.00517, 0.00994, 0.00996, 0.025, 0.475, float("nan"))] == [
        "5.2e-08", "0.0052", "0.0099", "0.010", "0.025", "0.475", "-"]


def test_group_sequential_error_rate_by_simulation():
    """200k null paths of 4 equally spaced looks: the share crossing the OBF bounds is 0.05 (binomial
    SE 0.0005; bound 0.003 = 6 SE); the fixed-design bound 1.96 at every look crosses far more often."""
    rng = np.random.default_rng(7)
    looks = 4
    partial = rng.standard_normal((200_000, looks)).cumsum(axis=1)  # [N, K] S_k
    z = partial / np.sqrt(np.arange(1, looks + 1))  # [N, K]
    bounds = stats.sequential_constant("obf", looks) * np.sqrt(looks / np.arange(1, looks + 1))
    assert abs((np.abs(z) >= bounds).any(axis=1).mean() - 0.05) < 0.003
    assert (np.abs(z) >= 1.96).any(axis=1).mean() > 0.10  # naive repeated looks: the check can fail


def test_student_t_against_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    for t, df in [(0.0, 5), (0.5, 3), (2.1, 10), (1.96, 163), (5.0, 20), (0.01, 1), (-3.0, 40)]:
        want = 2 * scipy_stats.t.sf(abs(t), df)
        assert stats.t_two_sided_p(t, df) == pytest.approx(want, rel=1e-9, abs=1e-14)
    for df in (5, 30, 163):
        assert stats.t_quantile(0.975, df) == pytest.approx(scipy_stats.t.ppf(0.975, df), rel=1e-7)


def null_data(rng, problems: int, seeds: int, effect_spread: float) -> list[tuple[str, float, float]]:
    """Exchangeable null: each problem has its own pass rate and its own effect +-effect_spread/2 of A
    over B, the sign a fair coin (A and B exchangeable per problem), so the mean effect is 0 but seeds of
    one problem share it."""
    base = rng.uniform(0.2, 0.8, problems)
    delta = effect_spread / 2 * rng.choice([-1.0, 1.0], problems)
    pa = np.clip(base + delta, 0, 1)[:, None]  # [G, 1]
    pb = np.clip(base - delta, 0, 1)[:, None]
    a = rng.random((problems, seeds)) < pa  # [G, S]
    b = rng.random((problems, seeds)) < pb
    return [(str(g), float(a[g, s]), float(b[g, s])) for g in range(problems) for s in range(seeds)]


def unclustered_p(triples) -> float:
    """The test the clustered one replaces: a paired t over (problem x seed) units as if independent."""
    return stats.clustered_paired([(f"{i}", a, b) for i, (_, a, b) in enumerate(triples)]).p_value


@pytest.mark.slow
def test_clustered_test_false_positive_rate_under_an_exchangeable_null():
    """1000 null sweeps (60 problems x 3 seeds, per-problem effects +-0.3): the clustered test rejects at
    5% in 5% of them (binomial SE 0.0069; bound 0.022, about 3 SE), while the unclustered test, which
    ignores that seeds share their problem's effect, rejects clearly more often (it is the broken check:
    the FPR bound has the power to tell them apart)."""
    rng = np.random.default_rng(2026)
    clustered, naive = [], []
    for _ in range(1000):
        data = null_data(rng, 60, 3, 0.6)
        clustered.append(stats.clustered_paired(data).p_value < 0.05)
        naive.append(unclustered_p(data) < 0.05)
    assert abs(np.mean(clustered) - 0.05) < 0.022, np.mean(clustered)
    assert np.mean(naive) > 0.05 + 0.03, np.mean(naive)


def test_clustered_estimate_pools_seeds_and_handles_edges():
    triples = [("p1", 1, 0), ("p1", 1, 1), ("p2", 0, 0), ("p2", 0, 1), ("p3", 1, 0), ("p3", 1, 0)]
    est = stats.clustered_paired(triples)
    assert est.estimate == pytest.approx((0.5 + -0.5 + 1.0) / 3)  # per-problem means, then their mean
    assert (est.clusters, est.units) == (3, 6)
    assert est.low < est.estimate < est.high
    assert math.isnan(stats.clustered_paired([("p", 1, 0)]).p_value)
    assert stats.clustered_paired([("a", 1, 1), ("b", 0, 0)]).p_value == 1.0


@pytest.mark.slow
def test_minimum_detectable_effect_formula_and_power():
    """MDE = (z_0.975 + z_0.8) SE = 2.8016 SE; a true effect of that size is detected 80% of the time
    (2000 simulated sweeps of 100 problems with normal per-problem differences: power within 0.03 =
    3.4 binomial SE of 0.8)."""
    assert stats.minimum_detectable_effect(1.0) == pytest.approx(1.959964 + 0.841621, abs=1e-5)
    assert stats.minimum_detectable_effect(0.02, alpha=0.01, power=0.9) == pytest.approx(
        0.02 * (2.575829 + 1.281552), abs=1e-6)
    rng = np.random.default_rng(5)
    problems, sd = 100, 0.5
    effect = stats.minimum_detectable_effect(sd / math.sqrt(problems))
    hits = 0
    for _ in range(2000):
        diffs = rng.normal(effect, sd, problems)
        hits += stats.clustered_paired([(str(g), d, 0.0) for g, d in enumerate(diffs)]).p_value < 0.05
    assert abs(hits / 2000 - 0.8) < 0.03, hits / 2000
    with pytest.raises(ValueError):
        stats.minimum_detectable_effect(1.0, power=1.0)


def test_parse_comparison():
    assert comparisons.parse_comparison("cos:w=0.9:lossless") == ("cos:w=0.9", "lossless")
    assert comparisons.parse_comparison("lossless:plain") == ("lossless", "plain")
    assert comparisons.parse_comparison("lossless vs plain") == ("lossless", "plain")
    gate = comparisons.parse_comparison("speccascade:min_p=0.1:honest:speccascade:min_p=0.1")
    assert gate[1].startswith("honest:speccascade") and gate[0].startswith("speccascade")
    assert comparisons.parse_comparison("lossless k=4 T=1:plain T=1") == ("lossless k=4 T=1", "plain T=1")
    for bad in ("", "lossless", "nonsense:rule", "lossless vs nonsense"):
        with pytest.raises(ValueError, match="comparison|A:B"):
            comparisons.parse_comparison(bad)


def test_sweep_settings_keep_old_sweeps_resumable():
    from verispec.evaluation.sweep import _settings_json
    from verispec.evaluation.units import SweepSpec

    assert "compare" not in json.loads(_settings_json(SweepSpec()))  # as written before comparisons existed
    declared = SweepSpec(compare=("lossless:plain",), sequential="obf:3")
    assert json.loads(_settings_json(declared))["compare"] == ["lossless:plain"]
    with pytest.raises(ValueError, match="comparison"):
        SweepSpec(compare=("lossless:nonsense",)).validate()
    with pytest.raises(ValueError, match="sequential"):
        SweepSpec(sequential="obf:x").validate()


@pytest.fixture(scope="module")
def core_rows():
    if not has_rows(CORE):
        pytest.skip(f"{CORE} is not in this checkout")
    return read_rows(CORE)  # through the store: references and stored steps resolved


def test_tables_on_the_committed_rows(core_rows):
    """The calibration row, a planned comparison and the length outcomes, recomputed by hand from the
    rows (one seed: the clustered test is the paired t over problems)."""
    table = comparisons.comparisons_table(core_rows, ["cos:w=0.9:lossless"])
    assert "lossless k=4 T=1 - plain T=1 (calibration)" in table and "cos:w=0.9 k=4 T=1 - lossless" in table
    by = {(r["rule"], r["prompt_id"]): r["score"] for r in core_rows}
    problems = sorted({r["prompt_id"] for r in core_rows})
    diffs = [by[("lossless", p)] - by[("plain", p)] for p in problems]
    [calibration] = comparisons.compare(core_rows, "lossless", "plain")
    assert calibration.pooled.estimate == pytest.approx(np.mean(diffs))
    assert calibration.pooled.se == pytest.approx(np.std(diffs, ddof=1) / math.sqrt(len(diffs)))
    assert f"{np.mean(diffs):+.3f}" in table
    # a config id pins its configuration; a bare spec covers the same k and temperature as the other side
    [pinned] = comparisons.compare(core_rows, "lossless k=4 T=1", "plain T=1")
    assert pinned.pooled == calibration.pooled
    assert comparisons.compare(core_rows, "lossless k=2 T=1", "plain") == []
    missing = comparisons.comparisons_table(core_rows, ["lenience:l=0.25:lossless"])
    assert "lenience:l=0.25 vs lossless has no rows on both sides" in missing and "(calibration)" in missing
    assert [comparisons.planned_look(n, 164, 3) for n in (1, 54, 55, 110, 164)] == [1, 1, 2, 3, 3]
    assert comparisons.planned_look(20, None, 3) == 3
    from verispec.evaluation.summary import baseline_of

    lengths = comparisons.length_table(core_rows, baseline_of)
    plain_cap = sum(r["finish"] == "length" for r in core_rows if r["rule"] == "plain") / len(problems)
    assert f"{plain_cap:.3f}" in lengths.splitlines()[2] and "protocol: extract" in lengths


def test_cap_hit_part_of_a_comparison(core_rows):
    """The part of a difference carried by pairs where either row hit the cap, recomputed from the rows:
    with the rest (pairs where both stopped by themselves) it adds up to the pooled difference, and the
    table prints it."""
    gate, honest = "speccascade:min_p=0.1,resample=target", "honest:speccascade:min_p=0.1,resample=target"
    [found] = comparisons.compare(core_rows, gate, honest)
    by = {(r["rule"], r["prompt_id"]): r for r in core_rows}
    problems = sorted({r["prompt_id"] for r in core_rows})
    capped = [p for p in problems if "length" in (by[(gate, p)]["finish"], by[(honest, p)]["finish"])]
    part = sum(by[(gate, p)]["score"] - by[(honest, p)]["score"] for p in capped) / len(problems)
    rest = sum(by[(gate, p)]["score"] - by[(honest, p)]["score"] for p in problems if p not in capped)
    assert found.cap_part == (pytest.approx(part), len(capped)) and 0 < len(capped) < len(problems)
    assert part + rest / len(problems) == pytest.approx(found.pooled.estimate)
    table = comparisons.comparisons_table(core_rows, [f"{gate} vs {honest}"])
    assert f"{part:+.3f} ({len(capped)} of {len(problems)})" in table and "from cap-hit pairs" in table
    # no cap-hit anywhere: no part
    stopped = [{**r, "finish": "eos"} for r in core_rows]
    assert comparisons.compare(stopped, gate, honest)[0].cap_part == (0.0, 0)


def test_progress_counts_pairs_and_looks_without_outcomes(core_rows, tmp_path, capsys):
    """`verispec report DIR --progress`: rows per configuration and the pairs of each declared comparison
    (and the calibration pair), the look a report would take, and no score, difference or p anywhere."""
    from verispec.cli import main

    half = [r for r in core_rows if r["prompt_id"] in {f"HumanEval/{i}" for i in range(30)}
            and not (r["rule"] == "lossless" and r["prompt_id"] == "HumanEval/0")]
    text = comparisons.progress_table(half, ["cos:w=0.9:lossless"], "obf:3", 164)
    assert "lossless k=4 T=1: 29 rows, 29 problems" in text and "plain T=1: 30 rows" in text
    assert "cos:w=0.9 k=4 T=1 - lossless k=4 T=1: 29 problems, 29 (problem, seed) pairs" in text
    assert "lossless k=4 T=1 - plain T=1: 29 problems" in text and "early: look 1 is planned at 54" in text
    assert "score" not in text and "p " not in text and "[" not in text
    assert "passed look" not in text  # 30 problems: look 1 (54) still ahead
    # over 50 planned problems the looks are at 16, 33, 50: 30 problems have passed look 1's count
    assert comparisons.look_counts(3, 50) == [16, 33, 50]
    assert comparisons.look_counts(3, 164) == [54, 109, 164]
    passed = comparisons.progress_table(half, ["cos:w=0.9:lossless"], "obf:3", 50)
    assert ("the fullest planned comparison has passed look 1's count (16 problems): if look 1 has not been "
            "read, read it on the suite's first 16 problems (verispec report DIR --problems 16)") in passed
    # the calibration row (added, not planned) past look 1 with the planned rule short of it: no hint
    # (plain and lossless copied whole, the rule still decoding, as in a --reuse-plain sweep)
    behind = [r for r in half if r["rule"] != "cos:w=0.9" or r["prompt_index"] < 10]
    assert "passed look" not in comparisons.progress_table(behind, ["cos:w=0.9:lossless"], "obf:3", 50)
    at_count = [r for r in half if r["prompt_index"] < 16]  # at a look's count, not past it: no hint
    assert "passed look" not in comparisons.progress_table(at_count, [], "obf:3", 50)
    two = comparisons.progress_table(half, [], "obf:5", 50)  # looks at 10, 20, 30, ...: the latest passed
    assert "passed look 2's count (20 problems)" in two and "look 1's" not in two
    assert "--problems 0" not in comparisons.progress_table(half, [], "obf:3", 2)  # look 1 at 0 problems
    out = tmp_path / "sweep"
    out.mkdir()
    shuffled = list(half)
    random.Random(0).shuffle(shuffled)  # not in the suite's order
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shuffled))
    (out / "sweep.json").write_text(json.dumps({"suite": "humaneval", "limit": 50,
                                                "compare": ["cos:w=0.9:lossless"], "sequential": "obf:3"}))
    assert main(["report", str(out), "--progress"]) == 0
    printed = capsys.readouterr().out
    assert "29 problems, 29 (problem, seed) pairs" in printed and not (out / "report.html").exists()
    # a look read late, at its planned count: only the suite's first N problems (prompt_index < N)
    assert main(["report", str(out), "--progress", "--problems", "16"]) == 0
    printed = capsys.readouterr().out
    assert "lossless k=4 T=1 - plain T=1: 15 problems" in printed and "plain T=1: 16 rows" in printed
    first = [r for r in half if r["prompt_index"] < 16]
    assert (f"read on the suite's first 16 problems only (--problems 16): {len(first)} of {len(half)} rows, "
            "30 problems decoded") in printed
    assert main(["report", str(out), "--problems", "16", "--html", str(tmp_path / "r.html")]) == 0
    printed = capsys.readouterr().out
    expected = comparisons.comparisons_table(first, ["cos:w=0.9:lossless"], "obf:3", 50)
    assert expected.splitlines()[2] in printed and "--problems 16" in (tmp_path / "r.html").read_text()
    for bad, message in ((0, "must be a positive number of problems; got 0"),
                         (20, "a reading is taken at a planned look's count (16, 33, 50 problems)"),
                         (60, "the sweep plans 50 problems")):
        assert main(["report", str(out), "--problems", str(bad)]) != 0
        assert message in capsys.readouterr().err
    # without a sequential design any prefix may be read, and the note says it is a look of its own
    (out / "sweep.json").write_text(json.dumps({"suite": "humaneval", "limit": 50}))
    assert main(["report", str(out), "--progress", "--problems", "20"]) == 0
    assert "a reading of a prefix is a look of its own (count it in --looks-taken)" in capsys.readouterr().out
    (out / "results.jsonl").write_text(json.dumps({k: v for k, v in half[0].items() if k != "prompt_index"}))
    assert main(["report", str(out), "--problems", "20"]) != 0
    assert "1 row(s) have no integer prompt_index" in capsys.readouterr().err


def test_the_legend_names_each_planned_look_and_an_early_reading():
    """obf:3 over 164 problems: looks planned at 54, 109, 164 (the last count of each look's share, as
    planned_look); a reading at 29 is look 1, early (it takes look 1's threshold before look 1's count), at
    55 look 2, early; at 54 and 164 on time; no planned count: the last look."""
    early = comparisons.sequential_design("obf", 3, 29, 164)
    assert "looks at 54, 109, 164 paired problems" in early and "look 1, 29 of 164" in early
    assert "early: look 1 is planned at 54 problems" in early
    assert "early: look 2 is planned at 109" in comparisons.sequential_design("obf", 3, 55, 164)
    assert "early" not in comparisons.sequential_design("obf", 3, 54, 164)
    assert "look 3, 164 of 164" in comparisons.sequential_design("obf", 3, 164, 164)
    assert "taken as the last look" in comparisons.sequential_design("pocock", 2, 10, None)
    assert "no declared comparison has paired rows" in comparisons.sequential_design("obf", 3, None, 164)


@pytest.mark.slow
def test_bench_declares_comparisons_and_the_report_prints_them(tmp_path, capsys):
    """End to end on the default pair: the graded suite, a truncation rule, two declared comparisons and
    an O'Brien-Fleming design of 2 looks; sweep.json stores them, the report prints the length outcomes,
    the planned comparisons with the calibration row, and the per-level table; a bad declaration is a
    clear CLI error before anything is decoded."""
    from verispec.cli import main

    out = tmp_path / "s"
    argv = ["bench", "--suite", "graded", "--rules", "speccascade:min_p=0.1", "--seeds", "0", "1",
            "--limit", "3", "--max-new-tokens", "4", "--no-progress", "--compare",
            "speccascade:min_p=0.1,resample=target vs honest:speccascade:min_p=0.1,resample=target",
            "lossless:plain", "--sequential", "obf:2",
            "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    settings = json.loads((out / "sweep.json").read_text())
    assert settings["sequential"] == "obf:2" and len(settings["compare"]) == 2
    assert "length outcomes:" in printed and "protocol: default" in printed
    assert "planned comparisons:" in printed and "obf boundary, 2 planned looks" in printed
    assert "by difficulty level:" in printed and "level 1" in printed
    assert "(calibration)" not in printed  # lossless vs plain was declared: it is a planned comparison
    assert "planned comparisons:" in (out / "report.html").read_text()
    bad = tmp_path / "bad"
    assert main([*argv[:-1], str(bad), "--compare", "lossless:nonsense"]) == 2
    assert "comparison" in capsys.readouterr().err and not (bad / "results.jsonl").exists()


def test_holm_step_down_by_hand():
    """comparisons.holm_step_down, the step-down both the report's current look and its retaken looks use:
    Holm's levels (alpha / (m - j) along ascending p) turned into thresholds by the given function, and
    rejection in that order until the first p at or over its threshold; a NaN p is kept, with no level."""
    as_level = lambda _, level: level  # noqa: E731
    # levels: 0.01 -> 0.05/3, 0.03 -> 0.05/2, 0.04 -> 0.05; 0.03 >= 0.025 stops it, so 0.04 is kept too
    assert comparisons.holm_step_down([0.01, 0.04, 0.03], as_level) == [
        (pytest.approx(0.05 / 3), True), (0.05, False), (0.025, False)]
    assert comparisons.holm_step_down([0.01, 0.04, 0.02], as_level) == [
        (pytest.approx(0.05 / 3), True), (0.05, True), (0.025, True)]
    halved = comparisons.holm_step_down([0.02, math.nan], lambda i, level: level / 2)
    assert halved[0] == (0.025, True) and math.isnan(halved[1][0]) and halved[1][1] is False
    # the function sees each hypothesis's own index (the report gives each its own look)
    seen = []
    comparisons.holm_step_down([0.3, 0.001], lambda i, level: seen.append((i, level)) or 1.0)
    assert seen == [(1, 0.025), (0, 0.05)]


def test_a_comparison_rejected_at_an_earlier_look_leaves_holms_family():
    """obf:2 over 40 problems (looks at 20 and 40). cos loses clearly on problems 0-19 and gains as much on
    20-39: rejected at look 1 (Holm's first level, 0.025, at look 1), though over all 40 its p is large.
    At look 2 it stays rejected, shows look 1's threshold, and leaves the family: budget, the only open
    comparison, is tested at the whole alpha's look-2 threshold (0.048), not at 0.024 (Holm's first step,
    alpha/2, where budget has the smaller p) as a reading that forgot look 1 would; its Holm p is over the
    open comparisons only. A look-1 reading carries nothing."""
    noise = [0.1 * ((7 * i) % 5 - 2) for i in range(40)]
    cos = [(-1.0 if i < 20 else 1.0) + noise[i] for i in range(40)]
    budget = [-0.12 + 0.5 * ((3 * i) % 7 - 3) / 3 for i in range(40)]  # p 0.12 at look 1, 0.038 at 2
    rows = diff_rows({"cos:w=0.9": cos, "budget:tv=0.1,ratio=2.0": budget})
    declared = ["cos:w=0.9 vs lossless", "budget:tv=0.1,ratio=2.0 vs lossless"]
    prefix = [r for r in rows if r["prompt_index"] < 20]
    look1 = [comparisons.compare(prefix, *comparisons.parse_comparison(d))[0] for d in declared]
    first = stats.sequential_threshold("obf", 2, 1, 0.025)
    assert look1[0].pooled.p_value < first < look1[1].pooled.p_value  # cos rejected at look 1, budget kept
    carried = comparisons.earlier_rejections(rows, declared, "obf", 2, 40, now=2)
    assert carried == {("cos:w=0.9 k=4 T=1", "lossless k=4 T=1"): (1, first, 20, look1[0].pooled.p_value)}
    assert comparisons.earlier_rejections(rows, declared, "obf", 2, 40, now=1) == {}
    full = [comparisons.compare(rows, *comparisons.parse_comparison(d))[0] for d in declared]
    last = stats.sequential_threshold("obf", 2, 2, 0.05)
    assert full[0].pooled.p_value > 0.5
    # budget between Holm's alpha/2 threshold and the whole alpha's: the carried rejection decides
    assert stats.sequential_threshold("obf", 2, 2, 0.025) < full[1].pooled.p_value < last
    table = comparisons.comparisons_table(rows, declared, "obf:2", 40)
    header = next(line for line in table.splitlines() if line.startswith("comparison (A - B)"))
    lines = {line.split(" - ")[0]: line for line in table.splitlines() if " - lossless" in line}
    cos_line, budget_line = lines["cos:w=0.9 k=4 T=1"], lines["budget:tv=0.1,ratio=2.0 k=4 T=1"]

    def cell(line: str, column: str) -> str:  # the fixed-width table: a column starts where its header does
        return line[re.search(rf"(?<=  ){re.escape(column)}(?=  )", header).start():].split()[0]

    assert "rejected at look 1 (retaken, 20 problems)" in cos_line
    assert comparisons._p(first) in cos_line.split()
    assert cell(cos_line, "MDE") == "-" and cell(cos_line, "Holm p") == "-"  # decided: no MDE, no Holm p
    assert cell(cos_line, "threshold") == comparisons._p(first)
    # budget alone in the family: Holm p = its p, threshold the whole alpha's
    assert cell(budget_line, "Holm p") == cell(budget_line, "p") == comparisons._p(full[1].pooled.p_value)
    assert cell(budget_line, "threshold") == comparisons._p(last)
    assert cell(budget_line, "decision") == "reject"
    assert "Holm p: adjusted over the 1 open declared comparison(s)" in table
    # a comparison declared twice (once by config ids) is one comparison: one row, one place in Holm's m
    again = [*declared, "cos:w=0.9 k=4 T=1 vs lossless k=4 T=1"]
    assert comparisons.comparisons_table(rows, again, "obf:2", 40) == table
    assert "stays rejected" in table and "Maurer and Bretz 2013" in table
    # a look-1 reading (the first 20 problems) carries nothing and reads as before
    early = comparisons.comparisons_table(prefix, declared, "obf:2", 40)
    assert "rejected at look" not in early and "stays rejected" not in early
    # rows without prompt_index: no prefix to retake, so nothing is carried
    bare = [{k: v for k, v in r.items() if k != "prompt_index"} for r in rows]
    assert comparisons.earlier_rejections(bare, declared, "obf", 2, 40, now=2) == {}
    unindexed = comparisons.comparisons_table(bare, declared, "obf:2", 40)
    assert "leave no earlier look's prefix to retake" in unindexed
    assert "prefix to retake" not in table and "prefix to retake" not in early


def test_earlier_looks_count_an_absent_comparison_and_carry_across_several_looks():
    """obf:3 over 60 problems (looks at 20, 40, 60). budget has rows only from problem 20 on, so at look
    1 it has no pairs: it still counts in Holm's m (p = 1), and cos, whose look-1 p lies between the
    threshold at alpha/2 and at alpha, is kept there (it would be rejected if budget dropped out of m).
    At look 2 both are rejected (budget, the smaller p, at alpha/2, then cos at alpha); at look 3 both
    read as carried, each naming its look and the problems its retake paired."""
    first_half, first_all = (stats.sequential_threshold("obf", 3, 1, a) for a in (0.025, 0.05))
    noise = [0.1 * ((7 * i) % 5 - 2) for i in range(60)]

    def look1_p(mu: float) -> float:
        return stats.clustered_paired([(f"q{i}", mu + noise[i], 0.0) for i in range(20)]).p_value

    mu = next(-m / 1000 for m in range(1, 400) if first_half < look1_p(-m / 1000) < first_all)
    cos = [mu + noise[i] if i < 20 else -1.0 + noise[i] for i in range(60)]
    budget = [-0.6 + 0.1 * ((3 * i) % 7 - 3) for i in range(60)]
    rows = [r for r in diff_rows({"cos:w=0.9": cos, "budget:tv=0.1,ratio=2.0": budget})
            if not (r["rule"].startswith("budget") and r["prompt_index"] < 20)]
    declared = ["cos:w=0.9 vs lossless", "budget:tv=0.1,ratio=2.0 vs lossless"]
    cos_key = ("cos:w=0.9 k=4 T=1", "lossless k=4 T=1")
    budget_key = ("budget:tv=0.1,ratio=2.0 k=4 T=1", "lossless k=4 T=1")
    assert comparisons.earlier_rejections(rows, declared, "obf", 3, 60, now=2) == {}
    at_3 = comparisons.earlier_rejections(rows, declared, "obf", 3, 60, now=3)
    assert {k: v[:3] for k, v in at_3.items()} == {
        budget_key: (2, stats.sequential_threshold("obf", 3, 2, 0.025), 20),
        cos_key: (2, stats.sequential_threshold("obf", 3, 2, 0.05), 40)}
    table = comparisons.comparisons_table(rows, declared, "obf:3", 60)
    assert "rejected at look 2 (retaken, 40 problems)" in table
    assert "rejected at look 2 (retaken, 20 problems)" in table
    assert "retaken on 20 paired problems, fewer than that look's planned 40" in table


def test_looks_taken_divides_thresholds_and_multiplies_holm_p(core_rows):
    """A fixed design read N times (--looks-taken N): each comparison's Holm p is N times the one-look
    Holm p (capped at 1) and its threshold the one-look threshold over N, recomputed from the rows; a
    declared sequential design refuses it (its thresholds count its own looks)."""
    declared = ["cos:w=0.9:lossless", "speccascade:min_p=0.1 vs honest:speccascade:min_p=0.1"]
    found = [comparisons.compare(core_rows, *comparisons.parse_comparison(d))[0] for d in declared]
    holm = stats.holm([c.pooled.p_value for c in found])
    levels = stats.holm_levels([c.pooled.p_value for c in found])
    table = comparisons.comparisons_table(core_rows, declared, looks_taken=4)
    for c, adjusted, level in zip(found, holm, levels):
        line = next(line for line in table.splitlines() if line.startswith(c.config_a))
        assert comparisons._p(min(1.0, 4 * adjusted)) in line.split() and comparisons._p(level / 4) in line
    assert "read 4 times (--looks-taken)" in table
    one_look = comparisons.comparisons_table(core_rows, declared)
    assert "one look (fixed design)" in one_look and "--looks-taken" not in one_look
    with pytest.raises(ValueError, match="group-sequential design"):
        comparisons.comparisons_table(core_rows, declared, "obf:3", 164, looks_taken=2)
    with pytest.raises(ValueError, match="positive integer"):
        comparisons.comparisons_table(core_rows, declared, looks_taken=0)


def _loglik_row(rule: str, problem: str, seed: int, log_target: list[float] | None, text: str,
                finish: str = "eos", score: float | None = None) -> dict:
    row = {"rule": rule, "k": 0 if rule == "plain" else 4, "temperature": 1.0, "prompt_id": problem,
           "seed": seed, "score": score if log_target is None else sum(log_target) / len(log_target),
           "score_name": "target_loglik", "finish": "eos", "text": text,
           "metrics": {"repetition_4": scorers.repetition(text, 4)}}
    if log_target is not None:
        row |= {"steps": {"log_target_raw": log_target}, "tokens": len(log_target), "finish": finish}
    return row


def _table_cells(table: str, label: str) -> list[str]:
    """The cells of the row starting with `label`, cut at the columns of the dashed rule under the header."""
    lines = table.splitlines()
    widths = [len(dashes) for dashes in lines[1].split("  ")]
    [line] = [x for x in lines[2:] if x.startswith(label)]
    cells, at = [], 0
    for w in widths:
        cells.append(line[at : at + w].strip())
        at += w + 2
    return cells


def _clustered(diffs: dict[str, list[float]]) -> tuple[float, float, float]:
    """Hand-computed clustered estimate: per-problem mean differences, their mean and 95% t interval."""
    means = [sum(v) / len(v) for v in diffs.values()]
    n = len(means)
    est = sum(means) / n
    se = math.sqrt(sum((m - est) ** 2 for m in means) / (n - 1) / n)
    half = stats.t_quantile(0.975, n - 1) * se
    return est, est - half, est + half


def test_loglik_controls_compare_at_equal_length_and_read_repetition():
    """The log-likelihood controls, hand-computed on two seeds of three problems (clustered by problem,
    2 df): the planned score, the score over the first m tokens (the shorter reply without its stop
    token), and repetition_4 whole and over the first w words; a row without steps leaves the
    same-length column only (n= says so), and a reply too short for a 4-gram the repetition columns."""
    rows, planned, prefix, whole_rep, prefix_rep = [], {}, {}, {}, {}
    plain_text = "one two three four five six"
    for i, problem in enumerate(["a", "b", "c"]):
        for seed in (0, 1):
            base = [-1.0 - 0.1 * i - 0.2 * seed, -2.0 + 0.3 * i, -0.001]  # two tokens, then its stop token
            spec = [-1.5 + 0.05 * i * seed, -1.0 - 0.2 * i, -0.3, -0.2 * seed, -0.1, -0.002]
            loop = "x " * (8 + i + seed)
            rows.append(_loglik_row("plain", problem, seed, base, plain_text))
            rows.append(_loglik_row("lossless", problem, seed, spec, loop))
            planned.setdefault(problem, []).append(sum(spec) / 6 - sum(base) / 3)
            prefix.setdefault(problem, []).append(sum(spec[:2]) / 2 - sum(base[:2]) / 2)
            whole_rep.setdefault(problem, []).append(scorers.repetition(loop, 4))
            prefix_rep.setdefault(problem, []).append(scorers.repetition("x " * 6, 4))
    rows.append(_loglik_row("plain", "d", 0, None, "tiny", score=-1.0))  # no steps, too short for 4-grams
    rows.append(_loglik_row("lossless", "d", 0, None, "x " * 9, score=-0.5))
    planned["d"] = [0.5]
    table = comparisons.loglik_controls_table(rows, ["lossless vs plain"])
    cells = _table_cells(table, "lossless k=4 T=1 - plain T=1")
    assert cells[1] == "7" and "(calibration)" not in cells[0]  # declared: not the calibration row
    for column, expected, suffix in ((2, planned, ""), (4, prefix, " (n=6)"), (6, whole_rep, " (n=6)"),
                                     (8, prefix_rep, " (n=6)")):
        est, low, high = _clustered(expected)
        assert cells[column] == f"{est:+.3f} [{low:+.3f}, {high:+.3f}]{suffix}", column
    assert "not in the corrected family" in table
    # undeclared, the same pair is the calibration row, printed once even if declared twice over
    assert "(calibration)" in _table_cells(comparisons.loglik_controls_table(rows, []), "lossless")[0]
    twice = comparisons.loglik_controls_table(rows, ["lossless vs plain", "lossless k=4 T=1 vs plain T=1"])
    assert sum(line.startswith("lossless") for line in twice.splitlines()) == 1
    # a temperature `:g` rounds is still matched by its own rows
    odd = [{**r, "temperature": 0.123456789} for r in rows]
    assert _table_cells(comparisons.loglik_controls_table(odd, []), "lossless")[1] == "7"
    # a sweep without a log-likelihood score prints no controls
    assert comparisons.loglik_controls_table([{**r, "score_name": "pass_at_1"} for r in rows], []) == ""


def test_loglik_controls_on_the_committed_mtbench_pilot():
    """On real rows (the MT-Bench pilot: plain and lossless on 16 questions, every reply ending on its
    stop token), the calibration row's same-length column equals a recomputation from the rows'
    per-token log-likelihoods, the stop tokens left out."""
    rows = read_rows(CORE.parents[1] / "qwen-mtbench-pilot" / "results.jsonl")
    assert all(r["finish"] == "eos" for r in rows)
    by = {(r["rule"], r["prompt_id"]): r["steps"]["log_target_raw"] for r in rows}
    diffs = {}
    for problem in sorted({r["prompt_id"] for r in rows}):
        a, b = by[("lossless", problem)], by[("plain", problem)]
        m = min(len(a), len(b)) - 1
        diffs[problem] = [sum(a[:m]) / m - sum(b[:m]) / m]
    cells = _table_cells(comparisons.loglik_controls_table(rows, []), "lossless k=4 T=1 - plain T=1")
    est, low, high = _clustered(diffs)
    assert cells[1] == "16" and cells[4] == f"{est:+.3f} [{low:+.3f}, {high:+.3f}]"


def test_tree_rows_are_configurations_of_their_own_in_the_outcome_tables(core_rows):
    """A tree configuration shares (rule, temperature) with its rule's chain configuration, and may share
    k: the outcome tables key it by its shape too, so a tree lossless configuration whose scores all
    differ leaves the chain comparisons as they were, gets its own length row (paired with plain, as in
    the main table), and is compared by naming its shape."""
    from verispec.evaluation.report import outcome_sections
    from verispec.evaluation.summary import baseline_of

    declared = ["lossless vs plain"]
    by = {(r["rule"], r["prompt_id"]): r["score"] for r in core_rows}
    problems = sorted({r["prompt_id"] for r in core_rows})
    assert comparisons.canonical_side("lossless tree:widths=2,1 k=2") == "lossless tree:widths=2,1 k=2"
    for k in (2, 4):  # a depth-2 tree, and one sharing the chain's k = 4 (keyed apart by its shape)
        trees = [{**r, "tree": "tree:widths=2,1", "k": k, "score": 1 - r["score"], "finish": "eos"}
                 for r in core_rows if r["rule"] == "lossless"]
        alone = comparisons.comparisons_table(core_rows, declared)
        assert comparisons.comparisons_table(core_rows + trees, declared) == alone
        side = f"lossless tree:widths=2,1 k={k} T=1"
        lengths = comparisons.length_table(core_rows + trees, baseline_of)
        tree_line = next(line for line in lengths.splitlines() if line.startswith(side))
        assert tree_line.split()[5] == "0.000", tree_line  # no tree row hit the cap
        [c] = comparisons.compare(core_rows + trees, side, "lossless k=4 T=1")
        want = np.mean([1 - 2 * by[("lossless", p)] for p in problems])
        assert c.config_a == side and c.pooled.estimate == pytest.approx(want)
        # a bare rule means chain drafts: the calibration pair stays the chain's
        [chain] = comparisons.compare(core_rows + trees, "lossless", "plain")
        assert chain.config_a == "lossless k=4 T=1"
        sections = outcome_sections(core_rows + trees, {"compare": [f"{side} vs lossless k=4 T=1"]})
        assert f"{side} - lossless k=4 T=1" in sections and "left out" not in sections
        progress = comparisons.progress_table(core_rows + trees, [])
        assert f"  {side}: {len(trees)} rows" in progress


def test_a_comparison_without_spread_gets_no_mde_and_a_note(core_rows):
    """Two configurations whose scores agree on every problem: the clustered t-test has standard error 0,
    so its p is a convention and a minimum detectable effect of 0 would be false; the table prints '-'
    and says why."""
    copy = [{**r, "tree": "tree:widths=2,1", "k": 2} for r in core_rows if r["rule"] == "lossless"]
    side = "lossless tree:widths=2,1 k=2 T=1"
    table = comparisons.comparisons_table(core_rows + copy, [f"{side} vs lossless k=4 T=1"])
    cells = _table_cells(table, f"{side} - lossless k=4 T=1")
    assert cells[-2] == "-" and f"note: {side} - lossless k=4 T=1: every problem's difference is the same" \
        in table
    assert "every problem's difference" not in comparisons.comparisons_table(core_rows, ["lossless vs plain"])
