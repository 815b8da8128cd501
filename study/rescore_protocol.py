"""Re-score a HumanEval sweep's rows under both code-task protocols (docs/design/evaluation.md,
'Code-task protocol').

    python study/rescore_protocol.py study/sweeps/qwen-humaneval-core [--compare A:B ...]

For every row: the stored score, the score of the first protocol recomputed (`extract`: the first code
block run as it is; a mismatch with the stored score is counted), and the sanitised program's score
(`sanitized`). Then the report's length outcomes and planned comparisons on the sanitised scores (the
calibration row lossless vs plain included). A reply's first block is the same whether decoding
stopped at its closing fence or went on, so the sanitised score of a row whose block closed within the
old cap is what the fence-stop protocol gives it; rows cut by the old cap before closing their block
would decode further under the new cap, which only a new sweep measures.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from verispec.evaluation import code_protocol, scorers
from verispec.evaluation.comparisons import comparisons_table, length_table
from verispec.evaluation.summary import baseline_of
from verispec.evaluation.store import read_rows, results_file
from verispec.evaluation.suites import humaneval_items


def rescore(row: dict, meta: dict) -> tuple[float, float]:
    old = scorers.humaneval_program(meta["code_prompt"], row["text"], meta["test"], meta["entry_point"])
    new = code_protocol.humaneval_sanitized_program(meta["code_prompt"], row["text"], meta["test"],
                                                    meta["entry_point"])
    return float(scorers.run_program(old)[0]), float(scorers.run_program(new)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="a HumanEval sweep's directory (or results.jsonl)")
    parser.add_argument("--compare", nargs="*", default=[], metavar="A:B")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    rows = read_rows(results_file(args.dir))
    problems = {item.id: item.meta for item in humaneval_items()}
    with ThreadPoolExecutor(args.threads) as pool:
        scores = list(pool.map(lambda r: rescore(r, problems[r["prompt_id"]]), rows))
    per_config = defaultdict(list)
    for row, (old, new) in zip(rows, scores):
        per_config[row["config"]].append((row["score"], old, new))
    print(f"{'config':55s} {'n':>4s} {'stored':>7s} {'extract':>8s} {'mismatch':>8s} {'sanitized':>9s}")
    for config, values in per_config.items():
        n = len(values)
        stored, old, new = (sum(v[i] for v in values) / n for i in range(3))
        mismatches = sum(v[0] != v[1] for v in values)
        print(f"{config:55s} {n:4d} {stored:7.3f} {old:8.3f} {mismatches:8d} {new:9.3f}")
    sanitized = [{**row, "score": new, "protocol": "sanitized (re-scored)"}
                 for row, (_, new) in zip(rows, scores)]
    print("\nlength outcomes (as decoded, old cap):\n" + length_table(sanitized, baseline_of))
    print("\ncomparisons on the sanitised scores:\n" + comparisons_table(sanitized, args.compare))
    mismatches = sum(v[0] != v[1] for values in per_config.values() for v in values)
    print(json.dumps({"rows": len(rows), "mismatches": mismatches}))


if __name__ == "__main__":
    main()
