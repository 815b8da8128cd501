"""Repository hygiene that no other test sees: no merge-conflict markers in tracked text files, the
test-ordering tables in tests/conftest.py name modules that exist, and every study's PLAN.md was
committed before any row of its own was written (study/check_plans.py)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
TEXT = (".py", ".md", ".toml", ".txt", ".cfg", ".yaml", ".yml")
MARKER = re.compile(r"^(<{7} |={7}$|>{7} )", re.MULTILINE)


def tracked_text_files() -> list[Path]:
    done = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:  # not a git checkout (an unpacked sdist): check the sources we ship
        return [p for p in ROOT.rglob("*") if p.suffix in TEXT and ".venv" not in p.parts]
    names = done.stdout.splitlines()
    return [ROOT / name for name in names if Path(name).suffix in TEXT or name == ".ci/run"]


def test_no_merge_conflict_markers():
    found = []
    for path in tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        found += [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
                  for m in MARKER.finditer(text)]
    assert not found, "merge-conflict markers left in: " + ", ".join(found)
    assert MARKER.search("a\n<<<<<<< HEAD\nb\n") and not MARKER.search("# ======= heading\n")


def test_conftest_tables_name_existing_modules():
    """A renamed module would silently fall out of HEAVY_FIRST (run late) or SLOW_MODULES (run in the fast
    loop): each name there must be a test module in tests/."""
    from conftest import HEAVY_FIRST, SLOW_MODULES

    present = {path.name for path in (ROOT / "tests").glob("test_*.py")}
    assert present, "no test modules found"
    assert sorted(set(HEAVY_FIRST) - present) == []
    assert sorted(SLOW_MODULES - present) == []
