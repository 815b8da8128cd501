"""Adaptive speculation against fixed k and plain decoding, side by side in one run.

    python benchmarks/adaptive_k.py                                             # default pair
    python benchmarks/adaptive_k.py --target qwen2.5-coder-1.5b-gguf --suite humaneval --prompts 2

What it measures: per prompt and round, in rotated order, `verispec.generate` with plain decoding, lossless
speculative decoding at each --ks, and `k="auto"` (verispec.speculation: measured costs, k chosen per
block, speculation off where it cannot pay), greedy or --temperature, batch 1, --tokens new tokens
(the prompt prefill included, as a user sees it). The pair's costs are measured once, before timing
(`verispec.api.pair_costs` reuses them), and printed (c, v per batch size) with the k each block chose.
Tokens/s per method: median over rounds of the prompts' total; the ratio to plain per round.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import environment

import verispec
from verispec.api import encode_prompt, pair_costs
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
    args = ap.parse_args()
    threads = configure_threads(args.threads)
    target = load_model(args.target)
    draft = args.draft or default_draft(args.target)
    drafter = load_drafter(draft, target)
    suite = load_suite(args.suite)
    prompts = [encode_prompt(target, item.prompt, suite.chat) for item in suite.items[: args.prompts]]
    costs = pair_costs(target, drafter, prompts[0], (1,), SamplingConfig(temperature=args.temperature))
    print(environment(), f"threads {threads}")
    print(f"target {args.target}, draft {draft}, suite {args.suite}, {len(prompts)} prompts x {args.tokens} "
          f"tokens, T={args.temperature:g}, batch 1; costs: {costs.summary()}")
    methods = {"plain": dict(draft=None), **{f"sd k={k}": dict(draft=draft, k=k) for k in args.ks},
               "sd k=auto": dict(draft=draft, k="auto")}
    speeds: dict[str, list[float]] = {m: [] for m in methods}
    choices: list[int] = []
    for r in range(args.rounds):
        order = list(methods)[r % len(methods):] + list(methods)[: r % len(methods)]
        totals = {m: [0, 0.0] for m in methods}
        for i, ids in enumerate(prompts):
            for m in order:
                start = time.perf_counter()
                out = verispec.generate(ids, target=target, max_new_tokens=args.tokens, seed=i,
                                        temperature=args.temperature, **methods[m])
                totals[m][0] += out.stats["tokens"]
                totals[m][1] += time.perf_counter() - start
                spec = out.stats["verification"]["speculation"]
                if spec is not None:
                    choices += spec["k_per_block"]
        for m, (n, s) in totals.items():
            speeds[m].append(n / s)
        print(f"round {r + 1}: " + ", ".join(f"{m} {speeds[m][-1]:.2f}" for m in methods), flush=True)
    print("\nmethod        tokens/s (median over rounds)   ratio to plain: median [min, max]")
    for m in methods:
        ratios = [a / b for a, b in zip(speeds[m], speeds["plain"])]
        print(f"{m:12s}  {statistics.median(speeds[m]):8.2f}   {statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}, {max(ratios):.3f}]")
    hist = {k: choices.count(k) for k in sorted(set(choices))}
    print(f"k=auto blocks by chosen k: {hist}")


if __name__ == "__main__":
    main()
