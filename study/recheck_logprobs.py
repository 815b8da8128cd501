"""Recompute, cache-free, the target's log-probability of every token a sweep emitted, and compare it with
the `log_target_raw` the sweep recorded at that position (read from the cache the decoding built).

A check of the cache and of the rollbacks of speculative decoding on a real pair: where a rejected
draft left something in the target's cache, or a row's cache were mixed with another's, the recorded
log-probabilities of speculative rows would move away from a fresh forward pass of the same text, while
plain decoding's would not. With bf16 weights both differ from the fresh pass by rounding (the pass
shapes differ); the check prints, per configuration, the distribution of the absolute differences, so
the two can be compared.

    python study/recheck_logprobs.py study/sweeps/qwen-humaneval-sanitized-seeds --rows 12
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch
from fresh import FreshPass, every_nth



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep")
    ap.add_argument("--rows", type=int, default=12, help="rows per configuration (every n-th)")
    ap.add_argument("--configs", nargs="+", default=["plain T=1", "lossless k=4 T=1"])
    args = ap.parse_args()
    fresh_pass = FreshPass(args.sweep)
    diffs: dict[str, list[float]] = defaultdict(list)
    for config in args.configs:
        mine = [r for r in fresh_pass.rows if r["config"] == config]
        for row in every_nth(mine, args.rows):
            reply = list(row["token_ids"])
            logits = fresh_pass.logits(row)  # [n, V], one fresh pass
            fresh = logits.log_softmax(-1).gather(-1, torch.tensor(reply)[:, None])[:, 0]  # [n]
            recorded = torch.tensor(row["steps"]["log_target_raw"], dtype=torch.float32)[: len(reply)]
            diffs[config] += (fresh - recorded).abs().tolist()
    print(f"{'config':24} positions  median |diff|  p99 |diff|  max |diff|")
    for config, values in diffs.items():
        values.sort()
        p99 = values[int(0.99 * (len(values) - 1))]
        median = statistics.median(values)
        print(f"{config:24} {len(values):9}  {median:12.2e}  {p99:10.2e}  {values[-1]:10.2e}")


if __name__ == "__main__":
    main()
