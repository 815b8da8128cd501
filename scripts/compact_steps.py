"""Move a sweep's inline per-position arrays (`steps`) and token ids into its steps.bin
(`verispec.evaluation.stepstore`) and write its rows as strict JSON (`store.strict_json`): each row keeps
pointers instead of its arrays, which shrinks results.jsonl several-fold.

    python scripts/compact_steps.py benchmarks/sweeps/qwen-mtbench-pilot [...] [--check]

The report of each sweep (`verispec report --markdown`) must read the same before and after (numbers are
stored as float32; the reports print 3-4 digits); otherwise nothing is changed and the sweep is named.
The rewrite is atomic: steps.bin and results.jsonl are built beside the old ones and replace them only
once read back. `--check` changes nothing and prints what would change.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from verispec.evaluation.report import write_report
from verispec.evaluation.stepstore import STEPS_FILE, compact_row
from verispec.evaluation.store import SAME_AS, load_row, strict_json


def compact(sweep: Path, check: bool) -> tuple[int, int, int]:
    """(rows, rows moved, bytes saved) for one sweep."""
    results = sweep / "results.jsonl"
    raw = results.read_bytes()
    with tempfile.TemporaryDirectory(dir=sweep.parent) as tmp:
        work = Path(tmp)
        for name in os.listdir(sweep):  # the report reads sweep.json, runs.jsonl, ... beside the rows
            if name not in ("results.jsonl", STEPS_FILE) and (sweep / name).is_file():
                shutil.copy(sweep / name, work / name)
        if (sweep / STEPS_FILE).exists():
            shutil.copy(sweep / STEPS_FILE, work / STEPS_FILE)
        lines, moved, rows = [], 0, 0
        for line in raw.split(b"\n"):
            if not line.strip():
                continue
            rows += 1
            row = load_row(line)
            new = row if SAME_AS in row else compact_row(work, row)
            moved += new is not row
            lines.append(strict_json(new).encode())
        (work / "results.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
        kept = [work / n for n in ("results.jsonl", STEPS_FILE) if (work / n).exists()]
        new_size = sum(p.stat().st_size for p in kept)
        old_size = len(raw) + ((sweep / STEPS_FILE).stat().st_size if (sweep / STEPS_FILE).exists() else 0)
        if check or (moved == 0 and lines == [line for line in raw.split(b"\n") if line.strip()]):
            return rows, moved, old_size - new_size
        before = write_report(sweep, html_path=work / "before.html", markdown=True)[0]
        after = write_report(work, html_path=work / "after.html", markdown=True)[0]
        if before != after:
            raise SystemExit(f"{sweep}: the report would read differently with float32 steps; "
                             "nothing changed")
        os.replace(work / STEPS_FILE, sweep / STEPS_FILE)
        os.replace(work / "results.jsonl", results)
        return rows, moved, old_size - new_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="change nothing; print what would change")
    args = parser.parse_args()
    for sweep in args.sweeps:
        rows, moved, saved = compact(sweep, args.check)
        print(f"{sweep}: {rows} rows, {moved} {'would move' if args.check else 'moved'} their steps to "
              f"{STEPS_FILE}, {saved / 1e6:.1f} MB {'to save' if args.check else 'saved'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
