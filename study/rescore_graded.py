"""Re-score a `graded-steps` sweep's rows independently of the suite's code (the studies' held-out check).

    python study/rescore_graded.py study/sweeps/qwen-graded-steps [--compare A:B ...]

For every row: the problem's answer recomputed from the prompt's own words ("Start with 412 and apply
these steps in order: 1. Add 18. 2. Divide by 5. ..."), not from the generator's stored answer; the
reply scored again with a scorer written here (the last number in the reply, or the one after '####'
when the reply has one: the suite's rule) and with a strict one (the number of the last answer marker,
'####' or \\boxed{...}; replies with neither score 0, whatever their last number). Printed: rows
whose recomputed answer or re-score differs from the stored score, how many replies lack a marker,
and each planned comparison (A - B on (problem, seed) pairs) under both
scorings with a paired t-test on per-problem mean differences (scipy) and an exact McNemar test on the
discordant pairs (scipy's binomial test): the report's p-values computed by other code. With
--problems N, only the suite's first N problems (chosen by the report's own prefix rule,
`report.first_problems`, so a sequential look is re-scored on the problems the report read there);
with --after N, only the problems after the first N (descriptive: the second part of a sweep apart).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import numpy as np
from scipy import stats

from heldout import paired_text, problem_differences, unit_differences

from verispec.evaluation import comparisons, graded
from verispec.evaluation.report import first_problems
from verispec.evaluation.store import read_rows

_STEP = re.compile(r"^\d+\. (Add|Subtract|Multiply by|Divide by) (\d+)\.$")
_START = re.compile(r"Start with (\d+) and apply these steps in order:")
_HASHES = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_MARKED = re.compile(r"####\s*\**\s*\$?\s*(-?[\d,]*\.?\d+)|\\boxed\{\s*(-?[\d,]*\.?\d+)\s*\}")
_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*|-?\.\d+")
LOW_LEVELS = (1, 2)  # the held-out plan's contrast: levels 1-2 against 3-5
SHORT_TOKENS = 40  # the held-out plan's "short reply"
LONG_TOKENS = 60  # where the lost-pair count's middle band ends (descriptive, not planned)


def answer_from_prompt(prompt: str) -> int:
    """The chain's value, computed from the prompt's words alone; a division that is not exact raises."""
    value = int(_START.search(prompt).group(1))
    for line in prompt.splitlines():
        found = _STEP.match(line.strip())
        if not found:
            continue
        word, operand = found.group(1), int(found.group(2))
        if word == "Add":
            value += operand
        elif word == "Subtract":
            value -= operand
        elif word == "Multiply by":
            value *= operand
        else:
            if value % operand:
                raise ValueError(f"inexact division {value} / {operand} in {prompt!r}")
            value //= operand
    return value


def _as_number(raw: str) -> float | None:
    try:
        return float(raw.replace(",", "").rstrip("."))
    except ValueError:
        return None


def reply_number(text: str, strict: bool) -> float | None:
    """The suite's rule: the number after the last '####', else the last number in the text. `strict`: the
    number of the last answer marker, '####' (markdown bold or '$' allowed) or '\\boxed{42}' (the model's
    habit), else None."""
    pattern = _MARKED if strict else _HASHES
    found = [m.group(m.lastindex) for m in pattern.finditer(text)]
    candidates = found or ([] if strict else _NUMBER.findall(text))
    numbers = [n for n in map(_as_number, candidates) if n is not None]
    return numbers[-1] if numbers else None


def last_number(text: str) -> float | None:
    """The reply's last number, '####' or not (a reply that echoes '#### 621' first and ends on the right
    answer counts as right here, wrong under the suite's rule)."""
    numbers = [n for n in map(_as_number, _NUMBER.findall(text)) if n is not None]
    return numbers[-1] if numbers else None


