"""Figures read from a committed sweep's rows (no decoding), for study/NOTEBOOK.md.

- per batch size: each configuration's rows, tokens, wall time of its units, throughput, speedup over
  plain decoding (`verispec.evaluation.summary.summarize` on that batch size's rows only), and the
  median per-row time per target pass and per draft step (the batch's prompt prefill included);
- configurations that decoded identical tokens on every shared (prompt, seed) unit;
- with --fence-stop (named Qwen targets): how many generated tokens come before the closing ``` of
  the first code block (re-tokenised with the target's tokenizer): what a stop string there saves;
- with --rescore: every row's text scored again by its suite on this (quiet) machine, and the rows
  whose score differs (e.g. a correct program that timed out while the sweep loaded the machine); then
  each comparison the sweep declared (`--compare`), on the stored and the re-scored rows, by code
  written apart from the report's (scipy's t-test on per-problem mean differences, exact McNemar, Holm
  over the declared comparisons still open: `heldout.paired_text`, `heldout.holm_adjusted`; from a
  sequential design's look 2 on, the earlier looks retaken and the report's carried rejections named);
  --planned alone: those comparisons on the stored scores, with no re-scoring;
- with --timed-out SECONDS: every row the sweep failed by timeout (the report's timeout note) run again
  with a limit of SECONDS, and whether it now passes, fails or times out again: a correct program slowed
  by a loaded machine passes; one that never ends times out again (copied rows included, named so);
- with --score-as SUITE: every row's text scored by another suite's scorer (e.g. the old protocol's
  rows, decoded to a 256-token cap with no fence stop, scored as `humaneval-sanitized` scores), each
  configuration's mean printed, and those scores used by --pairs: what a change of scoring alone does;
- with --pairs (0/1 scores): every pair of configurations on their shared units, not only each row
  against its baseline as the report does: wins/losses, difference with Newcombe's interval, exact
  McNemar p, the discordant fraction d and the difference McNemar resolves at 80% power, 2.8 sqrt(d/n);
  --also DIR [DIR ...] adds the configurations other sweeps of the same suite, models, dtypes, device
  and backend hold that this one does not (e.g. a rule decoded in its own sweep against the core's).

    python study/sweep_stats.py study/sweeps/qwen-humaneval-core --fence-stop --rescore --pairs
    python study/sweep_stats.py study/sweeps/qwen-humaneval-lenience --pairs \
        --also study/sweeps/qwen-humaneval-core
    python study/sweep_stats.py study/sweeps/qwen-humaneval-lenience --pairs \
        --also study/sweeps/qwen-humaneval-core --score-as humaneval-sanitized
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from heldout import holm_adjusted, paired_by_problem, paired_text, problem_differences

from verispec.evaluation import comparisons
from verispec.evaluation import stats as vstats
from verispec.evaluation.report import planned_problems, timed_out_rows
from verispec.evaluation.summary import is_score, row_seconds, summarize
from verispec.evaluation.store import read_rows


def timings(rows: list[dict]) -> None:
    by_size = defaultdict(list)
    for row in rows:
        size = int(row.get("batch_size", 1))
        by_size[(size, int(row.get("chunk_size", size)))].append(row)
    for (size, chunk), group in sorted(by_size.items()):
        seconds = sum(row_seconds(r) for r in group if "reused_from" not in r)
        done = sum(1 for r in group if "reused_from" not in r)
        rate = f"{60 * done / seconds:.2f} rows/min of decoding" if seconds else "no rows decoded here"
        print(f"\nbatch size {size}, chunk {chunk} ({done} rows decoded here: {rate})")
        print(f"{'config':56} rows tokens unit_s  tok/s speedup target_s/pass draft_s/step")
        for s in summarize(group):
            mine = [r for r in group if r["config"] == s["config"]]
            unit_seconds = sum(row_seconds(r) for r in mine)  # the units' wall time
            per_pass = statistics.median(r["target_seconds"] / r["target_calls"] for r in mine)
            drafts = [r["draft_seconds"] / r["draft_calls"] for r in mine if r["draft_calls"]]
            draft = f"{statistics.median(drafts):.3f}" if drafts else "-"
            tokens = sum(r["tokens"] for r in mine)
            print(f"{s['config'][:56]:56} {len(mine):4} {tokens:6} {unit_seconds:6.0f} "
                  f"{s['tokens_per_second']:6.2f} {s['speedup']:7.3f} {per_pass:13.3f} {draft:>12}")


def identical(rows: list[dict]) -> None:
    tokens = defaultdict(dict)  # config -> (prompt, seed) -> token ids
    for row in rows:
        tokens[row["config"]][(row["prompt_id"], row["seed"])] = row["token_ids"]
    print("\nconfigurations with identical tokens on every shared unit:")
    for a, b in itertools.combinations(tokens, 2):
        shared = tokens[a].keys() & tokens[b].keys()
        if shared and all(tokens[a][u] == tokens[b][u] for u in shared):
            print(f"  {a}  ==  {b}  ({len(shared)} units)")


def fence_stop(rows: list[dict], target: str) -> None:
    """Needs the target's tokenizer only: a named Qwen model's cached directory."""
    from transformers import AutoTokenizer

    from verispec.models import qwen

    tokenizer = AutoTokenizer.from_pretrained(qwen.locate(qwen.PART_SETS[target]))
    before = total = 0
    for row in rows:
        text, n = row["text"], row["tokens"]
        start = text.find("```")
        end = text.find("```", start + 3) if start >= 0 else -1
        total += n
        before += min(n, len(tokenizer(text[: end + 3])["input_ids"])) if end >= 0 else n
    print(f"\nfence stop: {before} of {total} tokens before the closing fence; "
          f"a stop string there saves {1 - before / total:.1%}")


def metrics_under(rows: list[dict], suite_name: str) -> tuple[list[dict], str]:
    """Every row's text scored again by `suite_name` (its metrics dicts, in row order) and the suite's
    primary metric; a prompt id the suite lacks stops the script."""
    from verispec.evaluation.suites import load_suite

    suite = load_suite(suite_name)
    items = items_for(suite, rows, suite_name)
    return [suite.score(r["text"], items[r["prompt_id"]]) for r in rows], suite.primary


def items_for(suite, rows: list[dict], suite_name: str) -> dict:
    """The suite's items by id; a prompt id of `rows` the suite lacks stops the script."""
    items = {item.id: item for item in suite.items}
    missing = sorted({r["prompt_id"] for r in rows} - items.keys())
    if missing:
        raise SystemExit(f"{suite_name}: the suite has no item {missing[0]!r} ({len(missing)} prompt ids "
                         "missing): score rows of the same task")
    return items


