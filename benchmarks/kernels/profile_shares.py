"""Where a run's time goes: inclusive shares of named functions in a py-spy raw profile.

    py-spy record -f raw -r 20 -o prof.txt -- verispec bench ...   # any command
    python benchmarks/kernels/profile_shares.py prof.txt

A function's share is the fraction of samples whose stack contains it (counted once per sample however
deep it recurs), so nested functions' shares overlap: read each against its parent.
"""

from __future__ import annotations

import argparse
from collections import Counter

# (label, frame prefix as py-spy writes it: "function (file.py:line)")
PARTS = [
    ("decode loop (BatchDecoder.step)", "BatchDecoder.step "),
    ("  draft proposals (ModelDrafter.propose_batch)", "ModelDrafter.propose_batch "),
    ("  model passes, target and draft (LeanBatchSession.logits_for)", "LeanBatchSession.logits_for "),
    ("    of which prompt context passes (LeanLlama.context)", "LeanLlama.context "),
    ("  target probabilities (sampling.process)", "process "),
    ("  rule maths, speculative blocks (Rule.verify_with_uniforms)", "Rule.verify_with_uniforms "),
    ("  exact diagnostics (_Recorder.flush)", "_Recorder.flush "),
    ("torch kernels, anywhere (OpOverloadPacket.__call__)", "OpOverloadPacket.__call__ "),
    ("  bf16 dense projections (lean.Linear)", "Linear.__call__ "),
    ("  int4 projections (Int4Linear)", "Int4Linear.__call__ "),
    ("scoring programs (run_program)", "run_program "),
    ("loading models (load_model)", "load_model "),
]


def shares(path: str) -> tuple[int, Counter]:
    """(samples, samples per PARTS label) of a py-spy raw file ('frame;frame;... count' lines)."""
    total, found = 0, Counter()
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        for label, prefix in PARTS:
            if any(f.startswith(prefix) for f in frames):
                found[label] += n
    return total, found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="py-spy record -f raw output")
    args = ap.parse_args()
    total, found = shares(args.profile)
    print(f"{total} samples\n\n| part | share of samples |\n|---|---|")
    for label, _ in PARTS:
        print(f"| {label} | {found[label] / max(total, 1):.3f} |")


if __name__ == "__main__":
    main()
