"""Rows that would poison a sweep are named and refused or decoded again, never counted or skipped in
silence: a hand-edited sweep.json before --resume, a score of `true`, a token count past the cap, a NaN
shift value (in report, resume and --reuse-from), a 100k-deep JSON line, a row of the wrong type (its
unit is decoded again by --resume), a FIFO or device given as a results or data file. Then a fuzz over
rows and sweep directories (mutated types, values, encodings, truncations): every mutation that makes
a row invalid is refused by every reader, with its line named; none raises or hangs."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verispec.cli import main
from verispec.evaluation.report import write_report
from verispec.evaluation.rowcheck import row_problem
from verispec.evaluation.store import ResultsFile, read_rows, scan_rows

ARGS = ["--suite", "shakespeare", "--rules", "lossless", "--seeds", "0", "--limit", "2", "--no-progress",
        "--no-report"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A real sweep of the default pair: plain and lossless on 2 prompts, 6 new tokens (4 rows)."""
    out = tmp_path_factory.mktemp("sweep") / "s"
    assert main(["bench", *ARGS, "--max-new-tokens", "6", "--out", str(out)]) == 0
    assert len(read_rows(out / "results.jsonl")) == 4
    return out


def copy_of(sweep: Path, tmp_path: Path, name: str = "copy") -> Path:
    out = tmp_path / name
    shutil.copytree(sweep, out, ignore=shutil.ignore_patterns(".lock"))
    return out


