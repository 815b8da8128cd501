"""Sweep units: what one unit of a sweep is (a prompt, a seed and a configuration under the sweep's
settings), its key, how a batch of units is decoded into rows, and the local executor.

Both executors (`LocalExecutor` here, `verispec.evaluation.ray_executor.RayPool` on Ray actors) hand
out the same work units (`work_units`) and decode them with the same function (`decode_rows`), so
their rows are the same; `verispec.evaluation.sweep.run_sweep` drives either through one interface.
Definitions: docs/design/evaluation.md, 'Sweep units and reuse'.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace

from typing import Callable, Sequence

import torch

from verispec import defaults
from verispec.api import DTYPES, as_dtype, check_device, encode_prompt, resolve_drafter, resolve_target
from verispec.decode import DecodeConfig, Generation, check_context, decode_prompts
from verispec.evaluation.comparisons import exact_number, parse_comparison
from verispec.evaluation.stats import parse_sequential
from verispec.evaluation.store import SCHEMA_VERSION, ResultsFile
from verispec.evaluation.suites import TARGET_LOGLIK, Item, Suite, load_suite
from verispec.models import check_dtype, default_draft
from verispec.rules import honest_baseline, parse
from verispec.sampling import SamplingConfig
from verispec.tree_decode import TRAVERSAL, tree_verification_rule
from verispec.trees import parse_shape

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
        """`RULE k=K T=TEMP` (`plain T=TEMP`); part of the unit key, so TEMP round-trips exactly."""
        t = exact_number(self.temperature)
        shape = f" {self.tree}" if self.tree else ""
        return f"{self.rule}{shape} k={self.k} T={t}" if self.rule != PLAIN else f"plain T={t}"

    @property
    def legacy_id(self) -> str:
        """The id verispec wrote before exact temperatures (`:g`, 6 significant digits): the same as `id`
        whenever the temperature is exact in 6 digits (every committed sweep), else a rounded one."""
        shape = f" {self.tree}" if self.tree else ""
        return (f"{self.rule}{shape} k={self.k} T={self.temperature:g}" if self.rule != PLAIN
                else f"plain T={self.temperature:g}")


@dataclass(frozen=True)
class SweepSpec:
    suite: str = "shakespeare"
    target: str = defaults.TARGET
    draft: str = defaults.AUTO_DRAFT  # resolved to the target's default drafter by `resolved()`
    rules: tuple[str, ...] = ("lossless",)
    temperatures: tuple[float, ...] = (1.0,)
    ks: tuple[int, ...] = (defaults.K,)
    seeds: tuple[int, ...] = (0,)
    limit: int | None = None  # number of prompts (None: the whole suite)
    max_new_tokens: int | None = None  # None: the suite's default
    device: str = "cpu"
    dtype: str = "float32"  # the target's compute dtype
    draft_dtype: str = "float32"
    backend: str | None = None  # the target's backend (lean / hf); filled in by run_sweep once it is loaded
    # planned comparisons, declared up front ("A:B" or "A vs B", rule specs or plain) and an optional
    # group-sequential design for interim looks ("pocock:K" / "obf:K"): read by the report
    # (`comparisons`); they change no result, so they are not part of a unit's key
    compare: tuple[str, ...] = ()
    sequential: str | None = None
    # tree / multi-draft shapes as an axis (`tree:widths=4,2,2,1`, `drafts:n=3`): each with lossless, and
    # with every rule that is a tree rule (lossy ones on top-k trees only); `traversal` is tree-only
    trees: tuple[str, ...] = ()

    def resolved(self) -> SweepSpec:
        """The spec with the draft named: "auto" becomes the target's default drafter (a sweep's rows and
        unit keys always name the drafter that decoded them)."""
        if self.draft != defaults.AUTO_DRAFT:
            return self
        return replace(self, draft=default_draft(self.target))

    def validate(self, device_here: bool = True) -> None:
        """Every setting checked (ValueError / TypeError naming it) before anything is written.

        `device_here=False` (the Ray executor: the models run on the workers, not on this machine) checks
        only that the device names a torch device type; the workers check that they have it."""

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
        check_dtype(self.target, as_dtype(self.dtype))
        check_dtype(self.draft, as_dtype(self.draft_dtype))
        if device_here:
            check_device(self.device)
        elif not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda", "mps"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        self.configs()  # parses every rule spec
        if not isinstance(self.compare, (tuple, list)):
            raise ValueError(f"compare must be a list of comparisons ('A:B'), got {self.compare!r}")
        for text in self.compare:
            parse_comparison(text)
        if self.sequential is not None:
            parse_sequential(self.sequential)

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
    chain-only rules are left out); lossy rules only on deterministic (top-k and dynamic) trees (their
    exact laws need a tree that is a function of the prefix). A `tree:widths` or dynamic shape fixes its
    depth (k = its number of levels); `drafts:n` without a depth takes each k of the grid."""
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
        depths = [shape.depth] if shape.depth is not None else list(ks)
        out += [RunConfig(s, k, t, shape.spec) for t in temperatures for k in depths
                for s in dict.fromkeys(specs)]
    return out


