"""study/check_plans.py: every study's PLAN.md was committed before any row of its own was written,
read from git and the rows."""

from __future__ import annotations

import json
import re
import subprocess
from datetime import datetime

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
