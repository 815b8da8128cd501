"""Rows a minute of the same sweep run several ways, side by side in one run (the
HumanEval sweep command against the fp32 path). Each mode is a real `verispec bench`
process with its own extra arguments (a batch size, `--chunk`, a target dtype, a draft), into a temporary
directory; repetitions run the modes in rotated order. The rate counts decoding only (the rows' work-unit
seconds, not the model load). Also prints tokens/s per configuration, the peak resident memory of each
process, and how many rows got the same tokens as the first mode's (modes that differ only in which rows
share a pass differ by float rounding of other shapes; another dtype is another model).

    python benchmarks/sweep_rate.py --limit 8 --mode "static=" "chunk=--chunk 8"
    python benchmarks/sweep_rate.py --limit 12 --mode "fp32 B4=--dtype float32 --draft qwen2.5-coder-0.5b" \
        "bf16 B4=--batch-size 4" "bf16 B8=--batch-size 8"
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from common import environment, print_table

from verispec.evaluation.summary import row_seconds
from verispec.evaluation.store import read_rows


def rate(rows: list[dict]) -> tuple[float, dict[str, float]]:
    """Rows a minute of decoding, and tokens/s per configuration (tokens over the units' seconds)."""
    tokens, seconds = defaultdict(int), defaultdict(float)
    for r in rows:
        tokens[r["config"]] += r["tokens"]
        seconds[r["config"]] += row_seconds(r)
    return 60 * len(rows) / sum(seconds.values()), {c: tokens[c] / seconds[c] for c in tokens}


def parse_mode(text: str) -> tuple[str, list[str]]:
    """'NAME=ARGS' -> (NAME, the extra `verispec bench` arguments, shell-split)."""
    name, sep, extra = text.partition("=")
    if not sep or not name.strip():
        raise SystemExit(f"--mode takes NAME=ARGS (e.g. 'bf16 B8=--batch-size 8'), got {text!r}")
    return name.strip(), shlex.split(extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-int4")
    ap.add_argument("--suite", default="humaneval-sanitized")
    ap.add_argument("--rules", nargs="+", default=["speccascade:min_p=0.1"])
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=4, help="unless a mode sets its own")
    ap.add_argument("--mode", nargs="+", default=["static=", "chunk=--chunk 12"], metavar="NAME=ARGS",
                    help="named sets of extra `verispec bench` arguments; a later argument wins "
                         "(default: static batches against --chunk 12)")
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    modes = dict(parse_mode(m) for m in args.mode)
    print(environment())
    base = ["bench", "--target", args.target, "--dtype", args.dtype, "--draft", args.draft, "--suite",
            args.suite, "--rules", *args.rules, "--temperatures", "1.0", "--k", "4", "--seeds", "0",
            "--limit", str(args.limit), "--batch-size", str(args.batch_size), "--no-progress", "--no-report"]
    results: dict[str, list[tuple[float, dict]]] = defaultdict(list)
    peak_gib: dict[str, float] = {}
    tokens: dict[str, dict] = {}
    names = list(modes)
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for mode in names[rep % len(names):] + names[:rep % len(names)]:  # rotated order
                out = Path(tmp) / f"{mode.replace(' ', '_')}-{rep}"
                command = [sys.executable, "-m", "verispec", *base, *modes[mode], "--out", str(out)]
                print(f"{mode}: {shlex.join(command[1:])}", flush=True)
                child = subprocess.Popen(command)
                _, status, usage = os.wait4(child.pid, 0)  # this process's own peak RSS (KiB)
                child.returncode = os.waitstatus_to_exitcode(status)
                if child.returncode:
                    raise SystemExit(f"{mode}: verispec bench exited with {child.returncode}")
                peak_gib[mode] = max(peak_gib.get(mode, 0.0), usage.ru_maxrss / 2**20)
                rows = read_rows(out / "results.jsonl")
                results[mode].append(rate(rows))
                tokens[mode] = {(r["config"], r["prompt_id"], r["seed"]): r["token_ids"] for r in rows}
    configs = list(results[names[0]][0][1])
    head = ["mode", "rep", "rows/min", f"vs {names[0]}", "peak GiB",
            *(c.split(" k=")[0].split(" T=")[0][:24] + " tok/s" for c in configs)]
    table = []
    for mode in names:
        for rep, (r, per) in enumerate(results[mode]):
            first = results[names[0]][rep][0]
            table.append([mode, str(rep), f"{r:.2f}", f"{r / first:.3f}", f"{peak_gib[mode]:.1f}",
                          *(f"{per.get(c, float('nan')):.2f}" for c in configs)])
    print(f"\n{args.limit} problems x {len(configs)} configurations, {args.reps} repetition(s); "
          "rows/min over decoding time; 'vs' in the same repetition")
    print_table(head, table)
    for mode in names[1:]:
        same = sum(tokens[names[0]][u] == tokens[mode].get(u) for u in tokens[names[0]])
        print(f"rows with the same tokens as {names[0]} (last repetition), {mode}: {same} of "
              f"{len(tokens[names[0]])}")


if __name__ == "__main__":
    main()
