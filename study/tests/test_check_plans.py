"""study/check_plans.py: every study's PLAN.md was committed before any row of its own was written,
read from git and the rows."""

from __future__ import annotations

import json
import os
import re
import subprocess
from datetime import datetime
from pathlib import Path

import pytest
from helpers import REPO, load_study


@pytest.mark.slow  # reads every planned sweep's rows (about 10 s)
def test_every_plan_was_committed_before_its_rows_were_written(tmp_path, capsys):
    """study/check_plans.py on the committed sweeps: each PLAN.md's first commit came before its
    sweep's first decoding run began, or (graded-steps: committed 76 s after its run began) before that
    run's first chunk could have finished; copy-only sweeps decode nothing. Run ids carry their start."""
    check_plans = load_study("check_plans")
    start = check_plans.run_start("20261206T084429Z-e128ef")
    assert (start.hour, start.minute, start.second, start.tzinfo is not None) == (8, 44, 29, True)
    assert check_plans.run_start("not-a-run") is None
    results = tmp_path / "results.jsonl"
    results.write_text("\n".join(json.dumps(r) for r in [
        {"run": "20261206T084429Z-a", "batch_seconds": 90.0},
        {"run": "20261206T084429Z-a", "batch_seconds": 5.0},
        {"run": "20261206T090000Z-b", "reused_from": "elsewhere"}, {"batch_seconds": 1.0}]) + '\n{"cut')
    assert check_plans.runs_in(results) == ({"20261206T084429Z-a": (2, 90.0), "": (1, 1.0)},
                                            {"20261206T090000Z-b": 1})
    # the verdicts, on a run that began 08:44:29 whose first chunk took 90 s
    fake = check_plans.REPO / "study" / "sweeps" / "fake"
    check_plans.runs_in = lambda _: ({"20261206T084429Z-a": (2, 90.0)}, {})
    for committed, verdict in (("08:44:00", "declared before decoding"),
                               ("08:45:30", "declared before any row was written"),
                               ("08:46:30", "PLAN.md committed after rows may have been written")):
        when = datetime.fromisoformat(f"2026-12-06T{committed}+00:00")
        check_plans.plan_commits = lambda _, when=when: [(when, "0" * 40, "plan")]
        assert check_plans.check(fake)[0] == verdict, committed
    check_plans = load_study("check_plans")  # a fresh copy for the real sweeps
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True,
                             text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("not a full git clone: the plans' first commits are not all here")
    assert check_plans.main([]) == 0
    plans, only_json = capsys.readouterr().out.split("declare comparisons only in their sweep.json")
    assert "-> PLAN.md committed after" not in plans and "runs of unknown start" not in plans
    assert re.search(r"\n(\d+) of \1 plan\(s\) whose sweep decodes committed before any row", plans)
    # a copy-only sweep declares a reading of rows decoded before it, and says so
    pooled = plans.split("study/sweeps/qwen-graded-steps-seeds01:")[1].split("->")[1].splitlines()[0]
    assert pooled.strip() == "copy-only"
    graded = plans.split("study/sweeps/qwen-graded-steps:")[1].split("->")[1].splitlines()[0]
    assert graded.strip() == "declared before any row was written"
    # the studies declared only in sweep.json are listed with what git shows (not counted): MT-Bench's
    # sweep.json was committed 45 s into its run, before its first chunk (255 s) was done
    mtbench = only_json.split("study/sweeps/qwen-mtbench:")[1].split("->")[1].splitlines()[0]
    assert mtbench.strip() == "declared before any row was written"



def test_a_plan_moved_to_study_keeps_its_history_and_the_move_is_no_amendment(tmp_path, monkeypatch):
    """A plan committed under benchmarks/sweeps, amended there, then moved unchanged to study/sweeps:
    its commits are the declaration and the amendment (read at its former home), not the move, and the
    rows at an old commit are read where they were then; a move that also edits a plan counts."""
    check_plans = load_study("check_plans")
    monkeypatch.setattr(check_plans, "REPO", tmp_path)
    clock = iter(range(10))

    def commit(subject: str) -> None:
        when = f"2026-12-01T10:0{next(clock)}:00+00:00"  # distinct times: commits sort by time
        env = {**os.environ, "GIT_AUTHOR_DATE": when, "GIT_COMMITTER_DATE": when}
        for args in (["add", "-A"], ["commit", "-qm", subject]):
            subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                           check=True, capture_output=True, env=env)

    def plan(root: str, name: str) -> Path:
        return tmp_path / root / "sweeps" / name / "PLAN.md"

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    for name in ("x", "y"):
        plan("benchmarks", name).parent.mkdir(parents=True)
        plan("benchmarks", name).write_text(f"plan {name}\n")
    commit("declare")
    plan("benchmarks", "x").write_text("plan x, amended\n")
    (plan("benchmarks", "x").parent / "results.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    commit("amend")
    (tmp_path / "study").mkdir()
    (tmp_path / "benchmarks" / "sweeps").rename(tmp_path / "study" / "sweeps")
    plan("study", "y").write_text("plan y, changed on the way\n")
    commit("move")
    commits = check_plans.plan_commits(plan("study", "x"))
    assert [subject for _, _, subject in commits] == ["declare", "amend"]
    assert check_plans.rows_at(commits[1][1], plan("study", "x").parent / "results.jsonl") == 2
    assert [subject for _, _, subject in check_plans.plan_commits(plan("study", "y"))] == ["declare", "move"]