def level_contrast(scores: dict[tuple[str, str, int], float], a: str, b: str,
                   low: tuple[int, ...] = LOW_LEVELS) -> dict:
    """The gap A - B on the `low` levels minus the gap on the others, from per-problem mean differences
    (a problem sits in one level, so the two groups are independent): Welch's t-test (scipy), and the
    low levels' own gap with its 95% t interval. The held-out plan's primary test (qwen-graded-steps-
    heldout/PLAN.md)."""
    per = problem_differences(scores, a, b)
    lo = np.array([d for p, d in per.items() if graded.level_of(p) in low])
    hi = np.array([d for p, d in per.items() if graded.level_of(p) not in low])
    contrast = lo.mean() - hi.mean()
    se = float(np.sqrt(lo.var(ddof=1) / len(lo) + hi.var(ddof=1) / len(hi)))
    welch = stats.ttest_ind(lo, hi, equal_var=False).pvalue if se > 0 else 1.0
    half = stats.t.ppf(0.975, len(lo) - 1) * lo.std(ddof=1) / np.sqrt(len(lo))
    return {"contrast": float(contrast), "se": se, "p": float(welch), "low_gap": float(lo.mean()),
            "low_interval": (float(lo.mean() - half), float(lo.mean() + half)), "low_n": len(lo),
            "high_n": len(hi)}


def short_share(scores: dict[tuple[str, str, int], float], tokens: dict[tuple[str, str, int], int],
                a: str, b: str, level: int | None, short: int = SHORT_TOKENS) -> tuple[float, float, int]:
    """On one level (None: all): (the gap A - B over all pairs, the part of it from pairs where A's or B's
    reply has fewer than `short` tokens (their summed difference over all pairs), how many such pairs)."""
    diff = {u: d for u, d in unit_differences(scores, a, b).items()
            if level is None or graded.level_of(u[0]) == level}
    if not diff:
        return float("nan"), float("nan"), 0
    shorts = [u for u in diff if min(tokens[(a, *u)], tokens[(b, *u)]) < short]
    return (sum(diff.values()) / len(diff), sum(diff[u] for u in shorts) / len(diff), len(shorts))


def sign_flip_p(scores: dict[tuple[str, str, int], float], a: str, b: str, flips: int,
                seed: int = 0) -> tuple[float, float]:
    """Exact-in-the-limit permutation p-values (two-sided) of the levels-1-2 contrast and of the slope of
    the per-problem gap on the level, by flipping the sign of each problem's A - B at random: valid under
    exchangeability of A and B within each problem, which holds exactly for two samplers of one law
    (the calibration row) and is the sharp null of no effect at all for a rule. A check that the
    Welch and cluster-robust p-values are calibrated on these rows; `flips` random sign vectors."""
    per = problem_differences(scores, a, b)
    diffs = np.array(list(per.values()))  # [P]
    levels = np.array([graded.level_of(p) for p in per], float)  # [P]
    low = np.isin(levels, LOW_LEVELS)
    centred = levels - levels.mean()

    def statistics(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # d [N, P] -> ([N], [N])
        return d[:, low].mean(1) - d[:, ~low].mean(1), (d * centred).sum(1) / (centred ** 2).sum()

    (contrast,), (slope,) = statistics(diffs[None, :])
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=(flips, len(diffs)))  # [N, P]
    null_contrast, null_slope = statistics(signs * diffs)
    tol = 1e-12  # ties with the observed value count as at least as extreme
    return (float(np.mean(np.abs(null_contrast) >= abs(contrast) - tol)),
            float(np.mean(np.abs(null_slope) >= abs(slope) - tol)))


def without_short(scores: dict[tuple[str, str, int], float], tokens: dict[tuple[str, str, int], int],
                  a: str, b: str, short: int = SHORT_TOKENS) -> dict[tuple[str, str, int], float]:
    """The scores of A and B on the (problem, seed) units where neither reply has fewer than `short`
    tokens: what is left of a comparison without its short pairs."""
    keep = {u for u in unit_differences(scores, a, b) if min(tokens[(a, *u)], tokens[(b, *u)]) >= short}
    return {(c, p, s): v for (c, p, s), v in scores.items() if c in (a, b) and (p, s) in keep}


def lost_pair_lengths(scores: dict[tuple[str, str, int], float], tokens: dict[tuple[str, str, int], int],
                      a: str, b: str, bounds: tuple[int, ...] = (SHORT_TOKENS, LONG_TOKENS)) -> list[int]:
    """The pairs A lost (A wrong where B is right), counted by the length of A's reply: under bounds[0]
    tokens, then each band up to the next bound, then bounds[-1] or more (len(bounds) + 1 counts)."""
    counts = [0] * (len(bounds) + 1)
    for unit, diff in unit_differences(scores, a, b).items():  # unit: (prompt id, seed)
        if diff < 0:
            counts[sum(tokens[(a, *unit)] >= bound for bound in bounds)] += 1
    return counts


