"""The results store: one JSONL file, one row per finished unit, crash-safe, one writer at a time.

Each row is written with a single `write` of one complete line, then flushed and fsync'ed before the
next unit starts. A process killed at any moment (SIGKILL included) leaves at most one partial last
line: `ResultsFile` cuts it off on open, so at most the unit in flight is lost. Rows carry a `unit`
key; a unit already present is never appended again. Any other unreadable line (invalid JSON,
non-UTF-8 bytes, not an object) is skipped with a warning naming its file and line number, and
counted (`ScanResult.skipped`): never a crash, never silent. `DirectoryLock` makes a sweep's output
directory exclusive (`fcntl.flock`, non-blocking): a second writer is refused with the holder's pid.

A row another sweep already holds is stored as a reference (`same_as`): `{"schema": 2, "unit": U,
"same_as": "NAME", ...}` names a sibling sweep directory (`../NAME/results.jsonl`) whose row of unit U
it is, and carries only the fields where it differs (`reused_from`, `run`). Readers see the whole row
(`scan_rows` resolves it); a reference whose source is missing, or names a path rather than a sibling,
is an invalid row, named with its line like any other.

A finished sweep can be sealed (`seal_rows`): its rows compressed into results.jsonl.xz and its steps
packed into one file (`stepstore.pack_records`); readers read it as before, writers refuse it until
`unseal_rows` (docs/design/evaluation.md, 'Sweep units and reuse').
"""

from __future__ import annotations

import calendar
import json
import logging
import lzma
import math
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from verispec.evaluation.rowcheck import row_problem
from verispec.evaluation.stepstore import (STORED_FIELDS, StepsReader, compact_row, decompress_xz,
                                          encode_steps, is_pointer, pack_records, resolve_row, steps_files)
from verispec.machine import describe

log = logging.getLogger(__name__)

# 2: rows and units carry dtype, draft_dtype, device and backend (schema 1 rows did not)
SCHEMA_VERSION = 2


class SweepLockedError(RuntimeError):
    """Another process holds the output directory's lock."""


@dataclass
class ScanResult:
    rows: list[dict] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # 1-based line number of each row
    skipped: list[str] = field(default_factory=list)  # one message per skipped line
    skipped_lines: list[int] = field(default_factory=list)
    invalid: list[tuple[int, str]] = field(default_factory=list)  # (line, problem) of rows `check` refused
    partial_last_line: bool = False


def _unreadable(path: Path, err: OSError) -> ValueError:
    return ValueError(f"cannot read {path}: {err.strerror or err}")


MAX_RESULTS_BYTES = 4 * 2**30  # a results file larger than this is refused, not read into memory
MAX_SETTINGS_BYTES = 64 * 2**20  # a sweep.json (its suite fingerprint lists every item's digest)


def check_regular_file(path: Path, max_bytes: int, what: str = "file") -> None:
    """ValueError naming the path unless it is a regular file of at most `max_bytes` (not a FIFO, a
    device such as /dev/zero, a directory); checked before anything opens it."""
    try:
        info = os.stat(path)
    except OSError as err:
        raise _unreadable(path, err) from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path} is not a regular file (a {_kind(info.st_mode)}); give a {what} on disk")
    if info.st_size > max_bytes:
        raise ValueError(f"{path} is {info.st_size / 2**20:.0f} MiB, over the {max_bytes / 2**20:.0f} MiB "
                         f"a {what} may have")


