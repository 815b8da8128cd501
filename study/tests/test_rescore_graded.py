"""study/rescore_graded.py, the held-out re-scoring of the graded-steps studies: answers read from the
prompts, replies parsed like the suite, the planned readings on constructed scores and on the committed
seed-0 rows."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from helpers import REPO, load_study
from scipy import stats

from verispec.evaluation import graded, scorers
from verispec.evaluation.store import read_rows


def test_rescore_graded_reads_answers_from_the_prompts_and_replies_like_the_suite():
    """study/rescore_graded.py, the held-out check of the graded-steps study: every problem's answer
    recomputed from its prompt's words equals the generator's; its reply parser follows the suite's rule
    ('####' wins, else the last number) and, strict, takes only a marked answer; on the committed seed-0
    study's rows it gives every stored score back."""
    rescore = load_study("rescore_graded")
    problems = graded.generate_steps()
    assert all(rescore.answer_from_prompt(p["prompt"]) == p["answer"] for p in problems)
    with pytest.raises(ValueError, match="inexact"):
        rescore.answer_from_prompt("Start with 7 and apply these steps in order:\n1. Divide by 2.\n")
    text = "1. 12 + 5 = 17\n2. 17 * 3 = 51\n#### 51\nCheck: 51 - 1 = 50"
    assert rescore.reply_number(text, strict=False) == 51 and rescore.reply_number(text, strict=True) == 51
    boxed = "1. 12 + 5 = 17\nThe answer is \\boxed{17}.\n(checked in 3 steps)"
    assert rescore.reply_number(boxed, strict=False) == 3 and rescore.reply_number(boxed, strict=True) == 17
    assert scorers.numeric_match(boxed, 3) == 1.0  # the suite's own rule: the last number
    plain = "So the number you end with is 1,203."
    assert rescore.reply_number(plain, strict=False) == 1203
    assert rescore.reply_number(plain, strict=True) is None
    answers = {p["id"]: p["answer"] for p in problems}
    path = REPO / "study" / "sweeps" / "qwen-graded-steps" / "results.jsonl"
    rows = read_rows(path)
    assert len(rows) == 800
    for row in rows:
        got = rescore.reply_number(row["text"], strict=False)
        assert float(got == answers[row["prompt_id"]]) == row["score"], row["prompt_id"]


def rescore_graded_seed0(monkeypatch, capsys, *options: str) -> str:
    """study/rescore_graded.py run on the committed seed-0 graded-steps study; what it printed."""
    sweep = REPO / "study" / "sweeps" / "qwen-graded-steps"
    monkeypatch.setattr(sys, "argv", ["rescore_graded.py", str(sweep), *options])
    load_study("rescore_graded").main()
    return capsys.readouterr().out


def test_rescore_graded_problems_reads_a_planned_look_only(monkeypatch, capsys):
    """rescore_graded.py --problems N keeps the suite's first N problems by the report's prefix rule (the
    committed seed-0 study, obf:2: looks at 100 and 200), and refuses a count that is not a look."""
    out = rescore_graded_seed0(monkeypatch, capsys, "--problems", "100")
    assert "read on the suite's first 100 problems only (--problems 100): 400 of 800 rows" in out
    assert "\n400 rows; re-scored" in out and "differ from the stored score in 0" in out
    with pytest.raises(SystemExit):
        rescore_graded_seed0(monkeypatch, capsys, "--problems", "60")
    assert "not at another prefix" in capsys.readouterr().err


def test_rescore_graded_after_reads_the_second_part_apart(monkeypatch, capsys):
    """rescore_graded.py --after N keeps the problems after the suite's first N (the committed seed-0
    study: problems 101-200 are the other 400 of its 800 rows), says it is descriptive, and refuses a
    count with nothing after it, one below 1, or one that leaves nothing before --problems' count."""
    out = rescore_graded_seed0(monkeypatch, capsys, "--after", "100")
    assert "descriptive, not a look: problems after the suite's first 100 only (--after 100): 400 rows" in out
    assert "\n400 rows; re-scored" in out and "differ from the stored score in 0" in out
    rescore = load_study("rescore_graded")
    rows = [{"prompt_index": i} for i in (0, 99, 100, 150)]
    assert rescore.problems_after(rows, 100) == rows[2:]
    for bad, message in ((200, "no rows beyond"), (0, "positive")):
        with pytest.raises(ValueError, match=message):
            rescore.problems_after(rows, bad)
    with pytest.raises(SystemExit):
        rescore_graded_seed0(monkeypatch, capsys, "--problems", "100", "--after", "100")
    assert "no problem lies between" in capsys.readouterr().err


def test_rescore_graded_short_replies_counts_each_configurations_short_replies():
    """rescore_graded.short_replies: per configuration, replies under 40 tokens (39 is short, 40 is not),
    all replies, and how many of the short ones are right."""
    rescore = load_study("rescore_graded")
    scores = {("a", "p1", 0): 1.0, ("a", "p2", 0): 0.0, ("a", "p3", 0): 1.0, ("b", "p1", 0): 0.0}
    tokens = {("a", "p1", 0): 39, ("a", "p2", 0): 12, ("a", "p3", 0): 40, ("b", "p1", 0): 200}
    assert rescore.short_replies(scores, tokens) == {"a": (2, 3, 1), "b": (0, 1, 0)}


