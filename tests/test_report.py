"""The report's statistics and summary: baselines and flags, Wilson / Newcombe intervals, McNemar's
exact test, t quantiles, percentiles, sequence KL, unit-set and timeout notes, speedup pairing
(docs/design.md, 'Words'). Pure functions on hand-made rows: no model is loaded."""

from __future__ import annotations

import calendar
import math
import time

import pytest

from verispec.evaluation.report import machine_notes, pace_note, planned_configs, terminal_table
from verispec.evaluation.summary import summarize
from verispec.evaluation.store import read_runs, run_started
from verispec.evaluation.sweep import new_run_id
from verispec.machine import cpu_model_and_flags, describe
from verispec.rules import parse


def test_report_flags_and_baselines():
    rows = []
    for prompt in range(6):
        for config, rule, score in (("lossless k=4 T=1", "lossless", 1.0),
                                    ("cos:w=0.9 k=4 T=1", "cos:w=0.9", 0.0),
                                    ("topk:k=2,resample=target k=4 T=1", "topk:k=2", 0.9),
                                    ("honest:topk:k=2,resample=target k=4 T=1", "honest:topk:k=2",
                                     0.9 + 0.01 * prompt)):
            rows.append({"unit": f"{config}{prompt}", "config": config, "rule": parse(rule).spec,
                         "family": "x", "k": 4, "temperature": 1.0, "prompt_id": str(prompt), "seed": 0,
                         "tokens": 10, "seconds": 1.0, "target_calls": 4, "proposed": 8, "accepted": 6,
                         "log_ratio": 0.1 * prompt, "mean_tv": 0.1, "target_nll": 2.0,
                         "score": score + (0.001 * prompt if rule == "cos:w=0.9" else 0),
                         "score_name": "exact_match", "steps": {}})
    summary = {s["config"]: s for s in summarize(rows)}
    assert summary["cos:w=0.9 k=4 T=1"]["baseline"] == "lossless k=4 T=1"
    assert summary["cos:w=0.9 k=4 T=1"]["flag"] == "WORSE"
    assert (summary["topk:k=2,resample=target k=4 T=1"]["baseline"]
            == "honest:topk:k=2,resample=target k=4 T=1")
    assert summary["topk:k=2,resample=target k=4 T=1"]["score_diff"] < 0
    assert summary["lossless k=4 T=1"]["flag"] == ""
    assert summary["honest:topk:k=2,resample=target k=4 T=1"]["baseline"] is None  # a baseline itself
    assert summary["lossless k=4 T=1"]["acceptance_rate"] == pytest.approx(0.75)
    assert summary["lossless k=4 T=1"]["block_efficiency"] == pytest.approx(2.5)
    assert summary["cos:w=0.9 k=4 T=1"]["seq_kl"] == pytest.approx(0.25)
    assert math.isfinite(summary["cos:w=0.9 k=4 T=1"]["seq_kl_ci"])


