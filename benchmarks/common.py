"""Shared helpers of the benchmark scripts: environment, timing, summaries, prompts."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

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