def rescore(rows: list[dict]) -> list[dict]:
    """Score every row's text again and name the rows whose score differs; rows copied from another
    sweep (--reuse-from) are left to that sweep's own rescoring. Returns the rows with the new scores
    (copied rows as stored)."""
    copied = sum(1 for r in rows if "reused_from" in r)
    if copied:
        print(f"\nnot rescored here: {copied} rows copied from another sweep (rescore that sweep)")
    changed, again_by_row = [], {}
    decoded = [r for r in rows if "reused_from" not in r]
    for suite_name in dict.fromkeys(r["suite"] for r in decoded):
        mine = [r for r in decoded if r["suite"] == suite_name]
        for row, metrics in zip(mine, metrics_under(mine, suite_name)[0]):
            again = metrics.get(row["score_name"])
            again_by_row[id(row)] = again
            if again != row["score"]:
                changed.append(f"  {row['config']} / {row['prompt_id']} (seed {row['seed']}): "
                               f"{row['score']} in the sweep, {again} now")
    print(f"\nrescored {len(decoded)} rows: {len(changed)} differ")
    for line in changed:
        print(line)
    return [dict(r, score=again_by_row[id(r)]) if id(r) in again_by_row else r for r in rows]


def timed_out_again(rows: list[dict], seconds: float, suite_spec: str | None = None) -> list[str]:
    """Run each row that timed out in the sweep again in the sandbox with a limit of `seconds` (its
    suite's program on its text); a line a row, printed and returned. `suite_spec`: the sweep's suite as
    sweep.json names it (a file suite's path, e.g. `mbpp:PATH`), used for rows of that suite."""
    from verispec.evaluation.sandbox import run_sandboxed
    from verispec.evaluation.suites import load_suite
    from verispec.spec import split

    timed_out = timed_out_rows(rows)
    lines = [f"\nrows that timed out in the sweep, run again with a {seconds:g} s limit: {len(timed_out)}"]
    print(lines[0])
    for suite_name in dict.fromkeys(r["suite"] for r in timed_out):
        named = suite_spec is not None and split(suite_spec, "suite", suite_name)[0] == suite_name
        spec = suite_spec if named else suite_name
        try:
            suite = load_suite(spec)
        except (ValueError, FileNotFoundError) as error:
            raise SystemExit(f"{suite_name}: cannot load the suite to run its rows again: {error}") from None
        if suite.program is None:
            raise SystemExit(f"{suite_name}: the suite scores text, not a program; nothing to run again")
        mine = [r for r in timed_out if r["suite"] == suite_name]
        items = items_for(suite, mine, suite_name)
        for row in mine:
            outcome = run_sandboxed(suite.program(row["text"], items[row["prompt_id"]]), timeout=seconds)
            verdict = "passes" if outcome.passed else ("times out again" if outcome.limit == "timeout"
                                                       else f"fails ({outcome.reason})")
            copied = f" (copied from {row['reused_from']})" if "reused_from" in row else ""
            lines.append(f"  {row['config']} / {row['prompt_id']} (seed {row['seed']}){copied}: {verdict}")
            print(lines[-1], flush=True)
    return lines


