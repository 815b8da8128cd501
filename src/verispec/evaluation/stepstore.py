"""Compact storage of a row's per-position arrays (`steps`): columns in a compressed binary file beside the
results, so a sweep adds a few MB rather than tens (docs/design.md, 'Sweep units and reuse').

`steps.bin` is append-only: each row's steps are one zlib-compressed record (a JSON header naming each
column and its type, then the columns: float32 numbers, int32 token ids, uint8 codes of a string
column's values), written and fsync'ed before the row that points at it. The row then holds
`"steps": {"stored": "steps.bin", "offset": O, "length": L, "crc32": C}`. A kill between the two leaves
bytes no row points at, which nothing reads. `store.scan_rows` resolves the pointer (checking the
checksum); a pointer that cannot be read makes its row invalid, named with its line.

Numbers are kept as float32 (7 significant digits; the reports print 3-4): the figures a report prints
from stored steps are checked equal to those from the full-precision rows when a sweep is converted
(`scripts/compact_steps.py`).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from json.decoder import NaN
from pathlib import Path

import numpy as np

STEPS_FILE = "steps.bin"
STORED = "stored"  # the key of a pointer (an inline steps dict has the step fields as keys)
MAX_RECORD = 256 * 2**20


def _column(name: str, values: list) -> tuple[list, bytes] | None:
    """(header entry, bytes) of one column, or None when it holds values of no supported kind."""
    if all(isinstance(v, str) for v in values):
        vocab = sorted(set(values))
        if len(vocab) > 255:
            return None
        index = {v: i for i, v in enumerate(vocab)}
        return [name, "cat", vocab], np.array([index[v] for v in values], dtype=np.uint8).tobytes()
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        if values and (min(values) < -2**31 or max(values) >= 2**31):
            return None
        return [name, "i4"], np.array(values, dtype=np.int32).tobytes()
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return [name, "f4"], np.array(values, dtype=np.float32).tobytes()
    return None


def encode_steps(steps: dict) -> bytes | None:
    """One compressed record of a row's steps, or None when they are not lists of one length of numbers,
    token ids or short strings (such a row keeps its steps inline)."""
    if not isinstance(steps, dict) or not steps or not all(isinstance(v, list) for v in steps.values()):
        return None
    lengths = {len(v) for v in steps.values()}
    if len(lengths) != 1:
        return None
    header, chunks = {"n": lengths.pop(), "fields": []}, []
    for name, values in steps.items():
        column = _column(str(name), values)
        if column is None:
            return None
        header["fields"].append(column[0])
        chunks.append(column[1])
    head = json.dumps(header).encode()
    return zlib.compress(struct.pack("<I", len(head)) + head + b"".join(chunks), 6)


def decode_steps(record: bytes) -> dict:
    """The steps dict of one record (float32 numbers come back as Python floats). ValueError if damaged."""
    try:
        raw = zlib.decompress(record)
        (size,) = struct.unpack("<I", raw[:4])
        header = json.loads(raw[4:4 + size])
        n, at, out = int(header["n"]), 4 + size, {}
        for field in header["fields"]:
            name, kind = field[0], field[1]
            dtype = {"cat": np.uint8, "i4": np.int32, "f4": np.float32}[kind]
            end = at + n * np.dtype(dtype).itemsize
            column = np.frombuffer(raw[at:end], dtype=dtype)
            if len(column) != n:
                raise ValueError("a column is cut short")
            at = end
            if kind == "cat":
                out[name] = [field[2][i] for i in column.tolist()]
            elif kind == "i4":
                out[name] = column.astype(np.int64).tolist()
            else:  # NaN as json's own NaN object, as a row read from JSON holds it (so rows compare equal)
                out[name] = [NaN if v != v else v for v in column.astype(np.float64).tolist()]
        return out
    except (zlib.error, struct.error, ValueError, KeyError, IndexError, TypeError) as err:
        raise ValueError(f"a damaged steps record ({err})") from None


def store_steps(directory: Path, steps: dict) -> dict | None:
    """Append `steps` to DIRECTORY/steps.bin (fsync'ed) and return the row's pointer to them, or None
    when they cannot be stored compactly (the caller keeps them inline)."""
    record = encode_steps(steps)
    if record is None:
        return None
    path = Path(directory) / STEPS_FILE
    with open(path, "ab") as f:
        offset = f.tell()
        f.write(record)
        f.flush()
        os.fsync(f.fileno())
    return {STORED: STEPS_FILE, "offset": offset, "length": len(record), "crc32": zlib.crc32(record)}


def is_pointer(steps) -> bool:
    return isinstance(steps, dict) and STORED in steps


class StepsReader:
    """Resolves pointers into one sweep's steps.bin (read once, on the first pointer)."""

    def __init__(self, directory: Path):
        self.directory, self.data = Path(directory), None

    def load(self, pointer: dict) -> dict | str:
        """The steps a pointer stands for, or the reason they cannot be read (a str)."""
        if pointer.get(STORED) != STEPS_FILE:
            return f"steps stored in {str(pointer.get(STORED))[:60]!r}, not {STEPS_FILE}"
        offset, length, crc = pointer.get("offset"), pointer.get("length"), pointer.get("crc32")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length, crc)):
            return "a steps pointer needs integer offset, length and crc32"
        if length > MAX_RECORD:
            return f"a steps record of {length} bytes (more than {MAX_RECORD})"
        if self.data is None:
            path = self.directory / STEPS_FILE
            if not path.is_file():
                return f"its steps file {path} does not exist"
            self.data = path.read_bytes()
        record = self.data[offset:offset + length]
        if len(record) != length or zlib.crc32(record) != crc:
            return f"its steps record at {offset} does not match its checksum"
        try:
            return decode_steps(record)
        except ValueError as err:
            return str(err)

