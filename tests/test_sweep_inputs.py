"""No silent wrong results, round two (issue 26), outside the server: exact unit keys, output paths,
data files (unique ids, line-numbered errors, a changed file refused on resume), the report on rows with
no finite score or of the wrong types, and spec parsing (deep nesting, digit separators)."""

from __future__ import annotations

import itertools
import json
import lzma
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from verispec.api import check_device
from verispec.cli import main
from verispec.evaluation.report import usable_rows, write_report
from verispec.evaluation.summary import summarize
from verispec.evaluation.store import read_rows, sealed_file
from verispec.evaluation.suites import Item, load_suite
from verispec.evaluation.sweep import run_sweep
from verispec.evaluation.units import RunConfig, SweepSpec, exact_number, unit_key
from verispec.rules import parse

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--rules", "lossless", "--seeds", "0", "--limit", "1", "--max-new-tokens", "4", "--no-progress",
         "--no-report"]


def cli_error(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("verispec: error:") and "Traceback" not in err, err
    return err


# --- unit keys -------------------------------------------------------------------------------------

def test_temperatures_that_differ_are_different_units():
    a, b = RunConfig("lossless", 4, 1.0), RunConfig("lossless", 4, 1.0000001)
    assert a.id == "lossless k=4 T=1" and b.id == "lossless k=4 T=1.0000001"
    spec, item = SweepSpec(), Item("p", "text")
    assert unit_key(spec, item, 0, a) != unit_key(spec, item, 0, b)
    for value in (0.0, 0.7, 1.0, 2.5, 1e-7, 0.1 + 0.2, 1 / 3, 5e-324, 1.7976931348623157e308):
        assert float(exact_number(value)) == value  # every float round-trips


def test_committed_rows_keep_their_unit_keys():
    """The keys of every committed sweep's rows are what this release computes: --resume and
    --reuse-from still recognise them (their temperatures are exact in 6 digits, so `id` = `legacy_id`)."""
    names = {f.name for f in fields(SweepSpec)}
    checked = 0
    for spec_path in sorted((REPO / "study" / "sweeps").glob("*/sweep.json")):
        settings = json.loads(spec_path.read_text())
        spec = SweepSpec(**{k: tuple(v) if isinstance(v, list) else v
                            for k, v in settings.items() if k in names})
        plain = spec_path.parent / "results.jsonl"
        sealed = sealed_file(plain)  # a finished sweep's rows are compressed (store.seal_rows)
        with (lzma.open(sealed, "rt") if sealed.exists() and not plain.exists() else open(plain)) as lines:
            rows = [json.loads(line) for line in itertools.islice(lines, 50)]  # not all of them parsed
        # a reference (store, `same_as`) stands for its holder's row of the same unit, checked there
        for row in (r for r in rows if "same_as" not in r):
            config = RunConfig(row["rule"], row["k"], row["temperature"])
            assert config.id == row["config"]
            assert unit_key(spec, Item(row["prompt_id"], ""), row["seed"], config) == row["unit"]
            checked += 1
    if not checked:
        pytest.skip("no committed sweeps")


@pytest.mark.slow
def test_bench_keeps_both_close_temperatures(tmp_path):
    out = tmp_path / "t"
    assert main(["bench", "--suite", "shakespeare", *SMALL, "--temperatures", "1.0", "1.0000001",
                 "--out", str(out)]) == 0
    rows = read_rows(out / "results.jsonl")
    assert len(rows) == 4  # plain and lossless at each temperature (`:g` made it 2)
    assert {r["temperature"] for r in rows} == {1.0, 1.0000001}


def test_resume_refuses_rows_keyed_by_a_rounded_temperature(tmp_path, capsys):
    out = tmp_path / "old"
    out.mkdir()
    (out / "sweep.json").write_text("{}")
    row = {"schema": 2, "unit": "0123456789abcdef", "config": "lossless k=4 T=0.123457", "prompt_id": "x"}
    (out / "results.jsonl").write_text(json.dumps(row) + "\n")
    err = cli_error(capsys, ["bench", "--suite", "shakespeare", *SMALL, "--temperatures", "0.123456789",
                             "--out", str(out), "--resume"])
    assert "rounded the temperature" in err and "0.123456789" in err


# --- output paths ----------------------------------------------------------------------------------

def test_bad_out_paths_are_refused_before_anything_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = cli_error(capsys, ["bench", "--suite", "shakespeare", *SMALL, "--out", ""])
    assert "empty path" in err
    assert list(tmp_path.iterdir()) == []  # nothing written into the current directory
    a_file = tmp_path / "file.txt"
    a_file.write_text("not a directory")
    assert "is a file" in cli_error(capsys, ["bench", "--suite", "shakespeare", *SMALL, "--out", str(a_file)])
    under = cli_error(capsys, ["bench", "--suite", "shakespeare", *SMALL, "--out", str(a_file / "sub")])
    assert "is a file" in under
    unusable = "/proc/verispec-out"  # /proc takes no new directories, even from root
    assert unusable in cli_error(capsys, ["bench", "--suite", "shakespeare", *SMALL, "--out", unusable])


# --- data files ------------------------------------------------------------------------------------

def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_duplicate_ids_are_named_with_their_lines(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"id": "a", "question": "1+1?", "answer": "2"},
                                              {"id": "b", "question": "2+2?", "answer": "4"},
                                              {"id": "a", "question": "3+3?", "answer": "6"}])
    with pytest.raises(ValueError, match=r"id 'a' on lines 1, 3"):
        load_suite(f"gsm8k:{path}")
    # an explicit id equal to another row's default (its index) is a duplicate too
    path = write_jsonl(tmp_path / "h.jsonl", [{"question": "1+1?", "answer": "2"},
                                              {"id": "0", "question": "2+2?", "answer": "4"}])
    with pytest.raises(ValueError, match=r"id '0' on lines 1, 2"):
        load_suite(f"gsm8k:{path}")


