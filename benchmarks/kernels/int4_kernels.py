"""Projection cost by rows per call: int4 weights (torch's CPU kernel, `verispec.models.int4.Int4Linear`)
against bf16 through oneDNN's packed kernel (as `verispec.models.lean.Linear` runs bf16), `x @ W^T` on
a contiguous W^T (the fp32 one-row kernel; an int4 projection's dense twin) and `F.linear`.

The Qwen2.5-Coder-1.5B target's four projection shapes per layer (q/k/v fused, o, gate/up fused, down),
8 distinct layers so the weights do not sit in cache, scaled to 28 layers; random weights (the cost
depends on shapes only). Rows = tokens in the call: 1 (a decoding step), k + 1 (a verification), a
batch, a prompt.

    python benchmarks/kernels/int4_kernels.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import environment

from verispec.models.int4 import Int4Linear, requantize

SHAPES = [(1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536)]  # (in, out) per layer
LAYERS, MODEL_LAYERS = 8, 28


def model_ms(fns: list, reps: int = 3) -> float:
    """Median ms of one call of every fn, scaled from LAYERS to MODEL_LAYERS layers."""
    for fn in fns:
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for fn in fns:
            fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3 * MODEL_LAYERS / LAYERS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 9, 16, 40, 166])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(environment())
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen) * 0.02 for _ in range(LAYERS) for i, o in SHAPES]
    int4 = [Int4Linear(*requantize([], w)) for w in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 8) for w in weights]
    dense = [w.bfloat16() for w in weights]
    transposed = [w.t().contiguous() for w in dense]  # [in, out]
    print("| rows | int4 ms | bf16 oneDNN packed ms | bf16 x @ W^T ms | bf16 F.linear ms "
          "| int4 / bf16 packed |")
    print("|---|---|---|---|---|---|")
    for m in args.rows:
        xs = [torch.randn(m, w.shape[1], generator=gen).bfloat16() for w in weights]  # [m, in]
        a = model_ms([lambda lin=lin, x=x: lin(x) for lin, x in zip(int4, xs)])
        b = model_ms([lambda p=p, x=x: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                      for p, x in zip(packed, xs)])
        t = model_ms([lambda w=w, x=x: x @ w for w, x in zip(transposed, xs)])
        c = model_ms([lambda w=w, x=x: F.linear(x, w) for w, x in zip(dense, xs)])
        print(f"| {m} | {a:.0f} | {b:.0f} | {t:.0f} | {c:.0f} | {a / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
