"""Sweeps: a grid of rules x temperatures x k x seeds over a suite, for one model pair.

Units are (prompt, seed, config); units of one (prompt, seed) run back to back across all configs,
so every config is timed interleaved with plain decoding on the same prompt. Every unit draws its
randomness from its own generator seeded by (seed, prompt index): a resumed sweep reproduces the
rows an uninterrupted one would have written (timings aside). The baselines are always included:
plain target decoding, lossless speculative decoding, and for each truncation rule its honest
truncation sampler at the same threshold (`honest:<spec>`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import secrets
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from verispec.evaluation.store import (SCHEMA_VERSION, DirectoryLock, ResultsFile, check_schema, read_rows,
                                      results_file, scan_rows)
from verispec.evaluation.suites import TARGET_LOGLIK, Item, Suite, load_suite
from verispec.decode import DecodeConfig, Generation, decode_prompts
from verispec.rules import honest_baseline, parse
from verispec.sampling import SamplingConfig
from verispec.tree_decode import TRAVERSAL, tree_verification_rule
from verispec.trees import TreeWidths, parse_shape

log = logging.getLogger(__name__)
PLAIN = "plain"
STEP_FIELDS = ("role", "tv", "kl", "tv_baseline", "max_ratio", "tail_mass", "expected_accept",
               "draft_confidence", "draft_over_target", "log_law", "log_target", "log_target_raw")


@dataclass(frozen=True)
class RunConfig:
    rule: str  # canonical rule spec, or "plain"
    k: int
    temperature: float
    tree: str | None = None  # a tree or multi-draft shape (`tree:widths=...`, `drafts:n=...`); None: chains

    @property
    def id(self) -> str:
        if self.rule == PLAIN:
            return f"plain T={self.temperature:g}"
        shape = f" {self.tree}" if self.tree else ""
        return f"{self.rule}{shape} k={self.k} T={self.temperature:g}"


@dataclass(frozen=True)
class SweepSpec:
    suite: str = "shakespeare"
    target: str = "default"
    draft: str = "default-draft"
    rules: tuple[str, ...] = ("lossless",)
    temperatures: tuple[float, ...] = (1.0,)
    ks: tuple[int, ...] = (4,)
    seeds: tuple[int, ...] = (0,)
    limit: int | None = None  # number of prompts (None: the whole suite)
    max_new_tokens: int | None = None  # None: the suite's default
    device: str = "cpu"
    dtype: str = "float32"  # the target's compute dtype
    draft_dtype: str = "float32"
    backend: str | None = None  # the target's backend (lean / hf); filled in by run_sweep once it is loaded
    # tree / multi-draft shapes as an axis (`tree:widths=4,2,2,1`, `drafts:n=3`): each with lossless, and
    # with every rule that is a tree rule (lossy ones on top-k trees only); `traversal` is tree-only
    trees: tuple[str, ...] = ()

    def validate(self, device_here: bool = True) -> None:
        """Every setting checked (ValueError / TypeError naming it) before anything is written.

        `device_here=False` (the Ray executor: the models run on the workers, not on this machine) checks
        only that the device names a torch device type; the workers check that they have it."""
        from verispec.api import DTYPES, check_device

        for name in ("suite", "target", "draft"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"sweep {name} must be a non-empty string, got {getattr(self, name)!r}")
        load_suite(self.suite)  # unknown suite, missing file
        for name, values in (("rules", self.rules), ("temperatures", self.temperatures), ("ks", self.ks),
                             ("seeds", self.seeds)):
            if not values:
                raise ValueError(f"sweep {name} must not be empty")
        for t in self.temperatures:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        for k in self.ks:
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"k (draft tokens per block) must be an integer >= 1, got {k!r}")
        for seed in self.seeds:
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SWEEP_SEED:
                raise ValueError(f"seed must be an integer in [0, 2**40], got {seed!r}")
        for name in ("limit", "max_new_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 (or unset), got {value!r}")
        for name in ("dtype", "draft_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(DTYPES)}, got {getattr(self, name)!r}")
        if device_here:
            check_device(self.device)
        elif not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda", "mps"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        self.configs()  # parses every rule spec

    def configs(self) -> list[RunConfig]:
        """The grid, baselines included: plain, lossless and honest truncation samplers; then the tree
        configurations (`tree_configs`)."""
        tree_only = [r for r in self.rules if r.strip() == TRAVERSAL]
        rules = [parse(r) for r in self.rules if r not in tree_only]  # validates every spec up front
        if tree_only and not self.trees:
            raise ValueError("rule 'traversal' verifies trees: give --tree (e.g. tree:widths=4,2,2,1)")
        specs: list[str] = ["lossless"]
        for rule in rules:
            specs.append(rule.spec)
            honest = honest_baseline(rule)
            if honest is not None:
                specs.append(honest.spec)
        specs = list(dict.fromkeys(specs))  # de-duplicate, keep order
        out = [RunConfig(PLAIN, 0, t) for t in self.temperatures]
        out += [RunConfig(s, k, t) for t in self.temperatures for k in self.ks for s in specs]
        return out + tree_configs(self.trees, self.rules, self.ks, self.temperatures)


def tree_configs(trees: Sequence[str], rules: Sequence[str], ks: Sequence[int],
                 temperatures: Sequence[float]) -> list[RunConfig]:
    """Per tree shape: lossless and every rule of `rules` that is a tree rule (`traversal` included;
    chain-only rules are left out); lossy rules only on top-k trees (their exact laws need a tree that
    is a function of the prefix). A `tree:widths` shape fixes its depth (k = its number of widths);
    `drafts:n` without a depth takes each k of the grid."""
    out = []
    for text in trees:
        shape = parse_shape(text)  # ValueError on a bad shape
        specs = []
        for spec in ["lossless", *rules]:
            try:
                verification = tree_verification_rule(spec, shape)
            except ValueError:
                continue  # a chain-only rule, or a lossy rule on sampled drafts
            specs.append(verification.spec)
        depths = [shape.depth] if isinstance(shape, TreeWidths) else (
            [shape.depth] if shape.depth is not None else list(ks))
        out += [RunConfig(s, k, t, shape.spec) for t in temperatures for k in depths
                for s in dict.fromkeys(specs)]
    return out


MAX_SWEEP_SEED = 2**40  # a unit's generator is seeded with seed * 1_000_003 + prompt index (< 2**64)


def new_run_id() -> str:
    """The id every row decoded by one `run_sweep` call records as `run` (UTC start time and 6 random
    hex digits): the report pairs a row with a plain row for its speedup only within one run, since
    rows timed in another process (a sweep resumed part-way through a chunk) or another sweep
    (`--reuse-from`) were timed under other conditions."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def unit_key(spec: SweepSpec, item: Item, seed: int, config: RunConfig) -> str:
    """The identity of a unit: every setting that changes its result (models, dtypes, device, backend)."""
    raw = json.dumps([SCHEMA_VERSION, spec.suite, spec.target, spec.draft, item.id, seed, config.id,
                      spec.max_new_tokens, spec.dtype, spec.draft_dtype, spec.device, spec.backend]
                     + ([config.tree] if config.tree else []))  # chain units keep their keys
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def _round(values: list, digits: int = 6) -> list:
    return [v if isinstance(v, str) else (float(f"{v:.{digits}g}") if math.isfinite(v) else v)
            for v in values]


