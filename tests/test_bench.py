"""The diagnostic framework: per-step shift, sweeps (kill + resume), the HTML report, suites and scorers
(the report's statistics: tests/test_report.py)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import results_row

from verispec.cli import main
from verispec.decode import DecodeConfig, speculative_decode
from verispec.diagnostics import kl, max_ratio, tail_mass, tv
from verispec.evaluation import load_results
from verispec.evaluation.report import write_report
from verispec.evaluation.summary import summarize
from verispec.evaluation.store import SAME_AS, SCHEMA_VERSION, ResultsFile, read_rows, read_runs, scan_rows
from verispec.models import load_drafter, load_model
from verispec.rules import parse
from verispec.sampling import SamplingConfig

TARGET = os.environ.get("VERISPEC_TEST_TARGET", "default")
DRAFT = os.environ.get("VERISPEC_TEST_DRAFT", "default-draft")
TIMING = {"seconds", "tokens_per_second", "target_seconds", "draft_seconds", "diagnostics_seconds",
          "batch_size", "chunk_size", "batch_seconds", "run"}  # "run": the sweep process that decoded it


@pytest.fixture(scope="module")
def pair():
    target = load_model(TARGET)
    return target, load_drafter(DRAFT, target)


@pytest.mark.parametrize("spec", ["lenience:l=0.5", "speccascade:min_p=0.2", "cos:w=0.5", "budget:tv=0.05",
                                  "sglang:single=0.5,acc=0.5", "lossless", "hsd"])
@pytest.mark.slow
def test_step_metrics_equal_offline_recomputation(pair, spec):
    target, drafter = pair
    rule = parse(spec)
    config = DecodeConfig(k=4, max_new_tokens=40, sampling=SamplingConfig(temperature=1.0), keep_probs=True,
                          stop_at_eos=False)
    gen = speculative_decode(target, drafter, target.encode("KING.\nWhat news?"), rule, config,
                             torch.Generator().manual_seed(4))
    f64 = lambda t: t.double() / t.double().sum(-1, keepdim=True)  # noqa: E731  (as the recorder does)
    p = f64(torch.cat(gen.probs["target"]))  # [n, V], the processed target at each emitted position
    laws, pos = [], 0
    for block, q in zip(gen.blocks, gen.probs["draft"]):
        m = q.shape[0]  # drafted positions kept from this block
        laws.append(rule.emitted(p[pos : pos + m], f64(q)))
        if block.emitted > m:  # the bonus position
            laws.append(rule._bonus(p[pos + m : pos + block.emitted]))
        pos += block.emitted
    law = torch.cat(laws)
    tokens = torch.tensor(gen.token_ids)
    steps = gen.steps
    torch.testing.assert_close(torch.tensor(steps["tv"], dtype=torch.float64), tv(law, p), rtol=0, atol=1e-9)
    torch.testing.assert_close(torch.tensor(steps["kl"], dtype=torch.float64), kl(law, p), rtol=0, atol=1e-9)
    torch.testing.assert_close(torch.tensor(steps["max_ratio"], dtype=torch.float64), max_ratio(law, p),
                               rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(torch.tensor(steps["tail_mass"], dtype=torch.float64), tail_mass(law, p),
                               rtol=0, atol=1e-9)
    llr = (law.gather(-1, tokens[:, None]).log() - p.gather(-1, tokens[:, None]).log()).sum().item()
    assert gen.log_ratio == pytest.approx(llr, abs=1e-6)
    if rule.lossless:
        assert gen.log_ratio == 0.0 and max(steps["tv"]) == 0.0
    else:
        assert gen.log_ratio != 0.0
    base = rule.baseline(p)
    if base is not None:
        torch.testing.assert_close(torch.tensor(steps["tv_baseline"], dtype=torch.float64), tv(law, base),
                                   rtol=0, atol=1e-9)


def bench_args(out: Path, *extra: str) -> list[str]:
    return ["bench", "--target", TARGET, "--draft", DRAFT, "--suite", "shakespeare", "--rules",
            "lenience:l=0.5", "speccascade:min_p=0.1", "--limit", "3", "--seeds", "0", "1",
            "--max-new-tokens", "16", "--out", str(out), "--no-progress", *extra]


def bench_cmd(out: Path, *extra: str) -> list[str]:
    """The real `python -m verispec bench ...` (for the tests that kill it or interrupt it)."""
    return [sys.executable, "-m", "verispec", *bench_args(out, *extra)]


@pytest.mark.slow
def test_sweep_results_do_not_depend_on_the_batch_size(tmp_path):
    """Rows decoded 4 at a time, or 2 at a time by continuous batching over work units of 6 rows
    (--chunk), equal rows decoded one by one: same units, same tokens, same acceptance;
    the per-step statistics agree to float rounding. Bound: the two runs' float32 logits differ only by
    the rounding of different GEMM shapes, a few float32 ulps of logits of size ~10, so a per-position
    log-probability or shift term moves by ~1e-6 on any CPU (AVX-512 or AVX2 kernels alike); allowed:
    1e-5 per position, i.e. 1e-5 on a per-token mean and n * 1e-5 on log_ratio, a sum over n tokens.
    (A relative 1e-5 on log_ratio failed on another CPU: 0.1161186 vs 0.1161169, 1.7e-6 absolute.)"""
    results = {}
    # in-process: the same code as the subprocess, without its start-up and model load; "2/6": work
    # units of all 6 rows decoded 2 at a time by continuous batching (--chunk)
    for size, extra in (("1", ()), ("4", ()), ("2/6", ("--chunk", "6"))):
        out = tmp_path / f"b{size.replace('/', '-')}"
        assert main(bench_args(out, "--batch-size", size.split("/")[0], "--no-report", *extra)) == 0
        results[size] = {r["unit"]: r for r in read_rows(out / "results.jsonl")}
    assert results["1"].keys() == results["4"].keys() == results["2/6"].keys()
    assert {r["batch_size"] for r in results["4"].values()} == {4, 2}  # 6 (prompt, seed) rows: 4 + 2
    assert {(r["batch_size"], r["chunk_size"]) for r in results["2/6"].values()} == {(2, 6)}
    for unit, one in results["1"].items():
        for other in (results["4"][unit], results["2/6"][unit]):
            assert one["token_ids"] == other["token_ids"], unit
            rates = one["acceptance_rate"], other["acceptance_rate"]
            assert rates[0] == rates[1] or rates[0] != rates[0], (unit, rates)
            n = len(one["token_ids"])
            bounds = {"mean_tv": 1e-5, "mean_kl": 1e-5, "target_nll": 1e-5, "log_ratio": n * 1e-5}
            for key, bound in bounds.items():
                a, b = one[key], other[key]
                assert abs(a - b) <= bound or (a != a and b != b), (unit, key, a, b)


def comparable(rows: list[dict]) -> dict:
    return {r["unit"]: {k: v for k, v in r.items() if k not in TIMING} for r in rows}


@pytest.mark.slow
def test_sweep_killed_and_resumed_equals_uninterrupted(tmp_path, capsys):
    """Batch size 1: every row decoded alone, so a resumed sweep must reproduce the rows exactly. The
    uninterrupted sweep runs in-process; the killed and the resumed ones are real `verispec bench`s."""
    full = tmp_path / "full"
    assert main(bench_args(full, "--batch-size", "1")) == 0
    assert "HTML report:" in capsys.readouterr().out
    expected = comparable(read_rows(full / "results.jsonl"))
    assert len(expected) == 3 * 2 * 5  # prompts x seeds x (plain, lossless, lenience, speccascade, honest)

    killed = tmp_path / "killed"
    for stop_after in (4, 13):  # kill twice, at different points, with SIGKILL
        proc = subprocess.Popen(bench_cmd(killed, "--batch-size", "1",
                                          *(["--resume"] if stop_after > 4 else [])),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while (time.time() < deadline and len(read_rows(killed / "results.jsonl")) < stop_after
               and proc.poll() is None):
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert len(read_rows(killed / "results.jsonl")) < len(expected)
    with open(killed / "results.jsonl", "a") as f:
        f.write('{"schema": 1, "unit": "partial')  # a row cut in the middle of its write
    resumed = subprocess.run(bench_cmd(killed, "--batch-size", "1", "--resume"), capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    rows = read_rows(killed / "results.jsonl")
    assert len(rows) == len({r["unit"] for r in rows}), "a unit was written twice"
    assert comparable(rows) == expected
    # each process marked its rows with its own run id (the report times a row only within its run):
    # the resume and the first process wrote rows; the second did unless the first passed 13 rows
    assert len({r["run"] for r in rows}) in (2, 3)
    assert len({r["run"] for r in read_rows(full / "results.jsonl")}) == 1
    # every process recorded its run and machine before decoding (runs.jsonl), the rows' runs among them
    runs = read_runs(killed / "results.jsonl")
    assert len(runs) in (2, 3) and {r["run"] for r in rows} <= set(runs)
    assert all(r["machine"]["cpu"] and r["executor"] == "local" and r["batch_size"] == 1
               for r in runs.values())
    # results load into pandas in one line
    frame = load_results(killed)
    assert len(frame) == len(expected) and {"config", "score", "mean_tv", "log_ratio"} <= set(frame.columns)
    # and the report covers every config
    table, html_path = write_report(killed)
    for config in {r["config"] for r in rows}:
        assert config in table


@pytest.mark.slow
@pytest.mark.parametrize("sig,status,word", [(signal.SIGINT, 130, "interrupted"),
                                             (signal.SIGTERM, 143, "terminated")])
def test_ctrl_c_stops_a_sweep_cleanly_and_resume_finishes_it(tmp_path, sig, status, word):
    """Ctrl-C (SIGINT) or `kill` (SIGTERM: a background sweep ignores SIGINT) on `bench`: exit 130 / 143
    with one line naming --resume, no traceback, finished rows kept."""
    out = tmp_path / "run"
    # the child gets SIGINT's default disposition: a shell starts background jobs (a CI script run with
    # `&`, nohup) with SIGINT ignored, children inherit that, and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen(bench_cmd(out, "--batch-size", "1", "--no-report"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 300
        while time.time() < deadline and len(read_rows(out / "results.jsonl")) < 2 and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()  # never leave a sweep running past the test
    assert proc.returncode == status, err
    assert f"verispec: {word}" in err and "--resume" in err and "Traceback" not in err, err
    kept = read_rows(out / "results.jsonl")
    assert 2 <= len(kept) < 30
    assert main(bench_args(out, "--batch-size", "1", "--no-report", "--resume")) == 0  # in-process
    rows = read_rows(out / "results.jsonl")
    assert len(rows) == 30 and len({r["unit"] for r in rows}) == 30 and rows[: len(kept)] == kept


def test_results_file_repairs_a_partial_line_and_never_duplicates(tmp_path):
    path = tmp_path / "results.jsonl"
    with ResultsFile(path) as store:
        store.append(results_row("a", x=1, schema=SCHEMA_VERSION))
        store.append(results_row("a", x=2, schema=SCHEMA_VERSION))
    with open(path, "a") as f:
        f.write(f'{{"schema": {SCHEMA_VERSION}, "unit": "b", "x"')
    with ResultsFile(path) as store:
        assert store.done == {"a"}
        store.append(results_row("b", x=3, schema=SCHEMA_VERSION))
    assert [r["unit"] for r in read_rows(path)] == ["a", "b"]
    assert path.read_text().count("\n") == 2
    path.write_text('{"schema": 99, "unit": "z"}\n')
    with pytest.raises(ValueError, match="schema"):
        ResultsFile(path)


@pytest.mark.slow
def test_sweep_refuses_to_overwrite_and_validates_rules(tmp_path):
    from verispec.evaluation.sweep import run_sweep
    from verispec.evaluation.units import SweepSpec

    with pytest.raises(ValueError, match="lenience"):
        run_sweep(SweepSpec(rules=("lenience:l=7",)), tmp_path / "x")
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "results.jsonl").write_text(f'{{"schema": {SCHEMA_VERSION}, "unit": "u"}}\n')
    with pytest.raises(FileExistsError, match="--resume"):
        run_sweep(SweepSpec(target=TARGET, draft=DRAFT), tmp_path / "y")


@pytest.mark.slow
def test_reuse_from_copies_the_units_another_sweep_decoded(tmp_path, capsys):
    """`--reuse-from`: the rows of a narrower sweep are copied, not decoded again (plain excepted: the
    speed reference is re-timed with the new rows), and the result equals decoding everything here."""
    from dataclasses import replace

    from verispec.evaluation.sweep import run_sweep
    from verispec.evaluation.units import SweepSpec

    narrow = SweepSpec(suite="shakespeare", target=TARGET, draft=DRAFT, rules=("lenience:l=0.5",), limit=2,
                       max_new_tokens=12)
    run_sweep(narrow, tmp_path / "a", progress=False, batch_size=2)
    a_rows = {r["unit"]: r for r in read_rows(tmp_path / "a" / "results.jsonl")}
    wide = replace(narrow, rules=("lenience:l=0.5", "cos:w=0.5"), limit=3)
    decoded: list[str] = []
    run_sweep(wide, tmp_path / "b", progress=False, batch_size=2, reuse_from=tmp_path / "a",
              on_row=lambda row, _: decoded.append(row["unit"]))
    b_rows = {r["unit"]: r for r in read_rows(tmp_path / "b" / "results.jsonl")}
    assert len(b_rows) == 3 * 4  # 3 prompts x (plain, lossless, lenience, cos)
    copied = {u for u, r in b_rows.items() if "reused_from" in r}
    assert copied == {u for u, r in a_rows.items() if r["rule"] != "plain"} and len(copied) == 2 * 2
    for unit in copied:
        row = dict(b_rows[unit])
        assert row.pop("reused_from") == str(tmp_path / "a")
        assert row == a_rows[unit]  # byte for byte, timings and batch size included
    assert sorted(decoded) == sorted(set(b_rows) - copied)  # the rest (plain everywhere) decoded here
    raw_b = {r["unit"]: r for r in scan_rows(tmp_path / "b" / "results.jsonl", resolve=False).rows}
    assert all(raw_b[u].get(SAME_AS) == "a" and "steps" not in raw_b[u] for u in copied)  # references
    # the copies are what this sweep would have decoded (same batches here: identical numerics)
    run_sweep(wide, tmp_path / "c", progress=False, batch_size=2)
    c_rows = read_rows(tmp_path / "c" / "results.jsonl")
    assert comparable([{k: v for k, v in r.items() if k != "reused_from"} for r in b_rows.values()]) == \
        comparable(c_rows)
    # the report says which rows were copied, and times only rows decoded beside their plain row
    table, _ = write_report(tmp_path / "b")
    assert f"4 row(s) copied from {tmp_path / 'a'} (--reuse-from)" in table
    summary = {s["rule"]: s for s in summarize(list(b_rows.values()))}
    new = {r["rule"]: r for r in b_rows.values() if r["prompt_index"] == 2}  # decoded here, at batch 1
    assert new["lossless"]["unit"] not in copied and new["plain"]["batch_size"] == 1
    expected = new["lossless"]["tokens"] / new["lossless"]["batch_seconds"] / (
        new["plain"]["tokens"] / new["plain"]["batch_seconds"])
    assert summary["lossless"]["speedup"] == pytest.approx(expected)
    assert summary["lossless"]["units"] == 3  # every other column counts the copies
    # several sources, the first holding a unit wins; a copy of a copy names the sweep that decoded it
    decoded.clear()
    run_sweep(wide, tmp_path / "g", progress=False, batch_size=2, reuse_from=[tmp_path / "b", tmp_path / "a"],
              on_row=lambda row, _: decoded.append(row["unit"]))
    g_rows = {r["unit"]: r for r in read_rows(tmp_path / "g" / "results.jsonl")}
    assert sorted(decoded) == sorted(u for u, r in g_rows.items() if r["rule"] == "plain")  # plain only
    assert {u: r["reused_from"] for u, r in g_rows.items() if r["rule"] != "plain"} == {
        u: str(tmp_path / ("a" if u in copied else "b")) for u, r in b_rows.items() if r["rule"] != "plain"}
    raw_g = {r["unit"]: r for r in scan_rows(tmp_path / "g" / "results.jsonl", resolve=False).rows}
    assert {u: raw_g[u][SAME_AS] for u in g_rows if g_rows[u]["rule"] != "plain"} == {
        u: "a" if u in copied else "b" for u, r in b_rows.items() if r["rule"] != "plain"}  # the holder
    # --reuse-plain copies plain rows too: only the units no source holds are decoded (the same rows as
    # decoding everything here); a row whose plain row was copied has no speedup, which the report says
    decoded.clear()
    run_sweep(wide, tmp_path / "h", progress=False, batch_size=2, reuse_from=tmp_path / "a", reuse_plain=True,
              on_row=lambda row, _: decoded.append(row["unit"]))
    h_rows = {r["unit"]: r for r in read_rows(tmp_path / "h" / "results.jsonl")}
    assert {u for u, r in h_rows.items() if "reused_from" in r} == set(a_rows)  # plain rows included
    assert sorted(decoded) == sorted(set(b_rows) - set(a_rows))
    assert comparable([{k: v for k, v in r.items() if k != "reused_from"} for r in h_rows.values()]) == \
        comparable(c_rows)
    h_summary = {s["rule"]: s for s in summarize(list(h_rows.values()))}
    cos = next(s for rule, s in h_summary.items() if rule.startswith("cos"))
    # prompts 0-1: plain copied from a; prompt 2 (not in a): plain decoded here, the speedup's one pair
    h_new = {r["rule"]: r for r in h_rows.values() if r["prompt_index"] == 2}
    assert cos["unpaired"] == 2 and "reused_from" not in h_new["plain"]
    assert cos["speedup"] == pytest.approx(
        h_new[cos["rule"]]["tokens"] / h_new[cos["rule"]]["batch_seconds"]
        / (h_new["plain"]["tokens"] / h_new["plain"]["batch_seconds"]))
    # runs.jsonl records a run only when it decodes: h's one run; its resume with nothing left and a
    # sweep whose every row is copied (from c, with plain) decode nothing and record nothing
    assert len(read_runs(tmp_path / "h" / "results.jsonl")) == 1
    # ... written before the run's first row: every row of a new sweep finds its run recorded
    recorded: list[int] = []
    run_sweep(narrow, tmp_path / "m", progress=False, batch_size=2,
              on_row=lambda row, _: recorded.append(len(read_runs(tmp_path / "m" / "results.jsonl"))))
    assert recorded == [1] * len(a_rows)  # the narrow sweep again: a's rows, each after the record
    run_sweep(wide, tmp_path / "h", resume=True, progress=False, batch_size=2)
    assert len(read_runs(tmp_path / "h" / "results.jsonl")) == 1
    run_sweep(wide, tmp_path / "k", progress=False, batch_size=2, reuse_from=tmp_path / "c", reuse_plain=True)
    assert len(read_rows(tmp_path / "k" / "results.jsonl")) == len(c_rows)
    assert not (tmp_path / "k" / "runs.jsonl").exists()
    # lossless: prompts 0-1 copied beside their copied plain rows (left out: their speedup is a's),
    # prompt 2 decoded here beside its plain row
    assert h_summary["lossless"]["unpaired"] == 0 and h_summary["lossless"]["reused"] == 2
    assert h_summary["lossless"]["speedup"] == pytest.approx(
        h_new["lossless"]["tokens"] / h_new["lossless"]["batch_seconds"]
        / (h_new["plain"]["tokens"] / h_new["plain"]["batch_seconds"]))
    h_table, _ = write_report(tmp_path / "h")
    assert "whose plain rows were copied by --reuse-plain), so its speedup is over the other 1" in h_table
    with pytest.raises(ValueError, match="copies plain rows from --reuse-from"):
        run_sweep(wide, tmp_path / "i", progress=False, reuse_plain=True)
    assert not (tmp_path / "i").exists()
    # other settings (here max_new_tokens) give other unit keys: nothing is copied
    other = replace(wide, max_new_tokens=10, limit=1)
    run_sweep(other, tmp_path / "d", progress=False, batch_size=2, reuse_from=tmp_path / "a")
    assert not any("reused_from" in r for r in read_rows(tmp_path / "d" / "results.jsonl"))
    # bad sources are refused before anything is written
    with pytest.raises(FileNotFoundError, match="no results file"):
        run_sweep(wide, tmp_path / "e", progress=False, reuse_from=tmp_path / "missing")
    assert not (tmp_path / "e").exists()
    with pytest.raises(ValueError, match="own output"):
        run_sweep(wide, tmp_path / "b", resume=True, progress=False, reuse_from=tmp_path / "b")
    assert read_rows(tmp_path / "b" / "results.jsonl") == list(b_rows.values())
    capsys.readouterr()
    assert main(bench_args(tmp_path / "f", "--reuse-from", str(tmp_path / "missing"))) == 2
    assert "no results file" in capsys.readouterr().err and not (tmp_path / "f").exists()


def console_messages(html_path: Path, tmp_path: Path) -> tuple[str, list[str]]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium); CI installs it")
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--enable-logging=stderr", "--v=0",
           "--dump-dom", html_path.as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout, [line for line in out.stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.slow
def test_html_report_renders_in_chromium_without_console_errors(tmp_path):
    rows = []
    for config, rule, fam in (("plain T=1", "plain", "plain"), ("lossless k=4 T=1", "lossless", "lossless"),
                              ("cos:w=0.5 k=4 T=1", "cos:w=0.5", "collaborative")):
        for prompt in ("a", "b", "c"):
            rows.append({
                "schema": SCHEMA_VERSION, "unit": config + prompt, "config": config, "rule": rule,
                "family": fam, "k": 0 if rule == "plain" else 4, "temperature": 1.0, "prompt_id": prompt,
                "seed": 0, "tokens": 10, "seconds": 0.1, "target_calls": 10 if rule == "plain" else 5,
                "proposed": 8, "accepted": 5,
                "log_ratio": 0.0 if fam != "collaborative" else 0.4, "mean_tv": 0.1,
                "target_nll": 3.0, "score": 0.5, "score_name": "distinct_2",
                "steps": {"role": ["accepted", "recovered"], "tv": [0.1, 0.2], "kl": [0.01, 0.02],
                          "tv_baseline": [None, None], "max_ratio": [1.5, 2.0], "tail_mass": [0.0, 0.01],
                          "draft_confidence": [0.9, 0.3], "draft_over_target": [3.0, 0.5]},
            })
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, html_path = write_report(tmp_path)
    dom, messages = console_messages(html_path, tmp_path)
    assert messages == []
    for config in ("plain T=1", "lossless k=4 T=1", "cos:w=0.5 k=4 T=1"):
        assert config in dom
    images = [re.split("['\"]", part)[0] for part in dom.split("data:image/png;base64,")[1:]]
    # the speed-vs-shift plot leads the report, then the three plots of its sections
    assert len(images) == 4 and all(base64.b64decode(img)[:8] == b"\x89PNG\r\n\x1a\n" for img in images)
    # the check can fail: a page with a script error is caught
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>undefinedFunction()</script></body></html>")
    assert console_messages(bad, tmp_path)[1]