def read_regular_file(path: Path, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of a regular file of at most `max_bytes`; ValueError naming the path for anything else
    (a FIFO, a device such as /dev/zero, a directory, a file past the limit), before reading it."""
    check_regular_file(path, max_bytes, what)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as err:
        raise _unreadable(path, err) from None
    if len(data) > max_bytes:  # it grew while read
        raise ValueError(f"{path} grew past the {max_bytes / 2**20:.0f} MiB a {what} may have")
    return data


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
             (stat.S_ISDIR, "directory"), (stat.S_ISSOCK, "socket"))
    for test, name in kinds:
        if test(mode):
            return name
    return "special file"


NON_FINITE = "non_finite"  # a row's key: where it held NaN or an infinity, stored as null (strict JSON)
_NON_FINITE_NAMES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _json_key(key) -> str:
    """A dict key as JSON writes it (1 -> "1", True -> "true"), so a path recorded with it finds the value
    in the row read back."""
    return key if isinstance(key, str) else next(iter(json.loads(json.dumps({key: 0}))))


def strict_json(row: dict) -> str:
    """The row as strict JSON (what any parser reads): each NaN or infinity is written null and named,
    by its path, under `non_finite`, so `scan_rows` gives the row back exactly."""
    found: list = []

    def walk(value, path: list):
        if isinstance(value, float) and not math.isfinite(value):
            found.append([path, "nan" if value != value else "inf" if value > 0 else "-inf"])
            return None
        if isinstance(value, dict):
            return {key: walk(item, [*path, _json_key(key)]) for key, item in value.items()}
        if isinstance(value, (list, tuple)):  # a tuple is written as a list
            return [walk(item, [*path, i]) for i, item in enumerate(value)]
        return value

    clean = walk({key: value for key, value in row.items() if key != NON_FINITE}, [])
    if found:
        clean[NON_FINITE] = found
    return json.dumps(clean, allow_nan=False)


def load_row(line: str | bytes) -> dict:
    """One stored line as the row it was written from (`strict_json`'s inverse; NaN in older, non-strict
    lines reads too). ValueError if it is not a JSON object or its `non_finite` marks are malformed."""
    row = json.loads(line)
    if not isinstance(row, dict):
        raise ValueError(f"a JSON {type(row).__name__}, not an object")
    return _restore_non_finite(row)


def _restore_non_finite(row: dict) -> dict:
    """The row `strict_json` wrote, with its NaN and infinities back. ValueError if `non_finite` is not
    a list of [path, name] naming null values of the row."""
    marks = row.pop(NON_FINITE, None)
    if marks is None:
        return row
    if not isinstance(marks, list):
        raise ValueError(f"{NON_FINITE} must be a list")
    for mark in marks:
        if not (isinstance(mark, list) and len(mark) == 2 and isinstance(mark[0], list) and mark[0]
                and mark[1] in _NON_FINITE_NAMES):
            raise ValueError(f"{NON_FINITE} holds a malformed entry {str(mark)[:80]}")
        *parents, last = mark[0]
        where = row
        try:
            for key in parents:
                where = where[key]
            if where[last] is not None:
                raise ValueError(f"{NON_FINITE} names a value that is not null: {mark[0]}")
            where[last] = _NON_FINITE_NAMES[mark[1]]
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"{NON_FINITE} names a path the row lacks: {str(mark[0])[:80]}") from None
    return row


SAME_AS = "same_as"  # a reference row's key: the sibling sweep that holds the whole row
_SWEEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


def reference_row(row: dict, source_name: str, source_row: dict) -> dict:
    """The reference that stands for `row` when sweep `source_name` holds `source_row` (the same unit):
    the fields where the two differ, plus `run`. ValueError if `row` lacks a field the source has
    (a reference cannot remove one)."""
    if row.get("unit") != source_row.get("unit"):
        raise ValueError("a reference must point at a row of the same unit")
    missing = set(source_row) - set(row)
    if missing:
        raise ValueError(f"the row lacks {sorted(missing)}, which its source has")
    ref = {"schema": row.get("schema"), "unit": row["unit"], SAME_AS: source_name}
    for key, value in row.items():
        same = json.dumps(value, sort_keys=True) == json.dumps(source_row.get(key), sort_keys=True)
        if key == "run" or not same:
            ref[key] = value
    return ref


def _resolve(path: Path, ref: dict, sources: dict[str, dict[str, dict] | str],
             steps: bool = True) -> dict | str:
    """The whole row a reference stands for, or the reason it cannot be read (a str)."""
    name = ref[SAME_AS]
    if not isinstance(name, str) or not _SWEEP_NAME.fullmatch(name) or name in (".", ".."):
        return f"{SAME_AS} must name a sibling sweep directory, got {str(name)[:80]!r}"
    if name not in sources:
        source = path.parent.parent / name / "results.jsonl"
        if not has_rows(source):
            sources[name] = f"its source {source} does not exist"
        else:
            scan = scan_rows(source, references=False, steps=steps)  # its steps read from its own folder
            sources[name] = {row.get("unit"): row for row in scan.rows if SAME_AS not in row}
    index = sources[name]
    if isinstance(index, str):
        return index
    whole = index.get(ref.get("unit"))
    if whole is None:
        return f"its source sweep {name} holds no row of unit {str(ref.get('unit'))[:40]!r}"
    return {**whole, **{key: value for key, value in ref.items() if key != SAME_AS}}


def scan_rows(path: Path, check: Callable[[dict], str | None] | None = None,
              max_bytes: int = MAX_RESULTS_BYTES, resolve: bool = True,
              references: bool | None = None, steps: bool = True) -> ScanResult:
    """Rows of a results file with their line numbers; bad lines are skipped, logged and counted.

    A last line without its newline is the unit a kill interrupted: ignored quietly (`ResultsFile`
    cuts it). `check(row)` (e.g. `rowcheck.row_problem`): a row it finds a problem with is skipped the
    same way, named with its line and the problem (`invalid`), so no reader counts it and `--resume`
    decodes its unit again. A reference row (`same_as`) is resolved to the whole row it stands for, and
    steps stored in steps.bin (`stepstore`) are read back (`resolve=False`: rows kept as written;
    `references=False`: steps read, references kept; `steps=False`: references resolved, stored steps
    and token ids left as pointers, for readers of the scalars and text alone, much faster on a large
    sweep); one that cannot be is invalid. A sealed sweep (`seal_rows`) is read from results.jsonl.xz
    when the plain file is absent. Raises ValueError naming the path if the file cannot be read at all,
    is not a regular file, or is larger than `max_bytes`."""
    out = ScanResult()
    sources: dict[str, dict[str, dict] | str] = {}
    references = resolve if references is None else references
    reader = StepsReader(Path(path).parent)
    path = Path(path)
    if not os.path.lexists(path):
        path = sealed_file(path)
        if not os.path.lexists(path):
            return out
        data = read_sealed(path, max_bytes)
    else:
        data = read_regular_file(path, max_bytes, "results file")
    lines = data.split(b"\n")
    last = len(lines) - 1  # data.split leaves b"" after a final newline
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = load_row(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            if number - 1 == last:  # no newline after it: the unit in flight when a kill came
                out.partial_last_line = True
                continue
            reason = ("not UTF-8" if isinstance(err, UnicodeDecodeError) else "JSON nested too deep"
                      if isinstance(err, RecursionError) else f"invalid JSON ({err})")
            message = f"{path}:{number}: skipped an unreadable line: {reason}"
            log.warning(message)
            out.skipped.append(message)
            out.skipped_lines.append(number)
            continue
        why = None
        if references and SAME_AS in row:
            row = _resolve(path, row, sources, steps)
            if isinstance(row, str):
                why, row = f"a reference that cannot be resolved: {row}", {}
        elif resolve and steps:
            row = resolve_row(reader, row)
            if isinstance(row, str):
                why, row = row, {}
        if why is None and check is not None:
            why = check(row)
        if why is not None:
            message = f"{path}:{number}: skipped an invalid row ({why})"
            log.warning(message)
            out.invalid.append((number, why))
            continue
        out.rows.append(row)
        out.lines.append(number)
    return out


SEALED_SUFFIX = ".xz"  # results.jsonl.xz: a finished sweep's rows, compressed (`seal_rows`)
MAX_SEALED_BYTES = 256 * 2**20  # a sealed file larger than this (compressed) is refused unread


def sealed_file(results_path: Path) -> Path:
    """Where a results file's rows lie once sealed (`seal_rows`)."""
    results_path = Path(results_path)
    return results_path.with_name(results_path.name + SEALED_SUFFIX)


def has_rows(results_path: Path) -> bool:
    """Whether a results file (plain, or sealed) holds any bytes of rows."""
    results_path = Path(results_path)
    return any(p.exists() and p.stat().st_size > 0 for p in (results_path, sealed_file(results_path)))


def read_sealed(path: Path, max_bytes: int = MAX_RESULTS_BYTES) -> bytes:
    """The rows' text of a sealed results file (`seal_rows`). ValueError naming the path if it is not a
    regular file, is damaged, or holds more than `max_bytes` of text (`stepstore.decompress_xz`)."""
    packed = read_regular_file(path, MAX_SEALED_BYTES, "sealed results file")
    return decompress_xz(packed, max_bytes, str(path))


def refuse_sealed(results_path: Path) -> None:
    """ValueError with the way out if a results file is sealed (its rows are read-only)."""
    sealed = sealed_file(results_path)
    if sealed.exists():
        raise ValueError(f"{Path(results_path).parent}'s rows are sealed ({sealed.name}) and read-only; to "
                         f"add rows, unseal them: python scripts/compact_steps.py --unseal "
                         f"{Path(results_path).parent}")


def _write_atomic(path: Path, data: bytes) -> None:
    """`path` holds `data` whole or keeps what it held: written beside, fsync'ed, renamed over."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal_rows(results_path: Path) -> Path:
    """Seal a finished sweep: its rows compressed into results.jsonl.xz, and its rows' per-position arrays
    and token ids (from steps.bin or an earlier pack) packed into one steps-<crc32>.bin.xz
    (`stepstore.pack_records`); about a tenth of the plain rows. Readers (`scan_rows`) read a sealed
    sweep as before; it is read-only (`ResultsFile` refuses it) until `unseal_rows`. A sealed sweep may be
    sealed again (its steps re-packed). Every row must read back the same, or nothing is removed.

    Crash-safe: the pack is written under a new name and the sealed rows renamed into place before the
    plain rows and the old steps files go, so an interrupted seal leaves files that read the same rows
    (the plain results file is read while it exists; sealing again finishes). Runs under the sweep's
    `DirectoryLock`."""
    results_path = Path(results_path)
    directory, sealed = results_path.parent, sealed_file(results_path)
    with DirectoryLock(directory):
        if results_path.exists():
            data = read_regular_file(results_path, MAX_RESULTS_BYTES, "results file")
            if data and not data.endswith(b"\n"):
                raise ValueError(f"{results_path} ends in a partial line: resume the sweep, or cut it, first")
        elif sealed.exists():
            data = read_sealed(sealed)
        else:
            raise FileNotFoundError(f"{results_path} does not exist")
        before = scan_rows(results_path, references=False)
        if before.skipped or before.invalid:
            raise ValueError(f"{results_path} has unreadable or invalid rows ({len(before.skipped)} + "
                             f"{len(before.invalid)}); mend or drop them before sealing")
        rows, records, slots, reader = [], [], [], StepsReader(directory)
        for line in data.split(b"\n"):
            if not line.strip():
                continue
            row = load_row(line)
            for key in STORED_FIELDS:
                if is_pointer(row.get(key)):
                    records.append(encode_steps(reader.load(row[key]), compress=False))
                    slots.append((len(rows), key))
            rows.append(row)
        old_steps = steps_files(directory)
        name = None
        if records:
            name, packed, pointers = pack_records(records)
            for (i, key), pointer in zip(slots, pointers):
                rows[i] = {**rows[i], key: pointer}
            _write_atomic(directory / name, packed)
        text = b"".join(strict_json(row).encode() + b"\n" for row in rows)
        fresh = StepsReader(directory)
        if [json.dumps(resolve_row(fresh, r), sort_keys=True) for r in rows] != [
                json.dumps(r, sort_keys=True) for r in before.rows]:
            raise ValueError(f"{directory}: the packed rows would not read back the same; nothing removed")
        _write_atomic(sealed, lzma.compress(text, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME))
        results_path.unlink(missing_ok=True)
        after = scan_rows(results_path, references=False)
        if json.dumps(after.rows, sort_keys=True) != json.dumps(before.rows, sort_keys=True):
            _write_atomic(results_path, data)  # the rows as they were; the plain file is read again
            raise ValueError(f"{sealed} does not read back as {results_path}; the plain rows are restored")
        for old in [n for n in old_steps if n != name]:  # no row points at them now
            (directory / old).unlink(missing_ok=True)
    return sealed


def unseal_rows(results_path: Path) -> Path:
    """`seal_rows`' inverse: results.jsonl again from its sealed file, which is then removed (the packed
    steps stay: the rows point into them). Where both exist (a seal interrupted before the plain rows
    went) the plain rows are the ones every reader reads, and their steps files are still there: the
    sealed file is removed and the plain rows kept."""
    results_path = Path(results_path)
    sealed = sealed_file(results_path)
    with DirectoryLock(results_path.parent):
        if not results_path.exists():
            _write_atomic(results_path, read_sealed(sealed))
        sealed.unlink()
    return results_path


def results_file(location: str | Path) -> Path:
    """A sweep's results file, given its --out directory or the file itself."""
    location = Path(location)
    if location.is_dir():
        return location / "results.jsonl"
    return location.with_name(location.name[:-len(SEALED_SUFFIX)]) if location.name.endswith(
        "results.jsonl" + SEALED_SUFFIX) else location