def test_a_bad_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "1+1?", "answer": "2"}, "{not json"])
    with pytest.raises(ValueError, match=r"g\.jsonl, line 2: not valid JSON"):
        load_suite(f"gsm8k:{path}")
    path = write_jsonl(tmp_path / "m.jsonl", [[1, 2]])
    with pytest.raises(ValueError, match=r"m\.jsonl, line 1: expected a JSON object, got list"):
        load_suite(f"mbpp:{path}")


def gsm8k_rows(n: int, edit: int | None = None) -> list[dict]:
    return [{"id": f"q{i}", "question": f"What is {i} + {i}?" + (" Think." if i == edit else ""),
             "answer": f"#### {2 * i}"} for i in range(n)]


@pytest.mark.slow
def test_a_changed_data_file_is_refused_on_resume(tmp_path, capsys):
    data = write_jsonl(tmp_path / "g.jsonl", gsm8k_rows(2))
    out = tmp_path / "s"
    argv = ["bench", "--suite", f"gsm8k:{data}", "--rules", "lossless", "--seeds", "0", "--max-new-tokens",
            "4", "--no-progress", "--no-report", "--out", str(out)]
    assert main(argv) == 0
    recorded = json.loads((out / "sweep.json").read_text())["suite_file"]
    assert set(recorded["items"]) == {"q0", "q1"} and len(recorded["sha256"]) == 64
    assert main([*argv, "--resume"]) == 0  # unchanged: resumes (nothing left to do)
    write_jsonl(data, gsm8k_rows(3, edit=1))  # question q1 edited, q2 added
    capsys.readouterr()
    err = cli_error(capsys, [*argv, "--resume"])
    assert "changed since this sweep began" in err and "'q2'" in err and "added" in err
    assert "edited ('q1')" in err
    assert len(read_rows(out / "results.jsonl")) == 4  # nothing written


@pytest.mark.slow
def test_reuse_from_skips_edited_questions(tmp_path):
    data = write_jsonl(tmp_path / "g.jsonl", gsm8k_rows(2))
    common = ["--rules", "lossless", "--seeds", "0", "--max-new-tokens", "4", "--no-progress", "--no-report"]
    assert main(["bench", "--suite", f"gsm8k:{data}", *common, "--out", str(tmp_path / "a")]) == 0
    edited = write_jsonl(tmp_path / "g2.jsonl", gsm8k_rows(2, edit=1))
    edited.replace(data)  # the same path, q1 edited
    assert main(["bench", "--suite", f"gsm8k:{data}", *common, "--out", str(tmp_path / "b"),
                 "--reuse-from", str(tmp_path / "a")]) == 0
    rows = read_rows(tmp_path / "b" / "results.jsonl")
    copied = {(r["prompt_id"], r["config"]) for r in rows if "reused_from" in r}
    assert copied == {("q0", "lossless k=4 T=1")}  # q1's row was decoded again, plain is never copied


# --- the report ------------------------------------------------------------------------------------

def report_row(config: str, rule: str, prompt: str, score, extra: dict | None = None) -> dict:
    row = {"schema": 2, "unit": f"{config}/{prompt}", "config": config, "rule": rule,
           "family": "plain" if rule == "plain" else "lossless", "k": 0 if rule == "plain" else 4,
           "temperature": 1.0, "prompt_id": prompt, "seed": 0, "score_name": "exact_match", "score": score,
           "proposed": 4, "accepted": 2, "tokens": 4, "target_calls": 4 if rule == "plain" else 2,
           "seconds": 1.0, "log_ratio": 0.0,
           "target_nll": 1.0, "mean_tv": 0.0,
           "steps": {"tv": [0.0, 0.0], "role": ["accepted", "bonus"], "draft_confidence": [0.9, 0.0],
                     "draft_over_target": [1.0, 0.0]}}
    return {**row, **(extra or {})}