def make_row(spec: SweepSpec, suite: Suite, item: Item, index: int, seed: int, config: RunConfig,
             gen: Generation, text: str) -> dict:
    if gen.steps is None:
        raise ValueError("sweep rows need per-step diagnostics (DecodeConfig.diagnostics=True)")
    metrics = suite.score(text, item)
    stats = gen.stats()
    metrics[TARGET_LOGLIK] = -stats["target_nll"]  # every suite's; the score of suites without a task
    del stats["rule"]  # the row's rule is the config's (plain decoding reports "plain" too)
    del stats["verification"]  # the per-response report (verispec serve); rows keep the full steps
    return {
        "schema": SCHEMA_VERSION, "unit": unit_key(spec, item, seed, config),
        "suite": suite.name, "prompt_id": item.id, "prompt_index": index, "seed": seed,
        "target": spec.target, "draft": spec.draft, "dtype": spec.dtype, "draft_dtype": spec.draft_dtype,
        "device": spec.device, "backend": spec.backend, "config": config.id, "rule": config.rule,
        "k": config.k,
        "temperature": config.temperature,
        "family": (PLAIN if config.rule == PLAIN else parse(config.rule).family if not config.tree
                   else tree_verification_rule(config.rule, parse_shape(config.tree)).family),
        "tree": config.tree,
        **stats,
        "metrics": metrics, "score": metrics.get(suite.primary), "score_name": suite.primary,
        "text": text, "token_ids": list(gen.token_ids),
        "steps": {f: _round(gen.steps[f]) for f in STEP_FIELDS if f in gen.steps},
    }


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, unit="run", desc="sweep", file=sys.stderr, dynamic_ncols=True)