def log_odds(scores: dict[tuple[str, str, int], float], config: str, level: int) -> float:
    """log(right / wrong) of one configuration on one level, with 0.5 added to both counts."""
    values = [v for (c, p, _), v in scores.items() if c == config and graded.level_of(p) == level]
    right = sum(values)
    return float(np.log((right + 0.5) / (len(values) - right + 0.5)))


def short_replies(scores: dict[tuple[str, str, int], float], tokens: dict[tuple[str, str, int], int],
                  short: int = SHORT_TOKENS) -> dict[str, tuple[int, int, int]]:
    """Per configuration: (replies with fewer than `short` tokens, all its replies, how many of the short
    ones are right), the graded-steps plans' share of short, unworked replies."""
    counts: dict[str, list[int]] = {}
    for key, score in scores.items():  # key: (config, prompt id, seed)
        count = counts.setdefault(key[0], [0, 0, 0])
        count[1] += 1
        if tokens[key] < short:
            count[0] += 1
            count[2] += int(score)
    return {config: (count[0], count[1], count[2]) for config, count in sorted(counts.items())}


def print_levels(tables: dict[str, dict], tokens: dict, a: str, b: str, flips: int = 0) -> None:
    """The held-out plan's level readings for one comparison: the contrast under every scoring, then,
    under the suite's rule, each level's gap, its short-reply share and both sides' log-odds. `flips`
    > 0 adds two readings that are not the plan's (after its reading): the sign-flip permutation p of
    the contrast and the slope, and the contrast without the short pairs."""
    for name, table in tables.items():
        c = level_contrast(table, a, b)
        lo, hi = c["low_interval"]
        print(f"    levels {'+'.join(map(str, LOW_LEVELS))} minus the rest, {name}: {c['contrast']:+.3f} "
              f"(se {c['se']:.3f}) Welch p {c['p']:.3g}; levels {'+'.join(map(str, LOW_LEVELS))}' gap "
              f"{c['low_gap']:+.3f} [{lo:+.3f}, {hi:+.3f}] ({c['low_n']} and {c['high_n']} problems)")
    table = tables["stored"]
    gap, from_short, n_short = short_share(table, tokens, a, b, None)
    share = f"{from_short / gap:.0%} of the gap" if math.isfinite(gap) and gap != 0 else "no gap to share"
    print(f"    all levels: gap {gap:+.3f}, from pairs with a reply under {SHORT_TOKENS} tokens "
          f"{from_short:+.3f} ({n_short} pairs; {share})")
    under, band, over = lost_pair_lengths(table, tokens, a, b)
    print(f"    pairs {a} lost: {under + band + over}; its reply under {SHORT_TOKENS} tokens in {under}, "
          f"{SHORT_TOKENS}-{LONG_TOKENS - 1} in {band}, {LONG_TOKENS} or more in {over}")
    for level in range(1, graded.LEVELS + 1):
        gap, from_short, n_short = short_share(table, tokens, a, b, level)
        print(f"    level {level}: gap {gap:+.3f}, from pairs with a reply under {SHORT_TOKENS} tokens "
              f"{from_short:+.3f} ({n_short} pairs); log-odds right {log_odds(table, a, level):+.2f} vs "
              f"{log_odds(table, b, level):+.2f}")
    if flips:
        p_contrast, p_slope = sign_flip_p(table, a, b, flips)
        print(f"    sign-flip permutation p ({flips} flips, stored): the contrast {p_contrast:.3g}, "
              f"the slope {p_slope:.3g}")
        c = level_contrast(without_short(table, tokens, a, b), a, b)
        print(f"    without pairs with a reply under {SHORT_TOKENS} tokens, stored: {c['contrast']:+.3f} "
              f"(se {c['se']:.3f}) Welch p {c['p']:.3g} ({c['low_n']} and {c['high_n']} problems)")