def _scores(rows: list[dict]) -> dict[tuple[str, str, int], float]:
    # keyed by the name comparisons give a configuration (temperature by :g), not the row's `config`
    return {(comparisons.config_name(comparisons.config_key(r)), r["prompt_id"], r["seed"]): float(r["score"])
            for r in rows if is_score(r["score"])}


def first_copies(rows: list[dict]) -> list[dict]:
    """The rows with a unit written twice kept once, its first copy (as the report reads them: two copies
    of one unit are one sample); rows without a unit are all kept."""
    seen: set = set()
    kept = []
    for row in rows:
        unit = row.get("unit")
        if unit is None or unit not in seen:
            kept.append(row)
            seen.add(unit)
    return kept


def heldout_earlier_rejections(rows: list[dict], keys: list[tuple[str, str]], sequential: str,
                               planned: int) -> dict[tuple[str, str], tuple[int, float, float]]:
    """The report's carried rejections (`comparisons.earlier_rejections`) done again with the held-out p
    (scipy): each look before this reading's, retaken on the suite's first `look_counts` problems, Holm's
    step-down over the comparisons still open (written here: level alpha / (open - rank)), a missing p
    counted as 1; {(A, B): (look, p there, threshold)}. The thresholds are the report's
    (`stats.sequential_threshold`: the declared design's, not an estimate)."""
    kind, looks = vstats.parse_sequential(sequential)
    counts = comparisons.look_counts(looks, planned)
    whole = _scores(rows)
    fullest = max((len(problem_differences(whole, a, b)) for a, b in keys), default=0)  # paired problems
    now = comparisons.planned_look(fullest, planned, looks)
    rejected: dict[tuple[str, str], tuple[int, float, float]] = {}
    for look in range(1, now):
        scores = _scores([r for r in rows if r["prompt_index"] < counts[look - 1]])
        family = [k for k in keys if k not in rejected]
        p_values = [paired_by_problem(scores, a, b)[3] for a, b in family]
        p_values = [1.0 if math.isnan(p) else p for p in p_values]
        for rank, i in enumerate(sorted(range(len(family)), key=lambda i: p_values[i])):
            threshold = vstats.sequential_threshold(kind, looks, look, 0.05 / (len(family) - rank))
            if not p_values[i] < threshold:
                break
            rejected[family[i]] = (look, p_values[i], threshold)
    return rejected


