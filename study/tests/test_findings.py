"""Every confirmatory figure of docs/findings.md ('Where each finding stands') is recomputable from the
repository by one command: study/README.md lists, per finding, the command and the figure it prints.
Here: each listed figure is the one docs/findings.md prints, and a sample of the commands, run as a user
runs them, prints its figures (the rest read other sweeps by the same code)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

ROW = re.compile(r"^\| ([^|]+) \| `([^`]+)` \| `([^`]+)` \|$", re.MULTILINE)
# one sweep of each task and temperature, and the report's own command: about 30 s on two cores
SAMPLE = ("study/sweeps/qwen-humaneval-collab-t07 --planned",
          "study/sweeps/qwen-graded-steps-collab --planned",
          "verispec report study/sweeps/qwen-mtbench-t07")


def findings() -> list[tuple[str, str, str]]:
    """(finding, command, figure) rows of study/README.md's table."""
    return ROW.findall((REPO / "study" / "README.md").read_text(encoding="utf-8"))


def test_every_listed_figure_is_the_one_the_findings_print():
    rows = findings()
    table = (REPO / "docs" / "findings.md").read_text(encoding="utf-8")
    stands = table[table.index("### Where each finding stands"):]
    stands = stands[:stands.index("\n\n", stands.index("| A - B"))]  # the table itself
    assert len(rows) >= 30
    missing = [(name, figure) for name, _, figure in rows if figure not in stands]
    assert not missing, missing
    for _, command, _ in rows:  # commands name committed sweeps
        sweep = next(part for part in command.split() if part.startswith("study/sweeps/"))
        assert (REPO / sweep / "sweep.json").is_file(), command


@pytest.mark.slow  # three commands, about 30 s on two cores
def test_a_sample_of_the_commands_prints_its_findings():
    by_command: dict[str, list[str]] = {}
    for _, command, figure in findings():
        by_command.setdefault(command, []).append(figure)
    sample = [c for c in by_command if any(s in c for s in SAMPLE)]
    assert len(sample) == len(SAMPLE)
    bin_dir = Path(sys.executable).parent  # the `verispec` and `python` of this environment
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    for command in sample:
        argv = command.split()
        argv[0] = sys.executable if argv[0] == "python" else str(bin_dir / argv[0])
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert [f for f in by_command[command] if f not in done.stdout] == [], command
