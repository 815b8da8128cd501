"""Compact storage of a row's per-position arrays (`steps`) and its token ids: columns in a compressed
binary file beside the results, so a sweep adds a few MB rather than tens (docs/design/evaluation.md,
'Sweep units and reuse').

`steps.bin` is append-only: each row's steps (and, in another record, its token ids) are one compressed
record: a JSON header naming each column and its type, then the columns (float32 numbers and int32 ids
with their bytes regrouped by significance, which compresses them better; uint8 codes of a string
column's values; a column equal to an earlier one is stored as a reference to it). Records are raw
LZMA2 (`lzma`) after a 3-byte mark; zlib records, as the first writer made them, still read. A record
is written and fsync'ed before the row that points at it; the row then holds `{"stored": "steps.bin",
"offset": O, "length": L, "crc32": C}` in place of the array(s). A kill between the two leaves bytes
no row points at, which nothing reads. `store.scan_rows` resolves the pointers (checking the checksum);
a pointer that cannot be read makes its row invalid, named with its line.

Numbers are kept as float32 (7 significant digits; the reports print 3-4): the figures a report prints
from stored steps are checked equal to those from the full-precision rows when a sweep is converted
(`scripts/compact_steps.py`).
"""

from __future__ import annotations

import json
import lzma
import os
import re
import struct
import zlib
from json.decoder import NaN
from pathlib import Path

import numpy as np

STEPS_FILE = "steps.bin"
STORED = "stored"  # the key of a pointer (an inline steps dict has the step fields as keys)
MAX_RECORD = 256 * 2**20
LZMA_MAGIC = b"VX2"  # then raw LZMA2 (no container: its 60 bytes would weigh on short rows); zlib starts 0x78
RAW_MAGIC = b"VXR"  # then the columns uncompressed: a packed file's records (compressed as one stream)
PACK_NAME = re.compile(r"steps-[0-9a-f]{8}\.bin\.xz")  # a packed file's name (`pack_records`)
_LZMA_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 6, "dict_size": 2**22}]
# a column kind's dtype ("s": bytes regrouped by `_shuffle`; "i4"/"f4": the first writer's plain columns)
_DTYPES = {"cat": np.uint8, "i4": np.int32, "f4": np.float32, "i4s": np.int32, "f4s": np.float32}
TOKEN_IDS = "token_ids"  # the row field whose list may be stored as a one-column record


def _shuffle(values: np.ndarray) -> bytes:
    """The bytes of a 4-byte column regrouped by significance (all first bytes, then all second, ...):
    neighbouring floats share exponents, which a compressor then sees as runs."""
    return values.view(np.uint8).reshape(-1, 4).T.tobytes()  # [n, 4] -> [4, n]


def _unshuffle(raw: bytes, dtype) -> np.ndarray:
    n = len(raw) // 4
    return np.frombuffer(raw, dtype=np.uint8).reshape(4, n).T.copy().view(dtype).reshape(n)  # [4,n]->[n]


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
        return [name, "i4s"], _shuffle(np.array(values, dtype=np.int32))
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return [name, "f4s"], _shuffle(np.array(values, dtype=np.float32))
    return None


def encode_steps(steps: dict, compress: bool = True) -> bytes | None:
    """One compressed record of a row's steps, or None when they are not lists of one length of numbers,
    token ids or short strings (such a row keeps its steps inline). `compress=False`: the same columns
    uncompressed (a packed file, `pack_records`, compresses a whole sweep's records at once)."""
    if not isinstance(steps, dict) or not steps or not all(isinstance(v, list) for v in steps.values()):
        return None
    lengths = {len(v) for v in steps.values()}
    if len(lengths) != 1:
        return None
    header, chunks, seen = {"n": lengths.pop(), "fields": []}, [], {}
    for name, values in steps.items():
        column = _column(str(name), values)
        if column is None:
            return None
        entry, data = column
        key = (json.dumps(entry[1:]), data)
        if key in seen:  # the same values as an earlier column (e.g. raw and processed logs at T = 1)
            header["fields"].append([entry[0], "same", seen[key]])
            continue
        seen[key] = entry[0]
        header["fields"].append(entry)
        chunks.append(data)
    head = json.dumps(header).encode()
    data = struct.pack("<I", len(head)) + head + b"".join(chunks)
    if not compress:
        return RAW_MAGIC + data
    return LZMA_MAGIC + lzma.compress(data, format=lzma.FORMAT_RAW, filters=_LZMA_FILTERS)


def decode_steps(record: bytes) -> dict:
    """The steps dict of one record (float32 numbers come back as Python floats). ValueError if damaged."""
    try:
        if record.startswith(RAW_MAGIC):
            raw = record[len(RAW_MAGIC):]
        elif record.startswith(LZMA_MAGIC):
            raw = lzma.decompress(record[len(LZMA_MAGIC):], format=lzma.FORMAT_RAW, filters=_LZMA_FILTERS)
        else:
            raw = zlib.decompress(record)
        (size,) = struct.unpack("<I", raw[:4])
        header = json.loads(raw[4:4 + size])
        n, at, out = int(header["n"]), 4 + size, {}
        for field in header["fields"]:
            name, kind = field[0], field[1]
            if kind == "same":
                out[name] = list(out[field[2]])
                continue
            dtype = _DTYPES[kind]
            end = at + n * np.dtype(dtype).itemsize
            if len(raw[at:end]) != end - at:
                raise ValueError("a column is cut short")
            chunk = raw[at:end]
            column = _unshuffle(chunk, dtype) if kind.endswith("s") else np.frombuffer(chunk, dtype)
            at = end
            if kind == "cat":
                out[name] = [field[2][i] for i in column.tolist()]
            elif kind in ("i4", "i4s"):
                out[name] = column.astype(np.int64).tolist()
            else:  # NaN as json's own NaN object, as a row read from JSON holds it (so rows compare equal)
                out[name] = [NaN if v != v else v for v in column.astype(np.float64).tolist()]
        return out
    except (zlib.error, lzma.LZMAError, struct.error, ValueError, KeyError, IndexError, TypeError) as err:
        raise ValueError(f"a damaged steps record ({err})") from None


