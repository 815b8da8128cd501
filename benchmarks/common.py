"""Shared helpers of the benchmark scripts: environment, timing, summaries, prompts."""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from scipy import stats

from verispec.api import encode_prompt
from verispec.evaluation.store import read_rows
from verispec.evaluation.suites import load_suite
from verispec.machine import describe
from verispec.models import load_model
from verispec.tables import text_table

PROMPTS = [
    "KING.\nWhat says the queen?\n",
    "To be, or not to be, that is the question:\n",
    "HAMLET.\nO, that this too too solid flesh would melt,\n",
    "ROMEO.\nBut soft, what light through yonder window breaks?\n",
    "FIRST CITIZEN.\nBefore we proceed any further, hear me speak.\n",
    "PORTIA.\nThe quality of mercy is not strain'd;\n",
]


def environment() -> dict:
    import transformers

    # cpu model, vector units (AVX2 only, AVX-512, bf16, AMX), usable CPUs, threads, torch
    return {**describe(), "transformers": transformers.__version__}


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def interleaved_times(cases: dict, reps: int) -> dict[str, list[float]]:
    """Seconds of each case's call over `reps` rounds, every case once per round (after one warm-up call
    each), so that a change in the machine's load touches all cases alike."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()  # warm up
    for _ in range(reps):
        for name, fn in cases.items():
            times[name].append(timed(fn)[0])
    return times


def spread(values: list[float]) -> dict:
    values = sorted(values)
    return {"min": values[0], "median": statistics.median(values), "max": values[-1], "n": len(values)}


def fmt_spread(s: dict, digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def print_table(head: list[str], rows: list[list[str]]) -> None:
    print(text_table(head, rows))


def write_json(path: str | Path, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2, default=float) + "\n")


class FreshPass:
    """A sweep's rows (`rows`) and its target model, loaded as the sweep ran it, for re-scoring a row's
    reply in one fresh, cache-free pass (`logits`)."""

    def __init__(self, sweep: str | Path) -> None:
        settings = json.loads((Path(sweep) / "sweep.json").read_text())
        self.rows = read_rows(Path(sweep) / "results.jsonl")
        self.target = load_model(settings["target"], dtype=getattr(torch, settings["dtype"]))
        self.suite = load_suite(settings["suite"])
        self.items = {item.id: item for item in self.suite.items}

    def logits(self, row: dict) -> torch.Tensor:
        """The target's logits [n, V] (float32) at each of the row's n emitted tokens."""
        prompt = encode_prompt(self.target, self.items[row["prompt_id"]].prompt, self.suite.chat)
        reply = list(row["token_ids"])
        ids = torch.tensor([prompt + reply[:-1]])  # [1, L + n - 1]: position t predicts token t + 1
        return self.target.session().logits_for(ids, len(reply))[0].float()  # [n, V]


def every_nth(rows: list[dict], count: int) -> list[dict]:
    """At most `count` rows, spread evenly over `rows`."""
    return rows[:: max(1, len(rows) // count)][:count]


# ------------------------------------------------------- held-out comparisons (scipy, not verispec.stats)
# The re-scoring scripts compute each planned comparison with this code, written apart from the report's
# (`verispec.evaluation.stats`), so that a published p is reproduced by other code, not only re-read.
Scores = dict[tuple[str, str, int], float]  # (config, problem, seed) -> score


def unit_differences(scores: Scores, a: str, b: str) -> dict[tuple[str, int], float]:
    """(problem, seed) -> A - B, on the units both configurations have."""
    return {(p, s): v - scores[(b, p, s)]
            for (c, p, s), v in scores.items() if c == a and (b, p, s) in scores}


def problem_differences(scores: Scores, a: str, b: str) -> dict[str, float]:
    """problem -> the mean of A - B over its seeds (the problem is the cluster)."""
    diffs: dict[str, list[float]] = defaultdict(list)
    for (p, _), d in unit_differences(scores, a, b).items():
        diffs[p].append(d)
    return {p: float(np.mean(v)) for p, v in diffs.items()}


def paired_by_problem(scores: Scores, a: str, b: str) -> tuple[float, float, float, float]:
    """A - B clustered by problem: (mean, 95% t interval low, high, one-sample t-test p) by scipy."""
    diffs = np.array(list(problem_differences(scores, a, b).values()))
    mean = float(diffs.mean())
    half = float(stats.t.ppf(0.975, len(diffs) - 1) * diffs.std(ddof=1) / np.sqrt(len(diffs)))
    p = float(stats.ttest_1samp(diffs, 0.0).pvalue) if diffs.std() > 0 else 1.0
    return mean, mean - half, mean + half, p


def paired_text(scores: Scores, a: str, b: str) -> str:
    """`paired_by_problem` with the exact McNemar test on the (problem, seed) pairs (for scores not 0/1:
    the sign test, the same binomial test of wins against losses), as one line."""
    pairs = unit_differences(scores, a, b)
    mean, low, high, t_p = paired_by_problem(scores, a, b)
    wins, losses = sum(d > 0 for d in pairs.values()), sum(d < 0 for d in pairs.values())
    mcnemar = stats.binomtest(wins, wins + losses, 0.5).pvalue if wins + losses else 1.0
    binary = all(v in (0.0, 1.0) for (c, _, _), v in scores.items() if c in (a, b))
    problems = len(problem_differences(scores, a, b))
    return (f"{mean:+.3f} [{low:+.3f}, {high:+.3f}] t-test p {t_p:.3g}; "
            f"{'McNemar' if binary else 'sign test'} +{wins}/-{losses} p {mcnemar:.3g} "
            f"({problems} problems, {len(pairs)} pairs)")


def holm_adjusted(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979), in the input's order; written here, apart from
    `verispec.evaluation.stats.holm`, for the held-out check."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted
