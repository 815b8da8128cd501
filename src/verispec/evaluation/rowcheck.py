"""What a results row must hold to be read: types and invariants, checked wherever rows are read.

One check (`row_problem`) for every reader of a results file: the report, `--resume` (a row that fails
it is not a finished unit: its unit is decoded again) and `--reuse-from` (never copied). A failing row is
named with its file and line (`store.scan_rows`), never counted or skipped in silence. The invariants:
token counts are non-negative integers within `max_new_tokens` (the row's own, or the sweep's for rows
written before rows recorded it) and within what the target calls can give (k + 1 tokens a call on a
chain); scores are numbers, not booleans (None or NaN: missing); the shift values (mean TV, KL, log ratio,
target NLL) are finite numbers, the TV within [0, 1]; `steps` are lists of one length.
"""

from __future__ import annotations

import math

# what the report's `summarize` reads from every row, and which of it must be a number
REQUIRED = ("config", "rule", "family", "k", "temperature", "prompt_id", "seed", "score_name", "score",
            "proposed", "accepted", "tokens", "target_calls", "seconds", "log_ratio", "target_nll", "mean_tv")
NUMERIC = ("k", "temperature", "proposed", "accepted", "tokens", "target_calls", "seconds", "log_ratio",
           "mean_tv")
STRINGS = ("config", "rule", "family", "score_name")  # must be strings (prompt ids: strings or integers)
OPTIONAL_NUMERIC = ("batch_size", "chunk_size", "batch_seconds", "target_calls")
ALIGNED_STEPS = ("role", "tv", "draft_confidence", "draft_over_target")
COUNTS = ("k", "tokens", "target_calls", "proposed", "accepted")  # non-negative integers
FINITE = ("temperature", "seconds", "log_ratio", "target_nll", "mean_tv", "mean_kl", "max_overshoot",
          "mean_tail_mass")  # finite where present (mean_tv_baseline: finite or None)


def is_number(x) -> bool:
    """An int or float, not a bool (JSON `true` is not 1)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _finite(x) -> bool:
    return is_number(x) and math.isfinite(x)


def row_problem(row: dict, max_new_tokens: int | None = None) -> str | None:
    """What makes a results row unusable, in words naming the field, or None: a missing key, a
    non-number where a number is read, a non-string name, `steps` that is not lists of numbers (roles:
    strings) of one length, `metrics` that is not an object, or a broken invariant (module docstring).
    `max_new_tokens`: the sweep's cap, for rows that do not record their own."""
    missing = [k for k in REQUIRED if k not in row]
    numbers = [k for k in NUMERIC + OPTIONAL_NUMERIC if k in row and not is_number(row[k])]
    wrong = [k for k in STRINGS if k in row and not isinstance(row[k], str)]
    wrong += [k for k in ("prompt_id", "seed")
              if k in row and not (isinstance(row[k], str) or is_number(row[k]))]
    wrong += [k for k in ("unit", "run", "reused_from")
              if row.get(k) is not None and not isinstance(row[k], str)]
    if "metrics" in row and row["metrics"] is not None and not isinstance(row["metrics"], dict):
        wrong.append("metrics")
    steps = row.get("steps", {})
    if not isinstance(steps, dict):
        wrong.append("steps")
    else:
        for key, values in steps.items():
            nullable = key not in ALIGNED_STEPS  # null: a diagnostic with no value there (read as missing)
            ok = isinstance(values, list) and all(
                isinstance(v, str) if key == "role" else is_number(v) or (v is None and nullable)
                for v in values)
            if not ok:
                wrong.append(f"steps.{key}")
        lengths = {len(v) for v in steps.values() if isinstance(v, list)}
        if len(lengths) > 1:
            wrong.append("steps (lists of different lengths)")
        absent = [k for k in ALIGNED_STEPS if steps and k not in steps]
        if absent:  # `summarize` indexes these together, position by position, across rows
            wrong.append(f"steps without {', '.join(absent)}")
    if not missing and not numbers and not wrong:
        broken = _invariants(row, max_new_tokens)
        return None if not broken else "; ".join(broken)
    parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
        [f"not numbers: {', '.join(numbers)}"] if numbers else []) + (
        [f"wrong type: {', '.join(wrong)}"] if wrong else [])
    return "; ".join(parts)


def _invariants(row: dict, max_new_tokens: int | None) -> list[str]:
    """The broken invariants of a row whose fields have the right types."""
    out = []
    counts = [k for k in COUNTS if k in row and not (isinstance(row[k], int) and row[k] >= 0)]
    if counts:
        out.append(f"not non-negative integers: {', '.join(counts)}")
    infinite = [k for k in FINITE if k in row and not _finite(row[k])]
    if row.get("mean_tv_baseline") is not None and not _finite(row["mean_tv_baseline"]):
        infinite.append("mean_tv_baseline")
    if infinite:
        out.append(f"not finite numbers: {', '.join(infinite)}")
    score = row.get("score")
    if score is not None and not (is_number(score) and not math.isinf(score)):
        out.append(f"score {score!r} is not a number (None or NaN: missing)")
    if out:
        return out
    if row["temperature"] < 0 or row["seconds"] < 0:
        out.append("a negative temperature or seconds")
    if not 0 <= row["mean_tv"] <= 1 + 1e-9:
        out.append(f"mean_tv {row['mean_tv']!r} outside [0, 1]")
    if row["accepted"] > row["proposed"]:
        out.append(f"accepted {row['accepted']} > proposed {row['proposed']}")
    cap = row.get("max_new_tokens", max_new_tokens)
    if cap is not None and not (isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1):
        out.append(f"max_new_tokens {cap!r} is not a positive integer")
    elif cap is not None and row["tokens"] > cap:
        out.append(f"tokens {row['tokens']} > max_new_tokens {cap}")
    if row.get("tree") is None and row["tokens"] > row["target_calls"] * (row["k"] + 1):
        out.append(f"tokens {row['tokens']} > what {row['target_calls']} target calls give at k = {row['k']}")
    return out
