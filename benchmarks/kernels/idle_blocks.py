"""A block that drafts nothing (adaptive speculation choosing k = 0 for every row) against a plain block.

    python benchmarks/kernels/idle_blocks.py --target qwen2.5-coder-1.5b-int4 \
        --draft qwen2.5-coder-0.5b-int4 --batch 16 --rounds 16

`verispec serve --k auto` keeps its rows in the speculative loop when the measured costs say drafting does
not pay: each block then drafts nothing, and the target's one pass, the rule's bonus draw and the
diagnostics of each position run as in a speculative block. This times those blocks against the plain
decoder's (`BatchDecoder` without a drafter) on the same prompt, batch and diagnostics, the two in turn
and their order alternating by round; each round's ratio is (seconds a block, k = 0) / (plain), and the
rounds give a geometric mean with a Student-t 95% interval on the log ratios. The costs given to the
policy make drafting never pay, so no block drafts (checked).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import environment

from verispec.decode import BatchDecoder, DecodeConfig
from verispec.models import load_drafter, load_model
from verispec.speculation import AdaptivePolicy, Costs

PROMPT = "Write a Python function that checks whether a number is prime."
NEVER = Costs(target={1: (1.0, 100.0)}, draft={1: 100.0})  # a draft step costs 100 target passes


def seconds_a_block(target, drafter, adaptive: bool, batch: int, tokens: int) -> float:
    """Seconds per block after the first (the prompts' prefill), over `tokens` new tokens a row."""
    policy = AdaptivePolicy(NEVER, 1) if adaptive else None
    config = DecodeConfig(k=1, max_new_tokens=tokens + 1, stop_at_eos=False, diagnostics=True, policy=policy)
    decoder = BatchDecoder(target, copy.copy(drafter) if adaptive else None, "lossless" if adaptive else None,
                           config)
    prompt = target.encode(PROMPT)
    rows = [decoder.add(prompt, torch.Generator().manual_seed(i)) for i in range(batch)]
    decoder.step()  # the prefill
    start, blocks, out = time.perf_counter(), 0, []
    while decoder.active:
        out += decoder.step()
        blocks += 1
    seconds = (time.perf_counter() - start) / blocks
    if adaptive:
        assert all(block.proposed == 0 for _, gen in out for block in gen.blocks), "a block drafted"
    assert len(out) == len(rows)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default")
    parser.add_argument("--draft", default="default-draft")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args()
    print(environment())
    target = load_model(args.target)
    drafter = load_drafter(args.draft, target)
    seconds_a_block(target, drafter, True, args.batch, 2)  # warm up both paths
    seconds_a_block(target, drafter, False, args.batch, 2)
    ratios = []
    for turn in range(args.rounds):
        order = (False, True) if turn % 2 == 0 else (True, False)
        times = {adaptive: seconds_a_block(target, drafter, adaptive, args.batch, args.tokens)
                 for adaptive in order}
        ratios.append(times[True] / times[False])
        print(f"round {turn}: plain {times[False] * 1000:.0f} ms a block, k = 0 {times[True] * 1000:.0f} ms: "
              f"{ratios[-1]:.3f}", flush=True)
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    print(f"k = 0 block / plain block at batch {args.batch}: geometric mean {math.exp(mean):.3f}, "
          f"95% interval [{math.exp(mean - half):.3f}, {math.exp(mean + half):.3f}] "
          f"over {len(ratios)} rounds")


if __name__ == "__main__":
    main()