def _settings_json(spec: SweepSpec) -> str:
    settings = asdict(spec)
    if not spec.trees:  # sweeps without trees keep the sweep.json they had before the axis existed
        del settings["trees"]
    return json.dumps({"schema": SCHEMA_VERSION, **settings}, indent=2, sort_keys=True) + "\n"


EXECUTORS = ("local", "ray")


def run_sweep(spec: SweepSpec, out_dir: str | Path, resume: bool = False, progress: bool = True,
              batch_size: int = 1, executor: str = "local", ray_options=None,
              on_row: Callable[[dict, tuple], None] | None = None,
              reuse_from: str | Path | Sequence[str | Path] | None = None, reuse_plain: bool = False) -> Path:
    """Run (or resume) a sweep; rows go to OUT_DIR/results.jsonl, the settings to OUT_DIR/sweep.json.

    Order: every setting is validated, the directory locked (one writer at a time), the models loaded
    and every prompt checked against the context, and only then is anything written. `resume`
    continues only the sweep `sweep.json` describes (same settings, dtypes, device and backend);
    without a `sweep.json` it refuses rather than guess whose rows `results.jsonl` holds.
    `batch_size` (rows decoded together) changes timings, not results, so it is not part of the
    sweep's settings: a sweep may be resumed with another batch size.

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
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    if executor == "local" and ray_options is not None:
        raise ValueError("ray_options apply only to executor='ray'")
    from verispec.api import as_dtype, encode_prompt, resolve_drafter, resolve_target

    spec.validate(device_here=executor == "local")
    if executor == "ray":
        from verispec.evaluation.ray_executor import RayOptions, check_ray_spec, import_ray

        ray_options = RayOptions() if ray_options is None else ray_options
        ray_options.validate()
        check_ray_spec(spec)
        import_ray()  # Ray missing: say which extra to install before anything is locked or written
    out_dir = Path(out_dir)
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
        has_rows = results_path.exists() and results_path.stat().st_size > 0
        if has_rows and not resume:
            raise FileExistsError(f"{results_path} already has results: pass --resume to continue it, "
                                  "or use a new --out")
        if has_rows and not spec_path.exists():
            raise ValueError(f"{results_path} has results but {spec_path} is missing: "
                             "cannot tell which sweep they "
                             "belong to, so refusing to resume; use a new --out")

        suite = load_suite(spec.suite).limit(spec.limit)
        configs = spec.configs()
        max_new = spec.max_new_tokens or suite.max_new_tokens
        units = [(i, item, seed, c)
                 for i, item in enumerate(suite.items) for seed in spec.seeds for c in configs]
        if executor == "ray":
            from verispec.evaluation.ray_executor import RayPool

            if has_rows:  # everything but the backend (which the workers report), before Ray starts
                _check_resumable(spec_path, spec, ignore_backend=True)
            with RayPool(spec, suite, max_new, ray_options) as pool:  # starts, loads, checks contexts
                spec = replace(spec, backend=pool.backend)
                if has_rows:
                    _check_resumable(spec_path, spec)
                spec_path.write_text(_settings_json(spec), encoding="utf-8")
                reuse_rows(spec, units, sources, results_path, progress, reuse_plain)
                pool.run_units(spec, suite, units, results_path, progress, batch_size, on_row, run)
            return results_path

        target = resolve_target(spec.target, spec.device, as_dtype(spec.dtype))
        spec = replace(spec, backend=str(backend_of(target)))
        if has_rows:
            _check_resumable(spec_path, spec)
        drafter = resolve_drafter(spec.draft, target, spec.device, as_dtype(spec.draft_dtype))
        prompts = [encode_prompt(target, item.prompt, suite.chat) for item in suite.items]
        check_contexts(suite, prompts, target, drafter, max_new)
        spec_path.write_text(_settings_json(spec), encoding="utf-8")
        reuse_rows(spec, units, sources, results_path, progress, reuse_plain)
        _run_units(spec, suite, units, target, drafter, prompts, max_new, results_path, progress, batch_size,
                   on_row, run)
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
        if not path.is_file():
            raise FileNotFoundError(f"--reuse-from: no results file at {path} (give another sweep's --out "
                                    "directory)")
        if results_path.exists() and path.resolve() == results_path.resolve():
            raise ValueError(f"--reuse-from {source} is this sweep's own output; to continue it use --resume")
        scan = scan_rows(path)
        check_schema(path, scan.rows, scan.lines)
        out.append((str(source), path))
    return out


def reuse_rows(spec: SweepSpec, units, sources: list[tuple[str, Path]], results_path: Path,
               progress: bool = False, reuse_plain: bool = False) -> int:
    """Append the rows of other sweeps (`read_reusable`; the first source holding a unit wins) that are
    results of this sweep's units not yet done: same unit key, and the row's own prompt, seed and
    configuration agree with it. Plain decoding is not copied unless `reuse_plain` (it is the speed
    reference: re-decoded here, beside this run's rows). Each copy keeps its tokens, metrics and timings
    (batch size included) and gains `reused_from`: the sweep that decoded it, kept through copies of copies.
    Returns the count."""
    wanted = {unit_key(spec, item, seed, config): (item.id, seed, config.id)
              for _, item, seed, config in units if reuse_plain or config.rule != PLAIN}
    total = 0
    with ResultsFile(results_path) as store:
        for source, path in sources:
            copied = 0
            for row in read_rows(path):
                unit = row.get("unit")
                if unit not in wanted or unit in store.done:
                    continue
                if (row.get("prompt_id"), row.get("seed"), row.get("config")) != wanted[unit]:
                    log.warning("--reuse-from %s: the row of unit %s does not match its key; not copied",
                                source, unit)
                    continue
                store.append({**row, "reused_from": row.get("reused_from", source)})
                copied += 1
            if progress:
                print(f"sweep: copied {copied} row(s) from {source} (--reuse-from)", file=sys.stderr)
            total += copied
    return total


def backend_of(target) -> str:
    """The backend a loaded target runs on (lean / hf), as recorded in sweep.json and every unit key."""
    return str(getattr(target, "backend", None) or os.environ.get("VERISPEC_BACKEND", "n/a"))


def check_contexts(suite: Suite, prompts: list[list[int]], target, drafter, max_new: int) -> None:
    """Refuse (ValueError naming the prompt) a prompt + max_new that does not fit a model's context."""
    from verispec.decode import check_context

    for item, ids in zip(suite.items, prompts):
        try:
            check_context(target, len(ids), max_new, drafter)
        except ValueError as err:
            raise ValueError(f"prompt {item.id!r} of suite {suite.name}: {err}") from None


def _check_resumable(spec_path: Path, spec: SweepSpec, ignore_backend: bool = False) -> None:
    """Refuse to resume a sweep whose sweep.json describes other settings (the backend aside if asked:
    the Ray executor learns it from its workers, and checks it again then)."""
    try:
        old = spec_path.read_text(encoding="utf-8")
        if ignore_backend:
            old_settings = json.loads(old)
            if not isinstance(old_settings, dict):
                raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"cannot read {spec_path}: {err}") from None
    if ignore_backend:
        same = {**old_settings, "backend": None} == json.loads(_settings_json(replace(spec, backend=None)))
    else:
        same = old == _settings_json(spec)
    if not same:
        raise ValueError(f"{spec_path} describes a different sweep "
                         "(settings, dtype, device, backend or "
                         "schema differ); resume with the same settings or use a new --out")


