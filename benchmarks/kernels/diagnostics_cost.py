"""Cost of the exact per-position diagnostics (docs/design/diagnostics.md, 'Diagnostics') at the Qwen
pair's size.

    python benchmarks/kernels/diagnostics_cost.py [--shape 40 151936] [--reps 7]

[n, V] = 40 emitted positions (a batch of 8 rows, k = 4, every draft accepted: 4 accepted + 1 bonus per
row) over Qwen2.5's 151,936 tokens, float32 rows as the decode loop hands them over. Times, interleaved
in one process (median of reps, as a ratio to lossless `position_stats`):
- `position_stats` for each rule (lossless takes the cheap path; the others build float64 laws);
- the shift distances alone on the same float64 rows: the fused `shift_distances` (one ratio law / p
  shared by KL and the overshoot) against the separate `verispec.probability` functions (tv, kl,
  tv to the baseline, max_ratio, tail_mass), which it must equal (tests/test_gates_sampling.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import environment, interleaved_times, print_table, spread, write_json

from verispec.diagnostics import shift
from verispec.probability import kl, max_ratio, renormalised_f64, tail_mass, tv
from verispec.rules import parse

RULES = ["lossless", "speccascade:min_p=0.1", "honest:speccascade:min_p=0.1", "lenience:l=0.25", "cos:w=0.9",
         "budget:tv=0.05"]


def separate(law: torch.Tensor, p: torch.Tensor, base: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"tv": tv(law, p), "kl": kl(law, p), "tv_baseline": tv(law, base), "max_ratio": max_ratio(law, p),
            "tail_mass": tail_mass(law, p, shift.TAIL)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", nargs=2, type=int, default=[40, 151936], metavar=("N", "V"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default="benchmarks/results/diagnostics_cost.json")
    args = ap.parse_args()
    n, v = args.shape
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(n, v, generator=gen) * 3  # [n, V]
    target_probs = logits.softmax(-1)
    draft_probs = (logits + torch.randn(n, v, generator=gen)).softmax(-1)
    tokens = target_probs.argmax(-1)
    roles = (["accepted"] * 4 + ["bonus"]) * (n // 5) + ["bonus"] * (n % 5)
    gate = parse("speccascade:min_p=0.1")
    p, q = renormalised_f64(target_probs), renormalised_f64(draft_probs)
    law, base = gate.emitted_law(p, q), gate.baseline_law(p)  # [n, V] float64
    cases = {f"position_stats {spec}": lambda r=parse(spec): shift.position_stats(
        r, target_probs, draft_probs, tokens, roles) for spec in RULES}
    cases["distances, separate functions"] = lambda: separate(law, p, base)
    cases["distances, fused"] = lambda: shift.shift_distances(law, p, base)
    fused, ref = shift.shift_distances(law, p, base), separate(law, p, base)
    worst = max((fused[name] - ref[name]).abs().max().item() for name in ref)
    times = interleaved_times(cases, args.reps)
    base_s = sorted(times["position_stats lossless"])[args.reps // 2]
    env = environment()
    out = {"environment": env, "shape": args.shape, "lossless_ms": base_s * 1e3,
           "fused_vs_separate_max_abs_diff": worst, "cases": {}}
    rows = []
    for name, ts in times.items():
        s = spread([t / base_s for t in ts])
        out["cases"][name] = {"ms": spread([t * 1e3 for t in ts]), "ratio": s}
        rows.append([name, f"{s['median'] * base_s * 1e3:.1f}", f"{s['median']:.2f}"])
    sep = spread(times["distances, separate functions"])["median"]
    out["fused_over_separate"] = spread(times["distances, fused"])["median"] / sep
    print(f"shape [n, V] = {args.shape}; {env}")
    print_table(["case", "median ms", "x lossless position_stats"], rows)
    print(f"fused / separate distances: {out['fused_over_separate']:.2f}; largest difference {worst:.2g}")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