def test_rescore_graded_level_readings_on_constructed_scores():
    """The held-out plan's readings (study/rescore_graded.py): the levels-1-2 contrast equals the
    difference of the two groups' per-problem mean gaps, with Welch's p from scipy; the short-reply share
    counts only pairs with a reply under 40 tokens; the last-number scoring ignores an early '####'."""
    rescore = load_study("rescore_graded")
    assert rescore.last_number("#### 621\n640 - 3 = 637") == 637
    assert rescore.reply_number("#### 621\n640 - 3 = 637", strict=False) == 621
    scores, tokens = {}, {}
    gaps = {1: [-1, -1, 0, 0], 2: [-1, 0, 0, 0], 3: [0, 0, 1, -1], 4: [0, 1, 0, 0], 5: [0, -1, 0, 0]}
    for level, diffs in gaps.items():
        for n, d in enumerate(diffs):
            pid = f"graded-steps-heldout-L{level}-{n:02d}"
            scores[("gate", pid, 2)], scores[("honest", pid, 2)] = float(d >= 0), float(d <= 0)
            tokens[("gate", pid, 2)], tokens[("honest", pid, 2)] = (12 if n == 0 else 90), 90
    got = rescore.level_contrast(scores, "gate", "honest")
    low, high = np.array(gaps[1] + gaps[2], float), np.array(gaps[3] + gaps[4] + gaps[5], float)
    assert low.mean() - high.mean() == -3 / 8  # levels 3-5 sum to 0 by construction
    assert got["contrast"] == pytest.approx(-3 / 8)
    assert got["p"] == pytest.approx(stats.ttest_ind(low, high, equal_var=False).pvalue)
    assert (got["low_n"], got["high_n"]) == (8, 12) and got["low_gap"] == pytest.approx(-3 / 8)
    want = stats.t.interval(0.95, len(low) - 1, loc=low.mean(), scale=stats.sem(low))
    assert got["low_interval"] == pytest.approx(want)
    # level 1: gap -2/4; the short pair (problem 00, 12 tokens) carries -1/4 of it
    assert rescore.short_share(scores, tokens, "gate", "honest", 1) == (-0.5, -0.25, 1)
    assert rescore.short_share(scores, tokens, "gate", "honest", 4) == (0.25, 0.0, 1)
    # all levels: gap (-2 - 1 + 0 + 1 - 1) / 20; the five short pairs (problem 00s) carry (-1 - 1) / 20
    assert rescore.short_share(scores, tokens, "gate", "honest", None) == (-3 / 20, -2 / 20, 5)
    # the lost pairs (gate wrong, honest right: every -1) by the gate reply's length: problem 00 of levels
    # 1 and 2 (12 tokens), then levels 1, 3 and 5's others (90 tokens); a reply of 40 tokens is in the band
    assert rescore.lost_pair_lengths(scores, tokens, "gate", "honest") == [2, 0, 3]
    assert rescore.lost_pair_lengths(scores, {**tokens, ("gate", "graded-steps-heldout-L1-00", 2): 40},
                                     "gate", "honest") == [1, 1, 3]
    # the band's edges: 59 tokens is in it, LONG_TOKENS (60) is past it
    assert rescore.LONG_TOKENS == 60
    assert rescore.lost_pair_lengths(scores, {**tokens, ("gate", "graded-steps-heldout-L1-00", 2): 59},
                                     "gate", "honest") == [1, 1, 3]
    assert rescore.lost_pair_lengths(scores, {**tokens, ("gate", "graded-steps-heldout-L1-00", 2): 60},
                                     "gate", "honest") == [1, 0, 4]
    assert rescore.log_odds(scores, "honest", 1) == pytest.approx(np.log(4.5 / 0.5))
    assert rescore.log_odds(scores, "gate", 1) == pytest.approx(np.log(2.5 / 2.5))
    # without the short pairs (problem 00 of every level): levels 1-2 keep [-1, 0, 0] and [0, 0, 0]
    rest = rescore.without_short(scores, tokens, "gate", "honest")
    assert len(rest) == 2 * 15
    assert rescore.level_contrast(rest, "gate", "honest")["contrast"] == pytest.approx(
        np.mean([-1, 0, 0, 0, 0, 0]) - np.mean([0, 1, -1, 1, 0, 0, -1, 0, 0]))


def test_sign_flip_p_is_exact_on_a_small_case_and_catches_a_planted_contrast():
    """rescore_graded.sign_flip_p: on 5 problems (one a level) the 2^5 sign vectors are few, so with many
    flips the p approaches the exact count; a planted levels-1-2 gap gets a small p, a symmetric one
    does not."""
    rescore = load_study("rescore_graded")

    def scores_of(diffs: list[int]) -> dict:
        out = {}
        for n, d in enumerate(diffs):
            pid = f"graded-steps-heldout-L{n % 5 + 1}-{n:02d}"
            out[("a", pid, 0)], out[("b", pid, 0)] = float(d > 0), float(d < 0)
        return out

    # one problem a level, gaps -1, -1, 0, 0, 0: the contrast -1; |contrast| >= 1 needs levels 1 and 2 to
    # keep equal signs (the rest are 0): 2 of the 4 sign patterns that matter, so p = 1/2 exactly
    p_contrast, _ = rescore.sign_flip_p(scores_of([-1, -1, 0, 0, 0]), "a", "b", flips=20000)
    assert p_contrast == pytest.approx(0.5, abs=0.02)
    planted = scores_of([-1] * 20 + [-1] * 20 + [0] * 60)  # levels cycle, so every level mixes: none
    assert rescore.sign_flip_p(planted, "a", "b", flips=2000)[0] > 0.05
    low_only = {}
    for n in range(100):  # 20 a level; levels 1 and 2 all lose, 3-5 split evenly
        level = n // 20 + 1
        d = -1 if level <= 2 else (1 if n % 2 else -1)
        pid = f"graded-steps-heldout-L{level}-{n:02d}"
        low_only[("a", pid, 0)], low_only[("b", pid, 0)] = float(d > 0), float(d < 0)
    p_contrast, p_slope = rescore.sign_flip_p(low_only, "a", "b", flips=2000)
    assert p_contrast < 0.001 and p_slope < 0.01