def test_binary_score_intervals_and_mcnemar():
    """Wilson's interval and McNemar's exact test against scipy, and their use in the summary."""
    from scipy.stats import binomtest

    from verispec.evaluation.stats import mcnemar_exact, wilson_interval

    for k, n in ((0, 10), (45, 100), (164, 164), (7, 20)):
        want = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert wilson_interval(k, n) == pytest.approx((want.low, want.high), abs=1e-6)
    # the interval holds its proportion exactly, also where centre - half cancels to rounding (0 of 75
    # gave a lower bound of 3.5e-18 and a negative error bar in the report's plot)
    assert wilson_interval(0, 75)[0] == 0.0 and wilson_interval(4, 4)[1] == 1.0
    assert all(wilson_interval(k, n)[0] <= k / n <= wilson_interval(k, n)[1]
               for n in range(1, 200) for k in range(n + 1))
    for better, worse in ((0, 6), (1, 9), (5, 5), (3, 12), (0, 0)):
        want = binomtest(better, better + worse, 0.5).pvalue if better + worse else 1.0
        assert mcnemar_exact(better, worse) == pytest.approx(want, rel=1e-9)
    # 12 prompts: the rule fails where its baseline passes on 8, wins on none -> WORSE (p = 2/256)
    rows = []
    for prompt in range(12):
        for config, rule, score in (("lossless k=4 T=1", "lossless", 1.0),
                                    ("cos:w=0.9 k=4 T=1", "cos:w=0.9", float(prompt >= 8))):
            rows.append({"unit": f"{config}{prompt}", "config": config, "rule": parse(rule).spec,
                         "family": "x", "k": 4, "temperature": 1.0, "prompt_id": str(prompt), "seed": 0,
                         "tokens": 10, "seconds": 1.0, "target_calls": 4, "proposed": 8, "accepted": 6,
                         "log_ratio": 0.1, "mean_tv": 0.1, "target_nll": 2.0, "score": score,
                         "score_name": "pass_at_1", "steps": {}})
    summary = {s["config"]: s for s in summarize(rows)}
    cos = summary["cos:w=0.9 k=4 T=1"]
    assert cos["binary_score"] and cos["discordant"] == (0, 8)
    assert cos["p_value"] == pytest.approx(2 / 256) and cos["flag"] == "WORSE"
    assert cos["score_interval"] == pytest.approx(wilson_interval(4, 12))
    from verispec.evaluation.report import terminal_table

    text = terminal_table(list(summary.values()))
    assert "0.333 [0.14, 0.61]" in text and "0.00781 (+0/-8)" in text
    markdown = terminal_table(list(summary.values()), markdown=True).splitlines()  # `report --markdown`
    assert markdown[0].startswith("| config | n | accept |") and markdown[1].startswith("|---|")
    assert markdown[3].startswith("| cos:w=0.9 k=4 T=1 |") and "| 0.333 [0.14, 0.61] |" in markdown[3]
    assert len(markdown) == 2 + 2 + 2  # header, rule, 2 rows, blank line, legend
    # `report --columns`: the named columns in the given order, the same cells
    narrow = terminal_table(list(summary.values()), markdown=True, columns=["config", "score", "McNemar p"])
    assert narrow.splitlines()[0] == "| config | score | McNemar p |"
    assert narrow.splitlines()[3] == "| cos:w=0.9 k=4 T=1 | 0.333 [0.14, 0.61] | 0.00781 (+0/-8) |"
    with pytest.raises(ValueError, match=r"unknown report column\(s\) 'pass@1'; the columns are: config, n,"):
        terminal_table(list(summary.values()), columns=["config", "pass@1"])
    # 3 of 12 discordant: a negative difference that is not significant is not flagged
    for row in rows:
        if row["config"].startswith("cos") and int(row["prompt_id"]) >= 3:
            row["score"] = 1.0
    cos = {s["config"]: s for s in summarize(rows)}["cos:w=0.9 k=4 T=1"]
    assert cos["discordant"] == (0, 3) and cos["p_value"] == pytest.approx(0.25) and cos["flag"] == ""
    assert cos["score_diff_interval"][0] < -0.25 < cos["score_diff_interval"][1] < 0.1  # Newcombe's
    # a NaN score (a scorer that could not run) leaves its pair out instead of switching McNemar off
    rows[-1]["score"] = math.nan
    cos = {s["config"]: s for s in summarize(rows)}["cos:w=0.9 k=4 T=1"]
    assert cos["paired_units"] == 11 and cos["discordant"] == (0, 3) and cos["units"] == 12


