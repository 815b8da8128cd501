"""Shared helpers of the benchmark scripts: environment, timing, summaries, prompts."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from verispec.machine import describe
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
