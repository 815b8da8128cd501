"""Move a sweep's inline per-position arrays (`steps`) and token ids into its steps.bin
(`verispec.evaluation.stepstore`), write its rows as strict JSON (`store.strict_json`) and, with `--seal`,
seal it (`store.seal_rows`): rows compressed into results.jsonl.xz, steps packed into one
steps-<crc32>.bin.xz; a finished sweep then weighs about a tenth of its inline rows, and is read-only
until unsealed. `--seal` on a sealed sweep packs its steps again.

    python scripts/compact_steps.py study/sweeps/qwen-mtbench-pilot [...] [--seal] [--check]
    python scripts/compact_steps.py --unseal study/sweeps/qwen-mtbench-pilot   # to add rows again

The report of each sweep (`verispec report --markdown`, and its HTML) must read the same before and after
(numbers are stored as float32; the reports print 3-4 digits); otherwise nothing is changed and the sweep
is named. The new files are built beside the old ones and read back; the steps files go in first (the
rows already there point at none of the new ones), then the rows, and old steps files no row points at
are removed last. `--check`
changes nothing and prints what would change.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from verispec.evaluation.report import write_report
from verispec.evaluation.stepstore import STEPS_FILE, compact_row, steps_files
from verispec.evaluation.store import (SAME_AS, load_row, read_sealed, refuse_sealed, seal_rows, sealed_file,
                                       strict_json, unseal_rows)

RESULTS = "results.jsonl"


def _report(sweep: Path, work: Path) -> tuple[str, str]:
    """(markdown, HTML) of a sweep's report (the HTML's path, which it names, is the same for both)."""
    html = work / "report.html"
    markdown = write_report(sweep, html_path=html, markdown=True)[0]
    text = html.read_text(encoding="utf-8")
    html.unlink()
    return markdown, text


def compact(sweep: Path, check: bool, seal: bool = False) -> tuple[int, int, int]:
    """(rows, rows moved, bytes saved) for one sweep. A sealed sweep is sealed again (its steps re-packed)
    with `seal`, and refused without it."""
    results, sealed = sweep / RESULTS, sealed_file(sweep / RESULTS)
    if results.exists():
        raw = results.read_bytes()
    elif seal:
        raw = read_sealed(sealed)
    else:
        refuse_sealed(results)  # a sealed sweep: unseal it to change it, or seal it again
        raise FileNotFoundError(f"{results} does not exist")
    old_steps = steps_files(sweep)
    old_size = sum((sweep / n).stat().st_size for n in [RESULTS, sealed.name, *old_steps]
                   if (sweep / n).exists())
    with tempfile.TemporaryDirectory(dir=sweep.parent) as tmp:
        work = Path(tmp)
        for name in os.listdir(sweep):  # the report reads sweep.json, runs.jsonl, ... beside the rows
            if name not in (RESULTS, sealed.name) and (sweep / name).is_file():
                shutil.copy(sweep / name, work / name)  # steps files too: the rows point into them
        lines, moved, rows = [], 0, 0
        for line in raw.split(b"\n"):
            if not line.strip():
                continue
            rows += 1
            row = load_row(line)
            new = row if SAME_AS in row else compact_row(work, row)
            moved += new is not row
            lines.append(strict_json(new).encode())
        (work / RESULTS).write_bytes(b"".join(line + b"\n" for line in lines))
        if seal:
            seal_rows(work / RESULTS)
        new_steps = steps_files(work)
        kept = [work / n for n in [RESULTS, sealed.name, *new_steps] if (work / n).exists()]
        new_size = sum(p.stat().st_size for p in kept)
        unchanged = moved == 0 and not seal and lines == [line for line in raw.split(b"\n") if line.strip()]
        if check or unchanged:
            return rows, moved, old_size - new_size
        with tempfile.TemporaryDirectory() as pages:
            if _report(sweep, Path(pages)) != _report(work, Path(pages)):
                raise SystemExit(f"{sweep}: the report would read differently once compacted; nothing "
                                 "changed")
        for name in new_steps:  # first the steps files: rows already here point at none of the new ones
            os.replace(work / name, sweep / name)
        if seal:
            os.replace(sealed_file(work / RESULTS), sealed)
            results.unlink(missing_ok=True)
        else:
            os.replace(work / RESULTS, results)
        for name in set(old_steps) - set(new_steps):  # no row points at them now
            (sweep / name).unlink()
        return rows, moved, old_size - new_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", type=Path)
    parser.add_argument("--seal", action="store_true",
                        help="also compress the rows (read-only until --unseal)")
    parser.add_argument("--unseal", action="store_true", help="make sealed rows plain (appendable) again")
    parser.add_argument("--check", action="store_true", help="change nothing; print what would change")
    args = parser.parse_args()
    for sweep in args.sweeps:
        if args.unseal:
            print(f"{sweep}: rows unsealed into {unseal_rows(sweep / RESULTS)}")
            continue
        rows, moved, saved = compact(sweep, args.check, args.seal)
        done = "would move" if args.check else "moved"
        print(f"{sweep}: {rows} rows, {moved} {done} their steps to {STEPS_FILE}"
              f"{', rows sealed' if args.seal and not args.check else ''}, {saved / 1e6:.1f} MB "
              f"{'to save' if args.check else 'saved'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