def test_t_quantiles_percentiles_and_large_mcnemar():
    """Student-t quantiles beyond the table (df > 30), the overshoot percentile and McNemar with
    thousands of discordant pairs, against scipy / numpy."""
    import numpy as np
    from scipy.stats import binomtest
    from scipy.stats import t as student_t

    from verispec.evaluation.stats import mcnemar_exact, percentile, t_interval, t_quantile_975

    for df in range(1, 400):
        assert t_quantile_975(df) == pytest.approx(student_t.ppf(0.975, df), rel=4e-4 if df <= 30 else 1e-6)
    values = [0.3 * i % 1.7 for i in range(44)]  # n = 44: t(43) = 2.017, not 1.96
    half = student_t.ppf(0.975, 43) * np.std(values, ddof=1) / math.sqrt(44)
    assert t_interval(values)[1] == pytest.approx(half, rel=1e-6)
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 101):
        xs = sorted(rng.exponential(size=n).tolist())
        assert percentile(xs, 0.95) == pytest.approx(float(np.percentile(xs, 95)), rel=1e-12)
    assert percentile([1.0, 2.0, math.inf], 0.95) == math.inf and math.isnan(percentile([], 0.95))
    for better, worse in ((480, 560), (600, 600), (3000, 3100)):
        want = binomtest(better, better + worse).pvalue
        assert mcnemar_exact(better, worse) == pytest.approx(want, rel=1e-9)


def test_newcombe_paired_interval():
    """Newcombe's square-and-add interval for a paired difference (method 10): the published example,
    the edge cases a t-interval gets wrong, and its coverage by simulation."""
    import numpy as np

    from verispec.evaluation.stats import newcombe_paired_interval

    # Cavo et al. 2012 in Fagerland, Lydersen & Laake (2017), ch. 8: -0.0621 (-0.1186 to -0.0046)
    lo, hi = newcombe_paired_interval(59, 6, 16, 80)
    assert (round(lo, 4), round(hi, 4)) == (-0.1186, -0.0046)
    # swapping the roles mirrors the interval
    assert newcombe_paired_interval(59, 16, 6, 80) == pytest.approx((-hi, -lo))
    # no discordant pair: the difference is 0 but not known exactly (a t-interval says 0 +- 0)
    lo, hi = newcombe_paired_interval(8, 0, 0, 4)
    assert lo < 0 < hi and hi - lo > 0.2
    assert all(math.isnan(x) for x in newcombe_paired_interval(0, 0, 0, 0))  # no pairs
    assert newcombe_paired_interval(0, 12, 0, 0)[1] == 1.0  # clipped to [-1, 1]
    # coverage at n = 44 with few discordant pairs (the sweeps' regime): near 95%
    rng = np.random.default_rng(1)
    probs = np.array([0.55, 0.06, 0.10, 0.29])  # both, only row, only baseline, neither
    truth = probs[1] - probs[2]
    draws = rng.multinomial(44, probs, size=4000)
    intervals = [newcombe_paired_interval(*map(int, d)) for d in draws]
    covered = np.mean([lo <= truth <= hi for lo, hi in intervals])
    assert 0.93 <= covered <= 0.975, covered


def test_report_seq_kl_and_unit_sets():
    """An infinite log-ratio (a token the target gives probability 0) makes the sequence KL infinite,
    never a smaller finite mean; configurations over different units get a note."""
    from verispec.evaluation.report import timeout_notes, unit_set_notes

    def row(config, rule, prompt, log_ratio=0.5):
        return {"unit": f"{config}{prompt}", "config": config, "rule": rule, "family": "x",
                "k": 0 if rule == "plain" else 4, "temperature": 1.0, "prompt_id": str(prompt), "seed": 0,
                "tokens": 10, "seconds": 1.0, "target_calls": 4, "proposed": 8, "accepted": 6,
                "log_ratio": log_ratio, "mean_tv": 0.1, "target_nll": 2.0, "score": 1.0,
                "score_name": "pass_at_1", "steps": {}}

    rows = [row("cos:w=0.9 k=4 T=0", "cos:w=0.9", p, math.inf if p == 2 else 0.5) for p in range(4)]
    rows += [row("lossless k=4 T=0", "lossless", p, 0.0) for p in range(3)]
    summary = {s["config"]: s for s in summarize(rows)}
    assert summary["cos:w=0.9 k=4 T=0"]["seq_kl"] == math.inf
    assert summary["lossless k=4 T=0"]["seq_kl"] == 0.0
    (note,) = unit_set_notes(rows)
    assert "cos:w=0.9 k=4 T=0: 4, lossless k=4 T=0: 3; 3 in all of them" in note
    assert unit_set_notes(rows[:3] + rows[4:]) == []
    # execution-scored rows that failed by timeout are named (the machine's failure, maybe not the rule's)
    rows[1]["metrics"] = {"pass_at_1": 0.0, "timed_out": 1.0}
    rows[4]["metrics"] = {"pass_at_1": 0.0, "timed_out": 0.0}
    (note,) = timeout_notes(rows)
    assert note.startswith("1 row(s) failed by timeout") and "cos:w=0.9 k=4 T=0 / 1 (seed 0)" in note
    assert timeout_notes(rows[2:]) == []
    from verispec.evaluation.report import _fmt

    formatted = (_fmt(7765444.0), _fmt(1.25), _fmt(math.inf), _fmt(math.nan))
    assert formatted == ("7.77e+06", "1.250", "inf", "-")  # overshoot in the millions stays readable


