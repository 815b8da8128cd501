"""Cost growth: time per generated token vs context length (128 .. 2048) and vs k (1 .. 8).

    python benchmarks/kernels/cost.py [--target default] [--draft default-draft]

For each context length L the prompt is L tokens of play text, then new tokens are decoded, plain
and lossless speculative (k = 4), greedy so that runs are comparable. The cost per token is
*marginal*: (time for 8 + N new tokens - time for 8 new tokens) / N, so the prompt's prefill (paid
once) is excluded; median of --reps. Then the same vs k at L = 256. Attention makes the cost per
token grow linearly with L; a quadratic surprise from cache handling (copying the cache every
step) would show as growth much faster than that.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import environment, print_table, write_json

from verispec.decode import DecodeConfig, autoregressive_decode, speculative_decode
from verispec.models import load_drafter, load_model
from verispec.sampling import SamplingConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--draft", default="default-draft")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 1536, 1984])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="benchmarks/results/cost.json")
    args = ap.parse_args()
    target = load_model(args.target)
    drafter = load_drafter(args.draft, target)
    text = "\n".join(["KING.\nWhat says the queen? Speak, and tell me true,",
                      "QUEEN.\nMy lord, I know not."] * 400)
    ids = target.encode(text)

    def cfg(k: int, n: int) -> DecodeConfig:
        return DecodeConfig(k=k, max_new_tokens=n, sampling=SamplingConfig(temperature=0), stop_at_eos=False,
                            diagnostics=False)

    def marginal_ms(run) -> tuple[float, float, float]:
        """Median over reps of (t(8 + N tokens) - t(8 tokens)) / N (the prefill cancels out), with the
        target's mean ms per forward pass and the tokens per target pass of the long runs."""
        times, per_call, per_pass = [], [], []
        for _ in range(args.reps):
            short, long = run(8), run(8 + args.new_tokens)
            times.append((long.seconds - short.seconds) / (long.num_tokens - short.num_tokens) * 1e3)
            calls = long.target_calls - short.target_calls
            per_call.append((long.target_seconds - short.target_seconds) / max(1, calls) * 1e3)
            per_pass.append(long.block_efficiency)
        return statistics.median(times), statistics.median(per_call), statistics.median(per_pass)

    plain = lambda prompt: lambda n: autoregressive_decode(target, prompt, cfg(4, n))  # noqa: E731
    spec = lambda prompt, k: lambda n: speculative_decode(  # noqa: E731
        target, drafter, prompt, "lossless", cfg(k, n), torch.Generator().manual_seed(0))
    by_length = []
    for length in args.lengths:
        prompt = ids[:length]
        p_ms, p_call, _ = marginal_ms(plain(prompt))
        s_ms, s_call, s_tpc = marginal_ms(spec(prompt, 4))
        by_length.append({"context": length, "plain_ms_per_token": p_ms, "target_step_ms": p_call,
                          "sd_ms_per_token": s_ms, "verify_pass_ms": s_call,
                          "sd_tokens_per_target_call": s_tpc})
    by_k = []
    prompt = ids[:256]
    for k in args.ks:
        ms, call, tpc = marginal_ms(spec(prompt, k))
        by_k.append({"k": k, "sd_ms_per_token": ms, "verify_pass_ms": call, "tokens_per_target_call": tpc})
    print(environment())
    print(f"marginal ms per generated token (greedy; tokens 9..{8 + args.new_tokens}; "
          f"median of {args.reps}):")
    base = by_length[0]
    print_table(["context", "plain ms/token", "x at 128", "target step ms", "SD k=4 ms/token", "x at 128",
                 "verify pass ms", "tokens/pass"],
                [[str(r["context"]), f"{r['plain_ms_per_token']:.2f}",
                  f"{r['plain_ms_per_token'] / base['plain_ms_per_token']:.2f}",
                  f"{r['target_step_ms']:.2f}", f"{r['sd_ms_per_token']:.2f}",
                  f"{r['sd_ms_per_token'] / base['sd_ms_per_token']:.2f}", f"{r['verify_pass_ms']:.2f}",
                  f"{r['sd_tokens_per_target_call']:.2f}"] for r in by_length])
    print("\nSD ms per token vs k (context 256):")
    print_table(["k", "ms/token", "verify pass ms", "tokens/target call"],
                [[str(r["k"]), f"{r['sd_ms_per_token']:.2f}", f"{r['verify_pass_ms']:.2f}",
                  f"{r['tokens_per_target_call']:.2f}"] for r in by_k])
    write_json(args.json, {"environment": environment(), "by_length": by_length, "by_k": by_k})


if __name__ == "__main__":
    main()
