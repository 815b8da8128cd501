"""Cost growth: time per generated token vs context length (128 .. 2048) and vs k (1 .. 8).

    python bench/cost.py [--target default] [--draft default-draft]

For each context length L the prompt is L tokens of held-out-like text (random ids for lengths the
text does not reach), then 64 new tokens are decoded: plain and lossless speculative (k = 4), greedy
so that runs are comparable; a table of ms/token, median of --reps. Then ms/token vs k at L = 256.
Linear growth of attention cost with L is expected; a quadratic surprise from cache handling would
show as ms/token growing faster than the attention share.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, print_table, write_json  # noqa: E402

from verispec.decode import DecodeConfig, autoregressive_decode, speculative_decode  # noqa: E402
from verispec.models import load_drafter, load_model  # noqa: E402
from verispec.sampling import SamplingConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--draft", default="default-draft")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 1536, 1984])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default="bench/results/cost.json")
    args = ap.parse_args()
    target = load_model(args.target)
    drafter = load_drafter(args.draft, target)
    text = "\n".join(["KING.\nWhat says the queen? Speak, and tell me true,", "QUEEN.\nMy lord, I know not."] * 400)
    ids = target.encode(text)
    cfg = lambda k: DecodeConfig(k=k, max_new_tokens=args.new_tokens, sampling=SamplingConfig(temperature=0),  # noqa: E731
                                 stop_at_eos=False, diagnostics=False)

    def ms_per_token(fn) -> float:
        times = []
        for _ in range(args.reps):
            gen = fn()
            times.append(gen.seconds / gen.num_tokens * 1e3)
        return statistics.median(times)

    by_length = []
    for length in args.lengths:
        prompt = ids[:length]
        plain = ms_per_token(lambda: autoregressive_decode(target, prompt, cfg(4)))
        spec = ms_per_token(lambda: speculative_decode(target, drafter, prompt, "lossless", cfg(4),
                                                       torch.Generator().manual_seed(0)))
        by_length.append({"context": length, "plain_ms_per_token": plain, "sd_ms_per_token": spec})
    by_k = []
    prompt = ids[:256]
    for k in args.ks:
        gen = speculative_decode(target, drafter, prompt, "lossless", cfg(k), torch.Generator().manual_seed(0))
        ms = ms_per_token(lambda: speculative_decode(target, drafter, prompt, "lossless", cfg(k),
                                                     torch.Generator().manual_seed(0)))
        by_k.append({"k": k, "sd_ms_per_token": ms, "tokens_per_target_call": gen.block_efficiency})
    print(environment())
    print(f"ms per generated token ({args.new_tokens} new tokens, greedy, median of {args.reps}):")
    base = by_length[0]
    print_table(["context", "plain ms/token", "x at 128", "SD k=4 ms/token", "x at 128"],
                [[str(r["context"]), f"{r['plain_ms_per_token']:.2f}", f"{r['plain_ms_per_token'] / base['plain_ms_per_token']:.2f}",
                  f"{r['sd_ms_per_token']:.2f}", f"{r['sd_ms_per_token'] / base['sd_ms_per_token']:.2f}"] for r in by_length])
    print(f"\nSD ms per token vs k (context 256):")
    print_table(["k", "ms/token", "tokens/target call"],
                [[str(r["k"]), f"{r['sd_ms_per_token']:.2f}", f"{r['tokens_per_target_call']:.2f}"] for r in by_k])
    write_json(args.json, {"environment": environment(), "by_length": by_length, "by_k": by_k})


if __name__ == "__main__":
    main()
