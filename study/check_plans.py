"""Was each study declared before it decoded? For every sweep with a PLAN.md (study/sweeps/*/), read
from git and the rows themselves, not from the prose that says so:

- the plan's first commit (its committer time) against the start of the first decoding run whose rows
  the sweep holds (rows copied with --reuse-from are left out: they were decoded elsewhere). A run's
  start is in its id (`YYYYMMDDTHHMMSSZ-...`, taken when the sweep starts, before any model loads), so
  "declared before decoding" means: committed before the first such run began. A plan committed just
  after its run began is still "declared before any row was written" when the commit came before the
  run's first chunk could have finished: a chunk's rows are written together when the chunk is done
  (`units.decode_rows`), so a run's first row lands no earlier than its start plus that chunk's wall
  time (`batch_seconds`, model loading not counted: a lower bound);
- each later commit to PLAN.md (an amendment): its time, its subject, an upper bound on the rows that
  could have been seen (rows of runs started by then, of unknown start, and copied rows), and how many
  rows the repository held at that commit;
- a copy-only sweep (every row copied with --reuse-from) declares a reading of rows decoded before it:
  its verdict says so, and how many of them came from runs started before the plan.

A hostile reader checks the claims "declared before decoding" and "amended before look N" here instead
of trusting them. Clocks are the machines' (committer time and the run id's UTC time, both from the
same session's machine).

    python study/check_plans.py            # every sweep with a PLAN.md
    python study/check_plans.py study/sweeps/qwen-mtbench-seeds
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from verispec.evaluation.store import has_rows, run_started, scan_rows

REPO = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def run_start(run: str) -> datetime | None:
    """The UTC start a run id carries (`20261206T084429Z-e128ef`: `store.run_started`), or None for
    another form."""
    started = run_started(run) if isinstance(run, str) else None
    return None if started is None else datetime.fromtimestamp(started, tz=timezone.utc)


def runs_in(results: Path) -> tuple[dict[str, tuple[int, float | None]], dict[str, int]]:
    """One pass over a sweep's rows -> (decoded, copied): decoded maps a run id to (rows the sweep decoded
    itself in that run, the wall seconds of the run's first chunk: its first row's `batch_seconds`, None
    where absent); copied maps a source run id to the rows the sweep copied from it (--reuse-from; a
    copied row keeps its run). "" stands for rows with no run id; a row cut mid-write counts in neither."""
    decoded: dict[str, tuple[int, float | None]] = {}
    copied: dict[str, int] = {}
    for row in scan_rows(results, resolve=False).rows:  # plain or sealed; rows as written
        run = row.get("run") or ""
        if "reused_from" in row:
            copied[run] = copied.get(run, 0) + 1
        else:
            count, first = decoded.get(run, (0, row.get("batch_seconds")))
            decoded[run] = (count + 1, first)
    return decoded, copied


# where the sweeps lived before (benchmarks/sweeps until the study moved to study/): a plan's history is
# read at each of its homes, and a commit that only moved it, content unchanged, is not an amendment
FORMER_HOMES = (Path("benchmarks") / "sweeps",)


def homes(path: Path) -> list[str]:
    """The repository paths a sweep's file had: where it is now and under each former home."""
    relative = path.relative_to(REPO)
    if relative.parts[:2] != ("study", "sweeps"):
        return [str(relative)]
    inside = relative.relative_to(Path("study") / "sweeps")  # <sweep>/<file>
    return [str(relative), *(str(home / inside) for home in FORMER_HOMES)]


