"""Serving benchmark: a bounded load generator against `verispec serve` on the default pair (loopback).

For each server mode (lossless speculative decoding; plain decoding, `--draft none`; lossless with
`--no-diagnostics`) the script starts `python -m verispec serve` as a subprocess on a free 127.0.0.1
port, warms it up, then at each concurrency level sends a fixed number of streaming requests
(asyncio + httpx, `concurrency` in flight at a time; fixed length via `ignore_eos`) and reports total
tokens/s, p50/p99 latency and p50/p99 time to first token (measured by the client). The cost of the
per-response report is measured two ways: the diagnostics on vs off (the exact per-token statistics the
report summarises), and in process, `Generation.stats()` (which builds the report) against decode time.

    python benchmarks/serve_load.py                       # all modes, concurrency 1 4 16 64
    python benchmarks/serve_load.py --concurrency 1 4 --max-tokens 16
    python benchmarks/serve_load.py --modes plain lossless lossless-auto lossless-mixed --concurrency 1 4 16
    python benchmarks/serve_load.py --modes lossless lossless-1thread --ray-replicas 1 2 --concurrency 1 4 16

The mode `lossless-auto` is the lossless server with `--k auto` (each request's k per block, 0 = plain,
from the pair's pass costs measured at start, at the batch's size); the table then prints its
throughput against plain decoding's at each concurrency. The mode `lossless-mixed` is the lossless
server sent requests at eight different temperatures (0.3 to 1.0; the other modes send temperature 1):
each request's rows keep their own settings in one batch, so its throughput beside `lossless` shows
what mixed sampling settings cost. `--target/--draft` serve another pair (e.g. the int4 Qwen pair).

`--long-prompt N` adds, per mode, the short load at `--long-prompt-concurrency` (default 4) measured alone
and then beside one request whose prompt is N tokens (started a second before, cancelled after): the
ratio of the short requests' p50 latency with and without it shows whether a long prefill holds the
others up (`--prefill-chunk`, docs/serving.md).

`--ray-replicas N ...` adds, per N, the lossless mode served by `verispec serve --ray --replicas N` (a
local Ray instance that the server process starts and stops; each replica has its own models, engine and
1 CPU, so one torch thread), beside the local server, so the table compares them at the same concurrency
levels. The mode `lossless-1thread` is the local server with one torch thread (`OMP_NUM_THREADS=1`), the
like-for-like baseline of one replica.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

PROMPTS = ["KING.\nWhat says the queen?\n", "ROMEO.\n",
           "First Citizen:\nBefore we proceed any further, hear me speak.\n", "HAMLET.\nTo be, or not to be,"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str], wait: float = 120, env: dict | None = None,
                 max_batch: int = 64) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "verispec", "serve", "--port", str(port), "--host", "127.0.0.1",
           "--max-batch", str(max_batch), "--max-queue", "256", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


MIXED_TEMPERATURES = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


async def one(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, mixed: bool = False) -> dict:
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "seed": i, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True},
            "temperature": MIXED_TEMPERATURES[i % len(MIXED_TEMPERATURES)] if mixed else 1.0}
    start = time.perf_counter()
    first = None
    final = usage = None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - start
            if "verification" in chunk:
                final = chunk
            if chunk.get("usage"):  # include_usage: a last chunk of its own (OpenAI's shape)
                usage = chunk["usage"]
    return {"latency": time.perf_counter() - start, "ttft": first,
            "tokens": usage["completion_tokens"], "verification": final["verification"]}


async def level(url: str, concurrency: int, requests: int, max_tokens: int, mixed: bool = False) -> dict:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def bounded(i):
            async with sem:
                return await one(client, url, i, max_tokens, mixed)

        start = time.perf_counter()
        out = await asyncio.gather(*(bounded(i) for i in range(requests)))
        wall = time.perf_counter() - start
    lat = sorted(r["latency"] for r in out)
    ttft = sorted(r["ttft"] for r in out if r["ttft"] is not None)
    q = lambda xs, f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    tokens = sum(r["tokens"] for r in out)
    vers = [r["verification"] for r in out]
    return {"concurrency": concurrency, "requests": requests, "tokens": tokens, "tokens_per_s": tokens / wall,
            "p50_latency": statistics.median(lat), "p99_latency": q(lat, 0.99),
            "p50_ttft": statistics.median(ttft), "p99_ttft": q(ttft, 0.99),
            "tokens_per_target_call": sum(v["tokens"] for v in vers) / sum(v["target_calls"] for v in vers)}


async def beside_long_prompt(url: str, concurrency: int, requests: int, max_tokens: int,
                             long_tokens: int) -> tuple[dict, bool]:
    """The short load while one request with a `long_tokens`-token prompt is being served (cancelled once
    the load is done); and whether it was still running when the load ended."""
    async with httpx.AsyncClient(timeout=3600) as client:
        text = " ".join(PROMPTS) * (long_tokens // 20 + 1)
        tokens = (await client.post(url + "/tokenize", json={"prompt": text})).json()["tokens"][:long_tokens]
        long = asyncio.create_task(client.post(url + "/v1/completions",
                                               json={"prompt": tokens, "max_tokens": 1, "seed": 0}))
        await asyncio.sleep(1.0)
        out = await level(url, concurrency, requests, max_tokens)
        still = not long.done()
        long.cancel()
        try:
            await long
        except (asyncio.CancelledError, httpx.HTTPError):
            pass
    return out, still


def report_overhead(n: int = 16, max_tokens: int = 64) -> dict:
    """In process: the time to build the report (`Generation.stats()`) and the diagnostics' time, as
    fractions of decode time, over n generations of the default pair."""
    import torch

    from verispec.decode import DecodeConfig, speculative_decode
    from verispec.models import load_drafter, load_model

    target = load_model("default")
    drafter = load_drafter("default-draft", target)
    build = diag = decode = 0.0
    for i in range(n):
        ids = target.encode(PROMPTS[i % len(PROMPTS)])
        gen = speculative_decode(target, drafter, ids, "budget:tv=0.01,ratio=2",
                                 DecodeConfig(k=4, max_new_tokens=max_tokens, stop_at_eos=False),
                                 torch.Generator().manual_seed(i))
        t0 = time.perf_counter()
        gen.stats(max_new_tokens=max_tokens, k=4)
        build += time.perf_counter() - t0
        diag += gen.diagnostics_seconds
        decode += gen.seconds
    return {"report_build_fraction": build / decode, "diagnostics_fraction": diag / decode}


def interleaved(args, modes: dict, envs: dict) -> list[dict]:
    """Every mode's server up at once (idle ones cost nothing), then per concurrency level and round the
    modes one after the other: a ratio's two sides are measured seconds apart. The order of the modes
    alternates between rounds (odd rounds run it reversed), so neither side of a ratio always runs first
    and a drift over the run falls on both."""
    servers = {}
    try:
        for mode in args.modes:
            servers[mode] = start_server(modes[mode], wait=600, env=envs.get(mode), max_batch=args.max_batch)
        for _, url in servers.values():
            asyncio.run(level(url, 4, 8, args.max_tokens))  # warm up (first batch shapes are slow)
        rows = []
        for c in args.concurrency:
            n = args.requests or max(4, c)
            for turn in range(args.rounds):
                order = list(servers.items())
                for mode, (_, url) in order[::-1] if turn % 2 else order:
                    mixed = mode == "lossless-mixed"
                    row = {"mode": mode, "round": turn,
                           **asyncio.run(level(url, c, n, args.max_tokens, mixed))}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        return rows
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)


def paired_ratios(rows: list[dict]) -> list[str]:
    """Each speculative mode's throughput over plain's at each concurrency, paired by round (a round's
    servers ran one after the other), then over the rounds: their geometric mean and 95% interval
    (Student t on the log ratios; the rounds are the replicates, so the interval covers the drift between
    server starts as well as within a run)."""
    from scipy import stats

    plain = {(r["round"], r["concurrency"]): r["tokens_per_s"] for r in rows if r["mode"] == "plain"}
    ratios: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        if r["mode"] in ("lossless", "lossless-auto") and (r["round"], r["concurrency"]) in plain:
            ratios.setdefault((r["mode"], r["concurrency"]), []).append(
                r["tokens_per_s"] / plain[r["round"], r["concurrency"]])
    out = []
    for (mode, c), values in ratios.items():
        logs = [math.log(v) for v in values]
        line = f"{mode} / plain at concurrency {c}: " + ", ".join(f"{v:.2f}x" for v in values)
        if len(values) > 1:
            mean = statistics.fmean(logs)
            half = stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
            line += (f"; geometric mean {math.exp(mean):.3f}x, 95% interval [{math.exp(mean - half):.3f}, "
                     f"{math.exp(mean + half):.3f}] over {len(values)} rounds")
        out.append(line)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=None,
                        help="per level (default: max(4, concurrency))")
    parser.add_argument("--modes", nargs="+", default=["lossless", "plain", "lossless-nodiag"])
    parser.add_argument("--long-prompt", type=int, default=0, metavar="TOKENS",
                        help="also measure the short load beside one request with a prompt this long")
    parser.add_argument("--long-prompt-concurrency", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=64,
                        help="the servers' --max-batch (the llama.cpp backend holds 8 rows)")
    parser.add_argument("--target", default="default")
    parser.add_argument("--draft", default="default-draft")
    parser.add_argument("--ray-replicas", nargs="*", type=int, default=[],
                        help="also the lossless mode on Ray Serve with each of these replica counts")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the modes in turn this many times (a fresh server each time); each "
                             "mode's throughput against plain is then paired by round, with its spread")
    parser.add_argument("--interleave", action="store_true",
                        help="start every mode's server first, then run each level's rounds with the modes "
                             "back to back (seconds apart instead of a server start apart, so the machine's "
                             "drift falls on both sides of a ratio); no long prompt, no Ray")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.interleave and (args.long_prompt or args.ray_replicas):
        parser.error("--interleave measures the short load only (no --long-prompt, no --ray-replicas)")
    pair = ["--target", args.target, "--draft", args.draft]
    modes = {"lossless": [*pair, "--rule", "lossless"], "plain": [*pair[:2], "--draft", "none"],
             "lossless-nodiag": [*pair, "--rule", "lossless", "--no-diagnostics"]}
    modes["lossless-mixed"] = modes["lossless"]  # the same server, requests at eight temperatures
    modes["lossless-auto"] = [*modes["lossless"], "--k", "auto"]  # k per block and row from measured costs
    modes["lossless-1thread"] = modes["lossless"]  # the local server with one torch thread, as a replica
    envs = {"lossless-1thread": {"OMP_NUM_THREADS": "1"}}
    for n in args.ray_replicas:
        modes[f"lossless-ray{n}"] = [*modes["lossless"], "--ray", "--replicas", str(n)]
    rows, longs = [], []
    if args.interleave:
        rows = interleaved(args, modes, envs)
    turns = [] if args.interleave else [(r, mode) for r in range(args.rounds)
             for mode in [*args.modes, *(f"lossless-ray{n}" for n in args.ray_replicas)]]
    for turn, mode in turns:
        proc, url = start_server(modes[mode], wait=600, env=envs.get(mode),  # a large pair loads in minutes
                                 max_batch=args.max_batch)
        try:
            asyncio.run(level(url, 4, 8, args.max_tokens))  # warm up (first batch shapes are slow)
            for c in args.concurrency:
                if mode == "lossless-nodiag" and c != max(args.concurrency):
                    continue  # the diagnostics toggle: one level is enough
                n = args.requests or max(4, c)
                mixed = mode == "lossless-mixed"
                row = {"mode": mode, "round": turn, **asyncio.run(level(url, c, n, args.max_tokens, mixed))}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if args.long_prompt:
                c = args.long_prompt_concurrency
                n = args.requests or max(4, c)
                alone = asyncio.run(level(url, c, n, args.max_tokens))
                beside, still = asyncio.run(beside_long_prompt(url, c, n, args.max_tokens, args.long_prompt))
                longs.append({"mode": mode, "concurrency": c, "p50_alone": alone["p50_latency"],
                              "p50_beside": beside["p50_latency"], "long_still_running": still})
                print(json.dumps(longs[-1]), flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    print("\n| mode | concurrency | requests | tokens/s | p50 latency (s) | p99 latency (s) | p50 TTFT (s) "
          "| p99 TTFT (s) | tokens/target call |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['concurrency']} | {r['requests']} | {r['tokens_per_s']:.1f} | "
              f"{r['p50_latency']:.2f} | {r['p99_latency']:.2f} | {r['p50_ttft']:.2f} | "
              f"{r['p99_ttft']:.2f} | {r['tokens_per_target_call']:.2f} |")
    for line in paired_ratios(rows):
        print(line)
    for r in longs:
        print(f"{r['mode']}: p50 latency of short requests at concurrency {r['concurrency']} beside a "
              f"{args.long_prompt}-token prompt / alone: {r['p50_beside'] / r['p50_alone']:.2f}x "
              f"({r['p50_beside']:.2f} s / {r['p50_alone']:.2f} s; the long prompt "
              f"{'still' if r['long_still_running'] else 'no longer'} running at the end)")
    single = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["mode"] == "lossless"}
    for r in rows:
        if r["mode"] == "lossless-mixed" and r["concurrency"] in single:
            print(f"mixed temperatures / one temperature at concurrency {r['concurrency']}: "
                  f"{r['tokens_per_s'] / single[r['concurrency']]:.2f}x")
    over = report_overhead()
    print(f"\nin process (16 x 64 tokens, budget:tv=0.01,ratio=2): building the report "
          f"{100 * over['report_build_fraction']:.2f}% of decode time; its diagnostics "
          f"{100 * over['diagnostics_fraction']:.2f}%")


if __name__ == "__main__":
    main()
