"""Shared helpers of the benchmark scripts: environment, timing, summaries, prompts."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch

from verispec.tables import text_table

PROMPTS = [
    "KING.\nWhat says the queen?\n",
    "To be, or not to be, that is the question:\n",
    "HAMLET.\nO, that this too too solid flesh would melt,\n",
    "ROMEO.\nBut soft, what light through yonder window breaks?\n",
    "FIRST CITIZEN.\nBefore we proceed any further, hear me speak.\n",
    "PORTIA.\nThe quality of mercy is not strain'd;\n",
]


def environment() -> dict:
    import transformers

    cpu, flags = platform.processor() or "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                # the vector units that decide which kernels run (AVX2 only, AVX-512, bf16, AMX)
                have = set(line.split(":", 1)[1].split())
                units = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
                flags = " ".join(f for f in units if f in have)
    except OSError:
        pass
    return {"cpu": cpu, "cpu_flags": flags, "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def spread(values: list[float]) -> dict:
    values = sorted(values)
    return {"min": values[0], "median": statistics.median(values), "max": values[-1], "n": len(values)}


def fmt_spread(s: dict, digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def print_table(head: list[str], rows: list[list[str]]) -> None:
    print(text_table(head, rows))


def write_json(path: str | Path, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2, default=float) + "\n")
