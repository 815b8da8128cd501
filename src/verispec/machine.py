"""What machine a measurement ran on: the CPU model, the vector units that decide which kernels torch
runs (AVX2 only, AVX-512, AVX512-BF16, AMX), the CPUs this process may use, torch's version and thread
count, and the GPU where there is one.

Benchmarks print it; a sweep records it per run (`runs.jsonl`; docs/design.md, 'Words', speedup), since
a sweep resumed over several sessions may run on machines of different kinds, and the report names the
mix.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

# the vector units that decide which CPU kernels run, in the order printed
UNITS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu_model_and_flags(cpuinfo: str | None = None) -> tuple[str, str]:
    """(CPU model name, its UNITS present, space-separated) from /proc/cpuinfo (or the text given); the
    model falls back to `platform.processor()` (which says only "x86_64" on some machines)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    cpu, flags = "", ""
    for line in cpuinfo.splitlines():
        if line.startswith("model name") and not cpu:
            cpu = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            have = set(line.split(":", 1)[1].split())
            flags = " ".join(f for f in UNITS if f in have)
    return cpu or platform.processor(), flags


def describe() -> dict:
    """The machine as a JSON-ready dict: cpu, cpu_flags, cpus (usable by this process), torch,
    torch_threads, python, and gpu / cuda where CUDA is available."""
    cpu, flags = cpu_model_and_flags()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = ({"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda} if torch.cuda.is_available()
           else {})
    return {"cpu": cpu, "cpu_flags": flags, "cpus": cpus, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(), **gpu}


def kind(machine: dict) -> str:
    """A machine's kind as the report names it (a `describe()` dict): the CPU model and its vector
    units, and the GPU where there is one."""
    text = f"{machine.get('cpu') or '?'} ({machine.get('cpu_flags') or 'no listed vector units'})"
    return f"{text}, {machine['gpu']}" if machine.get("gpu") else text
