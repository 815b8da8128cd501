"""The command line: `verispec rules` and the README's catalogue table stay in sync."""

from __future__ import annotations

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
