"""The command line: `verispec rules` and the README's catalogue table stay in sync."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from verispec.rules import names

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verispec", *args], capture_output=True, text=True,
                          timeout=120)


def test_rules_lists_every_rule():
    out = run_cli("rules")
    assert out.returncode == 0, out.stderr
    for name in names():
        assert any(line.startswith(name + " ") for line in out.stdout.splitlines()), name


def test_readme_catalogue_matches_cli():
    out = run_cli("rules", "--markdown")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in (ROOT / "README.md").read_text(), "README table is stale: regenerate it"


def test_a_closed_pipe_ends_quietly():
    """`verispec rules | head -1` and the like: the reader leaves early; verispec exits 141 (SIGPIPE's
    shell status) with nothing on stderr, not an error message or a traceback."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered
    proc = subprocess.Popen([sys.executable, "-m", "verispec", "rules", "--markdown"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # before the child writes anything: its first write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err