def read_rows(path: Path, max_new_tokens: int | None = None) -> list[dict]:
    """Complete, valid rows of a results file (a partial last line is ignored; unreadable lines and rows
    that fail `rowcheck.row_problem` are logged with their line and skipped)."""
    return scan_rows(path, check=lambda row: row_problem(row, max_new_tokens)).rows


RUNS_FILE = "runs.jsonl"  # beside results.jsonl: one line per run (`record_run`)
RUN_TIME = "%Y%m%dT%H%M%SZ"  # a run id begins with its UTC start in this format (`sweep.new_run_id`)


def run_started(run: str) -> float | None:
    """A run id's UTC start, epoch seconds (None for an id not of `sweep.new_run_id`'s form)."""
    try:
        return float(calendar.timegm(time.strptime(run[:16], RUN_TIME)))
    except ValueError:
        return None


def record_run(out_dir: Path, run: str, executor: str, batch_size: int, chunk: int | None) -> dict:
    """Append a run's record to OUT_DIR/runs.jsonl (written, flushed and fsync'ed before it decodes) and
    return it: the `run` id its rows carry, its start (UTC), executor, batch and chunk size, and the
    machine it decodes on (`verispec.machine.describe`; None under Ray, whose workers decode). A sweep
    resumed over several sessions may run on machines of different kinds; the report names the mix."""
    record = {"run": run, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "executor": executor, "batch_size": batch_size, "chunk": chunk,
              "machine": describe() if executor == "local" else None}
    with (Path(out_dir) / RUNS_FILE).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return record


