"""Adaptive speculation against fixed k and plain decoding, side by side in one run.

    python benchmarks/adaptive_k.py                                             # default pair
    python benchmarks/adaptive_k.py --target qwen2.5-coder-1.5b-gguf --suite humaneval --prompts 2
    python benchmarks/adaptive_k.py --batches 1 8 --prompts 8                  # batch 8 against batch 1
    python benchmarks/adaptive_k.py --target qwen2.5-coder-1.5b-int4 --suite humaneval --batches 1 8

What it measures: per round, in rotated order, `verispec.generate` with plain decoding, lossless
speculative decoding at each --ks, and `k="auto"` (verispec.speculation: measured costs, k chosen per
block and row, speculation off for a block where it cannot pay at the batch's size), greedy or
--temperature, --tokens new tokens (the prompt prefill included, as a user sees it). At batch size 1
each prompt is one call; at a batch size B > 1 all prompts go to one call with `batch_size=B`
(continuous batching, B rows at a time). The pair's costs are measured once per batch size, before
timing (`verispec.api.pair_costs` reuses them), and printed (c, v per batch size) with the k each block
chose. Tokens/s per (method, batch size): median over rounds of the prompts' total; the ratio to plain
decoding at the same batch size per round, and plain decoding's throughput against batch 1's.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import environment

import verispec
from verispec.api import as_dtype, encode_prompt, pair_costs
from verispec.evaluation.suites import load_suite
from verispec.models import default_draft, load_drafter, load_model
from verispec.sampling import SamplingConfig
from verispec.threads import configure_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--draft", default=None, help="default: the target's default drafter")
    ap.add_argument("--suite", default="shakespeare")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--ks", type=int, nargs="+", default=[4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", type=int, nargs="+", default=[1], help="batch sizes to compare")
    ap.add_argument("--dtype", default="float32", help="the target's compute dtype (named -gguf and -int4 "
                    "models ignore it)")
    args = ap.parse_args()
    if max(args.batches) > args.prompts:
        raise SystemExit(f"--prompts ({args.prompts}) must be at least the largest batch size")
    threads = configure_threads(args.threads)
    target = load_model(args.target, dtype=as_dtype(args.dtype))
    draft = args.draft or default_draft(args.target)
    drafter = load_drafter(draft, target)
    suite = load_suite(args.suite)
    prompts = [encode_prompt(target, item.prompt, suite.chat) for item in suite.items[: args.prompts]]
    sampling = SamplingConfig(temperature=args.temperature)
    print(environment(), f"threads {threads}")
    for b in args.batches:  # measured here, reused by generate's k="auto" at that batch size
        costs = pair_costs(target, drafter, prompts[0], tuple(sorted({1, b})), sampling)
        print(f"costs at batch sizes {sorted({1, b})}: {costs.summary()}")
    print(f"target {args.target}, draft {draft}, suite {args.suite}, {len(prompts)} prompts x {args.tokens} "
          f"tokens, T={args.temperature:g}, batch sizes {args.batches}")
    methods = {"plain": dict(draft=None), **{f"sd k={k}": dict(draft=draft, k=k) for k in args.ks},
               "sd k=auto": dict(draft=draft, k="auto")}
    runs = [(m, b) for b in args.batches for m in methods]
    speeds: dict[tuple[str, int], list[float]] = {run: [] for run in runs}
    choices: dict[int, list[int]] = {b: [] for b in args.batches}
    off: dict[int, int] = {b: 0 for b in args.batches}
    for r in range(args.rounds):
        order = runs[r % len(runs):] + runs[: r % len(runs)]
        for m, b in order:
            calls = [[ids] for ids in prompts] if b == 1 else [prompts]
            tokens, start = 0, time.perf_counter()
            for i, call in enumerate(calls):
                outs = verispec.generate(call, target=target, max_new_tokens=args.tokens, seed=i,
                                         temperature=args.temperature, batch_size=b, **methods[m])
                for out in outs:
                    tokens += out.stats["tokens"]
                    spec = out.stats["verification"]["speculation"]
                    if spec is not None:
                        choices[b] += spec["k_per_block"]
                        off[b] += spec["blocks_off"]
            speeds[(m, b)].append(tokens / (time.perf_counter() - start))
        line = ", ".join(f"{m} B={b} {speeds[(m, b)][-1]:.2f}" for m, b in runs)
        print(f"round {r + 1}: {line}", flush=True)
    print("\nmethod        B   tokens/s (median over rounds)   ratio to plain at B: median [min, max]")
    for m, b in runs:
        ratios = [x / y for x, y in zip(speeds[(m, b)], speeds[("plain", b)])]
        print(f"{m:12s} {b:2d}  {statistics.median(speeds[(m, b)]):8.2f}   {statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}, {max(ratios):.3f}]")
    for b in args.batches:
        if b != 1 and 1 in args.batches:
            ratios = [x / y for x, y in zip(speeds[("plain", b)], speeds[("plain", 1)])]
            print(f"plain B={b} / B=1 throughput: median {statistics.median(ratios):.2f} "
                  f"[{min(ratios):.2f}, {max(ratios):.2f}]")
        hist = {k: choices[b].count(k) for k in sorted(set(choices[b]))}
        print(f"k=auto at B={b}: row-blocks by chosen k {hist}; blocks with speculation off for the batch "
              f"{off[b]}")


if __name__ == "__main__":
    main()
