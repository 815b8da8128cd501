"""benchmarks/serve_load.py's paired ratios: each round's speculative throughput is divided by the plain
throughput of the same round and concurrency, and the rounds give a geometric mean with a Student-t
interval on the log ratios (checked against scipy's one-sample interval)."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from helpers import load_benchmark


def test_ratios_pair_by_round_and_concurrency():
    serve_load = load_benchmark("serve_load")
    rows = [{"mode": mode, "round": r, "concurrency": c, "tokens_per_s": tps}
            for mode, r, c, tps in [("plain", 0, 1, 10.0), ("lossless-auto", 0, 1, 9.8),
                                    ("plain", 1, 1, 20.0), ("lossless-auto", 1, 1, 20.6),
                                    ("plain", 2, 1, 11.0), ("lossless-auto", 2, 1, 11.0),
                                    ("plain", 0, 4, 40.0), ("lossless", 0, 4, 20.0)]]
    lines = serve_load.paired_ratios(rows)
    ratios = [9.8 / 10.0, 20.6 / 20.0, 1.0]  # paired within a round, not with another round's plain
    low, high = stats.ttest_1samp([math.log(v) for v in ratios], 0.0).confidence_interval()
    mean = math.exp(sum(math.log(v) for v in ratios) / 3)
    assert lines[0] == ("lossless-auto / plain at concurrency 1: 0.98x, 1.03x, 1.00x; geometric mean "
                        f"{mean:.3f}x, 95% interval [{math.exp(low):.3f}, {math.exp(high):.3f}] "
                        "over 3 rounds")
    assert lines[1] == "lossless / plain at concurrency 4: 0.50x"  # one round: no interval
    assert mean == pytest.approx(1.003, abs=5e-4)
