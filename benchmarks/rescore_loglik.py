"""Held-out re-scoring of a sweep scored by the target's log-likelihood per token (MT-Bench), for
benchmarks/RESULTS.md: each chosen row's reply is scored again by one cache-free forward pass of the
target over prompt + reply (teacher forcing), not by the decode loop that wrote the row, and the two are
compared per row and through the declared comparisons.

The decode loop scored the tokens in batched, cached passes of a few positions; this pass scores the
whole sequence at once, so in bfloat16 the two round differently: the script prints the per-row score
difference (max and mean absolute) and each declared comparison's pooled estimate and p on the
rows' scores and on the re-scored ones, so what rounding does to a published figure is on the page.

    python benchmarks/rescore_loglik.py benchmarks/sweeps/qwen-mtbench --every 3
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from common import FreshPass

from verispec.evaluation.comparisons import compare, parse_comparison
from verispec.evaluation.suites import TARGET_LOGLIK
from verispec.evaluation.units import backend_of


def teacher_forced_loglik(fresh: FreshPass, row: dict) -> float:
    """The row's reply's mean log-likelihood per token under the raw target (temperature 1, no
    truncation), from one cache-free pass over prompt + reply (`FreshPass.logits`)."""
    reply = torch.tensor(row["token_ids"])  # [n]
    log_probs = fresh.logits(row).log_softmax(-1).gather(-1, reply[:, None])[:, 0]  # [n]
    return log_probs.mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", help="a sweep's --out directory (score: target_loglik)")
    parser.add_argument("--every", type=int, default=1,
                        help="re-score the questions whose index is a multiple of N, every configuration "
                             "on them (so each comparison stays paired); 1: all rows")
    args = parser.parse_args()
    if args.every < 1:
        parser.error(f"--every must be a positive integer, got {args.every}")
    settings = json.loads((Path(args.sweep) / "sweep.json").read_text())
    fresh = FreshPass(args.sweep)
    if backend_of(fresh.target) != settings.get("backend"):
        raise SystemExit(f"the target loaded on the {backend_of(fresh.target)} backend, the sweep ran on "
                         f"{settings.get('backend')}: set VERISPEC_BACKEND to match")
    rows = [r for r in fresh.rows if r.get("score_name") == TARGET_LOGLIK
            and isinstance(r.get("score"), float) and r["token_ids"] and r["prompt_index"] % args.every == 0]
    if not rows:
        raise SystemExit(f"{args.sweep}: no rows scored by {TARGET_LOGLIK} to re-score")
    began = time.perf_counter()
    again = {r["unit"]: teacher_forced_loglik(fresh, r) for r in rows}
    seconds = time.perf_counter() - began
    bad = [r["unit"] for r in rows if not math.isfinite(again[r["unit"]])]
    if bad:
        raise SystemExit(f"{len(bad)} rows re-scored to a non-finite value: {bad[:5]}")
    diffs = [abs(again[r["unit"]] - r["score"]) for r in rows]
    print(f"re-scored {len(rows)} rows ({len({r['prompt_id'] for r in rows})} questions, index a multiple "
          f"of {args.every}) in {seconds:.0f} s: |row score - re-scored| max {max(diffs):.2g}, "
          f"mean {sum(diffs) / len(diffs):.2g}")
    rescored = [dict(r, score=again[r["unit"]]) for r in rows]
    for text in settings.get("compare") or []:
        a, b = parse_comparison(text)
        for before, after in zip(compare(rows, a, b), compare(rescored, a, b)):
            e, f = before.pooled, after.pooled
            print(f"  {before.config_a} - {before.config_b}: rows ({e.clusters} questions) {e.estimate:+.4f} "
                  f"[{e.low:+.4f}, {e.high:+.4f}] p {e.p_value:.3g}; re-scored ({f.clusters} questions) "
                  f"{f.estimate:+.4f} [{f.low:+.4f}, {f.high:+.4f}] p {f.p_value:.3g}")


if __name__ == "__main__":
    main()