def test_speedup_pairs_rows_decoded_at_the_same_batch_size():
    """A sweep resumed with another --batch-size holds rows of one config at two sizes: the speedup
    compares each row with its plain row only where both ran at the same size (throughput grows with
    the batch, so a batch-12 row against a batch-4 plain row would inflate it)."""
    def row(config: str, rule: str, prompt: int, batch_size: int, batch_seconds: float) -> dict:
        return {"unit": f"{config}{prompt}", "config": config, "rule": rule, "family": "x",
                "k": 0 if rule == "plain" else 4, "temperature": 1.0, "prompt_id": str(prompt), "seed": 0,
                "tokens": 10, "seconds": 99.0,
                "target_calls": 4, "proposed": 8, "accepted": 6, "log_ratio": 0.0, "mean_tv": 0.0,
                "target_nll": 2.0, "score": 1.0, "score_name": "pass_at_1", "steps": {},
                "batch_size": batch_size, "batch_seconds": batch_seconds}

    plain = [row("plain T=1", "plain", p, 4, 4.0) for p in range(4)]  # 10 tokens/s per row
    fast = [row("lossless k=4 T=1", "lossless", p, 4, 2.0) for p in range(2)]  # 20 tokens/s at batch 4
    big = [row("lossless k=4 T=1", "lossless", p, 12, 1.2) for p in range(2, 4)]  # 100 tokens/s at 12
    summary = {s["config"]: s for s in summarize(plain + fast + big)}
    assert summary["lossless k=4 T=1"]["speedup"] == pytest.approx(2.0)  # batch-4 pairs only
    assert summary["lossless k=4 T=1"]["speedup_batch_sizes"] == [4]  # the size the speedup was timed at
    assert "at the same batch size: 4)" in terminal_table(list(summary.values()))
    assert summary["plain T=1"]["speedup_batch_sizes"] == []  # plain against itself measures nothing
    alone = {s["config"]: s for s in summarize(plain + big)}
    assert math.isnan(alone["lossless k=4 T=1"]["speedup"])  # no pair at the same size: no figure
    # a row copied from another sweep (--reuse-from) was timed beside that sweep's plain rows, not these
    copied = [{**r, "reused_from": "elsewhere"} for r in fast]
    mixed = {s["config"]: s for s in summarize(plain + copied)}
    assert math.isnan(mixed["lossless k=4 T=1"]["speedup"]) and mixed["lossless k=4 T=1"]["units"] == 2
    assert mixed["lossless k=4 T=1"]["unpaired"] == 0 and mixed["lossless k=4 T=1"]["reused"] == 2
    # every row copied, plain's too (--reuse-plain): the legend names no batch size it has no speedup at
    all_copied = [{**r, "reused_from": "elsewhere"} for r in plain + fast]
    legend = terminal_table(summarize(all_copied))
    assert "at the same batch size: none measured in this sweep" in legend
    # plain decoded here, the rule's rows copied: still no speedup, and the legend says so
    assert "at the same batch size: none measured" in terminal_table(summarize(plain + copied))
    # --chunk: a work unit of 8 rows decoded 4 at a time; a row's share is the unit's seconds over its 8
    # rows, and it pairs only with a plain row of the same batch size and chunk
    chunked = [{**row("plain T=1", "plain", p, 4, 2.0), "chunk_size": 8} for p in range(4)]  # 40 tok/s
    chunked += [{**row("lossless k=4 T=1", "lossless", p, 4, 1.6), "chunk_size": 8} for p in range(2)]
    summary = {s["config"]: s for s in summarize(chunked)}
    assert summary["plain T=1"]["tokens_per_second"] == pytest.approx(40.0)
    assert summary["lossless k=4 T=1"]["speedup"] == pytest.approx(2.0 / 1.6)
    static = {s["config"]: s for s in summarize(chunked[:4] + fast)}  # batch 4 both, chunk 8 vs 4
    assert math.isnan(static["lossless k=4 T=1"]["speedup"])