MAX_SWEEP_SEED = 2**40  # a unit's generator is seeded with seed * 1_000_003 + prompt index (< 2**64)


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
             gen: Generation, text: str, max_new_tokens: int | None = None) -> dict:
    """A results row: the unit's settings (every one that defines it, the token cap `max_new_tokens`
    included), its decode statistics, metrics, text, token ids and per-step diagnostics."""
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
        "max_new_tokens": max_new_tokens if max_new_tokens is not None else spec.max_new_tokens,
        **stats,
        "metrics": metrics, "score": metrics.get(suite.primary), "score_name": suite.primary,
        "protocol": suite.protocol,
        "text": text, "token_ids": list(gen.token_ids),
        "steps": {f: _round(gen.steps[f]) for f in STEP_FIELDS if f in gen.steps},
    }


def progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm  # optional: no bar without it
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, unit="run", desc="sweep", file=sys.stderr, dynamic_ncols=True)


def backend_of(target) -> str:
    """The backend a loaded target runs on (lean / hf), as recorded in sweep.json and every unit key."""
    return str(getattr(target, "backend", None) or os.environ.get("VERISPEC_BACKEND", "n/a"))


def check_contexts(suite: Suite, prompts: list[list[int]], target, drafter, max_new: int) -> None:
    """Refuse (ValueError naming the prompt) a prompt + max_new that does not fit a model's context."""

    for item, ids in zip(suite.items, prompts):
        try:
            check_context(target, len(ids), max_new, drafter)
        except ValueError as err:
            raise ValueError(f"prompt {item.id!r} of suite {suite.name}: {err}") from None


def work_units(units, done: set[str], spec: SweepSpec, chunk: int) -> list[tuple[RunConfig, list]]:
    """The work still to do, in the order both executors hand it out: `chunk` (prompt, seed) rows at a
    time, every configuration on those rows back to back; each item is (config, its units)."""
    todo = [u for u in units if unit_key(spec, u[1], u[2], u[3]) not in done]
    pending = {(u[0], u[2], u[3]): u for u in todo}  # (prompt index, seed, config) -> unit
    rows = list(dict.fromkeys((u[0], u[2]) for u in todo))  # (prompt index, seed), in unit order
    configs = list(dict.fromkeys(u[3] for u in units))
    out = []
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        for config in configs:
            members = [pending[(i, seed, config)] for i, seed in part if (i, seed, config) in pending]
            if members:
                out.append((config, members))
    return out


def warm_up(target, drafter, prompt_ids: list[int]) -> None:
    """One tiny decode, so the first timed unit does not pay one-off costs."""
    warm = DecodeConfig(k=2, max_new_tokens=4, diagnostics=False)
    decode_prompts(target, [prompt_ids], [torch.Generator().manual_seed(0)], warm, drafter, "lossless")


def decode_rows(spec: SweepSpec, suite: Suite, target, drafter, prompts, members, config: RunConfig,
                max_new: int, slots: int | None = None) -> list[dict]:
    """The finished rows of one work unit (one configuration on `members`), timed as one batch.

    `slots`: at most that many rows decode at once, a finished row's place taken by the next member
    (continuous batching, `decode.decode_prompts`); None: all members at once (a static batch). Each
    row records `batch_size` (rows decoding at once: the slots, or fewer members), `chunk_size` (the
    unit's rows) and `batch_seconds` (the unit's wall time), so its share of the time is
    batch_seconds / chunk_size (`summary.row_seconds`)."""
    began = time.perf_counter()
    stop_check = suite.stop(target.decode) if suite.stop is not None else None
    generations = _decode(target, drafter, prompts, members, config, max_new, stop_check, slots)
    batch_seconds = time.perf_counter() - began
    rows = []
    width = len(members) if slots is None else min(slots, len(members))
    for (index, item, seed, _), gen in zip(members, generations):
        text = target.decode(list(gen.token_ids))
        row = make_row(spec, suite, item, index, seed, config, gen, text, max_new)
        row["batch_size"], row["chunk_size"], row["batch_seconds"] = width, len(members), batch_seconds
        rows.append(row)
    return rows