def store_steps(directory: Path, steps: dict | list) -> dict | None:
    """Append `steps` (a steps dict, or a list of token ids) to DIRECTORY/steps.bin (fsync'ed) and return
    the row's pointer to them, or None when they cannot be stored compactly (the caller keeps them
    inline)."""
    if isinstance(steps, list):
        if not steps:
            return None
        steps = {TOKEN_IDS: steps}
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in steps[TOKEN_IDS]):
            return None
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


def decompress_xz(packed: bytes, max_bytes: int, where: str) -> bytes:
    """The decompressed bytes of an .xz file's contents. ValueError naming `where` if they are damaged or
    cut short, or expand past `max_bytes` (checked while decompressing, so a small file that expands
    without bound is refused, not read into memory)."""
    decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    try:
        data = decompressor.decompress(packed, max_length=max_bytes + 1)
    except lzma.LZMAError as err:
        raise ValueError(f"{where} is damaged ({err})") from None
    if len(data) > max_bytes:
        raise ValueError(f"{where} holds more than {max_bytes:,} bytes once decompressed")
    if not decompressor.eof or decompressor.unused_data:
        raise ValueError(f"{where} is damaged (cut short, or bytes after its end)")
    return data


def steps_files(directory: Path) -> list[str]:
    """The steps files in a sweep directory: steps.bin and packs (`pack_records`), by name."""
    return sorted(p.name for p in Path(directory).iterdir()
                  if p.name == STEPS_FILE or PACK_NAME.fullmatch(p.name))


MAX_PACK_BYTES = 4 * 2**30  # a packed steps file's decompressed size (`decompress_xz` refuses more)


def pack_records(records: list[bytes]) -> tuple[str, bytes, list[dict]]:
    """(file name, its bytes, each record's pointer) of a packed steps file: `records` (uncompressed,
    `encode_steps(..., compress=False)`) one after the other, compressed as one .xz stream, which finds
    what a whole sweep's rows share (about 13% smaller than a record apiece). The name carries the
    content's checksum, so a new pack never replaces one that rows still point at. Pointers give offsets
    in the decompressed bytes."""
    pointers, offset = [], 0
    for record in records:
        pointers.append({"offset": offset, "length": len(record), "crc32": zlib.crc32(record)})
        offset += len(record)
    packed = lzma.compress(b"".join(records), format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)
    name = f"steps-{zlib.crc32(packed):08x}.bin.xz"
    return name, packed, [{STORED: name, **p} for p in pointers]


class StepsReader:
    """Resolves pointers into one sweep's steps.bin, or a packed steps file beside it (each file read
    once, on its first pointer)."""

    def __init__(self, directory: Path):
        self.directory, self.files = Path(directory), {}

    def _file(self, name: str) -> bytes | str:
        if name not in self.files:
            path = self.directory / name
            if not path.is_file():
                self.files[name] = f"its steps file {path} does not exist"
            elif name == STEPS_FILE:
                self.files[name] = path.read_bytes()
            else:
                try:
                    self.files[name] = decompress_xz(path.read_bytes(), MAX_PACK_BYTES, str(path))
                except ValueError as err:
                    self.files[name] = str(err)
        return self.files[name]

    def load(self, pointer: dict) -> dict | str:
        """The steps a pointer stands for, or the reason they cannot be read (a str)."""
        name = pointer.get(STORED)
        if name != STEPS_FILE and not (isinstance(name, str) and PACK_NAME.fullmatch(name)):
            return f"steps stored in {str(name)[:60]!r}, not {STEPS_FILE} or a packed steps file"
        offset, length, crc = pointer.get("offset"), pointer.get("length"), pointer.get("crc32")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length, crc)):
            return "a steps pointer needs integer offset, length and crc32"
        if length > MAX_RECORD:
            return f"a steps record of {length} bytes (more than {MAX_RECORD})"
        data = self._file(name)
        if isinstance(data, str):
            return data
        record = data[offset:offset + length]
        if len(record) != length or zlib.crc32(record) != crc:
            return f"its steps record at {offset} does not match its checksum"
        try:
            return decode_steps(record)
        except ValueError as err:
            return str(err)


STORED_FIELDS = ("steps", TOKEN_IDS)  # the row fields kept in steps.bin


def compact_row(directory: Path, row: dict) -> dict:
    """`row` with its steps and token ids appended to DIRECTORY/steps.bin and replaced by pointers (each
    left inline where it cannot be stored compactly, or is already a pointer)."""
    out = row
    for key in STORED_FIELDS:
        value = row.get(key)
        if value and isinstance(value, (dict, list)) and not is_pointer(value):
            pointer = store_steps(directory, value)
            if pointer is not None:
                out = {**out, key: pointer}
    return out


def resolve_row(reader: StepsReader, row: dict) -> dict | str:
    """`row` with its stored fields read back, or the reason one cannot be (a str)."""
    out = row
    for key in STORED_FIELDS:
        if is_pointer(row.get(key)):
            loaded = reader.load(row[key])
            if isinstance(loaded, str):
                return f"stored {key} that cannot be read: {loaded}"
            if key == TOKEN_IDS:
                if list(loaded) != [TOKEN_IDS]:
                    return f"stored {key} that cannot be read: a record of other columns"
                loaded = loaded[TOKEN_IDS]
            out = {**out, key: loaded}
    return out