def test_speedup_pairs_rows_timed_in_the_same_run():
    """A sweep killed part-way through a chunk and resumed decodes the chunk's remaining configurations
    in a new process: those rows are not timed against the first process's plain rows, and a note says
    how many rows each speedup leaves out."""
    from verispec.evaluation.report import speedup_notes

    def row(config: str, rule: str, prompt: int, batch_seconds: float, run: str) -> dict:
        return {"unit": f"{config}{prompt}", "config": config, "rule": rule, "family": "x",
                "k": 0 if rule == "plain" else 4, "temperature": 1.0, "prompt_id": str(prompt), "seed": 0,
                "tokens": 10, "seconds": 99.0, "target_calls": 4, "proposed": 8, "accepted": 6,
                "log_ratio": 0.0, "mean_tv": 0.0, "target_nll": 2.0, "score": 1.0, "score_name": "pass_at_1",
                "steps": {}, "batch_size": 2, "batch_seconds": batch_seconds, "run": run}

    plain = [row("plain T=1", "plain", p, 4.0, "first" if p < 2 else "second") for p in range(4)]
    lossless = [row("lossless k=4 T=1", "lossless", p, 2.0, "first") for p in range(2)]  # 2x, same run
    lossless += [row("lossless k=4 T=1", "lossless", p, 1.0, "second") for p in range(2, 4)]  # 4x
    resumed = [row("cos:w=0.5 k=4 T=1", "cos:w=0.5", p, 2.0, "second") for p in range(2)]  # other run
    resumed += [row("cos:w=0.5 k=4 T=1", "cos:w=0.5", p, 1.0, "second") for p in range(2, 4)]
    summary = {s["config"]: s for s in summarize(plain + lossless + resumed)}
    assert summary["lossless k=4 T=1"]["speedup"] == pytest.approx(40 / 6 / (40 / 16))  # all four pairs
    assert summary["lossless k=4 T=1"]["unpaired"] == 0
    cos = summary["cos:w=0.5 k=4 T=1"]
    assert cos["speedup"] == pytest.approx(4.0) and cos["unpaired"] == 2  # prompts 2, 3 only
    (note,) = speedup_notes(list(summary.values()))
    assert note.startswith("cos:w=0.5 k=4 T=1: 2 row(s) have no plain row timed in the same run")
    assert note.endswith("its speedup is over the other 2")
    # plain decoding leads the table wherever its rows are in the file; the rest keep first-seen order
    order = [s["config"] for s in summarize(resumed + lossless + plain)]
    assert order == ["plain T=1", "cos:w=0.5 k=4 T=1", "lossless k=4 T=1"]
    alone = summarize(plain[:2] + resumed[:2])
    assert math.isnan(alone[1]["speedup"]) and speedup_notes(alone)[0].endswith("it has no speedup")
    # rows written before rows recorded their run (no "run" field) pair as they always did
    legacy = [{k: v for k, v in r.items() if k != "run"} for r in plain + resumed]
    assert {s["config"]: s for s in summarize(legacy)}["cos:w=0.5 k=4 T=1"]["unpaired"] == 0


