"""Memory of a model pair: load it, decode one prompt plainly and speculatively, then read the process's
own counts from /proc: resident (VmRSS), of which private (RssAnon) and file pages (RssFile: memory-mapped
weights, shared between processes that map the same file and reclaimable), the proportional share
(Pss: each shared page split between the processes mapping it) and the peak (VmHWM).

`--workers N` runs N such processes at once and also prints how much the machine's MemAvailable fell
while all N held their pairs (what N sweep workers cost the machine, shared pages counted once).

    python benchmarks/pair_memory.py --target qwen2.5-coder-1.5b-int4 --workers 1 2
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from common import environment


def proc_kib(path: str) -> dict[str, int]:
    """The 'Name:   123 kB' fields of a /proc file, in KiB."""
    out = {}
    for line in open(path):
        name, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[name] = int(parts[0])
    return out


def one(target: str, draft: str | None, threads: int, hold: float) -> None:
    """The child: load, decode, print the counts, then hold the pair `hold` seconds."""
    import torch

    import verispec
    from verispec.evaluation.suites import load_suite
    from verispec.models import default_draft, load_model

    torch.set_num_threads(threads)
    start = time.perf_counter()
    t = load_model(target)
    d = load_model(draft or default_draft(target))
    t.session(), d.session()
    loaded = time.perf_counter() - start
    prompt = load_suite("humaneval").items[0].prompt
    rates = []
    for k in (None, 3):
        start = time.perf_counter()
        verispec.generate(prompt, target=t, draft=d if k else None, k=k or 4, temperature=0,
                          max_new_tokens=64, chat=True, diagnostics=False)
        rates.append(64 / (time.perf_counter() - start))
    status, rollup = proc_kib("/proc/self/status"), proc_kib("/proc/self/smaps_rollup")
    gib = lambda kib: f"{kib / 2**20:.2f}"  # noqa: E731
    print(f"| {gib(status['VmRSS'])} | {gib(status['RssAnon'])} | {gib(status['RssFile'])} | "
          f"{gib(rollup['Pss'])} | {gib(status['VmHWM'])} | {loaded:.0f} | {rates[0]:.2f} / {rates[1]:.2f} |",
          flush=True)
    time.sleep(hold)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-int4")
    ap.add_argument("--draft", default=None, help="default: the target's default draft")
    ap.add_argument("--workers", type=int, nargs="+", default=[1])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: 2 / N)")
    ap.add_argument("--hold", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        one(args.target, args.draft, args.threads, args.hold)
        return
    print(environment())
    print(f"pair: {args.target} / {args.draft or 'its default draft'}; HumanEval/0, 64 tokens plain, "
          "then SD k=3")
    for n in args.workers:
        threads = args.threads or max(1, 2 // n)
        print(f"\n{n} worker(s), {threads} thread(s) each; per worker, GiB:\n")
        print("| VmRSS | RssAnon (private) | RssFile | Pss | VmHWM (peak) | load s | plain / SD tok/s |")
        print("|---|---|---|---|---|---|---|")
        before = proc_kib("/proc/meminfo")["MemAvailable"]
        hold = 30.0 if n > 1 else 0.0  # every worker still holds its pair when the last one has decoded
        cmd = [sys.executable, __file__, "--child", "--target", args.target, "--threads", str(threads),
               "--hold", str(hold)] + (["--draft", args.draft] if args.draft else [])
        procs = [subprocess.Popen(cmd, stderr=subprocess.DEVNULL) for _ in range(n)]
        low = before
        while any(p.poll() is None for p in procs):
            low = min(low, proc_kib("/proc/meminfo")["MemAvailable"])
            time.sleep(0.5)
        if any(p.returncode for p in procs):
            raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")
        print(f"\nMemAvailable fell by at most {(before - low) / 2**20:.2f} GiB with {n} worker(s) "
              f"(file pages already in the page cache are not counted again)")


if __name__ == "__main__":
    main()
