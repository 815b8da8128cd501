"""Where a decode's time goes, on any device: wall seconds inside the engine's named parts (those of
benchmarks/profile_shares.py, which reads py-spy samples instead), for plain decoding and lossless SD of
a pair at chosen batch sizes. Each part is timed by a wrapper around its function (the outermost call
only), so parts nest: read each against its parent. On a GPU every model pass ends in the copy of its
logits to the CPU, which waits for the kernels, so 'model passes' holds the GPU's own time too.

    python benchmarks/step_profile.py                                  # default pair, CPU
    python benchmarks/step_profile.py --device cuda --batches 1 64     # both models on the GPU
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from common import environment, print_table

from verispec import decode
from verispec.decode import DecodeConfig, autoregressive_decode_batch, speculative_decode_batch
from verispec.evaluation.suites import load_suite
from verispec.models import load_drafter, load_model
from verispec.models.drafters import ModelDrafter
from verispec.models.lean import LeanBatchSession
from verispec.rules import Rule
from verispec.sampling import SamplingConfig

# (label, owner, attribute): the functions timed, outermost calls only
PARTS = [
    ("decode loop (BatchDecoder.step)", decode.BatchDecoder, "step"),
    ("  draft proposals (ModelDrafter.propose_batch)", ModelDrafter, "propose_batch"),
    ("  model passes, target and draft (LeanBatchSession.logits_for)", LeanBatchSession, "logits_for"),
    ("  target probabilities (sampling.process in the loop)", decode, "process"),
    ("  rule maths (Rule.verify_with_uniforms)", Rule, "verify_with_uniforms"),
    ("  exact diagnostics (_Recorder.flush)", decode._Recorder, "flush"),
]
SECONDS = {label: 0.0 for label, _, _ in PARTS}


GPU_BUSY = "GPU kernels' own time (torch.profiler, another run), share of its wall time"


def gpu_busy(fn) -> float:
    """The sum of the CUDA kernels' own times over the wall time of `fn()`, run under torch.profiler."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in kernels) / 1e6 / wall


def timed(label: str, fn):
    depth = [0]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        depth[0] += 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                SECONDS[label] += time.perf_counter() - start
    return wrapper


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
    for label, owner, name in PARTS:
        setattr(owner, name, timed(label, getattr(owner, name)))
    for b in args.batches:
        head, cells, walls = ["part"], {label: [] for label, _, _ in PARTS}, []
        for method in ("plain", "sd"):
            SECONDS.update(dict.fromkeys(SECONDS, 0.0))
            start = time.perf_counter()
            run(method, b)
            walls.append(time.perf_counter() - start)
            total = SECONDS[PARTS[0][0]]
            head.append(f"{method} share")
            for label, _, _ in PARTS:
                cells[label].append(f"{SECONDS[label] / total:.3f}" if total else "-")
            if args.device.startswith("cuda"):
                cells.setdefault(GPU_BUSY, []).append(f"{gpu_busy(lambda: run(method, b)):.3f}")
        print(f"\nB = {b}: plain {walls[0]:.2f} s ({b * args.tokens / walls[0]:.1f} tokens/s), sd "
              f"{walls[1]:.2f} s ({b * args.tokens / walls[1]:.1f} tokens/s); shares of the loop's time:")
        print_table(head, [[label, *row] for label, row in cells.items()])

if __name__ == "__main__":
    main()