def problems_after(rows: list[dict], after: int) -> list[dict]:
    """The rows of the problems after the suite's first `after` (prompt_index `after` or more): the
    second part of a sweep, read apart from the first (its level gaps, its short-reply share)."""
    if isinstance(after, bool) or not isinstance(after, int) or after < 1:
        raise ValueError(f"--after must be a positive number of problems; got {after!r}")
    if any(type(r.get("prompt_index")) is not int for r in rows):
        raise ValueError("--after: some rows have no integer prompt_index, so the suite's order is unknown")
    kept = [r for r in rows if r["prompt_index"] >= after]
    if not kept:
        raise ValueError(f"--after {after}: no rows beyond the first {after} problems")
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--compare", nargs="*", help="A:B or 'A vs B' (default: the sweep.json's)")
    parser.add_argument("--levels", action="store_true",
                        help="also each comparison's level readings declared in qwen-graded-steps-heldout/"
                             "PLAN.md: the levels-1-2 contrast under three scorings, per-level short-reply "
                             "share and log-odds")
    parser.add_argument("--permutations", type=int, default=0, metavar="N",
                        help="with --levels: also the sign-flip permutation p of the contrast and the slope "
                             "(N random flips) and the contrast without the short pairs (not the plan's "
                             "readings: checks of them)")
    parser.add_argument("--problems", type=int, metavar="N",
                        help="only the suite's first N problems, as `verispec report --problems N` reads a "
                             "sequential look (under a declared design, only a planned look's count)")
    parser.add_argument("--after", type=int, metavar="N",
                        help="only the problems after the suite's first N (with --problems M: problems N+1 "
                             "to M): a part of the rows, read descriptively, never a look")
    args = parser.parse_args()
    rows = read_rows(args.sweep / "results.jsonl")  # complete rows (a sweep still writing may cut its last)
    settings = json.loads((args.sweep / "sweep.json").read_text())
    if args.problems is not None:
        notes: list[str] = []
        try:
            rows = first_problems(rows, args.problems, settings, notes)
        except ValueError as error:
            parser.error(str(error))
        print(notes[0])
    if args.after is not None:
        if args.problems is not None and args.after >= args.problems:
            parser.error(f"--after {args.after} with --problems {args.problems}: no problem lies between")
        try:
            rows = problems_after(rows, args.after)
        except ValueError as error:
            parser.error(str(error))
        print(f"descriptive, not a look: problems after the suite's first {args.after} only (--after "
              f"{args.after}): {len(rows)} rows")
    declared = args.compare if args.compare is not None else settings.get("compare") or []
    problems = {"graded-steps": graded.generate_steps,
                "graded-steps-heldout": graded.generate_steps_heldout}[settings["suite"]]()
    prompts = {p["id"]: p["prompt"] for p in problems}
    generator_mismatch = sum(answer_from_prompt(p["prompt"]) != p["answer"] for p in problems)
    stored, suite_rule, strict, last, tokens = {}, {}, {}, {}, {}
    score_mismatch = unmarked = 0
    for r in rows:
        want = answer_from_prompt(prompts[r["prompt_id"]])
        key = (r["config"], r["prompt_id"], r["seed"])
        stored[key] = float(r["score"])
        tokens[key] = int(r["tokens"])
        got, got_strict = reply_number(r["text"], False), reply_number(r["text"], True)
        suite_rule[key] = float(got is not None and got == want)
        strict[key] = float(got_strict is not None and got_strict == want)
        last[key] = float(last_number(r["text"]) == want)
        unmarked += got_strict is None
        score_mismatch += suite_rule[key] != stored[key]
    print(f"{len(problems)} problems: answers recomputed from the prompts' words differ from the "
          f"generator's in {generator_mismatch}")
    print(f"{len(rows)} rows; re-scored (the suite's rule, answers from the prompts' words) differ from "
          f"the stored score in {score_mismatch}; replies with no answer marker ('####' or \\boxed): "
          f"{unmarked}")
    configs = sorted({r["config"] for r in rows})
    if args.levels:
        for config, (n_short, n, right) in short_replies(stored, tokens).items():
            print(f"replies under {SHORT_TOKENS} tokens: {config} {n_short} of {n} ({n_short / n:.3f}), "
                  f"{right} of them right")
    tables = {"stored": stored, "re-scored": suite_rule, "strict (marker)": strict, "last number": last}
    for name, table in tables.items():
        means = {c: np.mean([v for (cc, _, _), v in table.items() if cc == c]) for c in configs}
        print(f"{name}: " + "; ".join(f"{c} {m:.3f}" for c, m in means.items()))
    for spec in declared:  # the sides resolved to configurations as the report does; the statistics are ours
        for found in comparisons.compare(rows, *comparisons.parse_comparison(spec)):
            a, b = found.config_a, found.config_b
            for name, table in tables.items():
                print(f"  {a} - {b}, {name}: {paired_text(table, a, b)}")
            if args.levels:
                readings = ("stored", "strict (marker)", "last number")
                print_levels({k: tables[k] for k in readings}, tokens, a, b, args.permutations)


if __name__ == "__main__":
    main()