def test_load_notes_flag_chunks_far_below_their_configurations_median():
    """A chunk (a work unit's rows of one configuration: run, batch and chunk size, batch_seconds) at
    under half its configuration's median throughput is named: on a shared CPU the speedup column takes
    it at face value."""
    from verispec.evaluation.report import load_notes

    def chunk(config: str, first: int, batch_seconds: float, run: str = "r1", batch_size: int = 2) -> list:
        return [{"config": config, "prompt_id": f"P/{p}", "prompt_index": p, "seed": 0, "tokens": 10,
                 "seconds": 99.0, "batch_size": batch_size, "chunk_size": 2, "batch_seconds": batch_seconds,
                 "run": run} for p in (first, first + 1)]  # 20 tokens in batch_seconds

    rows = []
    for i in range(5):  # batch_seconds differ by a hair between units, as wall times do
        rows += chunk("plain T=1", 2 * i, 2.0 + i / 1e3)
        rows += chunk("lossless k=4 T=1", 2 * i, 5.0 if i == 3 else 1.9 + i / 1e3)
    (note,) = load_notes(rows)
    assert note.startswith("speed: 1 of 10 chunks")
    assert "lossless k=4 T=1 (2 rows, P/6 seed 0 to P/7 seed 0) at 4 tokens/s" in note
    assert "(0.38x)" in note  # 4 against the median 20 / 1.902 = 10.5; no passes recorded: no cause read
    # why: a row's wall seconds per target pass. Passes 3x as slow as the median chunk's: the machine's
    # load; at their usual speed: the chunk's shape (e.g. a long reply keeping the batch part-empty)
    timed = [{**r, "target_calls": 5, "seconds": 3.0 if r["batch_seconds"] == 5.0 else 1.0} for r in rows]
    (loaded,) = load_notes(timed)
    assert "(0.38x; its passes 3.00x as slow); in 1 of the 1 the target passes themselves" in loaded
    assert "usual speed" not in loaded
    (shape,) = load_notes([{**r, "seconds": 1.0} for r in timed])
    assert "(0.38x; its passes 1.00x as slow); in 0 of the 1" in shape
    assert "in 1 they ran at about their usual speed, so the chunk was slow for its shape" in shape
    assert load_notes([r for r in rows if r["config"] == "plain T=1"]) == []
    assert load_notes(rows[:12]) == []  # three chunks of each: too few for a median
    assert load_notes([{**r, "reused_from": "x"} if r["batch_seconds"] == 5.0 else r for r in rows]) == []
    assert load_notes([{k: v for k, v in r.items() if k != "batch_seconds"} for r in rows]) == []  # old rows
    # a unit is found by its batch_seconds wherever its rows lie in the file (Ray returns them in any order)
    assert load_notes(rows[::-1]) == [note]
    # chunks at another batch size are compared among themselves (pooled with the batch-2 chunks, these
    # 3 tokens/s chunks would pull the median to 4 and hide the slow one)
    batch8 = [r for i in range(4) for r in chunk("lossless k=4 T=1", 20 + 2 * i, 6.6 + i / 1e3, batch_size=8)]
    assert load_notes(rows + batch8) == [note.replace("1 of 10", "1 of 14")]


