"""Benchmarks: curated suites, sweeps over rules x settings, and the diagnostic report."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from verispec.evaluation.store import read_rows


def load_results(path: str | Path):
    """All rows of a sweep as a pandas DataFrame (one row per prompt x config x seed)."""

    path = Path(path)
    return pd.DataFrame(read_rows(path / "results.jsonl" if path.is_dir() else path))
