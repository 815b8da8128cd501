"""Sweeps: a grid of rules x temperatures x k x seeds over a suite, for one model pair.

Units are (prompt, seed, config); units of one (prompt, seed) run back to back across all configs,
so every config is timed interleaved with plain decoding on the same prompt. Every unit draws its
randomness from its own generator seeded by (seed, prompt index): a resumed sweep reproduces the
rows an uninterrupted one would have written (timings aside). The baselines are always included:
plain target decoding, lossless speculative decoding, and for each truncation rule its honest
truncation sampler at the same threshold (`honest:<spec>`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Sequence

from verispec import defaults
from verispec.evaluation.ray_executor import RayPool, check_ray_spec, import_ray
from verispec.evaluation.store import (
    MAX_SETTINGS_BYTES,
    RUN_TIME,
    SAME_AS,
    SCHEMA_VERSION,
    DirectoryLock,
    ResultsFile,
    check_schema,
    has_rows,
    read_regular_file,
    read_rows,
    record_run,
    reference_row,
    refuse_sealed,
    results_file,
    scan_rows,
)
from verispec.evaluation.rowcheck import row_problem
from verispec.evaluation.sandbox import require_sandbox
from verispec.evaluation.suites import file_fingerprint, fingerprint_changes, load_suite
from verispec.evaluation.units import PLAIN, LocalExecutor, RunConfig, SweepSpec, unit_key
from verispec.ray_cluster import RayOptions

log = logging.getLogger(__name__)










def new_run_id() -> str:
    """The id every row decoded by one `run_sweep` call records as `run` (UTC start time and 6 random
    hex digits): the report pairs a row with a plain row for its speedup only within one run, since
    rows timed in another process (a sweep resumed part-way through a chunk) or another sweep
    (`--reuse-from`) were timed under other conditions."""
    return time.strftime(RUN_TIME, time.gmtime()) + "-" + secrets.token_hex(3)










def _settings_json(spec: SweepSpec, suite_file: dict | None = None) -> str:
    """sweep.json: the settings, and for a file-backed suite its fingerprint (`suites.file_fingerprint`).
    `compare`, `sequential` and `trees` are left out when unset, so sweeps written before they
    existed resume."""
    settings = asdict(spec)
    for key, unset in (("compare", ()), ("sequential", None), ("trees", ())):
        if settings[key] in (unset, list(unset or [])):
            del settings[key]
    extra = {} if suite_file is None else {"suite_file": suite_file}
    return json.dumps({"schema": SCHEMA_VERSION, **settings, **extra}, indent=2, sort_keys=True) + "\n"


EXECUTORS = ("local", "ray")


def run_sweep(spec: SweepSpec, out_dir: str | Path, resume: bool = False, progress: bool = True,
              batch_size: int = defaults.BATCH_SIZE, executor: str = "local", ray_options=None,
              on_row: Callable[[dict, tuple], None] | None = None,
              reuse_from: str | Path | Sequence[str | Path] | None = None, reuse_plain: bool = False,
              chunk: int | None = None) -> Path:
    """Run (or resume) a sweep; rows go to OUT_DIR/results.jsonl, the settings to OUT_DIR/sweep.json.

    Order: every setting is validated, the directory locked (one writer at a time), the models loaded
    and every prompt checked against the context, and only then is anything written. `resume`
    continues only the sweep `sweep.json` describes (same settings, dtypes, device and backend);
    without a `sweep.json` it refuses rather than guess whose rows `results.jsonl` holds.
    `batch_size` (rows decoded together) changes timings, not results, so it is not part of the
    sweep's settings: a sweep may be resumed with another batch size.

    `chunk` (None: `batch_size`): (prompt, seed) rows per work unit. Each configuration decodes a
    unit's rows `batch_size` at a time by continuous batching (a finished row's slot goes to the next
    row), so a chunk larger than the batch keeps the slots full when replies end at different lengths;
    the configurations still run back to back on each unit's rows, so speed stays compared interleaved.
    Timings only, like `batch_size` (rows draw from their own generators; matmul rounding aside,
    docs/design.md 'Token roles'): not a setting, a sweep may be resumed with another chunk.

    `executor`: "local" decodes in this process; "ray" hands the same work units to Ray actors, each
    holding the model pair (`verispec.evaluation.ray_executor`, options in `ray_options`, a
    `RayOptions`). This process alone writes the results file, so the rows, `--resume` and the
    crash-safety are the same for both, and a sweep started with one executor may be resumed with the
    other. `on_row(row, workers)` is called after each row is appended (`workers`: the live Ray actor
    handles; empty for the local executor): a hook for tests and benchmarks.

    `reuse_from`: other sweeps' directories (or results files). Their rows whose unit key a unit of this
    sweep has (same suite, models, dtypes, device, backend, prompt, seed, rule, k, temperature and
    max_new_tokens: the same result) are copied instead of decoded, marked `reused_from`, with their
    own timings; plain decoding is not copied, so every speedup of a newly decoded row is measured
    against plain rows timed in this run (`reuse_rows`). `reuse_plain` copies plain rows too: a rule
    added to a finished study for its quality alone, without paying for plain decoding again; its rows
    then have no speedup (the report says so), every other column is unchanged."""
    if not isinstance(reuse_plain, bool):
        raise TypeError(f"reuse_plain must be True or False, got {reuse_plain!r}")
    if reuse_plain and not reuse_from:
        raise ValueError("reuse_plain (--reuse-plain) copies plain rows from --reuse-from: give the sweeps")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < batch_size):
        raise ValueError(f"chunk must be an integer >= batch_size ({batch_size}), got {chunk!r}")
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    check_out_dir(out_dir)  # before anything starts: '' (the current directory), a file, an unwritable path
    if executor == "local" and ray_options is not None:
        raise ValueError("ray_options apply only to executor='ray'")
    spec = spec.resolved()
    spec.validate(device_here=executor == "local")
    if executor == "ray":
        ray_options = RayOptions() if ray_options is None else ray_options
        ray_options.validate()
        check_ray_spec(spec)
        import_ray()  # Ray missing: say which extra to install before anything is locked or written
    out_dir = check_out_dir(out_dir)
    suite_file = file_fingerprint(spec.suite)
    run = new_run_id()
    sources = [] if reuse_from is None else read_reusable(reuse_from, out_dir / "results.jsonl")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PermissionError(f"cannot create the output directory {out_dir}: "
                              f"{err.strerror or err}") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write to the output directory {out_dir}: permission denied")
    spec_path, results_path = out_dir / "sweep.json", out_dir / "results.jsonl"
    with DirectoryLock(out_dir):
        refuse_sealed(results_path)  # before any model loads
        held = has_rows(results_path)
        if held and not resume:
            raise FileExistsError(f"{results_path} already has results: pass --resume to continue it, "
                                  "or use a new --out")
        if held and not spec_path.exists():
            raise ValueError(f"{results_path} has results but {spec_path} is missing: "
                             "cannot tell which sweep they "
                             "belong to, so refusing to resume; use a new --out")
        if held:
            check_config_ids(results_path, spec.configs())
            # everything but the backend (known once the models are loaded), before anything loads
            _check_resumable(spec_path, spec, ignore_backend=True, suite_file=suite_file)

        suite = load_suite(spec.suite).limit(spec.limit)
        if suite.program is not None:  # generated code will run: the sandbox must, before models load
            require_sandbox()
        configs = spec.configs()
        max_new = spec.max_new_tokens or suite.max_new_tokens
        units = [(i, item, seed, c)
                 for i, item in enumerate(suite.items) for seed in spec.seeds for c in configs]
        # both executors: load the pair (here or on the workers), check every prompt's context, then
        # decode the units still to do; this process alone writes the results file
        pool = (RayPool(spec, suite, max_new, ray_options) if executor == "ray"
                else LocalExecutor(spec, suite, max_new))
        with pool:
            spec = replace(spec, backend=str(pool.backend))
            if held:
                _check_resumable(spec_path, spec, suite_file=suite_file)
                check_rows_belong(results_path, {unit_key(spec, item, seed, c) for _, item, seed, c in units},
                                  max_new)
            spec_path.write_text(_settings_json(spec, suite_file), encoding="utf-8")
            reuse_rows(spec, units, sources, results_path, progress, reuse_plain, suite_file, max_new)
            # the run is recorded (runs.jsonl) just before its first unit decodes: a resume with nothing
            # left, or a sweep whose rows were all copied (--reuse-from), decodes nothing and records nothing
            pool.run_units(spec, suite, units, results_path, progress, batch_size, on_row, run, chunk=chunk,
                           on_start=lambda: record_run(out_dir, run, executor, batch_size, chunk))
    return results_path


def read_reusable(sources, results_path: Path) -> list[tuple[str, Path]]:
    """(source, results file) of each sweep in `sources` (directories or results files) for
    `reuse_rows`, checked before anything is locked, loaded or written: a missing or unreadable source,
    this sweep's own results file, or rows of another schema are refused (FileNotFoundError /
    ValueError naming it). The rows are not kept: `reuse_rows` reads them again, one source at a time,
    so they are not held in memory beside the models for the whole sweep."""
    out = []
    for source in [sources] if isinstance(sources, (str, Path)) else list(sources):
        path = results_file(source)
        if not has_rows(path) and not path.is_file():
            raise FileNotFoundError(f"--reuse-from: no results file at {path} (give another sweep's --out "
                                    "directory)")
        if results_path.exists() and path.resolve() == results_path.resolve():
            raise ValueError(f"--reuse-from {source} is this sweep's own output; to continue it use --resume")
        scan = scan_rows(path)
        check_schema(path, scan.rows, scan.lines)
        out.append((str(source), path))
    return out


def reuse_rows(spec: SweepSpec, units, sources: list[tuple[str, Path]], results_path: Path,
               progress: bool = False, reuse_plain: bool = False, suite_file: dict | None = None,
               max_new_tokens: int | None = None) -> int:
    """Append the rows of other sweeps (`read_reusable`; the first source holding a unit wins) that are
    results of this sweep's units not yet done: same unit key, and the row's own prompt, seed and
    configuration agree with it. Plain decoding is not copied unless `reuse_plain` (it is the speed
    reference: re-decoded here, beside this run's rows). Each copy keeps its tokens, metrics and timings
    (batch size included) and gains `reused_from`: the sweep that decoded it, kept through copies of copies.
    For a file-backed suite (`suite_file`, its fingerprint) a row is copied only if the source's sweep.json
    records the same digest for its prompt (an edited question is decoded again). Returns the count."""
    wanted = {unit_key(spec, item, seed, config): (item.id, seed, config.id)
              for _, item, seed, config in units if reuse_plain or config.rule != PLAIN}
    total = 0
    with ResultsFile(results_path, max_new_tokens) as store:
        for source, path in sources:
            copied, same, changed = 0, _same_items(path, suite_file), set()
            # a sibling sweep's row is written as a reference to it (store, `same_as`), not a copy
            sibling = Path(path).resolve().parent.parent == Path(results_path).resolve().parent.parent
            held = scan_rows(path, references=False).rows if sibling else []  # its steps read, refs kept
            raw = {row.get("unit"): row for row in held}
            for row in read_rows(path, max_new_tokens):  # a row that fails rowcheck is named, never copied
                unit = row.get("unit")
                if unit not in wanted or unit in store.done:
                    continue
                if not same(row.get("prompt_id")):
                    changed.add(str(row.get("prompt_id")))
                    continue
                if (row.get("prompt_id"), row.get("seed"), row.get("config")) != wanted[unit]:
                    log.warning("--reuse-from %s: the row of unit %s does not match its key; not copied",
                                source, unit)
                    continue
                copy = {**row, "reused_from": row.get("reused_from", source)}
                stored = raw.get(unit)
                if stored is not None and SAME_AS in stored:  # already a reference: point at its holder
                    copy = {**stored, "reused_from": copy["reused_from"]}
                elif stored is not None:
                    copy = reference_row(copy, Path(path).resolve().parent.name, stored)
                store.append(copy)
                copied += 1
            if changed:
                log.warning("--reuse-from %s: %d prompt(s) not the same item in its data file (or its "
                            "sweep.json records none), their rows not copied: %s", source, len(changed),
                            ", ".join(sorted(changed)[:5]))
            if progress:
                print(f"sweep: copied {copied} row(s) from {source} (--reuse-from)", file=sys.stderr)
            total += copied
    return total


def _same_items(results_path: Path, suite_file: dict | None) -> Callable[[object], bool]:
    """Whether a prompt id of the sweep at `results_path` reads the same item as in `suite_file` (always
    true for a built-in suite; never when the source's sweep.json records no fingerprint)."""
    if suite_file is None:
        return lambda prompt_id: True
    try:
        theirs = json.loads(read_regular_file(results_path.parent / "sweep.json", MAX_SETTINGS_BYTES,
                                              "sweep.json").decode("utf-8"))["suite_file"]
        items = dict(theirs["items"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        items = {}
    return lambda prompt_id: prompt_id in items and items[prompt_id] == suite_file["items"].get(prompt_id)






def check_rows_belong(results_path: Path, units: set[str], max_new_tokens: int | None) -> None:
    """Refuse to resume (ValueError naming the line) when the results file holds a row that is no unit of
    this sweep: its settings differ from what sweep.json and the command say (e.g. a hand-edited
    sweep.json, whose rows were decoded under another max_new_tokens); resuming would decode this
    sweep's units beside them and a report would merge both settings. Rows that fail `rowcheck` are
    named by `ResultsFile` and decoded again, not refused here."""
    scan = scan_rows(results_path, check=lambda row: row_problem(row, max_new_tokens))
    for row, line in zip(scan.rows, scan.lines):
        if row.get("unit") not in units:
            cap = (f" (its max_new_tokens {row['max_new_tokens']}, this sweep's {max_new_tokens})"
                   if row.get("max_new_tokens", max_new_tokens) != max_new_tokens else "")
            raise ValueError(f"{results_path}:{line}: row {row.get('config')!r} / {row.get('prompt_id')!r} "
                             f"(seed {row.get('seed')!r}) is not a unit of this sweep{cap}: its settings "
                             "differ from sweep.json's and the command's (was either edited?); resuming "
                             "would mix both settings in one report; restore them or use a new --out")


def check_config_ids(results_path: Path, configs: list[RunConfig]) -> None:
    """Refuse to resume rows written under a rounded temperature id (`RunConfig.legacy_id`): their unit
    keys are not this release's, so they would be decoded again beside the old ones."""
    ids = {c.id for c in configs}
    legacy = {c.legacy_id: c.id for c in configs if c.legacy_id != c.id}
    if not legacy:
        return
    for row in scan_rows(results_path).rows:  # every readable row, valid or not: its key is what matters
        if row.get("config") in legacy and row.get("config") not in ids:
            raise ValueError(f"{results_path} holds rows of {row['config']!r}, written by an older verispec "
                             f"that rounded the temperature to 6 digits (now {legacy[row['config']]!r}); "
                             "they cannot be resumed exactly: use a new --out")


def _check_resumable(spec_path: Path, spec: SweepSpec, ignore_backend: bool = False,
                     suite_file: dict | None = None) -> None:
    """Refuse to resume a sweep whose sweep.json describes other settings (more seeds aside: a resume may
    extend a sweep to seeds it did not have; the backend aside if asked:
    the Ray executor learns it from its workers, and checks it again then), or whose data file changed
    since (`suite_file`: ValueError naming the ids added, removed and edited)."""
    try:
        raw = read_regular_file(spec_path, MAX_SETTINGS_BYTES, "sweep.json")
        old_settings = json.loads(raw.decode("utf-8"))
        if not isinstance(old_settings, dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ValueError(f"cannot read {spec_path}: {err}") from None
    old_file = old_settings.pop("suite_file", None)
    new_settings = json.loads(_settings_json(replace(spec, backend=None) if ignore_backend else spec))
    if ignore_backend:
        old_settings["backend"] = None
    old_seeds, new_seeds = old_settings.pop("seeds", None), new_settings.pop("seeds", None)
    if old_settings == new_settings and old_seeds != new_seeds:
        # more seeds for the same sweep: the old seeds' units keep their keys and rows (each row's generator
        # is seeded by its own (seed, prompt index)); dropping a seed would orphan rows, so it is refused
        if not isinstance(old_seeds, list) or not set(old_seeds) <= set(new_seeds):
            raise ValueError(f"{spec_path} was run with --seeds {old_seeds}: a resume may add seeds, not "
                             f"drop them (got --seeds {new_seeds}); use a new --out")
        log.info("%s: extending the sweep from seeds %s to %s", spec_path, old_seeds, new_seeds)
    if old_settings != new_settings:
        raise ValueError(f"{spec_path} describes a different sweep "
                         "(settings, dtype, device, backend or "
                         "schema differ); resume with the same settings or use a new --out")
    if suite_file is None:
        return
    if not isinstance(old_file, dict):
        log.warning("%s records no fingerprint of the suite's data file (written by an older verispec): "
                    "cannot check that %s is unchanged since the sweep began", spec_path, spec.suite)
    elif old_file.get("sha256") != suite_file["sha256"]:
        raise ValueError(f"the data file of suite {spec.suite!r} changed since this sweep began "
                         f"({fingerprint_changes(old_file, suite_file)}): its rows would mix old and new "
                         "questions; restore the file or use a new --out")


def check_out_dir(out_dir) -> Path:
    """The output directory, refused (ValueError / PermissionError naming it) when it cannot be one: an
    empty name (it would be the current directory), a file, a path under a file, or an unwritable place."""
    if isinstance(out_dir, str) and not out_dir.strip():
        raise ValueError("--out must name a directory, got an empty path (it would write into the current "
                         "directory); give e.g. --out runs/my-sweep")
    if not isinstance(out_dir, (str, Path)):
        raise TypeError(f"out_dir must be a str or Path, got {type(out_dir).__name__}")
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path} is a file, not a directory; give a directory")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--out {path}: {existing} is a file, so no directory can be made under it")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write to the output directory {path}: {existing} is not writable")
    return path










