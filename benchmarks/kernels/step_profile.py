"""Where a decode's time goes, on any device: wall seconds inside the engine's named parts (those of
benchmarks/kernels/profile_shares.py, which reads py-spy samples instead), for plain decoding and lossless
SD of a pair at chosen batch sizes. Each part is timed by a wrapper around its function (the outermost
call only), so parts nest and overlap: the draft's own model passes count under 'draft proposals' and
under 'model passes' both; read each row against its parent. On a GPU every model pass ends in the copy of
its logits to the CPU, which waits for the kernels, so 'model passes' holds the GPU's own time too, and a
last row gives the CUDA kernels' own time (a second run under torch.profiler) over the unprofiled run's
wall time.

    python benchmarks/kernels/step_profile.py                                  # default pair, CPU
    python benchmarks/kernels/step_profile.py --device cuda --batches 1 64     # both models on the GPU
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import environment, print_table

from verispec import decode
from verispec.decode import DecodeConfig, autoregressive_decode_batch, speculative_decode_batch
from verispec.evaluation.suites import load_suite
from verispec.models import load_drafter, load_model
from verispec.models.base import batch_session
from verispec.rules import Rule
from verispec.sampling import SamplingConfig

GPU_BUSY = "CUDA kernels' own time (torch.profiler, a second run) / unprofiled wall time"
SECONDS: dict[str, float] = {}


def parts(drafter: object, session: object) -> list[tuple[str, object, str]]:
    """(label, owner, attribute) of the functions timed: the loop, the drafter's and the target's batched
    session's own classes (whichever backend and drafter), the loop's probabilities, rules, diagnostics."""
    d, b = type(drafter).__name__, type(session).__name__
    return [
        ("decode loop (BatchDecoder.step)", decode.BatchDecoder, "step"),
        (f"  draft proposals ({d}.propose_batch)", type(drafter), "propose_batch"),
        (f"  model passes, target and draft ({b}.logits_for)", type(session), "logits_for"),
        ("  target probabilities (sampling.process in the loop)", decode, "process"),
        ("  rule maths (Rule.verify_with_uniforms)", Rule, "verify_with_uniforms"),
        ("  exact diagnostics (_Recorder.flush)", decode._Recorder, "flush"),
    ]


def timed(label: str, fn: Callable) -> Callable:
    """`fn`, adding the wall time of its outermost calls to SECONDS[label]."""
    depth = [0]

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> object:
        depth[0] += 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                SECONDS[label] = SECONDS.get(label, 0.0) + time.perf_counter() - start
    return wrapper


def kernel_seconds(fn: Callable[[], None]) -> float:
    """The sum of the CUDA kernels' own times while `fn()` runs under torch.profiler."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in kernels) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--draft", default="default-draft")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(args.target, args.device)
    drafter = load_drafter(args.draft, target, args.device)
    texts = [item.prompt for item in load_suite("shakespeare").items]
    prompts = [target.encode(texts[i % len(texts)]) for i in range(max(*args.batches, 2))]
    config = DecodeConfig(k=args.k, max_new_tokens=args.tokens, stop_at_eos=False,
                          sampling=SamplingConfig(temperature=1.0))
    print(f"{environment()}\ntarget {target.name}, draft {drafter.name}, device {args.device}; "
          f"{args.tokens} tokens per row, k = {args.k}, T = 1, diagnostics on")

    def run(method: str, b: int) -> None:
        gens = [torch.Generator().manual_seed(i) for i in range(b)]
        if method == "plain":
            autoregressive_decode_batch(target, prompts[:b], config, gens)
        else:
            speculative_decode_batch(target, drafter, prompts[:b], "lossless", config, gens)

    run("plain", 2)  # warm up both models and the kernels
    run("sd", 2)
    timed_parts = parts(drafter, batch_session(target))
    for label, owner, name in timed_parts:
        setattr(owner, name, timed(label, getattr(owner, name)))
    for b in args.batches:
        head, cells, walls = ["part"], {label: [] for label, _, _ in timed_parts}, []
        for method in ("plain", "sd"):
            SECONDS.clear()
            start = time.perf_counter()
            run(method, b)
            walls.append(time.perf_counter() - start)
            total = SECONDS.get(timed_parts[0][0], 0.0)
            head.append(f"{method} share")
            for label, _, _ in timed_parts:
                cells[label].append(f"{SECONDS.get(label, 0.0) / total:.3f}" if total else "-")
            if args.device.startswith("cuda"):
                busy = kernel_seconds(lambda: run(method, b)) / walls[-1]
                cells.setdefault(GPU_BUSY, []).append(f"{busy:.3f}")
        print(f"\nB = {b}: plain {walls[0]:.2f} s ({b * args.tokens / walls[0]:.1f} tokens/s), sd "
              f"{walls[1]:.2f} s ({b * args.tokens / walls[1]:.1f} tokens/s); shares of the loop's time:")
        print_table(head, [[label, *row] for label, row in cells.items()])


if __name__ == "__main__":
    main()
