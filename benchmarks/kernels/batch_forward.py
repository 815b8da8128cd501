"""Batched forward passes: the time of ONE lean forward pass over B rows vs B = 1.

    python benchmarks/kernels/batch_forward.py [--target default] [--context 128] [--reps 7]
    python benchmarks/kernels/batch_forward.py --kernels     # the matmul kernel choice of lean.Linear

Each row holds `--context` tokens of play text (rows start at different offsets); a *decode step*
feeds one new token per row, a *verification pass* 5 per row (k = 4 drafts + 1), through
`LeanBatchSession.logits_for` (so per-row prefix matching and the logits copy are included). The
same request is repeated, so the session rolls each row back and re-feeds the same tokens: every
call is one full forward pass. B = 1, 2, 4, ..., 64 interleaved within each repetition; median
[min, max] over reps of the mean of `--inner` calls; "per row" is (time / B) / time at B = 1.
The batch-1 `LeanSession` (the single-row decode path) is timed alongside for reference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import PROMPTS, environment, fmt_spread, print_table, spread

from verispec.models import load_model

SIZES = [1, 2, 4, 8, 16, 32, 64]


def kernels(reps: int) -> None:
    """x @ W^T (GEMV layout) vs oneDNN packed vs F.linear, by GEMM row count M = B*m."""
    from verispec.models.lean import Linear

    gen = torch.Generator().manual_seed(0)
    shapes = [(1152, 384), (384, 384), (2048, 384), (384, 1024), (4096, 384)]  # qkv, o, gate_up, down, head
    lins = [Linear(torch.randn(*s, generator=gen) * 0.05) for s in shapes]
    sizes = [1, 2, 4, 16, 64, 256]
    xs = {m: [torch.randn(m, lin.weight_t.shape[0], generator=gen) for lin in lins] for m in sizes}
    paths = {
        "x @ W^T": lambda lin, x: x @ lin.weight_t,
        "oneDNN packed": lambda lin, x: torch.ops.mkldnn._linear_pointwise(
            x, lin.packed, None, "none", [], ""),
        "F.linear": lambda lin, x: torch.nn.functional.linear(x, lin.weight_t.t()),
    }
    times: dict[tuple[int, str], list[float]] = {(m, p): [] for m in sizes for p in paths}
    with torch.inference_mode():
        for _ in range(reps):
            for m in sizes:
                for name, fn in paths.items():
                    start = time.perf_counter()
                    for _ in range(5):
                        for lin, x in zip(lins, xs[m]):
                            fn(lin, x)
                    times[(m, name)].append((time.perf_counter() - start) / 5 * 1e6)
    print("matmul kernels: the default target's five weight shapes (one layer's + the head), summed, us")
    cells = [[str(m), *(fmt_spread(spread(times[(m, p)]), 0) for p in paths)] for m in sizes]
    print_table(["M = B*m", *paths], cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--kernels", action="store_true", help="time the matmul kernels instead")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(environment())
    if args.kernels:
        kernels(args.reps)
        return
    target = load_model(args.target)
    text = torch.tensor(target.encode("".join(PROMPTS) * 40))
    rows = {b: [text[7 * i : 7 * i + args.context] for i in range(b)] for b in SIZES}
    sessions = {b: target.batch_session() for b in SIZES}
    single = target.session()
    for b in SIZES:  # prefill once
        sessions[b].logits_for(list(range(b)), rows[b], [1] * b)
    kinds = {"step": 1, "verify": 5}
    times: dict[tuple[str, object], list[float]] = {(k, b): [] for k in kinds for b in [*SIZES, "single"]}

    def once(b, n):
        if b == "single":
            single.logits_for(rows[1][0][None], n)
        else:
            sessions[b].logits_for(list(range(b)), rows[b], [n] * b)

    for _ in range(args.reps):
        for b in ["single", *SIZES]:
            for kind, n in kinds.items():
                once(b, n)  # warm this shape
                start = time.perf_counter()
                for _ in range(args.inner):
                    once(b, n)
                times[(kind, b)].append((time.perf_counter() - start) / args.inner * 1e3)
    base = {k: statistics.median(times[(k, 1)]) for k in kinds}
    table = []
    for b in ["single", *SIZES]:
        cells = [f"B={b}" if b != "single" else "LeanSession (batch 1)"]
        for kind in kinds:
            s = spread(times[(kind, b)])
            per_row = s["median"] / (1 if b == "single" else b) / base[kind]
            cells += [fmt_spread(s), f"{per_row:.3f}"]
        table.append(cells)
    print(f"one forward pass, default target (lean), context {args.context} tokens per row; ms; "
          f"median [min, max] of {args.reps} reps x {args.inner} calls")
    print_table(["rows", "step ms", "step per row / B=1", "verify (5 tok) ms", "verify per row / B=1"], table)


if __name__ == "__main__":
    main()
