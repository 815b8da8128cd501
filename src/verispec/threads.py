"""One torch thread setting for every entry point: `--threads`, else `$VERISPEC_THREADS`, else a default
that does not oversubscribe the CPUs this process may run on.

Decoding on a CPU is a chain of small matmuls; OpenMP threads that wait for a busy core spin against each
other, so on a machine with other load two threads can run a request many times slower than one. The
default is the number of CPUs this process may use (`os.sched_getaffinity`), at most the physical cores,
and `check_threads` measures whether the chosen count is in fact faster than one thread right now.
"""

from __future__ import annotations

import logging
import os
import time

import torch

log = logging.getLogger(__name__)

ENV = "VERISPEC_THREADS"


def physical_cores() -> int | None:
    """Physical cores among the CPUs this process may run on (hyper-threads of one core counted once,
    from /sys/devices/system/cpu/cpuN/topology/thread_siblings_list), or None where that is unknown."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = set()
    for cpu in sorted(os.sched_getaffinity(0)):
        try:
            path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
            with open(path, encoding="ascii") as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(cpu))
    return len(cores) or None


def default_threads() -> int:
    """The physical cores among the CPUs this process may run on (hyper-threads add no matmul units)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores = physical_cores()
    return max(1, min(usable, cores) if cores else usable)


def resolve_threads(threads: int | None = None) -> int:
    """`threads` if given, else `$VERISPEC_THREADS`, else `default_threads()`; a clear error if invalid."""
    source = "--threads"
    if threads is None and os.environ.get(ENV, "").strip():
        threads, source = os.environ[ENV].strip(), f"${ENV}"
    if threads is None:
        return default_threads()
    try:
        value = int(threads) if not isinstance(threads, bool) else None
    except (TypeError, ValueError):
        value = None
    if value is None or value < 1 or str(threads).strip() != str(value):
        raise ValueError(f"{source} must be a whole number of threads >= 1, got {threads!r}")
    return value


def configure_threads(threads: int | None = None) -> int:
    """Resolve the thread count and set torch's intra-op threads to it; returns the count."""
    count = resolve_threads(threads)
    torch.set_num_threads(count)
    return count


def matmul_seconds(threads: int, repeats: int = 5) -> float:
    """Median seconds of a decode-sized matmul ([8, 1024] @ [1024, 1024], float32, 4 times) on `threads`
    threads: about 10 ms on one idle core of this project's machines."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(8, 1024), torch.randn(1024, 1024)
        a @ b  # warm the thread pool
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(4):
                a @ b
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]
    finally:
        torch.set_num_threads(before)


def check_threads(threads: int) -> str | None:
    """Whether `threads` threads run a decode-sized matmul slower than one thread right now (the
    machine's other load); the warning (also logged), or None."""
    if threads <= 1:
        return None
    many, one = matmul_seconds(threads), matmul_seconds(1)
    if many <= one:
        return None
    message = (f"with this machine's current load, {threads} torch threads ran a decode-sized matmul slower "
               f"than 1 thread ({many * 1e3:.1f} ms vs {one * 1e3:.1f} ms): consider --threads 1 "
               f"(or {ENV}=1)")
    log.warning(message)
    return message