def lines_of(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def poison(out: Path, line: int, **changes) -> dict:
    """Set fields of the row on `line` (1-based) of OUT/results.jsonl; returns the poisoned row."""
    lines = lines_of(out / "results.jsonl")
    row = json.loads(lines[line - 1])
    row.update(changes)
    lines[line - 1] = json.dumps(row)
    write_lines(out / "results.jsonl", lines)
    return row


@pytest.mark.slow
def test_a_hand_edited_max_new_tokens_is_refused_on_resume_naming_a_row(sweep, tmp_path, capsys):
    out = copy_of(sweep, tmp_path)
    settings_path = out / "sweep.json"
    edited = json.loads(settings_path.read_text())
    edited["max_new_tokens"] = 8
    settings_path.write_text(json.dumps(edited))
    before = (out / "results.jsonl").read_bytes()
    code = main(["bench", *ARGS, "--max-new-tokens", "8", "--out", str(out), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and "results.jsonl:1" in err and "not a unit of this sweep" in err, err
    assert "max_new_tokens 6, this sweep's 8" in err
    assert (out / "results.jsonl").read_bytes() == before  # nothing decoded beside them


@pytest.mark.slow
def test_rows_record_their_token_cap(sweep):
    assert {r["max_new_tokens"] for r in read_rows(sweep / "results.jsonl")} == {6}


@pytest.mark.slow
@pytest.mark.parametrize("field,value,why", [
    ("score", True, "score True is not a number"),
    ("tokens", -5, "not non-negative integers: tokens"),
    ("tokens", 200_000, "tokens 200000 > max_new_tokens 6"),
    ("mean_tv", float("nan"), "not finite numbers: mean_tv"),
    ("mean_kl", float("inf"), "not finite numbers: mean_kl"),
    ("k", "4", "not numbers: k"),
])
def test_a_poisoned_row_is_named_by_report_and_decoded_again_by_resume(sweep, tmp_path, field, value,
                                                                       why):
    out = copy_of(sweep, tmp_path)
    row = poison(out, 2, **{field: value})
    table, _ = write_report(out / "results.jsonl")  # no traceback (a NaN mean_tv crashed `stdev`)
    assert why in table and "line(s) 2" in table, table[-600:]
    with ResultsFile(out / "results.jsonl", 6) as store:
        assert row["unit"] not in store.done and len(store.done) == 3  # not a finished unit
    assert main(["bench", *ARGS, "--max-new-tokens", "6", "--out", str(out), "--resume"]) == 0
    rows = read_rows(out / "results.jsonl")
    assert len(rows) == 4 and row["unit"] in {r["unit"] for r in rows}  # decoded again, valid this time
    again = next(r for r in rows if r["unit"] == row["unit"])
    original = next(r for r in read_rows(sweep / "results.jsonl") if r["unit"] == row["unit"])
    assert again["token_ids"] == original["token_ids"]  # the same unit, the same tokens


@pytest.mark.slow
def test_reuse_never_copies_a_poisoned_row(sweep, tmp_path):
    source = copy_of(sweep, tmp_path, "source")
    lossless = next(i for i, line in enumerate(lines_of(source / "results.jsonl"), 1)
                    if json.loads(line)["rule"] == "lossless")
    poison(source, lossless, mean_tv=float("nan"))
    out = tmp_path / "new"
    argv = ["bench", *ARGS, "--max-new-tokens", "6", "--out", str(out), "--reuse-from", str(source)]
    assert main(argv) == 0
    rows = read_rows(out / "results.jsonl")
    copied = [r for r in rows if "reused_from" in r]
    assert len(rows) == 4 and len(copied) == 1 and all(math.isfinite(r["mean_tv"]) for r in rows)


@pytest.mark.slow
def test_a_deeply_nested_line_is_named_not_a_recursion_error(sweep, tmp_path, capsys):
    out = copy_of(sweep, tmp_path)
    lines = lines_of(out / "results.jsonl")
    write_lines(out / "results.jsonl", lines[:1] + ["[" * 100_000 + "]" * 100_000] + lines[1:])
    table, _ = write_report(out / "results.jsonl")
    assert "skipped 1 unreadable line(s)" in table and "line(s) 2" in table
    assert len(scan_rows(out / "results.jsonl").rows) == 4
    assert main(["bench", *ARGS, "--max-new-tokens", "6", "--out", str(out), "--resume"]) == 0
    assert main(["bench", *ARGS, "--max-new-tokens", "6", "--out", str(tmp_path / "b"),
                 "--reuse-from", str(out)]) == 0
    settings_path = out / "sweep.json"
    settings_path.write_text("[" * 100_000 + "]" * 100_000)
    code = main(["bench", *ARGS, "--max-new-tokens", "6", "--out", str(out), "--resume"])
    assert code == 2 and "cannot read" in capsys.readouterr().err


def test_a_fifo_or_a_device_is_refused_at_once(tmp_path, capsys):
    fifo_dir = tmp_path / "fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "results.jsonl")
    for argv, words in ((["report", str(fifo_dir)], "not a regular file (a FIFO)"),
                        (["bench", "--suite", "mbpp:/dev/zero", "--out", str(tmp_path / "z"),
                          "--no-progress"],
                         "not a regular file (a character device)")):
        started = time.monotonic()
        assert main(argv) == 2
        assert words in capsys.readouterr().err and time.monotonic() - started < 5


# --- the fuzz ---------------------------------------------------------------------------------------

# each mutation makes a valid row invalid, whatever the row: (field, value or a function of the old value)
INVALID = {
    "score": [True, False, "1.0", [1.0], {"v": 1}, float("inf"), -float("inf")],
    "tokens": [-1, -5, 10**9, 1.5, True, "4", None, float("nan")],
    "target_calls": [-1, "2", None, [], 2.5],
    "k": [-1, "4", None, 1.5, True],
    "temperature": [-1.0, "1", None, float("nan"), float("inf")],
    "seconds": [-0.5, None, float("nan"), "x"],
    "mean_tv": [float("nan"), float("inf"), -0.1, 1.5, None, "0"],
    "mean_kl": [float("nan"), float("inf"), "0"],
    "log_ratio": [float("nan"), None, {}],
    "target_nll": [float("inf"), None, "1"],
    "proposed": [-1, None, "4"],
    "accepted": [-1, 10**6, None],
    "config": [None, 5, [], {}],
    "rule": [None, 1],
    "unit": [5, [], {"a": 1}],
    "steps": [[1, 2], "x", {"tv": "abc", "role": 5}, {"tv": [0.1], "role": ["a", "b"]}],
    "metrics": [[1], "m", 3],
    "max_new_tokens": [0, -3, "6", True, 1],
}
REQUIRED_FIELDS = ["config", "rule", "family", "k", "temperature", "prompt_id", "seed", "score_name", "score",
                   "proposed", "accepted", "tokens", "target_calls", "seconds", "log_ratio", "target_nll",
                   "mean_tv"]
BREAKS = ["truncate", "bad utf-8", "not an object", "deep", "garbage"]
COUNT = {"rows": 0}


def _mutations():
    field_value = st.sampled_from([(f, v) for f, vs in INVALID.items() for v in vs]).map(
        lambda fv: ("set", fv[0], fv[1]))
    deletion = st.sampled_from(REQUIRED_FIELDS).map(lambda f: ("delete", f, None))
    broken = st.sampled_from(BREAKS).map(lambda b: ("break", b, None))
    return st.one_of(field_value, deletion, broken)


@pytest.mark.slow
def test_fuzz_rows_and_sweep_directories(sweep, tmp_path_factory):
    """Mutated rows (types, values, encodings, truncations), one to three in a sweep's results file: the
    report, --resume's view (ResultsFile) and --reuse-from's (read_rows) each refuse every mutated row,
    name its line, keep every other row, and raise nothing else."""
    original = lines_of(sweep / "results.jsonl")
    counter = iter(range(10**9))

    @settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(st.integers(0, len(original) - 1), _mutations()), min_size=1, max_size=3,
                    unique_by=lambda m: m[0]))
    def run(mutations):
        COUNT["rows"] += 1
        out = tmp_path_factory.mktemp(f"fuzz{next(counter)}")
        for name in ("sweep.json", "steps.bin"):  # steps.bin: the rows' stored steps (stepstore)
            if (sweep / name).exists():
                shutil.copy(sweep / name, out / name)
        lines: list = [line.encode() for line in original]
        for index, (kind, what, value) in mutations:
            row = json.loads(original[index])
            if kind == "set":
                row[what] = value
                lines[index] = json.dumps(row).encode()
            elif kind == "delete":
                del row[what]
                lines[index] = json.dumps(row).encode()
            elif what == "truncate":
                lines[index] = lines[index][: len(lines[index]) // 2]
            elif what == "bad utf-8":
                lines[index] = lines[index][:20] + b"\xff\xfe" + lines[index][20:]
            elif what == "not an object":
                lines[index] = b"[" + lines[index] + b"]"
            elif what == "deep":
                lines[index] = b"[" * 50_000 + b"]" * 50_000
            else:
                lines[index] = b"\x00garbage{"
        (out / "results.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
        bad_lines = {index + 1 for index, _ in mutations}
        scan = scan_rows(out / "results.jsonl", check=lambda r: row_problem(r, 6))
        refused = set(scan.skipped_lines) | {line for line, _ in scan.invalid}
        assert refused == bad_lines, (mutations, scan.skipped, scan.invalid)
        assert len(scan.rows) == len(original) - len(bad_lines)
        with ResultsFile(out / "results.jsonl", 6) as store:
            assert len(store.done) == len(original) - len(bad_lines)
        assert len(read_rows(out / "results.jsonl", 6)) == len(original) - len(bad_lines)
        table, _ = write_report(out / "results.jsonl")
        for line in bad_lines:
            assert f"line(s) {line}" in table or f", {line}" in table, (mutations, table[-800:])

    run()
    assert COUNT["rows"] >= 100
