"""Sealed sweeps (`store.seal_rows`): a finished sweep's results.jsonl compressed into results.jsonl.xz and
its steps packed into one steps-<crc32>.bin.xz read the same everywhere (rows, references into it, the
report), are read-only until unsealed, and a damaged, oversized, missing or half-written file gives a
clear answer, never a wrong row."""

from __future__ import annotations

import json
import lzma
import shutil
from pathlib import Path

import pytest

from helpers import REPO, load_script, results_row
from verispec.cli import main
from verispec.evaluation.report import write_report
from verispec.evaluation.stepstore import PACK_NAME, STEPS_FILE
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
    with pytest.raises(ValueError, match="sealed"):  # half-sealed: not appendable either
        ResultsFile(path)
    seal_rows(path)
    assert not path.exists() and read_sealed(sealed_file(path)) == data
    sealed_file(path).write_bytes(lzma.compress(b"other rows\n"))  # an interrupted seal, then unsealed:
    path.write_bytes(data)  # the plain rows (the ones read) are kept, the sealed file goes
    unseal_rows(path)
    assert path.read_bytes() == data and not sealed_file(path).exists()


def test_sealing_a_committed_sweep_keeps_its_report(tmp_path):
    """The conversion the committed sweeps went through: compact, seal; the report reads the same."""
    source = REPO / "study" / "sweeps" / "qwen-mtbench-pilot"
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
    assert len(packs(sweep)) == 1 and not (sweep / STEPS_FILE).exists()
    with pytest.raises(ValueError, match="sealed"):  # sealed rows are changed only by sealing again
        load_script("compact_steps").compact(sweep, check=False)
    load_script("compact_steps").compact(sweep, check=False, seal=True)  # packed again: the same
    assert write_report(sweep, html_path=tmp_path / "c.html", markdown=True)[0] == before


STEPS = {"role": ["accepted", "bonus", "recovered", "accepted"], "tv": [0.0, 0.125, float("nan"), 1.0],
         "kl": [float("inf"), 1e-9, 2.5, 0.0], "log_target": [-0.1, -12.75, -1e-30, -3.0]}


def packs(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if PACK_NAME.fullmatch(p.name))


def test_sealing_packs_the_steps_into_one_file_and_every_row_reads_the_same(tmp_path):
    path = tmp_path / "s" / "results.jsonl"
    with ResultsFile(path) as store:  # steps and token ids in steps.bin, one record each
        for i in range(6):
            store.append(results_row(f"u{i}", steps=STEPS, token_ids=[1, 2, 3, i]))
    rows = read_rows(path)
    seal_rows(path)
    [pack] = packs(path.parent)
    assert not (path.parent / STEPS_FILE).exists() and not path.exists()
    assert json.dumps(read_rows(path)) == json.dumps(rows)  # NaN and infinities included
    raw = scan_rows(path, resolve=False).rows
    assert {r["steps"]["stored"] for r in raw} == {pack} == {r["token_ids"]["stored"] for r in raw}
    # unsealed, a row is added (its steps go to steps.bin), sealed again: one new pack holds them all
    unseal_rows(path)
    with ResultsFile(path) as store:
        store.append(results_row("u6", steps=STEPS, token_ids=[7]))
    rows = read_rows(path)
    seal_rows(path)
    assert packs(path.parent) != [pack] and len(packs(path.parent)) == 1
    assert not (path.parent / STEPS_FILE).exists()
    assert json.dumps(read_rows(path)) == json.dumps(rows)
    seal_rows(path)  # a sealed sweep sealed again: the same pack (same content, same name)
    assert json.dumps(read_rows(path)) == json.dumps(rows) and len(packs(path.parent)) == 1


def test_a_damaged_or_missing_pack_makes_its_rows_invalid_not_wrong(tmp_path):
    path = tmp_path / "s" / "results.jsonl"
    with ResultsFile(path) as store:
        store.append(results_row("u0"))
        store.append(results_row("u1", steps=STEPS))
    seal_rows(path)
    [pack] = packs(path.parent)
    data = (path.parent / pack).read_bytes()
    (path.parent / pack).write_bytes(data[:-20])
    scan = scan_rows(path)
    assert [r["unit"] for r in scan.rows] == ["u0"] and "damaged" in scan.invalid[0][1]
    (path.parent / pack).unlink()
    assert "does not exist" in scan_rows(path).invalid[0][1]
    raw = scan_rows(path, resolve=False).rows[1]
    bad = {**raw, "steps": {**raw["steps"], "stored": "../elsewhere.bin.xz"}}
    (path.parent / "results.jsonl").write_text(strict_json(bad) + "\n")  # a plain file is read first
    assert "not steps.bin or a packed steps file" in scan_rows(path).invalid[0][1]


def test_an_interrupted_pack_leaves_the_rows_reading_from_the_old_steps(tmp_path):
    """A pack written beside the old steps.bin before the rows were replaced (a kill in between): the rows
    still point at steps.bin and read as before; sealing again finishes and removes the orphan."""
    path = tmp_path / "s" / "results.jsonl"
    with ResultsFile(path) as store:
        store.append(results_row("u1", steps=STEPS))
    rows = read_rows(path)
    (path.parent / "steps-0badf00d.bin.xz").write_bytes(lzma.compress(b"not rows"))
    assert json.dumps(read_rows(path)) == json.dumps(rows)
    seal_rows(path)
    assert "steps-0badf00d.bin.xz" not in packs(path.parent) and len(packs(path.parent)) == 1
    assert json.dumps(read_rows(path)) == json.dumps(rows)


def test_steps_false_resolves_references_and_leaves_steps_stored(tmp_path):
    """`scan_rows(steps=False)`: references resolved (their source's steps not read), stored steps left as
    pointers; the same rows otherwise."""
    write(tmp_path / "a" / "results.jsonl", [])
    with ResultsFile(tmp_path / "a" / "results.jsonl") as store:
        store.append(results_row("u1", steps=STEPS, text="hi"))
    mine = write(tmp_path / "b" / "results.jsonl", [{"schema": 2, "unit": "u1", SAME_AS: "a", "run": "r"}])
    seal_rows(tmp_path / "a" / "results.jsonl")
    light, full = scan_rows(mine, steps=False).rows, scan_rows(mine).rows
    assert light[0]["text"] == "hi" == full[0]["text"] and light[0]["run"] == "r"
    assert light[0]["steps"]["stored"] in packs(tmp_path / "a") and full[0]["steps"]["role"] == STEPS["role"]
    assert ({k: v for k, v in light[0].items() if k != "steps"}
            == {k: v for k, v in full[0].items() if k != "steps"})
