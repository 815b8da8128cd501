"""Rows a minute of a sweep decoded in static batches against the same sweep with `--chunk` (work units
of M rows decoded --batch-size at a time by continuous batching), side by side in one run (issue 22's
sweep criterion). Each repetition runs both, in alternating order, as real `verispec bench` processes
into a temporary directory; the rate counts decoding only (the rows' work-unit seconds, not the model
load). Also prints tokens/s per configuration and how many rows got the same tokens both ways (the
modes differ only in which rows share a pass: float rounding of other shapes).

    python benchmarks/chunk_rate.py --limit 12 --chunk 12 --reps 1
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from common import environment, print_table

from verispec.evaluation.report import row_seconds
from verispec.evaluation.store import read_rows


def rate(rows: list[dict]) -> tuple[float, dict[str, float]]:
    """Rows a minute of decoding, and tokens/s per configuration (tokens over the units' seconds)."""
    tokens, seconds = defaultdict(int), defaultdict(float)
    for r in rows:
        tokens[r["config"]] += r["tokens"]
        seconds[r["config"]] += row_seconds(r)
    return 60 * len(rows) / sum(seconds.values()), {c: tokens[c] / seconds[c] for c in tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-int4")
    ap.add_argument("--suite", default="humaneval-sanitized")
    ap.add_argument("--rules", nargs="+", default=["speccascade:min_p=0.1"])
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=12)
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    print(environment())
    base = ["bench", "--target", args.target, "--dtype", args.dtype, "--draft", args.draft, "--suite",
            args.suite, "--rules", *args.rules, "--temperatures", "1.0", "--k", "4", "--seeds", "0",
            "--limit", str(args.limit), "--batch-size", str(args.batch_size), "--no-progress", "--no-report"]
    modes = {"static": [], "chunk": ["--chunk", str(args.chunk)]}
    results: dict[str, list[tuple[float, dict]]] = defaultdict(list)
    tokens: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = list(modes) if rep % 2 == 0 else list(modes)[::-1]
            for mode in order:
                out = Path(tmp) / f"{mode}-{rep}"
                subprocess.run([sys.executable, "-m", "verispec", *base, *modes[mode], "--out", str(out)],
                               check=True)
                rows = read_rows(out / "results.jsonl")
                results[mode].append(rate(rows))
                tokens[mode] = {r["unit"]: r["token_ids"] for r in rows}
    configs = list(results["static"][0][1])
    head = ["mode", "rep", "rows/min", *(c.split(" k=")[0].split(" T=")[0][:24] + " tok/s" for c in configs)]
    table = [[mode, str(rep), f"{r:.2f}", *(f"{per[c]:.2f}" for c in configs)]
             for mode in modes for rep, (r, per) in enumerate(results[mode])]
    print(f"\n{args.limit} problems x {len(configs)} configurations, batch {args.batch_size}, "
          f"chunk {args.chunk}, {args.reps} repetition(s)")
    print_table(head, table)
    ratios = [c[0] / s[0] for s, c in zip(results["static"], results["chunk"])]
    print("chunk / static rows a minute, per repetition: " + ", ".join(f"{x:.3f}" for x in ratios))
    same = sum(tokens["static"][u] == tokens["chunk"].get(u) for u in tokens["static"])
    print(f"rows with the same tokens both ways (last repetition): {same} of {len(tokens['static'])}")


if __name__ == "__main__":
    main()
