"""A rule's effect at one setting minus its effect at another: a difference in differences, paired by
(problem, seed) and clustered by problem (issue 23; e.g. the collaborative rules at T = 1 against T = 0.7).

    python benchmarks/temperature_contrast.py benchmarks/sweeps/qwen-humaneval-collab-seeds \\
        benchmarks/sweeps/qwen-humaneval-collab-t07 --seeds 1 2

For every rule both sweeps hold (besides the baseline and plain) and every (problem, seed) where the rule
and the baseline (lossless SD by default, at the same k) have a row in both sweeps: the rule's score
minus the baseline's in sweep A, the same in sweep B, and A's difference minus B's, with the clustered
paired t-test (`verispec.evaluation.stats.clustered_paired`: per-problem means, t on problems - 1 df),
its interval and the minimum detectable effect (80% power, 0.05 two-sided). The same for the reply length
(tokens). Each sweep's own rows only: nothing is decoded. Descriptive: the units of A and B are different
draws (another temperature, another sweep), paired only by problem and seed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from verispec.evaluation import stats, store
from verispec.evaluation.comparisons import PLAIN, config_key


def _by_config(rows: list[dict], seeds: set[int] | None) -> dict[tuple[str, int], dict[tuple, dict]]:
    """(rule, k) -> {(problem, seed): row} for chain rows (one temperature per sweep is checked)."""
    out: dict[tuple[str, int], dict[tuple, dict]] = {}
    for row in rows:
        rule, k, _, tree = config_key(row)
        if tree is None and (seeds is None or row["seed"] in seeds):
            out.setdefault((rule, k), {})[(row["prompt_id"], row["seed"])] = row
    return out


def _temperature(rows: list[dict], where: Path) -> float:
    temperatures = sorted({row["temperature"] for row in rows})
    if len(temperatures) != 1:
        raise SystemExit(f"{where}: expected rows at one temperature, found {temperatures}")
    return temperatures[0]


def contrast(rows_a: list[dict], rows_b: list[dict], baseline: str = "lossless",
             seeds: set[int] | None = None, value: Callable[[dict], float] = lambda r: float(r["score"]),
             ) -> dict[str, tuple[stats.PairedEstimate, stats.PairedEstimate, stats.PairedEstimate]]:
    """rule -> (its effect in A, its effect in B, A's effect minus B's), each over the (problem, seed)
    units where the rule and the baseline have rows in both A and B; rows with a non-numeric value
    are left out."""
    a, b = _by_config(rows_a, seeds), _by_config(rows_b, seeds)
    out = {}
    for rule, k in sorted(set(a) & set(b)):
        base = (baseline, 0 if baseline == PLAIN else k)  # plain has no k
        if rule in (baseline, PLAIN) or base not in a or base not in b:
            continue
        in_a, in_b = [], []
        for unit in sorted(set(a[(rule, k)]) & set(a[base]) & set(b[(rule, k)]) & set(b[base])):
            values = [value(a[(rule, k)][unit]), value(a[base][unit]),
                      value(b[(rule, k)][unit]), value(b[base][unit])]
            if any(v is None or v != v for v in values):
                continue
            in_a.append((unit[0], values[0] - values[1]))
            in_b.append((unit[0], values[2] - values[3]))
        out[rule] = (stats.clustered_paired([(p, d, 0.0) for p, d in in_a]),
                     stats.clustered_paired([(p, d, 0.0) for p, d in in_b]),
                     stats.clustered_paired([(p, da, db) for (p, da), (_, db) in zip(in_a, in_b)]))
    return out


def _text(e: stats.PairedEstimate) -> str:
    return f"{e.estimate:+.3f} [{e.low:+.3f}, {e.high:+.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_a", type=Path, help="a sweep's --out directory (its effect is A)")
    parser.add_argument("sweep_b", type=Path, help="another sweep's --out directory (its effect is B)")
    parser.add_argument("--seeds", type=int, nargs="+", help="only these seeds (default: all shared)")
    parser.add_argument("--baseline", default="lossless", help="each rule's baseline (default lossless)")
    args = parser.parse_args()
    rows_a = store.read_rows(store.results_file(args.sweep_a))
    rows_b = store.read_rows(store.results_file(args.sweep_b))
    t_a, t_b = _temperature(rows_a, args.sweep_a), _temperature(rows_b, args.sweep_b)
    seeds = set(args.seeds) if args.seeds else None
    print(f"A = {args.sweep_a} (T = {t_a:g}), B = {args.sweep_b} (T = {t_b:g}); each rule minus "
          f"{args.baseline}, seeds {sorted(seeds) if seeds else 'all shared'}; clustered by problem")
    for name, value in (("score", lambda r: float(r["score"])), ("tokens", lambda r: float(r["tokens"]))):
        print(f"\n{name}:")
        print("| rule | problems | units | A: rule - base | B: rule - base | A - B | p | MDE |")
        print("|---|---|---|---|---|---|---|---|")
        for rule, (in_a, in_b, diff) in contrast(rows_a, rows_b, args.baseline, seeds, value).items():
            mde = stats.minimum_detectable_effect(diff.se) if diff.se == diff.se else float("nan")
            print(f"| {rule} | {diff.clusters} | {diff.units} | {_text(in_a)} | {_text(in_b)} | "
                  f"{_text(diff)} | {diff.p_value:.3g} | {mde:.3f} |")


if __name__ == "__main__":
    main()
