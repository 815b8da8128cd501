"""Named models on the path that fits the machine (docs/guide.md, 'Real model pair: Qwen2.5-Coder').

- `fast_path(name, dtype)`: with no dtype given, the Qwen names resolve to their lean int4 models
  (`-int4`: about a third of the dense bf16 memory, faster on CPU); an explicit dtype keeps the dense
  weights in it (float32 by `--dtype float32`).
- `check_fits(models)`: a pair whose peak resident size (per named model and dtype, measured:
  RESIDENT_GB, loaded in turn) is larger than the memory available now (`MemAvailable`, so other processes'
  memory counts) is refused before either loads, with the size and a smaller alternative. It runs
  beside `hf.check_memory`, which estimates one model at a time from its parameter count (any path);
  the measured peaks are the larger (a load's transient copies), and a pair is checked as a whole.
  VERISPEC_SKIP_MEMORY_CHECK=1 skips both.
"""

from __future__ import annotations

import os

from verispec.models.hf import available_memory

FAST_PATH = {"qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-int4", "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-int4"}

# Resident memory of loading each named model and decoding a few tokens with it, in GB (10^9 bytes):
# (peak, resident after), from /proc/self/status VmHWM and VmRSS (benchmarks/model_memory.py; RESULTS,
# 'Resident memory of the named models'); a model not listed is not checked here. Keyed by (name, dtype).
RESIDENT_GB: dict[tuple[str, str], tuple[float, float]] = {
    ("qwen2.5-coder-1.5b-int4", "float32"): (6.93, 5.36),  # float32: the model's own (int4, bf16 compute)
    ("qwen2.5-coder-1.5b", "bfloat16"): (7.68, 6.80),
    ("qwen2.5-coder-1.5b", "float32"): (15.44, 14.57),
    ("qwen2.5-coder-0.5b-int4", "float32"): (2.16, 1.92),
    ("qwen2.5-coder-0.5b", "bfloat16"): (3.18, 2.64),
    ("qwen2.5-coder-0.5b", "float32"): (7.01, 6.50),
}

SKIP_ENV = "VERISPEC_SKIP_MEMORY_CHECK"
MARGIN_GB = 0.5  # kept free beside the load: the interpreter, buffers, the decode's own tensors


def fast_path(name: object, dtype: str | None) -> tuple[object, str, str | None]:
    """(name, dtype, note): the model to load for `name` when `dtype` may be None (not given). A Qwen name
    with no dtype is its -int4 model (the note says so); otherwise the name as given, dtype float32 by
    default."""
    if dtype is None and isinstance(name, str) and name in FAST_PATH:
        fast = FAST_PATH[name]
        return fast, "float32", (f"{name}: the fast path, {fast} (int4 weights, bf16 compute); "
                                 f"--dtype bfloat16 or float32 loads the dense weights")
    return name, "float32" if dtype is None else dtype, None


def available_gb() -> float | None:
    """MemAvailable in GB (what can be allocated without swapping, other processes' memory excluded), or
    None where the kernel does not say."""
    free = available_memory()
    return None if free is None else free / 1e9


def needed_gb(models: list[tuple[object, str]]) -> float | None:
    """The peak resident size of loading these (name, dtype) models one after the other (the target, then
    the draft): the largest of, for each model, what the ones before it hold after loading plus its own
    peak. None when one was not measured (a path, a model object, an unmeasured dtype)."""
    sizes = [RESIDENT_GB.get((name, dtype)) if isinstance(name, str) else None for name, dtype in models]
    if any(size is None for size in sizes):
        return None
    need, held = 0.0, 0.0
    for peak, after in sizes:
        need, held = max(need, held + peak), held + after
    return need


def check_fits(models: list[tuple[object, str]], available: float | None = None) -> None:
    """MemoryError naming the size, what is available and a smaller load, when `models` (name, dtype)
    cannot fit in the memory available now; nothing when a size is unknown or the check is skipped."""
    if os.environ.get(SKIP_ENV) == "1":
        return
    need = needed_gb(models)
    have = available_gb() if available is None else available
    if need is None or have is None or need + MARGIN_GB <= have:
        return
    names = " + ".join(f"{name} ({dtype})" for name, dtype in models)
    smaller = [f"{FAST_PATH[name]}" for name, _ in models if isinstance(name, str) and name in FAST_PATH]
    hint = (f"; the int4 path ({', '.join(smaller)}: leave --dtype unset) needs less" if smaller else "")
    raise MemoryError(f"loading {names} needs about {need:.1f} GB resident and {have:.1f} GB is available "
                      f"now{hint}; free memory or set {SKIP_ENV}=1 to try anyway")