def test_report_names_rows_without_a_finite_score(tmp_path):
    rows = [report_row("plain T=1", "plain", p, 1.0) for p in "abc"]
    rows += [report_row("lossless k=4 T=1", "lossless", "a", 1.0),
             report_row("lossless k=4 T=1", "lossless", "b", float("nan")),
             report_row("lossless k=4 T=1", "lossless", "c", "high")]
    path = write_jsonl(tmp_path / "results.jsonl", [json.dumps(r) for r in rows])
    table, _ = write_report(path)
    assert "1 row(s) have no finite score" in table  # NaN: a missing score, left out and named
    assert "lossless k=4 T=1 / b (seed 0): nan" in table
    assert "score 'high' is not a number" in table and "line(s) 6" in table  # a string: an invalid row
    assert "n=1 of 2" in table
    lossless = [s for s in summarize(rows) if s["config"] == "lossless k=4 T=1"][0]
    assert lossless["scored"] == 1 and lossless["paired_units"] == 1 and lossless["score"] == 1.0


@pytest.mark.parametrize("bad,field", [({"config": None}, "config"),
                                       ({"steps": {"tv": "abc", "role": 5}}, "steps.tv, steps.role"),
                                       ({"steps": [1, 2]}, "steps"), ({"metrics": [1]}, "metrics"),
                                       ({"steps": {"tv": [0.1], "role": ["accepted", "bonus"]}}, "lengths"),
                                       ({"steps": {"tv": [0.1], "role": ["bonus"]}}, "steps without"),
                                       ({"seed": [0]}, "seed"), ({"batch_seconds": "x"}, "batch_seconds"),
                                       ({"unit": {"a": 1}}, "unit")])
def test_report_skips_malformed_rows_naming_the_field(tmp_path, bad, field):
    rows = [report_row("plain T=1", "plain", "a", 1.0), report_row("lossless k=4 T=1", "lossless", "a", 1.0),
            report_row("lossless k=4 T=1", "lossless", "b", 0.0, bad)]
    kept, notes = usable_rows(tmp_path / "r.jsonl", rows, [1, 2, 3])
    assert len(kept) == 2 and len(notes) == 1 and field in notes[0] and "line(s) 3" in notes[0]
    path = write_jsonl(tmp_path / "results.jsonl", [json.dumps(r) for r in rows])
    table, _ = write_report(path)  # no traceback: the row is skipped and named
    assert field in table


# --- spec parsing and the device check -------------------------------------------------------------

def test_deeply_nested_honest_is_a_value_error(capsys):
    deep = "honest:" * 1000 + "speccascade:min_p=0.1"
    with pytest.raises(ValueError, match="not another honest rule"):
        parse(deep)
    assert "not another honest rule" in cli_error(capsys, ["run", "--prompt", "To be", "--rule", deep])
    assert parse("honest:speccascade:min_p=0.1").spec == "honest:speccascade:min_p=0.1,resample=target"


@pytest.mark.parametrize("spec", ["lenience:l=0_5", "topk:k=1_0", "cos:w=0_9", "lenience:l=١", "topk:k=0x10",
                                  "lenience:l=nan", "lenience:l=.5.", "lenience:l=1e"])
def test_numbers_are_plain_decimals(spec):
    with pytest.raises(ValueError, match="not a plain decimal number"):
        parse(spec)


def test_plain_decimals_still_parse():
    assert parse("lenience:l=0.5").spec == parse("lenience:l=5e-1").spec == parse("lenience:l=+.5").spec
    assert parse("topk:k=3.0").spec.startswith("topk:k=3,")
    with pytest.raises(ValueError, match="digit separators"):
        parse("lenience:l=0_5")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_one_device_check_for_run_bench_and_the_server():
    """`verispec.api.check_device` is the one check (run, bench and the server call it)."""
    with pytest.raises(ValueError, match="not available") as direct:
        check_device("cuda")
    with pytest.raises(ValueError) as sweep:
        SweepSpec(device="cuda").validate()
    assert str(sweep.value) == str(direct.value)


def test_run_sweep_checks_out_before_the_spec(tmp_path):
    with pytest.raises(ValueError, match="empty path"):
        run_sweep(SweepSpec(device="no-such-device"), "", progress=False)


@pytest.mark.parametrize("chunk", [0, 3, True, 4.5, "8"])
def test_a_chunk_smaller_than_the_batch_or_not_an_integer_is_refused(tmp_path, chunk):
    """--chunk holds the rows of a work unit, decoded --batch-size at a time: refused before anything
    is created when it is not an integer >= the batch size."""
    with pytest.raises(ValueError, match="chunk must be an integer >= batch_size"):
        run_sweep(SweepSpec(), tmp_path / "out", progress=False, batch_size=4, chunk=chunk)
    assert not (tmp_path / "out").exists()
