"""Test, on a sweep's committed rows, that every emitted token follows the law its configuration claims.

Plain sampling and lossless speculative decoding claim x_t ~ softmax(logits_t / T) given the tokens before
it (Leviathan et al. 2023, Theorem 1); an honest truncation sampler (`honest:<rule>`) claims the truncated
target. This script recomputes the target's logits in one fresh, cache-free pass per row and runs
`verispec.diagnostics.law_check` (randomised PIT with a Kolmogorov-Smirnov test, and the surprise z) per
configuration and seed, over all emitted tokens of the rows it reads. Lossy rules are not checked: their
law at a position depends on the draft's too.

Power: at every position of the same rows, a token is also drawn from the claimed law at 0.95 T and at
1.05 T (a sampler 5% too cold or too hot, one step off the real prefix) and checked against the claimed law
in the same way; the rows `T x 0.95` and `T x 1.05` show what such a bias would look like.

The fresh pass differs from the in-loop logits by rounding (bf16 weights, other pass shapes; median
|difference| of the chosen token's log-probability 3.5e-6, p99 0.08 on the seeds sweep:
`study/recheck_logprobs.py`); the tests look for a sampler-sized bias, not for that.

    python study/law_check.py study/sweeps/qwen-humaneval-sanitized-seeds --rows 1000 \
        --configs "plain T=1" "lossless k=4 T=1" "honest:speccascade:min_p=0.1,resample=target k=4 T=1"
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import torch
from fresh import FreshPass, every_nth

from verispec.diagnostics.law_check import LawCheck, token_statistics
from verispec.rules.registry import parse
from verispec.sampling import SamplingConfig, process


POWER = (0.95, 1.05)  # the power check's samplers: the claimed law at 0.95 T and at 1.05 T


def claimed_law(row: dict, scale: float = 1.0):
    """logits [n, V] -> the law [n, V] a row's configuration claims its tokens follow (at `scale` times its
    temperature: the deliberately broken samplers of the power check)."""
    sampling = SamplingConfig(temperature=row["temperature"] * scale)
    if row["rule"] in ("plain", "lossless"):
        return lambda logits: process(logits, sampling)
    rule = parse(row["rule"])
    if rule.family != "baseline":
        raise ValueError(f"{row['config']}: a lossy rule's law depends on the draft; only plain, lossless "
                         f"and honest configurations are checked")
    return lambda logits: rule.bonus_law(process(logits, sampling))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep")
    ap.add_argument("--rows", type=int, default=40, help="rows per configuration and seed (every n-th)")
    ap.add_argument("--configs", nargs="+", default=["plain T=1", "lossless k=4 T=1"])
    ap.add_argument("--seeds", nargs="+", type=int, default=None, help="sweep seeds to read (default all)")
    args = ap.parse_args()
    fresh = FreshPass(args.sweep)
    rows = fresh.rows
    seeds = args.seeds if args.seeds is not None else sorted({r["seed"] for r in rows})
    generator = torch.Generator().manual_seed(20261204)  # the PIT's v_t and the power check's tokens
    checks: dict[tuple[str, int | str], LawCheck] = defaultdict(LawCheck)
    started = time.perf_counter()
    done = 0
    for config in args.configs:
        for seed in seeds:
            mine = [r for r in rows if r["config"] == config and r["seed"] == seed]
            for row in every_nth(mine, args.rows):
                done += 1
                if done % 20 == 0:  # about 4 s a row: a line every minute or so, on stderr
                    print(f"{done} rows checked, {time.perf_counter() - started:.0f} s", file=sys.stderr)
                reply = torch.tensor(row["token_ids"])  # [n]
                logits = fresh.logits(row)  # [n, V]
                log_law = claimed_law(row)(logits).log()  # [n, V]
                statistics = token_statistics(log_law, reply, generator)
                for key in ((config, seed), (config, "pooled")):
                    checks[key].add(*statistics)
                for scale in POWER:
                    law = claimed_law(row, scale)(logits)  # [n, V]
                    broken = torch.multinomial(law, 1, generator=generator)[:, 0]  # [n]
                    power = checks[(f"{config} [T x {scale}]", "pooled")]
                    power.add(*token_statistics(log_law, broken, generator))
    print(f"{len(rows)} rows in {args.sweep}; seeds {seeds}; {time.perf_counter() - started:.0f} s")
    print(f"{'config':64} {'seed':>6} rows  tokens  off  KS D    KS p    first-token KS p  surprise z  p")
    for (config, seed), check in checks.items():
        r = check.result()
        print(f"{config:64} {seed:>6} {r['rows']:4} {r['tokens']:7} {r['off_support']:4}  {r['ks_d']:.4f}  "
              f"{r['ks_p']:.4f}  {r['first_ks_p']:16.4f}  {r['surprise_z']:+10.2f}  {r['surprise_p']:.4f}")


if __name__ == "__main__":
    main()
