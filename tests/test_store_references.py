"""Rows stored as references to the sweep that holds them (`store`, `same_as`): readers see the whole row,
a reference that cannot be resolved is an invalid row named with its line, `--reuse-from` a sibling
sweep writes references, and every reference committed under study/sweeps resolves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import results_row
from verispec.evaluation.rowcheck import row_problem
from verispec.evaluation.store import SAME_AS, read_rows, reference_row, scan_rows

REPO = Path(__file__).resolve().parents[1]


def write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_reference_reads_as_the_whole_row(tmp_path):
    source = results_row("u1", steps={"tv": [0.0, 0.1]}, run="r1", score=float("nan"))
    write(tmp_path / "a" / "results.jsonl", [source, results_row("u2")])
    copy = {**source, "reused_from": "study/sweeps/a"}
    ref = reference_row(copy, "a", source)
    assert set(ref) == {"schema", "unit", SAME_AS, "run", "reused_from"}  # only what differs, and the run
    mine = write(tmp_path / "b" / "results.jsonl", [ref, results_row("u3")])
    scan = scan_rows(mine)
    assert not scan.invalid and len(scan.rows) == 2
    assert json.dumps(scan.rows[0], sort_keys=True) == json.dumps(copy, sort_keys=True)  # NaN included
    assert scan_rows(mine, resolve=False).rows[0] == ref


@pytest.mark.parametrize("same_as,why", [("../a", "sibling sweep directory"), ("/etc", "sibling sweep"),
                                         ("missing", "does not exist"), ("a", "holds no row of unit")])
def test_an_unresolvable_reference_is_an_invalid_row(tmp_path, same_as, why):
    write(tmp_path / "a" / "results.jsonl", [results_row("other")])
    mine = write(tmp_path / "b" / "results.jsonl", [{"schema": 2, "unit": "u1", SAME_AS: same_as},
                                                    results_row("u3")])
    scan = scan_rows(mine)
    assert [r["unit"] for r in scan.rows] == ["u3"]
    assert scan.invalid and scan.invalid[0][0] == 1 and why in scan.invalid[0][1]
    assert [r["unit"] for r in read_rows(mine)] == ["u3"]


def test_a_reference_cannot_drop_a_field():
    with pytest.raises(ValueError, match="lacks"):
        reference_row({"unit": "u", "a": 1}, "s", {"unit": "u", "a": 1, "b": 2})


@pytest.mark.slow
def test_every_committed_reference_resolves_to_a_valid_row():
    sweeps = REPO / "study" / "sweeps"
    checked = 0
    for spec in sorted(sweeps.glob("*/sweep.json")):
        path = spec.parent / "results.jsonl"
        stored = scan_rows(path, resolve=False).rows
        if not any(SAME_AS in r for r in stored):
            continue
        scan = scan_rows(path, check=row_problem)  # references and steps resolved, every row checked
        assert not scan.invalid and not scan.skipped, (path, scan.invalid[:3])
        assert len(scan.rows) == len(stored)
        checked += 1
    if not checked:
        pytest.skip("no sweep stores references")
