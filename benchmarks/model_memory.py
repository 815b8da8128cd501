"""Peak resident memory of loading one named model and decoding a few tokens with it, per (name, dtype):
the figures `verispec.models.fit.RESIDENT_GB` refuses loads by. Each configuration runs in its own
process (a fresh peak), which reports its VmHWM (peak resident) and VmRSS from /proc/self/status.

    python benchmarks/model_memory.py qwen2.5-coder-1.5b-int4:float32 qwen2.5-coder-1.5b:bfloat16 ...
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common import environment

CHILD = r"""
import json, sys, torch
import verispec
from verispec.models import load_model
name, dtype = sys.argv[1], sys.argv[2]
model = load_model(name, "cpu", getattr(torch, dtype))
verispec.generate("def fib(n):", target=model, draft=None, max_new_tokens=8, temperature=0, chat=False,
                  diagnostics=False)
status = {}
for line in open("/proc/self/status"):
    key, _, value = line.partition(":")
    if key in ("VmHWM", "VmRSS"):
        status[key] = int(value.split()[0]) * 1024 / 1e9
print(json.dumps(status))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", help="NAME:DTYPE, e.g. qwen2.5-coder-1.5b:bfloat16")
    args = parser.parse_args()
    print(environment())
    print("| model | dtype | peak resident (VmHWM) GB | resident after (VmRSS) GB |")
    print("|---|---|---|---|")
    for config in args.configs:
        name, _, dtype = config.partition(":")
        done = subprocess.run([sys.executable, "-c", CHILD, name, dtype or "float32"], capture_output=True,
                              text=True)
        if done.returncode != 0:
            print(f"| {name} | {dtype} | failed ({done.returncode}): {done.stderr.strip()[-200:]} | |")
            continue
        status = json.loads(done.stdout.strip().splitlines()[-1])
        peak, after = status["VmHWM"], status["VmRSS"]
        print(f"| {name} | {dtype or 'float32'} | {peak:.2f} | {after:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
