"""Rule maths cost: the cost of the rule maths alone, against one pass that reads the same inputs.

    python benchmarks/kernels/rule_maths.py [--shape 64 9 50000] [--reps 7]

For each rule: `emitted(p, q)` on [B, K, V] and `verify(p, q, x)` on [B, K+1, V] / [B, K, V], as the
decode loop calls them (inputs already validated: `_emitted`, `verify_with_uniforms(validate=False)`)
and through the public API (validating inputs), each as a ratio to `torch.minimum(p, q).sum(-1)`,
timed interleaved in one process (median of reps).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import environment, interleaved_times, print_table, spread, write_json

from verispec.rules import parse

RULES = ["lossless", "hsd", "lenience:l=0.5", "cos:w=0.5", "budget:tv=0.05,ratio=2", "speccascade:min_p=0.1",
         "typical:eps=0.09,alpha=0.3", "topk:k=8", "topp:p=0.9", "relaxed:n=10,delta=0.6",
         "fuzzy:threshold=0.1", "sglang:single=0.9,acc=0.5", "honest:speccascade:min_p=0.1"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", nargs=3, type=int, default=[64, 9, 50000], metavar=("B", "K1", "V"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rules", nargs="+", default=RULES)
    ap.add_argument("--json", default="benchmarks/results/rule_maths.json")
    args = ap.parse_args()
    b, k1, v = args.shape
    gen = torch.Generator().manual_seed(0)
    p = (torch.randn(b, k1, v, generator=gen) * 3).softmax(-1)  # [B, K+1, V]
    q = (torch.randn(b, k1 - 1, v, generator=gen) * 3).softmax(-1)  # [B, K, V]
    x = torch.multinomial(q.view(-1, v), 1, generator=gen).view(b, k1 - 1)  # [B, K]
    uniforms = torch.rand(b, k1, generator=gen, dtype=torch.float64)
    p_k = p[:, : k1 - 1].contiguous()
    cases = {"baseline minimum(p,q).sum(-1)": lambda: torch.minimum(p_k, q).sum(-1)}
    for spec in args.rules:
        rule = parse(spec)
        if not rule.block_level:
            cases[f"{spec} | emitted (loop)"] = lambda r=rule: r.emitted_law(p_k, q)
            cases[f"{spec} | emitted (API)"] = lambda r=rule: r.emitted(p_k, q)
        cases[f"{spec} | verify (loop)"] = lambda r=rule: r.verify_with_uniforms(
            p, q, x, uniforms, validate=False)
        cases[f"{spec} | verify (API)"] = lambda r=rule: r.verify_with_uniforms(p, q, x, uniforms)
    times = interleaved_times(cases, args.reps)
    base = sorted(times["baseline minimum(p,q).sum(-1)"])[args.reps // 2]
    rows, out = [], {"environment": environment(), "shape": args.shape, "baseline_ms": base * 1e3,
                     "cases": {}}
    for name, ts in times.items():
        s = spread([t / base for t in ts])
        out["cases"][name] = {"ms": spread([t * 1e3 for t in ts]), "ratio": s}
        rows.append([name, f"{s['median'] * base * 1e3:.1f}", f"{s['median']:.2f}",
                     "yes" if s["median"] <= 3 else "NO"])
    print(f"shape [B, K+1, V] = {args.shape}; {environment()}")
    print_table(["case", "median ms", "x baseline", "<= 3x"], rows)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
