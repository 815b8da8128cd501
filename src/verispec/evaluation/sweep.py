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
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from verispec.evaluation.store import SCHEMA_VERSION, ResultsFile
from verispec.evaluation.suites import Item, Suite, load_suite
from verispec.decode import DecodeConfig, Generation, autoregressive_decode, speculative_decode
from verispec.rules import honest_baseline, parse
from verispec.sampling import SamplingConfig

log = logging.getLogger(__name__)
PLAIN = "plain"
STEP_FIELDS = ("role", "tv", "kl", "tv_baseline", "max_ratio", "tail_mass", "expected_accept", "draft_confidence",
               "draft_over_target", "log_law", "log_target", "log_target_raw")


@dataclass(frozen=True)
class RunConfig:
    rule: str  # canonical rule spec, or "plain"
    k: int
    temperature: float

    @property
    def id(self) -> str:
        return f"{self.rule} k={self.k} T={self.temperature:g}" if self.rule != PLAIN else f"plain T={self.temperature:g}"


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

    def configs(self) -> list[RunConfig]:
        """The grid, baselines included: plain, lossless and honest truncation samplers."""
        rules = [parse(r) for r in self.rules]  # validates every spec up front
        specs: list[str] = ["lossless"]
        for rule in rules:
            specs.append(rule.spec)
            honest = honest_baseline(rule)
            if honest is not None:
                specs.append(honest.spec)
        specs = list(dict.fromkeys(specs))  # de-duplicate, keep order
        out = [RunConfig(PLAIN, 0, t) for t in self.temperatures]
        out += [RunConfig(s, k, t) for t in self.temperatures for k in self.ks for s in specs]
        return out


def unit_key(spec: SweepSpec, item: Item, seed: int, config: RunConfig) -> str:
    raw = json.dumps([spec.suite, spec.target, spec.draft, item.id, seed, config.id, spec.max_new_tokens])
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def _round(values: list, digits: int = 6) -> list:
    return [v if isinstance(v, str) else (float(f"{v:.{digits}g}") if math.isfinite(v) else v) for v in values]


def make_row(spec: SweepSpec, suite: Suite, item: Item, index: int, seed: int, config: RunConfig,
             gen: Generation, text: str) -> dict:
    if gen.steps is None:
        raise ValueError("sweep rows need per-step diagnostics (DecodeConfig.diagnostics=True)")
    metrics = suite.score(text, item)
    stats = gen.stats()
    del stats["rule"]  # the row's rule is the config's (plain decoding reports "plain" too)
    del stats["verification"]  # the per-response report (verispec serve); rows keep the full steps
    return {
        "schema": SCHEMA_VERSION, "unit": unit_key(spec, item, seed, config),
        "suite": suite.name, "prompt_id": item.id, "prompt_index": index, "seed": seed,
        "target": spec.target, "draft": spec.draft, "config": config.id, "rule": config.rule, "k": config.k,
        "temperature": config.temperature, "family": parse(config.rule).family if config.rule != PLAIN else PLAIN,
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


def run_sweep(spec: SweepSpec, out_dir: str | Path, resume: bool = False, progress: bool = True) -> Path:
    """Run (or resume) a sweep; rows go to OUT_DIR/results.jsonl, the spec to OUT_DIR/sweep.json."""
    from verispec.api import as_dtype, encode_prompt, resolve_drafter, resolve_target

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_path, results_path = out_dir / "sweep.json", out_dir / "results.jsonl"
    spec_json = json.dumps(asdict(spec), indent=2, sort_keys=True)
    if results_path.exists() and results_path.stat().st_size and not resume:
        raise FileExistsError(f"{results_path} already has results: pass --resume to continue it, or use a new --out")
    if resume and spec_path.exists() and spec_path.read_text() != spec_json + "\n":
        raise ValueError(f"{spec_path} describes a different sweep; resume with the same settings or use a new --out")
    spec_path.write_text(spec_json + "\n")

    suite = load_suite(spec.suite).limit(spec.limit)
    configs = spec.configs()
    target = resolve_target(spec.target, spec.device, as_dtype(spec.dtype))
    drafter = resolve_drafter(spec.draft, target, spec.device, as_dtype(spec.draft_dtype))
    max_new = spec.max_new_tokens or suite.max_new_tokens
    prompts = [encode_prompt(target, item.prompt, suite.chat) for item in suite.items]
    units = [(i, item, seed, c) for i, item in enumerate(suite.items) for seed in spec.seeds for c in configs]

    with ResultsFile(results_path) as store:
        todo = [u for u in units if unit_key(spec, u[1], u[2], u[3]) not in store.done]
        bar = _progress(len(units), len(units) - len(todo), progress)
        if todo:  # warm up both models so the first timed unit does not pay one-off costs
            warm = DecodeConfig(k=2, max_new_tokens=4, diagnostics=False)
            speculative_decode(target, drafter, prompts[0], "lossless", warm, torch.Generator().manual_seed(0))
        for index, item, seed, config in todo:
            sampling = SamplingConfig(temperature=config.temperature)
            generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
            if config.rule == PLAIN:
                gen = autoregressive_decode(target, prompts[index], DecodeConfig(max_new_tokens=max_new, sampling=sampling),
                                            generator)
            else:
                decode = DecodeConfig(k=config.k, max_new_tokens=max_new, sampling=sampling)
                gen = speculative_decode(target, drafter, prompts[index], config.rule, decode, generator)
            store.append(make_row(spec, suite, item, index, seed, config, gen, target.decode(list(gen.token_ids))))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
    return results_path