def _decode(target, drafter, prompts, members, config: RunConfig, max_new: int,
            stop_check=None, slots: int | None = None) -> list[Generation]:
    """The generations of one configuration on a batch of units, decoded together (`stop_check`: the
    suite's stop condition, `Suite.stop`)."""
    sampling = SamplingConfig(temperature=config.temperature)
    generators = [torch.Generator().manual_seed(seed * 1_000_003 + index) for index, _, seed, _ in members]
    ids = [prompts[index] for index, _, _, _ in members]
    if config.rule == PLAIN:
        plain = DecodeConfig(max_new_tokens=max_new, sampling=sampling, stop_check=stop_check)
        return decode_prompts(target, ids, generators, plain, batch_size=slots)
    decode = DecodeConfig(k=config.k, max_new_tokens=max_new, sampling=sampling, stop_check=stop_check,
                          tree=config.tree)
    return decode_prompts(target, ids, generators, decode, drafter, config.rule, batch_size=slots)


def load_pair(spec: SweepSpec, suite: Suite) -> tuple:
    """The sweep's target and drafter on this machine, and the suite's prompts encoded by the target:
    what each executor loads once (the local one in the `bench` process, each Ray worker in its actor)."""
    check_device(spec.device)
    target = resolve_target(spec.target, spec.device, as_dtype(spec.dtype))
    drafter = resolve_drafter(spec.draft, target, spec.device, as_dtype(spec.draft_dtype))
    prompts = [encode_prompt(target, item.prompt, suite.chat) for item in suite.items]
    return target, drafter, prompts


class LocalExecutor:
    """The local executor: loads the pair in this process and decodes the work units here. The same
    interface as the Ray executor's `RayPool` (a context manager with `backend` and `run_units`), so
    `run_sweep` drives both alike (docs/design/evaluation.md, 'Sweeps on Ray')."""

    def __init__(self, spec: SweepSpec, suite: Suite, max_new: int):
        self.spec, self.suite, self.max_new = spec, suite, max_new

    def __enter__(self) -> LocalExecutor:
        self.target, self.drafter, self.prompts = load_pair(self.spec, self.suite)
        self.backend = backend_of(self.target)
        check_contexts(self.suite, self.prompts, self.target, self.drafter, self.max_new)
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def run_units(self, spec: SweepSpec, suite: Suite, units, results_path, progress_bar: bool,
                  batch_size: int, on_row=None, run: str = "", chunk: int | None = None,
                  on_start: Callable[[], None] | None = None) -> None:
        """Decode the units not yet in the results file: work units of `chunk` (default `batch_size`)
    (prompt, seed) rows, decoded `batch_size` at once by continuous batching (`run_sweep`).

    Rows of one configuration are decoded together (`decode.decode_prompts`), and every
    configuration runs on the same rows back to back, so speed is compared interleaved and at the same
    batch size. Each row draws from its own generator, seeded by (seed, prompt index), so
    its tokens do not depend on the batch it lands in (up to float rounding of different
    matmul shapes: docs/design/rules.md, 'Token roles'). Each row records its batch's size and wall time.
    `on_start` is called once before the first unit decodes, and not at all when none is left (the
    sweep records its run there: a run that decodes nothing leaves no record)."""
        with ResultsFile(results_path, self.max_new) as store:
            work = work_units(units, store.done, spec, chunk or batch_size)
            todo = sum(len(members) for _, members in work)
            if work and on_start is not None:
                on_start()  # before the bar exists, so an error here leaves nothing open
            bar = progress(len(units), len(units) - todo, progress_bar)
            if work:
                warm_up(self.target, self.drafter, self.prompts[0])
            for config, members in work:
                for row in decode_rows(spec, suite, self.target, self.drafter, self.prompts, members, config,
                                       self.max_new, batch_size):
                    store.append({**row, "run": run})
                    if bar is not None:
                        bar.update(1)
                    if on_row is not None:
                        on_row(row, ())
            if bar is not None:
                bar.close()
