"""Batch-1 decoding speed of this tree against another commit, side by side in one run.

    python benchmarks/engine_b1.py                 # against the commit before the one-engine change
    python benchmarks/engine_b1.py --base HEAD~3 --rounds 7 --tokens 64
    python benchmarks/engine_b1.py --instructions --reps 4      # instructions counted by valgrind (slow)

What it measures: tokens/s of one prompt decoded alone (batch 1) on the default pair, plain decoding
and lossless speculative decoding (k = 4), T = 1 and greedy, diagnostics on (the default), 64 new
tokens, `stop_at_eos=False` so every run emits the same number of tokens. The base commit is checked
out into a temporary git worktree; each round runs one process per tree, alternating which goes
first, so machine noise hits both alike. Inside a process the pair is loaded and warmed up before
timing, and each (method, temperature) decodes the six shakespeare prompts of benchmarks/common.py
once. The figure per tree is the median over rounds of total tokens / total seconds; the ratio
(this tree / base) is computed per round, and its median and range are printed.

`--instructions`: wall time on a shared machine does not resolve a few per cent (the rounds above range
over +-30%), so this mode counts instructions instead, which machine load does not change: each tree's
worker runs under `valgrind --tool=callgrind` twice, decoding one prompt (64 tokens, T = 1, plain and
lossless k = 4) once and 1 + --reps times; the difference over --reps is the instructions of one decode.
Under valgrind torch runs its AVX2 kernels (valgrind does not emulate AVX-512), the same in both trees.
About 10-25 minutes per worker run on this machine; the two runs of a tree go in parallel.

Both trees are called through `speculative_decode` / `autoregressive_decode`, which exist in both:
before the change they ran the separate batch-1 loop, after it the engine with a batch of one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import environment

WORKER = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
from verispec.decode import DecodeConfig, autoregressive_decode, speculative_decode
from verispec.models import load_drafter, load_model
from verispec.sampling import SamplingConfig
sys.path.insert(0, sys.argv[3])
from common import PROMPTS
tokens = int(sys.argv[2])
target = load_model("default")
drafter = load_drafter("default-draft", target)
prompts = [target.encode(t) for t in PROMPTS]
out = {}
for temperature in (1.0, 0.0):
    cfg = DecodeConfig(k=4, max_new_tokens=tokens, stop_at_eos=False,
                       sampling=SamplingConfig(temperature=temperature))
    warm = DecodeConfig(k=4, max_new_tokens=8, stop_at_eos=False, sampling=cfg.sampling)
    speculative_decode(target, drafter, prompts[0], "lossless", warm, torch.Generator().manual_seed(0))
    autoregressive_decode(target, prompts[0], warm, torch.Generator().manual_seed(0))
    for method in ("plain", "sd"):
        n, t0 = 0, time.perf_counter()
        for i, p in enumerate(prompts):
            g = torch.Generator().manual_seed(i)
            gen = (autoregressive_decode(target, p, cfg, g) if method == "plain"
                   else speculative_decode(target, drafter, p, "lossless", cfg, g))
            n += gen.num_tokens
        out[f"{method} T={temperature:g}"] = n / (time.perf_counter() - t0)
print(json.dumps(out))
"""


COUNT_WORKER = r"""
import sys, torch
torch.set_num_threads(1)
from verispec.decode import DecodeConfig, autoregressive_decode, speculative_decode
from verispec.models import load_drafter, load_model
from verispec.sampling import SamplingConfig
method, runs, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
target = load_model("default")
drafter = load_drafter("default-draft", target)
prompt = target.encode("KING.\nWhat says the queen?\n")
cfg = DecodeConfig(k=4, max_new_tokens=tokens, stop_at_eos=False, sampling=SamplingConfig(temperature=1.0))
for _ in range(runs):
    g = torch.Generator().manual_seed(0)
    if method == "plain":
        autoregressive_decode(target, prompt, cfg, g)
    else:
        speculative_decode(target, drafter, prompt, "lossless", cfg, g)
"""


def instructions(src: Path, method: str, reps: int, tokens: int) -> float:
    """Instructions of one decode in tree `src`: callgrind totals of 1 + reps decodes minus 1, over reps."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    procs = []
    for runs in (1, 1 + reps):
        cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c",
               COUNT_WORKER, method, str(runs), str(tokens)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    totals = []
    for proc in procs:
        _, err = proc.communicate()
        found = re.search(r"Collected : (\d+)", err)
        if proc.returncode != 0 or found is None:
            raise SystemExit(f"valgrind run failed ({proc.returncode}): {err[-2000:]}")
        totals.append(int(found.group(1)))
    return (totals[1] - totals[0]) / reps


def run(src: Path, threads: int, tokens: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    here = str(Path(__file__).parent)
    done = subprocess.run([sys.executable, "-c", WORKER, str(threads), str(tokens), here], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def count_instructions(base: Path, this: Path, reps: int, tokens: int, methods: list[str]) -> None:
    print(f"instructions per decode (one prompt, {tokens} tokens, T=1, valgrind callgrind, {reps} reps):")
    for method in methods:
        counts = {name: instructions(src, method, reps, tokens)
                  for name, src in (("base", base), ("this", this))}
        print(f"{method:6s} base {counts['base'] / 1e6:8.1f} M  this {counts['this'] / 1e6:8.1f} M  "
              f"this/base {counts['this'] / counts['base']:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="c957926", help="the commit to compare against")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--instructions", action="store_true", help="count instructions with valgrind instead")
    ap.add_argument("--reps", type=int, default=4, help="--instructions: decodes beyond the first")
    ap.add_argument("--methods", nargs="+", default=["plain", "sd"], choices=["plain", "sd"],
                    help="--instructions: which decodes to count")
    args = ap.parse_args()
    repo = Path(__file__).resolve().parent.parent
    print(environment())
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(base), args.base],
                       check=True, capture_output=True)
        try:
            if args.instructions:
                count_instructions(base / "src", repo / "src", args.reps, args.tokens, args.methods)
                return
            results: dict[str, list[dict]] = {"base": [], "this": []}
            for r in range(args.rounds):
                order = [("base", base / "src"), ("this", repo / "src")]
                for name, src in order if r % 2 == 0 else order[::-1]:
                    results[name].append(run(src, args.threads, args.tokens))
                print(f"round {r + 1}: base {results['base'][-1]}, this {results['this'][-1]}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(base)], check=False)
    print(f"\nbatch 1, default pair, {args.tokens} tokens, {args.threads} thread(s), {args.rounds} rounds; "
          f"tokens/s median over rounds; ratio this/base per round: median [min, max]")
    for key in results["this"][0]:
        b = [x[key] for x in results["base"]]
        t = [x[key] for x in results["this"]]
        ratios = [y / x for x, y in zip(b, t)]
        print(f"{key:12s} base {statistics.median(b):7.1f}  this {statistics.median(t):7.1f}  "
              f"ratio {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]")


if __name__ == "__main__":
    main()
