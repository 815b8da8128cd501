"""fp32 vs bf16 matmul cost on this CPU, for the Qwen2.5-Coder-1.5B target's weight shapes.

One transformer layer's projections (q/k/v fused, o, gate/up fused, down) plus the untied output head,
through the lean backend's own kernel choice (`verispec.models.lean.Linear`: W^T GEMV for one row,
oneDNN's packed GEMM above where it agrees with F.linear, else F.linear), for 1 and 5 new tokens
(a plain step and a k = 4 verification pass). Random weights: the cost depends on shapes and dtype only.

    python benchmarks/kernels/dtype_kernels.py

On CPUs without bf16 instructions (AVX512-BF16 / AMX) torch emulates bf16 matmuls, so bf16 halves
memory but not time; this prints both so the choice of compute dtype is measured, not assumed.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import environment

from verispec.models.lean import Linear

# Qwen2.5-Coder-1.5B: (in, out) of q/k/v fused, o_proj, gate/up fused, down_proj, lm_head
SHAPES = [(1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536), (1536, 151936)]


def median_ms(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    flags = {f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split()}
    print(environment(), "| bf16 instructions:", sorted(flags & {"avx512_bf16", "amx_bf16"}) or "none")
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        linears = [Linear(torch.randn(o, i, dtype=dtype) * 0.02) for i, o in SHAPES]
        for m in (1, 5):
            xs = [torch.randn(1, m, i, dtype=dtype) for i, _ in SHAPES]  # [1, m, in]
            results[(dtype, m)] = sum(median_ms(lambda lin=lin, x=x: lin(x)) for lin, x in zip(linears, xs))
            packed = linears[0].packed is not None
            kernel = "W^T GEMV" if m == 1 else "oneDNN packed" if packed else "F.linear"
            print(f"{str(dtype).removeprefix('torch.'):9s} m = {m}: {results[(dtype, m)]:8.1f} ms ({kernel})",
                  flush=True)
    for m in (1, 5):
        print(f"bf16 / fp32 at m = {m}: {results[(torch.bfloat16, m)] / results[(torch.float32, m)]:.1f}x")


if __name__ == "__main__":
    main()
