"""Replace rows a sweep copied from another (`--reuse-from`) by references to the sweep that decoded them
(`verispec.evaluation.store`, `same_as`), so a copied row costs a line instead of its tokens and steps.

    python scripts/reference_reused_rows.py study/sweeps/qwen-mtbench-seeds012 [...] [--check]

A copied row becomes a reference only if the row it would resolve to is the same row (every field, NaN
included); the file is rewritten atomically and read back before it replaces the old one, and the
rows every reader sees (`store.scan_rows`) must come out identical. `--check` changes nothing and says
what would change.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from verispec.evaluation.store import SAME_AS, load_row, reference_row, refuse_sealed, scan_rows, strict_json


def originals(sweeps_root: Path) -> dict[str, list[tuple[str, dict]]]:
    """unit -> [(sweep name, row)] for every row a sweep decoded itself (not copied, not a reference)."""
    out: dict[str, list[tuple[str, dict]]] = {}
    for results in sorted(spec.parent / "results.jsonl" for spec in sweeps_root.glob("*/sweep.json")):
        for row in scan_rows(results, references=False).rows:
            if "reused_from" not in row and SAME_AS not in row:
                out.setdefault(row.get("unit"), []).append((results.parent.name, row))
    return out


def canonical(row: dict) -> str:
    return json.dumps(row, sort_keys=True)


def rewrite(sweep: Path, index: dict[str, list[tuple[str, dict]]], check: bool) -> tuple[int, int, int]:
    """(rows, references made, bytes saved) for one sweep."""
    results = sweep / "results.jsonl"
    refuse_sealed(results)  # sealed rows are read-only: unseal them first
    raw = results.read_bytes()
    lines = raw.split(b"\n")
    out_lines, made = [], 0
    for line in lines:
        if not line.strip():
            out_lines.append(line)
            continue
        row = load_row(line)
        if "reused_from" in row and SAME_AS not in row:
            for name, source in index.get(row.get("unit"), []):
                if name == sweep.name:
                    continue
                try:
                    ref = reference_row(row, name, source)
                except ValueError:
                    continue
                resolved = {**source, **{k: v for k, v in ref.items() if k != SAME_AS}}
                if canonical(resolved) == canonical(row):
                    out_lines.append(strict_json(ref).encode())
                    made += 1
                    break
            else:
                out_lines.append(line)
        else:
            out_lines.append(line)
    new = b"\n".join(out_lines)
    rows = len([line for line in lines if line.strip()])
    if check or made == 0:
        return rows, made, len(raw) - len(new)
    before = [canonical(r) for r in scan_rows(results).rows]
    tmp = results.with_suffix(".jsonl.tmp")
    tmp.write_bytes(new)
    after = [canonical(r) for r in scan_rows(tmp).rows]
    if before != after:
        tmp.unlink()
        raise SystemExit(f"{sweep}: the rewritten rows would differ from the stored ones; nothing changed")
    os.replace(tmp, results)
    return rows, made, len(raw) - len(new)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="change nothing; print what would change")
    args = parser.parse_args()
    roots = {sweep.resolve().parent for sweep in args.sweeps}
    if len(roots) != 1:
        raise SystemExit("give sweeps of one folder (references name sibling sweeps)")
    index = originals(roots.pop())
    for sweep in args.sweeps:
        rows, made, saved = rewrite(sweep, index, args.check)
        print(f"{sweep}: {rows} rows, {made} copied rows {'would become' if args.check else 'now'} "
              f"references, {saved / 1e6:.1f} MB {'to save' if args.check else 'saved'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