def test_the_report_names_the_machine_kinds_rows_were_decoded_on():
    """A sweep resumed over sessions may run on an AVX-512/AMX Intel and an AVX2-only AMD: the report
    names each kind with its rows (from runs.jsonl); runs recorded nowhere (older sweeps) say nothing."""
    intel = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_flags": "avx2 fma avx512f amx_bf16"}
    amd = {"cpu": "AMD EPYC 9B14", "cpu_flags": "avx2 fma"}
    rows = [{"run": "a", "config": "plain T=1"}] * 3 + [{"run": "b", "config": "plain T=1"}] * 2
    rows += [{"run": "c", "config": "plain T=1", "reused_from": "elsewhere"}]  # its machine is elsewhere
    (note,) = machine_notes(rows, {"a": {"machine": intel}, "b": {"machine": amd}, "c": {"machine": amd}})
    assert note.startswith("decoded on 2 machine kinds (Intel(R) Xeon(R) Processor (avx2 fma avx512f "
                           "amx_bf16): 3 row(s); AMD EPYC 9B14 (avx2 fma): 2 row(s))")
    assert machine_notes(rows[:3], {"a": {"machine": intel}}) == [
        "decoded on Intel(R) Xeon(R) Processor (avx2 fma avx512f amx_bf16): 3 row(s)"]
    assert machine_notes(rows, {}) == []  # no run recorded: nothing to say
    (mixed,) = machine_notes(rows, {"a": {"machine": intel}})  # one kind known, run b not recorded
    assert mixed.startswith("decoded on Intel(R) Xeon(R) Processor (avx2 fma avx512f amx_bf16): 3 row(s); "
                            "not recorded (a run before runs were recorded, or Ray workers): 2 row(s)")
    assert "machine kinds" not in mixed  # an unrecorded run is not counted as another kind
    assert machine_notes(rows, {"a": {"machine": None}, "b": {"machine": None}}) == []  # Ray: workers'
    # malformed records or run ids (valid JSON of the wrong type) are read as not recorded, never a crash
    odd = [{"run": ["a"], "config": "plain T=1"}, {"config": "plain T=1"},
           {"run": "a", "config": "plain T=1"}]
    assert machine_notes(odd, {"a": {"machine": "Intel"}}) == []
    assert machine_notes(odd, {"a": {"machine": intel}})[0].endswith("2 row(s)")


def test_a_runs_file_that_cannot_be_read_leaves_the_report_intact(tmp_path, caplog):
    (tmp_path / "runs.jsonl").mkdir()  # not a file: unreadable
    with caplog.at_level("WARNING"):
        assert read_runs(tmp_path / "results.jsonl") == {}
    assert "left out of the report" in caplog.text
    (tmp_path / "runs.jsonl").rmdir()
    (tmp_path / "runs.jsonl").write_text('{"run": "a", "machine": null}\n[1]\n{"run": 3}\n')
    assert read_runs(tmp_path / "results.jsonl") == {"a": {"run": "a", "machine": None}}


def test_cpu_model_and_vector_units_are_read_from_cpuinfo():
    cpuinfo = ("processor\t: 0\nmodel name\t: AMD EPYC 9B14\n"
               "flags\t\t: fpu sse avx2 fma avx512f avx512_bf16\n"
               "processor\t: 1\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu\n")
    assert cpu_model_and_flags(cpuinfo) == ("AMD EPYC 9B14", "avx2 fma avx512f avx512_bf16")
    here = describe()
    assert here["cpu"] and here["cpus"] >= 1 and here["torch_threads"] >= 1