def read_runs(results_path: Path) -> dict[str, dict]:
    """{run id: its record} from the runs.jsonl beside a results file ({} where there is none: sweeps
    written before runs were recorded); unreadable lines are skipped and logged (`scan_rows`), and an
    unreadable file is logged and read as none (the record only adds a note to a report)."""
    try:
        scan = scan_rows(Path(results_path).parent / RUNS_FILE)
    except ValueError as err:
        log.warning("%s; the runs' machines are left out of the report", err)
        return {}
    return {r["run"]: r for r in scan.rows if isinstance(r.get("run"), str)}


def check_schema(path: Path, rows: list[dict], lines: list[int] | None = None) -> None:
    """Refuse rows written by another schema version, with both version numbers."""
    for i, row in enumerate(rows):
        if row.get("schema") != SCHEMA_VERSION:
            where = f"{path}:{lines[i]}" if lines else str(path)
            found = row.get("schema")
            age = "an older" if isinstance(found, int) and found < SCHEMA_VERSION else "another (newer?)"
            raise ValueError(f"{where}: row with schema {found!r} ({age} verispec), this verispec reads "
                             f"and writes schema {SCHEMA_VERSION}; use a verispec that matches, "
                             "or a new output directory")


class DirectoryLock:
    """An exclusive, non-blocking `fcntl.flock` on DIR/.lock, holding the owner's pid; released on close
    (and by the OS when the process dies, so a killed sweep never leaves a stale lock)."""

    def __init__(self, directory: Path):
        import fcntl

        self.path = Path(directory) / ".lock"
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise PermissionError(f"cannot write to {directory}: {err.strerror or err}") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(self._fd)
            raise SweepLockedError(f"{directory} is in use by another verispec process (pid {holder}); "
                                   "wait for it to finish or use another --out") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def close(self) -> None:
        import fcntl

        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ResultsFile:
    """The writer's side: `done` holds the unit keys present; rows are not kept in memory (a long sweep's
    writer, e.g. the Ray executor's driver, grows by a key per row, not by the rows' steps)."""

    def __init__(self, path: Path, max_new_tokens: int | None = None, compact_steps: bool = True):
        """compact_steps: a row's steps go to steps.bin (`stepstore`), the row keeps a pointer."""
        self.path, self.compact_steps = path, compact_steps
        path.parent.mkdir(parents=True, exist_ok=True)
        refuse_sealed(path)
        self._repair()
        scan = scan_rows(path, check=lambda row: None if row.get("schema") != SCHEMA_VERSION
                         else row_problem(row, max_new_tokens))  # another schema: refused below
        self.skipped = scan.skipped
        self.invalid = scan.invalid  # their units are not done: decoded again
        check_schema(path, scan.rows, scan.lines)
        self.done = {row["unit"] for row in scan.rows if isinstance(row.get("unit"), str)}
        self._file = open(path, "a", encoding="utf-8")

    def _repair(self) -> None:
        """Cut a partial last line (left by a kill mid-write) so the next row starts on a fresh line."""
        if not self.path.exists():
            return
        check_regular_file(self.path, MAX_RESULTS_BYTES, "results file")  # no FIFO, no device
        with open(self.path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)

    def append(self, row: dict) -> None:
        if row["unit"] in self.done:
            return
        if self.compact_steps:
            row = compact_row(self.path.parent, row)  # steps.bin written and fsync'ed before the row
        self._file.write(strict_json(row) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done.add(row["unit"])

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