def planned_comparisons(rows: list[dict], rescored: list[dict] | None, declared: list[str],
                        sequential: str | None = None, planned: int | None = None) -> None:
    """Each declared comparison on the stored and on the re-scored rows, by the held-out code
    (`heldout.paired_text`: scipy's t-test on per-problem mean differences, exact McNemar), with Holm over
    the declared comparisons (`heldout.holm_adjusted`): the report's estimates and p-values reproduced by
    other code. Under a declared sequential design (`sequential`, over `planned` problems) read at look 2
    or later, the comparisons rejected at an earlier look (`heldout_earlier_rejections`) are named and Holm
    runs over the open ones, as the report's; the thresholds are the report's."""
    print("\nplanned comparisons by the held-out code (scipy; Holm over the declared comparisons open):")
    copied = sum(1 for r in rows if "reused_from" in r)
    if rescored and copied:
        print(f"  (re-scored: the {copied} rows copied from other sweeps keep their stored scores)")
    for name, table_rows in (("stored", rows), ("re-scored", rescored)) if rescored else (("stored", rows),):
        table_rows = first_copies(table_rows)
        scores = _scores(table_rows)
        found = list({(f.config_a, f.config_b): f for spec in declared
                      for f in comparisons.compare(table_rows, *comparisons.parse_comparison(spec))}.values())
        keys = [(f.config_a, f.config_b) for f in found]
        indexed = all(type(r.get("prompt_index")) is int for r in table_rows)
        carried = (heldout_earlier_rejections(table_rows, keys, sequential, planned)
                   if sequential and planned and indexed else {})
        open_keys = [k for k in keys if k not in carried]
        holm = dict(zip(open_keys, holm_adjusted([paired_by_problem(scores, *k)[3] for k in open_keys])))
        for f, key in zip(found, keys):
            if key in carried:
                look, p, threshold = carried[key]
                after = (f"rejected at look {look} (retaken: p {p:.3g} under the report's threshold "
                         f"{threshold:.2g})")
            else:
                after = f"Holm p {holm[key]:.3g}"
            print(f"  {name}: {f.config_a} - {f.config_b}: {paired_text(scores, f.config_a, f.config_b)}; "
                  f"{after}")


def score_as(rows: list[dict], suite_name: str) -> list[dict]:
    """The rows with `score` replaced by `suite_name`'s primary score of their text (copies)."""
    metrics, primary = metrics_under(rows, suite_name)
    scored = [dict(r, score=m[primary], score_name=primary) for r, m in zip(rows, metrics)]
    print(f"\nscored as {suite_name} ({primary}):")
    by_config = defaultdict(list)
    for row in scored:
        by_config[row["config"]].append(row["score"])
    for config, values in by_config.items():
        print(f"  {config}: n={len(values)} mean {statistics.fmean(values):.3f}")
    return scored