def test_progress_gives_the_rows_to_go_and_the_latest_runs_pace():
    """--progress: rows done of those planned, and the time the rest takes at the latest run's pace
    (rows a minute from its start, which its id records, to the file's last write); copied rows count
    as done, not as pace; no outcome in it."""
    start = calendar.timegm((2026, 12, 5, 15, 0, 0, 0, 0, 0))
    rows = [{"config": c, "prompt_id": str(p), "seed": 0, "run": "20261205T150000Z-abcdef"}
            for p in range(30) for c in ("plain T=1", "lossless k=4 T=1")]  # 60 rows in the run
    rows += [{"config": "plain T=1", "prompt_id": "99", "seed": 0, "run": "x", "reused_from": "elsewhere"}]
    (note,) = pace_note(rows, 100, 2, start + 30 * 60)  # 61 of 400; 60 rows in 30 minutes: 2 a minute
    assert note.startswith("progress: 61 of 400 rows (2 configurations x 100 problems x 2 seed(s)); "
                           "the latest run (20261205T150000Z-abcdef) wrote 2.00 rows a minute")
    assert "the other 339 rows take about 2.8 h" in note and "median chunk" not in note  # no chunk times
    # with chunk times (a chunk's rows share its wall time): plain's chunks of 15 rows took 60 and 50 s
    # (4 and 3.33 s a row), lossless's 90 s and, paused by SIGSTOP for 20 minutes, 1290 s (6 and 86 s a
    # row): median 5 s a row, 339 rows to go; the pace from the run's start (2 a minute) counts the pause
    timed = [dict(r, chunk_size=15, batch_seconds=(60.0, 50.0, 90.0, 1290.0)[(r["config"] != "plain T=1") * 2
                                                                             + (int(r["prompt_id"]) >= 15)])
             if "reused_from" not in r else r for r in rows]
    # a copied row with a chunk time of its own, a row of another run and rows without a usable time are
    # not this run's chunks
    timed += [dict(rows[-1], batch_seconds=1.0, chunk_size=1, prompt_id="98"),
              {"config": "plain T=1", "prompt_id": "97", "seed": 0, "run": "20261205T140000Z-000000",
               "batch_seconds": 1.0, "chunk_size": 1},
              {"config": "plain T=1", "prompt_id": "96", "seed": 0, "run": "20261205T150000Z-abcdef",
               "batch_seconds": float("nan")},
              {"config": "plain T=1", "prompt_id": "95", "seed": 0, "run": "20261205T150000Z-abcdef",
               "batch_seconds": 0.0}]
    (note,) = pace_note(timed, 100, 2, start + 30 * 60)
    assert "the other 335 rows take about" in note
    assert note.endswith("at the median chunk's 5.0 s a row (4 chunks of this run, all configurations; not "
                         "moved by a paused or loaded chunk, but low when some chunks are slow for real) "
                         f"about {335 * 5 / 3600:.1f} h")
    # a chunk's time is per planned row (chunk_size), not per row present: plain's first chunk read on 5
    # of its 15 rows still takes 60 / 15 = 4 s a row (per row present, 12: median 9 s, 0.9 h)
    partial = [r for r in timed if not (r["config"] == "plain T=1" and 5 <= int(r["prompt_id"]) < 15)]
    assert pace_note(partial, 100, 2, start + 30 * 60)[0].endswith(f"about {345 * 5 / 3600:.1f} h")
    plain_only = [r for r in timed[:61] if r["config"] == "plain T=1"]  # two timed chunks: too few
    assert "median chunk" not in pace_note(plain_only, 100, 2, start + 30 * 60)[0]
    assert pace_note(rows, 100, 2, start + 30) == ["progress: 61 of 400 rows (2 configurations x 100 "
                                                   "problems x 2 seed(s))"]  # under a minute: no pace
    assert pace_note([], 100, 1, start) == [] and pace_note(rows, None, 1, start) == []
    planned = planned_configs({"suite": "mtbench", "rules": ["budget:tv=0.1,ratio=2"], "ks": [4],
                               "temperatures": [1.0], "seeds": [0], "schema": 2, "backend": "lean"})
    assert planned == ["plain T=1", "lossless k=4 T=1", "budget:tv=0.1,ratio=2.0 k=4 T=1"]
    (note,) = pace_note(rows, 100, 2, start + 30, planned)  # the rule with no row yet counts
    assert note.startswith("progress: 61 of 600 rows (3 configurations x 100 problems x 2 seed(s))")
    assert planned_configs({"suite": "mtbench", "rules": ["nonsense:x=1"], "ks": [4],
                            "temperatures": [1]}) == []
    assert planned_configs({}) == []  # no sweep.json: not SweepSpec's defaults
    assert run_started("20261205T150000Z-abcdef") == start and run_started("x") is None
    assert abs(run_started(new_run_id()) - time.time()) < 5  # the id's form and its reading agree
