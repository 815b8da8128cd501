"""Sealed rows (`store.seal_rows`): a finished sweep's results.jsonl compressed into results.jsonl.xz reads
the same everywhere (rows, references into it, the report), is read-only until unsealed, and a damaged,
oversized or half-sealed file gives a clear answer, never a wrong row."""

from __future__ import annotations

import json
import lzma
import shutil
from pathlib import Path

import pytest

from helpers import REPO, load_script, results_row
from verispec.cli import main
from verispec.evaluation.report import write_report
from verispec.evaluation.store import (SAME_AS, ResultsFile, has_rows, read_rows, read_sealed, results_file,
                                       scan_rows, seal_rows, sealed_file, strict_json, unseal_rows)


def write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(strict_json(r) + "\n" for r in rows))
    return path


def test_seal_and_unseal_round_trip_bytes_and_rows(tmp_path):
    path = write(tmp_path / "s" / "results.jsonl",
                 [results_row("u1"), results_row("u2", mean_tv=float("nan"))])
    data, rows = path.read_bytes(), read_rows(path)
    sealed = seal_rows(path)
    assert sealed == sealed_file(path) and sealed.name == "results.jsonl.xz"
    assert not path.exists() and has_rows(path)
    assert lzma.decompress(sealed.read_bytes()) == data  # a plain .xz: `xzcat` reads it
    after = read_rows(path)
    assert json.dumps(after) == json.dumps(rows)  # NaN included
    assert results_file(sealed) == path and results_file(tmp_path / "s") == path
    unseal_rows(path)
    assert path.read_bytes() == data and not sealed.exists()


def test_a_sealed_sweep_is_read_only_until_unsealed(tmp_path):
    path = write(tmp_path / "s" / "results.jsonl", [results_row("u1")])
    seal_rows(path)
    with pytest.raises(ValueError, match="sealed .*--unseal"):
        ResultsFile(path)
    assert not path.exists()  # the refusal wrote nothing
    unseal_rows(path)
    with ResultsFile(path) as store:
        assert store.done == {"u1"}
        store.append(results_row("u2"))
    assert [r["unit"] for r in read_rows(path)] == ["u1", "u2"]


def test_a_sealed_sweep_refuses_resume_before_loading_models(tmp_path, capsys):
    out = tmp_path / "s"
    write(out / "results.jsonl", [results_row("u1")])
    (out / "sweep.json").write_text("{}")
    seal_rows(out / "results.jsonl")
    code = main(["bench", "--suite", "shakespeare", "--rules", "lossless", "--seeds", "0", "--limit", "1",
                 "--max-new-tokens", "4", "--no-progress", "--no-report", "--resume", "--out", str(out)])
    assert code == 2 and "sealed" in capsys.readouterr().err
    assert not (out / "results.jsonl").exists()


def test_references_into_a_sealed_sibling_resolve(tmp_path):
    source = results_row("u1", text="hello")
    write(tmp_path / "a" / "results.jsonl", [source])
    mine = write(tmp_path / "b" / "results.jsonl", [{"schema": 2, "unit": "u1", SAME_AS: "a", "run": "r"}])
    seal_rows(tmp_path / "a" / "results.jsonl")
    (tmp_path / "b" / "sweep.json").write_text("{}")
    assert load_script("compact_steps").compact(tmp_path / "b", check=False, seal=True)[:2] == (1, 0)
    assert not (tmp_path / "b" / "steps.bin").exists()  # references alone: nothing to move
    assert read_rows(mine) == [{**source, "run": "r"}]


def test_damaged_truncated_or_oversized_sealed_rows_are_refused_with_the_path(tmp_path):
    path = write(tmp_path / "s" / "results.jsonl", [results_row(f"u{i}") for i in range(50)])
    sealed = seal_rows(path)
    packed = sealed.read_bytes()
    sealed.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(ValueError, match="results.jsonl.xz is damaged"):
        scan_rows(path)
    sealed.write_bytes(packed + b"junk")
    with pytest.raises(ValueError, match="damaged"):
        scan_rows(path)
    sealed.write_bytes(lzma.compress(b"\n" * 5000))  # 5 KB of text from a few bytes, over the limit below
    with pytest.raises(ValueError, match="more than 1,000 bytes"):
        read_sealed(sealed, max_bytes=1000)


def test_an_interrupted_seal_reads_the_plain_rows_and_sealing_again_finishes(tmp_path):
    path = write(tmp_path / "s" / "results.jsonl", [results_row("u1")])
    data = path.read_bytes()
    sealed_file(path).write_bytes(lzma.compress(data))  # the sealed file renamed in, the plain one still here
    assert [r["unit"] for r in read_rows(path)] == ["u1"]
    seal_rows(path)
    assert not path.exists() and read_sealed(sealed_file(path)) == data


def test_sealing_a_committed_sweep_keeps_its_report(tmp_path):
    """The conversion the committed sweeps went through: compact, seal; the report reads the same."""
    source = REPO / "benchmarks" / "sweeps" / "qwen-mtbench-pilot"
    if not has_rows(source / "results.jsonl"):
        pytest.skip("the committed sweep is not in this checkout")
    sweep = tmp_path / "qwen-mtbench-pilot"
    shutil.copytree(source, sweep)
    if sealed_file(sweep / "results.jsonl").exists():
        unseal_rows(sweep / "results.jsonl")
    before = write_report(sweep, html_path=tmp_path / "a.html", markdown=True)[0]
    rows, moved, saved = load_script("compact_steps").compact(sweep, check=False, seal=True)
    assert rows == 32 and saved > 0 and not (sweep / "results.jsonl").exists()
    assert write_report(sweep, html_path=tmp_path / "b.html", markdown=True)[0] == before
    with pytest.raises(ValueError, match="sealed"):
        load_script("compact_steps").compact(sweep, check=False, seal=True)