def blob(sha: str, path: str) -> str | None:
    """The object id of `path` at commit `sha` (None where it did not exist)."""
    done = subprocess.run(["git", "rev-parse", "-q", "--verify", f"{sha}:{path}"], cwd=REPO,
                          capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def plan_commits(plan: Path) -> list[tuple[datetime, str, str]]:
    """(committer time, hash, subject) of every commit that changed the plan at any of its homes, oldest
    first; a commit that moved it between homes with its content unchanged is left out."""
    paths = homes(plan)
    out = git("log", "--no-renames", "--format=%cI%x09%H%x09%s", "--", *paths)
    commits = []
    for line in out.splitlines():
        when, sha, subject = line.split("\t", 2)
        before = {blob(f"{sha}^", path) for path in paths} - {None}
        after = {blob(sha, path) for path in paths} - {None}
        if before and before == after and len(after) == 1:  # moved (or copied), not changed
            continue
        commits.append((datetime.fromisoformat(when).astimezone(timezone.utc), sha, subject))
    return sorted(commits)


def rows_at(sha: str, results: Path) -> int:
    """Rows in the sweep's plain results file as committed at `sha`, at whichever home it had then (0
    where it did not exist yet)."""
    for path in homes(results):
        done = subprocess.run(["git", "show", f"{sha}:{path}"], cwd=REPO, capture_output=True, text=True)
        if done.returncode == 0:
            return sum(1 for line in done.stdout.splitlines() if line.strip())
    return 0


def check(sweep: Path, declaration: str = "PLAN.md") -> tuple[str, list[str]]:
    """(a verdict: "declared before decoding", "declared before any row was written", "copy-only",
    "nothing decoded", "<declaration> committed after rows may have been written", "not committed" or
    "runs of unknown start"), and the lines that show it; `declaration`: the file whose first commit
    declares."""
    plan, results = sweep / declaration, sweep / "results.jsonl"
    commits = plan_commits(plan)
    decoded, copied = runs_in(results)  # read once: a sweep's rows are tens of MB
    runs = {run: count for run, (count, _) in decoded.items()}
    first_chunk = {run: seconds for run, (_, seconds) in decoded.items()}
    starts = {run: run_start(run) for run in runs}
    lines = [f"{sweep.relative_to(REPO)}: {sum(runs.values())} decoded rows in {len(runs)} run(s)"
             + (f", {sum(copied.values())} copied" if copied else "")
             + ("" if has_rows(results) else " (no results.jsonl)")]
    if not commits:
        return "not committed", lines + [f"  {declaration} has no commit"]
    first, sha, subject = commits[0]
    lines.append(f"  declared {first:%Y-%m-%d %H:%M:%S} UTC ({sha[:7]}: {subject[:80]})")
    if not runs and copied:
        before = sum(n for r, n in copied.items() if run_start(r) is None or run_start(r) <= first)
        verdict = "copy-only"
        lines.append(f"  {before} of its {sum(copied.values())} copied row(s) come from runs started before "
                     "this plan (or of unknown start)"
                     + (": it declares a reading of rows from runs started before it"
                        if before == sum(copied.values()) else ""))
    elif not runs:
        verdict = "nothing decoded"
    elif any(start is None for start in starts.values()):
        verdict = "runs of unknown start"
        lines.append(f"  {sum(n for r, n in runs.items() if starts[r] is None)} decoded row(s) carry no "
                     "run id with a start time")
    else:
        earliest_run = min(runs, key=lambda r: starts[r])
        earliest = starts[earliest_run]
        lines.append(f"  first decoding run started {earliest:%Y-%m-%d %H:%M:%S} UTC "
                     f"({(earliest - first).total_seconds():+.0f} s after the plan)")
        chunk = first_chunk[earliest_run]
        if first < earliest:
            verdict = "declared before decoding"
        elif chunk is not None and (first - earliest).total_seconds() < chunk:
            verdict = "declared before any row was written"
            lines.append(f"  its first chunk took {chunk:.0f} s, so its first rows were written at least "
                         f"{chunk - (first - earliest).total_seconds():.0f} s after the plan's commit")
        else:
            verdict = f"{declaration} committed after rows may have been written"
    for when, sha, subject in commits[1:]:
        # an upper bound on the rows that could have been seen: runs started by then, copied rows, rows
        # of unknown start
        seen = (sum(n for r, n in runs.items() if starts[r] is None or starts[r] <= when)
                + sum(copied.values()))
        lines.append(f"  amended {when:%Y-%m-%d %H:%M:%S} UTC ({sha[:7]}: {subject[:60]}): "
                     f"at most {seen} row(s) could have been seen (runs started by then, copied rows); "
                     f"{rows_at(sha, results)} row(s) committed at that commit")
    return verdict, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweeps", nargs="*", type=Path,
                        help="sweep directories (default: every study/sweeps/* with a PLAN.md)")
    args = parser.parse_args(argv)
    sweeps = [p.resolve() for p in args.sweeps] or sorted(p.parent for p in
                                                          (REPO / "study" / "sweeps").glob("*/PLAN.md"))
    if git("rev-parse", "--is-shallow-repository").strip() == "true":
        print("a shallow clone: the plans' first commits are not all here (git fetch --unshallow)")
        return 2
    bad, verdicts = 0, []
    for sweep in sweeps:
        if not (sweep / "PLAN.md").is_file():
            print(f"{sweep}: no PLAN.md")
            bad += 1
            continue
        verdict, lines = check(sweep)
        print("\n".join(lines) + f"\n  -> {verdict}")
        verdicts.append(verdict)
        bad += verdict not in ("declared before decoding", "declared before any row was written",
                               "nothing decoded", "copy-only")
    decoding = sum(v in ("declared before decoding", "declared before any row was written") for v in verdicts)
    print(f"\n{decoding} of {decoding + bad} plan(s) whose sweep decodes committed before any row of theirs "
          f"was written; {verdicts.count('copy-only')} copy-only (a declared reading of rows decoded "
          "before), "
          f"{verdicts.count('nothing decoded')} with nothing decoded yet")
    if not args.sweeps:
        # studies declared only by their sweep.json (`--compare`, `--sequential`): the first run writes it
        # before any row and `--resume` refuses other settings, so the declaration is fixed from the first
        # row on, but only its commit time can show a reader when it existed; listed, not counted
        only = sorted(p.parent for p in (REPO / "study" / "sweeps").glob("*/sweep.json")
                      if not (p.parent / "PLAN.md").exists() and json.loads(p.read_text()).get("compare"))
        print(f"\n{len(only)} sweep(s) declare comparisons only in their sweep.json (not counted above):")
        for sweep in only:
            verdict, lines = check(sweep, "sweep.json")
            print("\n".join(lines) + f"\n  -> {verdict}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
