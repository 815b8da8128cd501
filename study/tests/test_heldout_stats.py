"""study/heldout.py's held-out statistics (scipy, written apart from verispec.evaluation.stats) agree
with the report's on the same numbers: the check that a published p is reproduced by other code."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats as scipy_stats
from helpers import REPO, diff_rows, load_study

from verispec.evaluation import comparisons, stats
from verispec.evaluation.store import has_rows, scan_rows

heldout = load_study("heldout")


def test_holm_adjusted_equals_the_reports_holm():
    rng = np.random.default_rng(0)
    for size in (1, 2, 3, 5):
        p_values = list(rng.uniform(0, 0.2, size))
        assert heldout.holm_adjusted(p_values) == pytest.approx(stats.holm(p_values))
    assert heldout.holm_adjusted([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])  # by hand


def test_paired_by_problem_equals_the_reports_clustered_test():
    rng = np.random.default_rng(1)
    scores, triples = {}, []
    for problem in range(30):
        for seed in range(3):
            a, b = float(rng.random() < 0.6), float(rng.random() < 0.5)
            scores[("A", f"p{problem}", seed)], scores[("B", f"p{problem}", seed)] = a, b
            triples.append((f"p{problem}", a, b))
    scores[("A", "p99", 0)] = 1.0  # no B row: not a pair
    mean, low, high, p = heldout.paired_by_problem(scores, "A", "B")
    ours = stats.clustered_paired(triples)
    assert (mean, low, high, p) == pytest.approx((ours.estimate, ours.low, ours.high, ours.p_value))
    assert "(30 problems, 90 pairs)" in heldout.paired_text(scores, "A", "B")


def test_the_edge_cases_follow_the_reports_conventions():
    one = {("A", "p0", 0): 1.0, ("B", "p0", 0): 0.0}
    mean, low, high, p = heldout.paired_by_problem(one, "A", "B")  # one problem: no interval, no p
    ours = stats.clustered_paired([("p0", 1.0, 0.0)])
    assert mean == ours.estimate == 1.0 and all(np.isnan(v) for v in (low, high, p, ours.p_value))
    assert all(np.isnan(v) for v in heldout.paired_by_problem({}, "A", "B"))
    same = {(c, f"p{i}", 0): v for i in range(3) for c, v in (("A", 1.0), ("B", 0.0))}
    assert heldout.paired_by_problem(same, "A", "B") == (1.0, 1.0, 1.0, 0.0)  # no spread, mean 1
    assert stats.clustered_paired([(f"p{i}", 1.0, 0.0) for i in range(3)]).p_value == 0.0
    tied = {(c, f"p{i}", 0): 1.0 for i in range(3) for c in ("A", "B")}
    assert heldout.paired_by_problem(tied, "A", "B")[3] == 1.0
    adjusted = heldout.holm_adjusted([float("nan"), 0.01, 0.04])
    assert np.isnan(adjusted[0]) and adjusted[1:] == pytest.approx(stats.holm([float("nan"), 0.01, 0.04])[1:])


def test_sweep_stats_planned_prints_each_declared_comparison_and_holm(capsys):
    """`sweep_stats.py --planned` on constructed rows: each declared comparison's estimate and p equal
    the report's clustered test, Holm runs over the declared comparisons only, and re-scored rows are
    read where given (a row at T = 0.7 named as the report names it: 'T=0.7')."""
    sweep_stats = load_study("sweep_stats")
    rng = np.random.default_rng(2)
    rows = []
    for problem in range(12):
        for seed in (0, 1):
            for rule, k, rate in (("plain", 0, 0.5), ("lossless", 4, 0.5), ("cos:w=0.9", 4, 0.2),
                                  ("lenience:l=0.25", 4, 0.45)):
                rows.append({"rule": rule, "k": k, "temperature": 0.7, "tree": None, "seed": seed,
                             "prompt_id": f"HumanEval/{problem}", "score": float(rng.random() < rate),
                             "finish": "stop", "tokens": 10, "config": f"{rule} T=0.7000000001"})
    declared = ["cos:w=0.9 vs lossless", "lenience:l=0.25 vs lossless"]
    rescored = [dict(r, score=1.0) if r["rule"] == "cos:w=0.9" else r for r in rows]
    sweep_stats.planned_comparisons(rows, rescored, declared)
    out = capsys.readouterr().out
    expected = []
    for rule in ("cos:w=0.9", "lenience:l=0.25"):
        triples = [(a["prompt_id"], a["score"], b["score"]) for a in rows for b in rows
                   if a["rule"] == rule and b["rule"] == "lossless"
                   and (a["prompt_id"], a["seed"]) == (b["prompt_id"], b["seed"])]
        expected.append(stats.clustered_paired(triples))
    holm = stats.holm([e.p_value for e in expected])
    for e, h in zip(expected, holm):
        assert f"{e.estimate:+.3f} [{e.low:+.3f}, {e.high:+.3f}] t-test p {e.p_value:.3g}" in out
        assert f"Holm p {h:.3g}" in out
    assert "(12 problems, 24 pairs)" in out and "re-scored: cos:w=0.9 k=4 T=0.7" in out
    assert "lossless k=4 T=0.7 - plain" not in out  # the calibration row is not declared here


def test_heldout_carry_matches_the_reports_earlier_rejections(capsys):
    """sweep_stats' held-out retake of earlier looks (scipy p, Holm written there) finds the report's
    carried rejections: obf:3 over 60 problems with budget absent from look 1's prefix (kept in Holm's
    m) and both comparisons rejected at look 2; the printed lines name them and Holm runs over none."""
    sweep_stats = load_study("sweep_stats")
    noise = [0.1 * ((7 * i) % 5 - 2) for i in range(60)]
    cos = [(-0.136 if i < 20 else -1.0) + noise[i] for i in range(60)]  # look 1: between alpha/2 and alpha
    budget = [-0.6 + 0.1 * ((3 * i) % 7 - 3) for i in range(60)]
    rows = [r for r in diff_rows({"cos:w=0.9": cos, "budget:tv=0.1,ratio=2.0": budget})
            if not (r["rule"].startswith("budget") and r["prompt_index"] < 20)]
    declared = ["cos:w=0.9 vs lossless", "budget:tv=0.1,ratio=2.0 vs lossless"]
    ours = comparisons.earlier_rejections(rows, declared, "obf", 3, 60, now=3)
    keys = [("cos:w=0.9 k=4 T=1", "lossless k=4 T=1"),
            ("budget:tv=0.1,ratio=2.0 k=4 T=1", "lossless k=4 T=1")]
    theirs = sweep_stats.heldout_earlier_rejections(rows, keys, "obf:3", 60)
    assert sorted(ours) == sorted(keys) and {look for look, _, _, _ in ours.values()} == {2}
    assert {k: (look, threshold) for k, (look, threshold, _, _) in ours.items()} == {
        k: (look, threshold) for k, (look, _, threshold) in theirs.items()}
    for k, (_, _, _, p) in ours.items():  # the p each look was decided on, by the report's code and scipy's
        assert p == pytest.approx(theirs[k][1], rel=1e-6)
    sweep_stats.planned_comparisons(rows, None, declared, "obf:3", 60)
    out = capsys.readouterr().out
    assert out.count("rejected at look") == len(ours) and "Holm p" not in out.split("open):")[1]
    # a unit written twice counts once, its first copy, as the report reads it: a later copy of a cos row
    # in look 1's prefix with another score changes nothing
    late = dict(next(r for r in rows if r["rule"] == "cos:w=0.9"), score=5.0)
    assert sweep_stats.first_copies([*rows, late]) == rows
    sweep_stats.planned_comparisons([*rows, late], None, declared, "obf:3", 60)
    assert capsys.readouterr().out == out
    # without prompt_index nothing is retaken: Holm over both, as before
    sweep_stats.planned_comparisons([{k: v for k, v in r.items() if k != "prompt_index"} for r in rows],
                                    None, declared, "obf:3", 60)
    assert capsys.readouterr().out.count("Holm p") == 2


def test_rescore_returns_decoded_rows_rescored_and_copied_rows_as_stored(capsys):
    """sweep_stats.rescore on committed graded-steps rows (scored without the sandbox): a decoded row
    whose stored score was tampered with is named and comes back with its true score; a copied row
    (`reused_from`) is left to its own sweep and comes back as stored."""
    sweep_stats = load_study("sweep_stats")
    path = REPO / "study" / "sweeps" / "qwen-graded-steps" / "results.jsonl"
    if not has_rows(path):
        pytest.skip(f"{path} is not in this checkout")
    rows = [r for r in scan_rows(path, references=False).rows if "reused_from" not in r][:3]  # decoded there
    tampered = dict(rows[0], score=1.0 - rows[0]["score"])
    copied = dict(rows[1], score=1.0 - rows[1]["score"], reused_from="elsewhere")
    out_rows = sweep_stats.rescore([tampered, copied, rows[2]])
    printed = capsys.readouterr().out
    assert "rescored 2 rows: 1 differ" in printed and "1 rows copied from another sweep" in printed
    assert [r["score"] for r in out_rows] == [rows[0]["score"], copied["score"], rows[2]["score"]]


@pytest.mark.slow  # reads eight committed sweeps (about 6 s)
def test_across_settings_reproduces_the_readmes_bonferroni_figures(capsys):
    """study/across_settings.py recomputes, from the committed rows, each setting's Holm p for the
    gate against honest min-p and its Bonferroni across the five settings: the figures the README quotes
    (HumanEval T = 1 0.0145 -> 0.072, graded-steps seed 0 0.026 -> 0.13, seed 1 0.007 -> 0.035, seeds
    0-1 0.0005 -> 0.0026, held-out problems 0.062 -> 0.31, MT-Bench T = 1 seed 0 at look 1 2.3e-5 ->
    1.2e-4, MT-Bench T = 0.7 at look 2, Holm over the three comparisons open there, 0.0042 -> 0.021;
    HumanEval T = 0.7 not shown)."""
    across = load_study("across_settings")
    if not all(has_rows(REPO / "study" / "sweeps" / sweep / "results.jsonl")
               for _, sweep, _ in across.SETTINGS):
        pytest.skip("the committed sweeps are not in this checkout")
    assert across.main() == 0
    out = capsys.readouterr().out
    for figures in ("0.0145 -> 0.0725", "0.485 -> 1", "0.0264 -> 0.132", "0.00705 -> 0.0352",
                    "0.000519 -> 0.0026", "0.062 -> 0.31", "2.31e-05 -> 0.000116", "0.00423 -> 0.0212"):
        assert figures in out, figures
    # read at its last look, MT-Bench seed 0's gate was itself rejected at look 1: refused, not miscounted
    with pytest.raises(ValueError, match="rejected at an earlier look"):
        across.gate_holm_p("qwen-mtbench", None)
    readme = (REPO / "docs" / "findings.md").read_text()
    for figures in ("0.0145 to 0.072", "0.026 to 0.13", "0.007 to 0.035", "0.0005 to 0.0026", "0.062 to 0.31",
                    "2.3e-5 to 1.2e-4", "0.0042 to 0.021"):
        assert figures in readme, figures


def test_rescore_loglik_picks_questions_by_residue_and_clusters_the_stop_residual_by_question():
    """study/rescore_loglik.py: --every N --offset R keeps every configuration on the questions whose
    index is R modulo N (the comparisons stay paired; --offset 1 gives the rows --every 2 left out), and
    the stop residual's interval is clustered by question: with one row a question it is the one-sample
    t interval (scipy), with two seeds of a question sharing its value the rows are not counted twice."""
    rescore = load_study("rescore_loglik")
    rows = [{"score_name": "target_loglik", "score": -1.0, "token_ids": [1], "prompt_index": i,
             "prompt_id": f"q{i}", "config": config, "seed": seed}
            for i in range(6) for config in ("plain T=1", "lossless k=4 T=1") for seed in (1, 2)]
    rows.append(dict(rows[0], score=None))  # not scored: never re-scored
    even, odd = rescore.chosen(rows, 2), rescore.chosen(rows, 2, 1)
    assert {r["prompt_index"] for r in even} == {0, 2, 4} and {r["prompt_index"] for r in odd} == {1, 3, 5}
    assert len(even) + len(odd) == 24 and len(rescore.chosen(rows, 2, 1, ["plain T=1"])) == 6
    for every, offset in ((0, 0), (2, 2), (2, -1)):
        with pytest.raises(ValueError, match="offset"):
            rescore.chosen(rows, every, offset)
    values = [0.3, -0.2, 0.5, 0.1, -0.4, 0.25]
    one = rescore.residual_line("lossless", [(f"q{i}", v) for i, v in enumerate(values)])
    t = scipy_stats.ttest_1samp(values, 0.0)
    low, high = t.confidence_interval()
    assert one == (f"  lossless: 6 rows, 6 questions, stop residual {np.mean(values):+.3f} "
                   f"[{low:+.3f}, {high:+.3f}] p {t.pvalue:.3g}")
    twice = rescore.residual_line("lossless", [(f"q{i}", v) for i, v in enumerate(values) for _ in (1, 2)])
    assert twice.replace("12 rows", "6 rows") == one  # a question's two equal rows: same interval, same p
    single = "  plain: 1 row(s), 1 question(s), stop residual +0.200"
    assert rescore.residual_line("plain", [("q0", 0.2)]) == single


def test_across_settings_takes_holm_over_the_open_comparisons_only_if_a_carry_holds_at_its_level(
        tmp_path, monkeypatch):
    """across_settings.gate_holm_p on an obf:2 sweep of 40 problems where cos was rejected at look 1: the
    gate's Holm p at look 2 is over the comparisons still open (the gate alone here: its raw p), as the
    report's; a correction strict enough that cos's look-1 rejection would not hold there is refused,
    and so is a gate that was itself rejected at look 1."""
    across = load_study("across_settings")
    noise = [0.1 * ((7 * i) % 5 - 2) for i in range(40)]
    gate = "speccascade:min_p=0.1,resample=target"
    rows = diff_rows({"cos:w=0.9": [(-1.0 if i < 20 else 1.0) + noise[i] for i in range(40)],
                      gate: [-0.12 + 0.5 * ((3 * i) % 7 - 3) / 3 for i in range(40)],
                      f"honest:{gate}": [0.0] * 40})
    sweep = tmp_path / "study" / "sweeps" / "fake"
    sweep.mkdir(parents=True)
    (sweep / "sweep.json").write_text(json.dumps({"compare": [across.GATE, "cos:w=0.9 vs lossless"],
                                                  "sequential": "obf:2", "limit": 40}))
    (sweep / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(across, "REPO", tmp_path)
    estimate, holm_p, paired = across.gate_holm_p("fake", None)
    gate_alone = comparisons.compare(rows, *comparisons.parse_comparison(across.GATE))[0].pooled
    assert (estimate, holm_p, paired) == (gate_alone.estimate, gate_alone.p_value, 40)
    monkeypatch.setattr(across, "N_SETTINGS", 10**12)
    with pytest.raises(ValueError, match="would not be rejected there"):
        across.gate_holm_p("fake", None)
    monkeypatch.setattr(across, "N_SETTINGS", 5)
    (sweep / "sweep.json").write_text(json.dumps({"compare": [across.GATE], "sequential": "obf:2",
                                                  "limit": 40}))
    # the gate now loses clearly on problems 0-19 (rejected at look 1) and gains on 20-39
    gate_first = diff_rows({gate: [(-1.0 if i < 20 else 1.0) + noise[i] for i in range(40)],
                            f"honest:{gate}": [0.0] * 40})
    (sweep / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gate_first))
    with pytest.raises(ValueError, match="the gate was rejected at an earlier look"):
        across.gate_holm_p("fake", None)
