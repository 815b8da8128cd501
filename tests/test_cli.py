"""The command line: `verispec rules` and the README's catalogue table stay in sync.

The output checks call `verispec.cli.main` in-process (a subprocess costs ~2 s of interpreter and torch
start-up each); the closed-pipe test runs the real `python -m verispec rules` entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from verispec.cli import main
from verispec.rules import names

ROOT = Path(__file__).resolve().parents[1]


def run_cli(capsys, *args: str) -> str:
    """`verispec ARGS` in this process: its stdout; exit status 0 and nothing on stderr."""
    code = main(list(args))
    out, err = capsys.readouterr()
    assert code == 0 and err == "", err
    return out


def test_rules_lists_every_rule(capsys):
    out = run_cli(capsys, "rules")
    for name in names():
        assert any(line.startswith(name + " ") for line in out.splitlines()), name


def test_readme_catalogue_matches_cli(capsys):
    out = run_cli(capsys, "rules", "--markdown")
    assert out.strip() in (ROOT / "README.md").read_text(), "README table is stale: regenerate it"


def test_a_closed_pipe_ends_quietly():
    """`verispec rules | head -1` and the like: the reader leaves early; verispec exits 141 (SIGPIPE's
    shell status) with nothing on stderr, not an error message or a traceback."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered
    proc = subprocess.Popen([sys.executable, "-m", "verispec", "rules", "--markdown"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # before the child writes anything: its first write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err
