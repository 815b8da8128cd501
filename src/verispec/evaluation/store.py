"""The results store: one JSONL file, one row per finished unit, crash-safe.

Each row is written with a single `write` of one complete line, then flushed and fsync'ed before the
next unit starts. A process killed at any moment (SIGKILL included) leaves at most one partial last
line: `ResultsFile` cuts it off on open, so at most the unit in flight is lost. Rows carry a `unit`
key; a unit already present is never appended again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SCHEMA_VERSION = 1


def read_rows(path: Path) -> list[dict]:
    """Complete rows of a results file (a partial last line is ignored)."""
    if not path.exists():
        return []
    rows = []
    with open(path, "rb") as f:
        data = f.read()
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # only the last line can be partial: the unit that was in flight
    return rows


class ResultsFile:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._repair()
        self.rows = read_rows(path)
        for row in self.rows:
            if row.get("schema") != SCHEMA_VERSION:
                raise ValueError(f"{path}: row with schema {row.get('schema')!r}, this verispec writes "
                                 f"schema {SCHEMA_VERSION}; use a new output directory")
        self.done = {row["unit"] for row in self.rows}
        self._file = open(path, "a", encoding="utf-8")

    def _repair(self) -> None:
        """Cut a partial last line (left by a kill mid-write) so the next row starts on a fresh line."""
        if not self.path.exists():
            return
        with open(self.path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)

    def append(self, row: dict) -> None:
        if row["unit"] in self.done:
            return
        self._file.write(json.dumps(row, allow_nan=True) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done.add(row["unit"])
        self.rows.append(row)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