def work_units(units, done: set[str], spec: SweepSpec, batch_size: int) -> list[tuple[RunConfig, list]]:
    """The work still to do, in the order both executors hand it out: `batch_size` (prompt, seed) rows
    at a time, every configuration on those rows back to back; each item is (config, its units)."""
    todo = [u for u in units if unit_key(spec, u[1], u[2], u[3]) not in done]
    pending = {(u[0], u[2], u[3]): u for u in todo}  # (prompt index, seed, config) -> unit
    rows = list(dict.fromkeys((u[0], u[2]) for u in todo))  # (prompt index, seed), in unit order
    configs = list(dict.fromkeys(u[3] for u in units))
    out = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        for config in configs:
            members = [pending[(i, seed, config)] for i, seed in chunk if (i, seed, config) in pending]
            if members:
                out.append((config, members))
    return out


def warm_up(target, drafter, prompt_ids: list[int]) -> None:
    """One tiny decode, so the first timed unit does not pay one-off costs."""
    warm = DecodeConfig(k=2, max_new_tokens=4, diagnostics=False)
    decode_prompts(target, [prompt_ids], [torch.Generator().manual_seed(0)], warm, drafter, "lossless")


def decode_rows(spec: SweepSpec, suite: Suite, target, drafter, prompts, members, config: RunConfig,
                max_new: int) -> list[dict]:
    """The finished rows of one work unit (one configuration on `members`), timed as one batch."""
    began = time.perf_counter()
    generations = _decode(target, drafter, prompts, members, config, max_new)
    batch_seconds = time.perf_counter() - began
    rows = []
    for (index, item, seed, _), gen in zip(members, generations):
        row = make_row(spec, suite, item, index, seed, config, gen, target.decode(list(gen.token_ids)))
        row["batch_size"], row["batch_seconds"] = len(members), batch_seconds
        rows.append(row)
    return rows


