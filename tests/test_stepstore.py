"""Rows' per-position arrays in steps.bin (`verispec.evaluation.stepstore`): the round trip (float32
numbers, token ids, roles, NaN and infinities), pointers resolved by every reader, a damaged or missing
record named as an invalid row, and a real sweep writing them (smaller files, the same report)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from helpers import results_row
from verispec.evaluation.stepstore import (STEPS_FILE, decode_steps, encode_steps, is_pointer, steps_files,
                                            store_steps)
from verispec.evaluation.store import ResultsFile, read_rows, scan_rows, sealed_file


def float32_equal(a: float, b: float) -> bool:
    """Whether b is a as float32 stores it (NaN and infinities included)."""
    return math.isnan(b) if math.isnan(a) else float(np.float32(a)) == b


STEPS = {"token": [5, 17, 151643, 3], "role": ["accepted", "bonus", "recovered", "accepted"],
         "tv": [0.0, 0.123456789, float("nan"), 1.0], "kl": [float("inf"), 1e-9, 2.5, 0.0],
         "log_target": [-0.1, -12.75, -1e-30, -3.0], "draft_confidence": [0.5, float("nan"), 0.9, 0.2],
         "draft_over_target": [1.0, float("nan"), 3.5, 0.7]}  # four positions: results_row's 4 tokens


def test_round_trip_keeps_ids_and_roles_exactly_and_numbers_as_float32():
    back = decode_steps(encode_steps(STEPS))
    assert list(back) == list(STEPS)
    assert back["token"] == STEPS["token"] and back["role"] == STEPS["role"]
    for key in ("tv", "kl", "log_target"):
        assert all(float32_equal(a, b) for a, b in zip(STEPS[key], back[key])), key
    assert math.isnan(back["tv"][2]) and back["kl"][0] == math.inf


def test_steps_that_are_not_columns_stay_inline():
    assert encode_steps({"tv": [0.1, 0.2], "kl": [0.1]}) is None  # lengths differ
    assert encode_steps({"tv": [0.1, None]}) is None
    assert encode_steps({}) is None and encode_steps([1, 2]) is None
    assert encode_steps({"token": [2**40]}) is None  # not an int32


def test_a_row_with_stored_steps_reads_as_the_whole_row(tmp_path):
    path = tmp_path / "results.jsonl"
    row = results_row("u1", steps=STEPS)
    with ResultsFile(path) as store:
        store.append(row)
    raw = json.loads(path.read_text())
    assert is_pointer(raw["steps"]) and (tmp_path / STEPS_FILE).exists()
    [back] = read_rows(path)
    assert back["steps"]["role"] == STEPS["role"] and back["steps"]["token"] == STEPS["token"]
    assert {k: v for k, v in back.items() if k != "steps"} == {k: v for k, v in row.items() if k != "steps"}
    with ResultsFile(path, compact_steps=False) as store:  # the inline form still reads, and is written
        store.append(results_row("u2", steps=STEPS))
    assert not is_pointer(json.loads(path.read_text().splitlines()[1])["steps"])
    assert [r["unit"] for r in read_rows(path)] == ["u1", "u2"]


@pytest.mark.parametrize("damage,why", [("flip", "checksum"), ("missing", "does not exist"),
                                        ("pointer", "integer offset")])
def test_damaged_stored_steps_make_an_invalid_row_named_with_its_line(tmp_path, damage, why):
    path = tmp_path / "results.jsonl"
    pointer = store_steps(tmp_path, STEPS)
    rows = [results_row("u0"), results_row("u1", steps=pointer)]
    if damage == "flip":
        data = bytearray((tmp_path / STEPS_FILE).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (tmp_path / STEPS_FILE).write_bytes(bytes(data))
    elif damage == "missing":
        (tmp_path / STEPS_FILE).unlink()
    else:
        rows[1]["steps"] = {**pointer, "offset": "0"}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    scan = scan_rows(path)
    assert [r["unit"] for r in scan.rows] == ["u0"]
    assert scan.invalid[0][0] == 2 and why in scan.invalid[0][1]


@pytest.mark.slow
def test_a_sweep_stores_its_steps_compactly_and_reports_the_same(tmp_path):
    from verispec.evaluation.report import write_report
    from verispec.evaluation.sweep import run_sweep
    from verispec.evaluation.units import SweepSpec

    spec = SweepSpec(suite="shakespeare", target="default", draft="default-draft",
                     rules=("lenience:l=0.5",), limit=2, max_new_tokens=24)
    run_sweep(spec, tmp_path / "a", progress=False, batch_size=2)
    rows = read_rows(tmp_path / "a" / "results.jsonl")
    assert all(len(r["steps"]["tv"]) == r["tokens"] for r in rows)
    inline = tmp_path / "inline"
    inline.mkdir()
    (inline / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))  # steps inline
    for name in ("sweep.json", "runs.jsonl"):
        (inline / name).write_text((tmp_path / "a" / name).read_text())
    compact = (tmp_path / "a" / "results.jsonl").stat().st_size + (tmp_path / "a" / STEPS_FILE).stat().st_size
    assert compact < 0.5 * (inline / "results.jsonl").stat().st_size
    assert write_report(tmp_path / "a")[0] == write_report(inline)[0]


@pytest.mark.slow
def test_compacting_a_committed_sweep_keeps_its_report(tmp_path):
    """scripts/compact_steps.py on a committed sweep written out with its steps and token ids inline (as
    the first writer stored every row, NaN as bare JSON): they move to steps.bin, the files shrink, the
    rows become strict JSON, and the report reads the same (the script refuses otherwise)."""
    import shutil
    from pathlib import Path

    from helpers import load_script
    from verispec.evaluation.report import write_report

    source = Path(__file__).resolve().parents[1] / "study" / "sweeps" / "qwen-mtbench-pilot"
    if not source.exists():
        pytest.skip("the committed sweep is not in this checkout")
    sweep = tmp_path / "qwen-mtbench-pilot"
    shutil.copytree(source, sweep)
    rows = read_rows(sweep / "results.jsonl")  # plain or sealed (results.jsonl.xz)
    for name in steps_files(sweep):  # its packed steps go: every row is written inline, as first stored
        (sweep / name).unlink()
    sealed_file(sweep / "results.jsonl").unlink(missing_ok=True)
    (sweep / "results.jsonl").write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in rows))
    before = write_report(sweep, html_path=tmp_path / "a.html", markdown=True)[0]
    size = (sweep / "results.jsonl").stat().st_size
    rows, moved, saved = load_script("compact_steps").compact(sweep, check=False)
    assert rows == moved == 32 and saved > size / 2
    assert write_report(sweep, html_path=tmp_path / "b.html", markdown=True)[0] == before
    assert all(is_pointer(json.loads(line)["steps"]) and is_pointer(json.loads(line)["token_ids"])
               for line in (sweep / "results.jsonl").open())
    for line in (sweep / "results.jsonl").read_text().splitlines():  # strict JSON: no bare NaN
        json.loads(line, parse_constant=pytest.fail)


def test_equal_columns_are_stored_once_and_read_back_as_themselves():
    steps = {**STEPS, "log_target_raw": list(STEPS["log_target"])}  # equal at T = 1, no truncation
    record = encode_steps(steps)
    assert len(record) < len(encode_steps(STEPS)) + 40  # a reference, not a second column
    back = decode_steps(record)
    assert back["log_target_raw"] == back["log_target"] and list(back) == list(steps)
    back["log_target_raw"][0] = 99.0  # two lists, not one aliased
    assert back["log_target"][0] != 99.0


def test_a_record_of_the_first_writer_zlib_and_plain_columns_still_reads():
    import struct
    import zlib

    head = json.dumps({"n": 2, "fields": [["tv", "f4"], ["token", "i4"]]}).encode()
    body = np.array([0.25, 0.5], np.float32).tobytes() + np.array([7, 9], np.int32).tobytes()
    back = decode_steps(zlib.compress(struct.pack("<I", len(head)) + head + body))
    assert back == {"tv": [0.25, 0.5], "token": [7, 9]}


def test_token_ids_are_stored_beside_the_steps_and_read_back(tmp_path):
    path = tmp_path / "results.jsonl"
    row = {**results_row("u1", steps=STEPS), "token_ids": [151643, 0, 5, 17]}
    with ResultsFile(path) as store:
        store.append(row)
    raw = json.loads(path.read_text())
    assert is_pointer(raw["token_ids"]) and is_pointer(raw["steps"])
    [back] = read_rows(path)
    assert back["token_ids"] == row["token_ids"]
    raw["token_ids"] = raw["steps"]  # a pointer at a record of other columns: named, not misread
    path.write_text(json.dumps(raw) + "\n")
    scan = scan_rows(path)
    assert not scan.rows and "other columns" in scan.invalid[0][1]


def test_rows_are_strict_json_and_read_back_with_their_nan_and_infinities(tmp_path):
    from verispec.evaluation.store import load_row, strict_json

    path = tmp_path / "results.jsonl"
    row = {**results_row("u1"), "acceptance_rate": float("nan"), "log_ratio": float("-inf"),
           "metrics": {"distinct_2": float("nan"), "repetition_4": 0.5}, "steps": {"tv": [0.1, None]}}
    row["steps"]["kl"] = [float("inf"), 0.0]  # steps that stay inline (a None) keep their infinity too
    with ResultsFile(path) as store:
        store.append(row)
    text = path.read_text()
    json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name} in a stored row"))
    [back] = scan_rows(path).rows  # (no row check: these steps are not a decoder's)
    assert math.isnan(back["acceptance_rate"]) and back["log_ratio"] == -math.inf
    assert math.isnan(back["metrics"]["distinct_2"]) and back["metrics"]["repetition_4"] == 0.5
    assert back["steps"]["kl"] == [math.inf, 0.0] and back["steps"]["tv"] == [0.1, None]
    assert strict_json(back) == text.strip()  # written again, the same line
    odd = load_row(strict_json({"m": {1: float("nan")}, "t": (1.0, float("inf"))}))  # int key, tuple
    assert math.isnan(odd["m"]["1"]) and odd["t"] == [1.0, math.inf]
    bad = json.loads(text)
    bad["non_finite"] = [[["tokens"], "nan"]]  # names a value that is not null
    path.write_text(json.dumps(bad) + "\n" + json.dumps(results_row("u2")) + "\n")
    scan = scan_rows(path)
    assert [r["unit"] for r in scan.rows] == ["u2"] and "not null" in scan.skipped[0]
