"""A rule's effect at one setting minus its effect at another: a difference in differences, paired by
(problem, seed) and clustered by problem (e.g. the collaborative rules at T = 1 against T = 0.7).

    python study/temperature_contrast.py study/sweeps/qwen-humaneval-collab-seeds \\
        study/sweeps/qwen-humaneval-collab-t07 --seeds 1 2

For every rule both sweeps hold (besides the baseline and plain) and every (problem, seed) where the rule
and the baseline (lossless SD by default, at the same k) have a row in both sweeps: the rule's score
minus the baseline's in sweep A, the same in sweep B, and A's difference minus B's, with the clustered
paired t-test (`verispec.evaluation.stats.clustered_paired`: per-problem means, t on problems - 1 df),
its interval and the minimum detectable effect (80% power, 0.05 two-sided). The same for the reply length
(tokens). Each sweep holds one temperature (refused otherwise); configurations not in both sweeps with
the baseline are named and left out. Each sweep's own rows only: nothing is decoded. Descriptive: the
units of A and B are different draws (another temperature, another sweep), paired only by problem and
seed.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

from verispec.evaluation import stats, store
from verispec.evaluation.comparisons import PLAIN, canonical_side, config_key
from verispec.evaluation.summary import is_score

Units = dict[tuple[str, int], dict[tuple[str, int], dict]]  # (rule, k) -> {(problem, seed): row}


def _score(row: dict) -> float | None:
    """The row's score, or None where the scorer could not run (None, NaN, not a number)."""
    value = row.get("score")
    return float(value) if is_score(value) else None


def _tokens(row: dict) -> float:
    return float(row["tokens"])


def _by_config(rows: list[dict], seeds: set[int] | None, side: str) -> Units:
    """Chain rows by (rule, k); rows at more than one temperature are refused (a side is one setting)."""
    temperatures = sorted({row["temperature"] for row in rows})
    if len(temperatures) > 1:
        raise ValueError(f"sweep {side} has rows at several temperatures {temperatures}: one setting a side")
    out: Units = {}
    for row in rows:
        rule, k, _, tree = config_key(row)
        if tree is None and (seeds is None or row["seed"] in seeds):
            out.setdefault((rule, k), {})[(row["prompt_id"], row["seed"])] = row
    return out


def _base(baseline: str, k: int) -> tuple[str, int]:
    return baseline, 0 if baseline == PLAIN else k  # plain has no k


def unmatched(rows_a: list[dict], rows_b: list[dict], baseline: str = "lossless") -> list[str]:
    """The chain configurations ('rule k=K') that `contrast` cannot pair: in one sweep only, or without
    the baseline at their k in both."""
    baseline = canonical_side(baseline)
    a, b = _by_config(rows_a, None, "A"), _by_config(rows_b, None, "B")
    both = set(a) & set(b)
    return [f"{rule} k={k}" for rule, k in sorted(set(a) | set(b))
            if rule not in (baseline, PLAIN) and not {(rule, k), _base(baseline, k)} <= both]


def contrast(rows_a: list[dict], rows_b: list[dict], baseline: str = "lossless",
             seeds: set[int] | None = None, value: Callable[[dict], float | None] = _score,
             ) -> dict[str, tuple[stats.PairedEstimate, stats.PairedEstimate, stats.PairedEstimate]]:
    """rule -> (its effect in A, its effect in B, A's effect minus B's), each over the (problem, seed)
    units where the rule and the baseline have rows in both A and B; units where any of the four values
    is None or NaN are left out. `baseline`: a rule spec (canonicalised as the report does) or `plain`."""
    baseline = canonical_side(baseline)
    a, b = _by_config(rows_a, seeds, "A"), _by_config(rows_b, seeds, "B")
    out = {}
    for rule, k in sorted(set(a) & set(b)):
        base = _base(baseline, k)
        if rule in (baseline, PLAIN) or base not in a or base not in b:
            continue
        in_a, in_b = [], []
        for unit in sorted(set(a[(rule, k)]) & set(a[base]) & set(b[(rule, k)]) & set(b[base])):
            values = [value(a[(rule, k)][unit]), value(a[base][unit]),
                      value(b[(rule, k)][unit]), value(b[base][unit])]
            if any(v is None or math.isnan(v) for v in values):
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
    seeds = set(args.seeds) if args.seeds else None
    try:
        left_out = unmatched(rows_a, rows_b, args.baseline)
    except ValueError as err:
        raise SystemExit(f"temperature_contrast: {err}") from None
    t_a, t_b = (rows[0]["temperature"] if rows else math.nan for rows in (rows_a, rows_b))
    print(f"A = {args.sweep_a} (T = {t_a:g}), B = {args.sweep_b} (T = {t_b:g}); each rule minus "
          f"{canonical_side(args.baseline)}, seeds {sorted(seeds) if seeds else 'all shared'}; clustered by "
          "problem")
    if left_out:
        print(f"not in both sweeps with the baseline, left out: {', '.join(left_out)}")
    for name, value in (("score", _score), ("tokens", _tokens)):
        print(f"\n{name}:")
        print("| rule | problems | units | A: rule - base | B: rule - base | A - B | p | MDE |")
        print("|---|---|---|---|---|---|---|---|")
        for rule, (in_a, in_b, diff) in contrast(rows_a, rows_b, args.baseline, seeds, value).items():
            mde = stats.minimum_detectable_effect(diff.se) if math.isfinite(diff.se) else math.nan
            print(f"| {rule} | {diff.clusters} | {diff.units} | {_text(in_a)} | {_text(in_b)} | "
                  f"{_text(diff)} | {diff.p_value:.3g} | {mde:.3f} |")


if __name__ == "__main__":
    main()