def _run_units(spec, suite, units, target, drafter, prompts, max_new, results_path, progress,
               batch_size: int = 1, on_row=None, run: str = "") -> None:
    """Decode the units not yet in the results file, `batch_size` (prompt, seed) rows at a time.

    Rows of one configuration are decoded together (`decode.decode_prompts`), and every
    configuration runs on the same rows back to back, so speed is compared interleaved and at the same
    batch size. Each row draws from its own generator, seeded by (seed, prompt index), so
    its tokens do not depend on the batch it lands in (up to float rounding of different
    matmul shapes: docs/design.md, 'Token roles'). Each row records its batch's size and wall time."""
    with ResultsFile(results_path) as store:
        work = work_units(units, store.done, spec, batch_size)
        todo = sum(len(members) for _, members in work)
        bar = _progress(len(units), len(units) - todo, progress)
        if work:
            warm_up(target, drafter, prompts[0])
        for config, members in work:
            for row in decode_rows(spec, suite, target, drafter, prompts, members, config, max_new):
                store.append({**row, "run": run})
                if bar is not None:
                    bar.update(1)
                if on_row is not None:
                    on_row(row, ())
        if bar is not None:
            bar.close()


def _decode(target, drafter, prompts, members, config: RunConfig, max_new: int) -> list[Generation]:
    """The generations of one configuration on a batch of units, decoded together."""
    sampling = SamplingConfig(temperature=config.temperature)
    generators = [torch.Generator().manual_seed(seed * 1_000_003 + index) for index, _, seed, _ in members]
    ids = [prompts[index] for index, _, _, _ in members]
    if config.rule == PLAIN:
        plain = DecodeConfig(max_new_tokens=max_new, sampling=sampling)
        return decode_prompts(target, ids, generators, plain)
    decode = DecodeConfig(k=config.k, max_new_tokens=max_new, sampling=sampling, tree=config.tree)
    return decode_prompts(target, ids, generators, decode, drafter, config.rule)