def pairs(rows: list[dict]) -> None:
    from verispec.evaluation.stats import mcnemar_exact, newcombe_paired_interval, paired_table

    scores = defaultdict(dict)  # config -> (prompt, seed) -> score (a scorer that could not run: left out)
    for row in rows:
        if is_score(row["score"]):
            scores[row["config"]][(row["prompt_id"], row["seed"])] = row["score"]
    print("\nevery pair of configurations on their shared units (0/1 scores):")
    for a, b in itertools.combinations(scores, 2):
        shared = scores[a].keys() & scores[b].keys()
        n = len(shared)
        if not n:
            continue
        both, wins, losses, neither = paired_table([(scores[a][u], scores[b][u]) for u in shared])
        lo, hi = newcombe_paired_interval(both, wins, losses, neither)
        d = (wins + losses) / n
        print(f"  {a} vs {b}: n={n} +{wins}/-{losses} diff={(wins - losses) / n:+.3f} [{lo:+.3f}, {hi:+.3f}] "
              f"McNemar p={mcnemar_exact(wins, losses):.3g} d={d:.2f} resolves {2.8 * (d / n) ** 0.5:.3f}")


SETTINGS = ("suite", "target", "draft", "dtype", "draft_dtype", "device", "backend")


def other_configs(rows: list[dict], sweeps: list[str]) -> list[dict]:
    """The rows of other sweeps whose configuration `rows` lacks; refused (SystemExit) if a sweep's
    settings differ, since then its rows are another experiment's."""
    mine = {tuple(r[k] for k in SETTINGS) for r in rows}
    have = {r["config"] for r in rows}
    extra = []
    for sweep in sweeps:
        theirs = read_rows(f"{sweep}/results.jsonl")
        settings = {tuple(r[k] for k in SETTINGS) for r in theirs}
        if settings != mine:
            raise SystemExit(f"--also {sweep}: other settings ({sorted(settings)} vs {sorted(mine)})")
        extra += [r for r in theirs if r["config"] not in have]
        have |= {r["config"] for r in theirs}
    return extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", help="a sweep's --out directory")
    parser.add_argument("--fence-stop", action="store_true", help="also measure a closing-fence stop string")
    parser.add_argument("--rescore", action="store_true", help="score every row's text again")
    parser.add_argument("--planned", action="store_true",
                        help="the declared comparisons by the held-out code on the stored scores (with "
                             "--rescore: on the re-scored ones too)")
    parser.add_argument("--pairs", action="store_true", help="compare every pair of configurations")
    parser.add_argument("--also", nargs="+", default=[], metavar="DIR",
                        help="with --pairs: other sweeps (same settings) whose configurations join the pairs")
    parser.add_argument("--timed-out", type=float, metavar="SECONDS",
                        help="run the rows that timed out again with a limit of SECONDS")
    parser.add_argument("--score-as", metavar="SUITE",
                        help="score every row's text with SUITE's scorer (printed, and used by --pairs)")
    args = parser.parse_args()
    rows = read_rows(f"{args.sweep}/results.jsonl")
    timings(rows)
    identical(rows)
    if args.fence_stop:
        fence_stop(rows, rows[0]["target"])
    if args.timed_out is not None:
        if not math.isfinite(args.timed_out) or args.timed_out <= 0:
            parser.error(f"--timed-out must be a positive number of seconds, got {args.timed_out:g}")
        settings = Path(args.sweep) / "sweep.json"
        spec = json.loads(settings.read_text()).get("suite") if settings.exists() else None
        timed_out_again(rows, args.timed_out, spec)
    if args.rescore or args.planned:
        rescored = rescore(rows) if args.rescore else None
        settings = Path(args.sweep) / "sweep.json"
        declared = json.loads(settings.read_text()).get("compare") or [] if settings.exists() else []
        if declared:
            plan = json.loads(settings.read_text())
            planned_comparisons(rows, rescored, declared, plan.get("sequential"), planned_problems(plan))
        elif args.planned:
            print(f"\nplanned comparisons: {settings} declares none (`--compare`)")
    if args.also and not args.pairs:
        parser.error("--also works with --pairs")
    compared = rows + other_configs(rows, args.also) if args.pairs else rows
    if args.score_as:
        compared = score_as(compared, args.score_as)
    if args.pairs:
        pairs(compared)


if __name__ == "__main__":
    main()
