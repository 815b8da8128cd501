"""Shared helpers of the study's re-checking scripts (law_check.py, recheck_logprobs.py,
rescore_loglik.py): a sweep's rows with its target loaded as the sweep ran it, and an even sample of rows."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from verispec.api import encode_prompt
from verispec.evaluation.store import read_rows
from verispec.evaluation.suites import load_suite
from verispec.models import load_model


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
