"""The diagnostic report of a sweep: speed, shift and quality of every rule, side by side.

`verispec.evaluation.summary.summarize(rows)` aggregates the results rows per config (its docstring
gives the definitions and intervals); `terminal_table` and `render_html` render it, with the sweep's
notes (units, speed, load, machines, scores, time-outs, pace).
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import json
import logging
import math
from collections import Counter, defaultdict
from pathlib import Path
from statistics import median
from typing import Sequence

from verispec.evaluation.comparisons import (comparisons_table, length_table, level_table,
                                             loglik_controls_table, look_counts, progress_table, tier_table)
from verispec.evaluation.stats import (parse_sequential)
from verispec.evaluation.summary import (baseline_of, batch_size_of, chunk_size_of, finite_values, is_score,
                                         row_seconds, summarize)
from verispec.evaluation.rowcheck import row_problem
from verispec.evaluation.store import (MAX_SETTINGS_BYTES, check_schema, read_regular_file, read_runs,
                                       has_rows, results_file, run_started, scan_rows)
from verispec.evaluation.suites import load_suite
from verispec.evaluation.units import SweepSpec
from verispec.machine import kind
from verispec.tables import markdown_table, text_table


def _fmt(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) >= 1e5 else f"{x:.{digits}f}"  # overshoot reaches 1e6 and more
    return str(x)


def _score_text(s: dict) -> str:
    """A binary score with its Wilson interval, any other with its t half-width; `(n=X of Y)` when rows
    without a finite score were left out (`score_notes` names them)."""
    left_out = f" (n={s['scored']} of {s['units']})" if s.get("scored", s["units"]) != s["units"] else ""
    if s.get("binary_score") and all(math.isfinite(x) for x in s["score_interval"]):
        lo, hi = s["score_interval"]
        return f"{_fmt(s['score'])} [{lo:.2f}, {hi:.2f}]{left_out}"
    return _pm(s["score"], s["score_ci"]) + left_out


def _p_text(s: dict) -> str:
    if not s["baseline"] or not math.isfinite(s.get("p_value", math.nan)):
        return "-"
    better, worse = s["discordant"]
    return f"{s['p_value']:.3g} (+{better}/-{worse})"


def _diff_text(s: dict) -> str:
    """The paired difference with its interval: Newcombe's [lo, hi] for 0/1 scores, else its t half-width."""
    if not s["baseline"]:
        return "-"
    if s.get("discordant") is not None and all(math.isfinite(x) for x in s["score_diff_interval"]):
        lo, hi = s["score_diff_interval"]
        return f"{s['score_diff']:+.3f} [{lo:+.2f}, {hi:+.2f}]"
    return _pm(s["score_diff"], s["score_diff_ci"])


def _pm(value, half) -> str:
    return (_fmt(value) if not (isinstance(half, float) and math.isfinite(half))
            else f"{_fmt(value)}±{_fmt(half)}")


COLUMNS = [
    ("config", "config"), ("n", "units"), ("accept", "acceptance_rate"), ("tok/call", "block_efficiency"),
    ("drafted/call", "drafted_per_call"),
    ("speedup", "speedup"), ("TV", "tv"), ("KL", "kl"), ("TV-base", "tv_baseline"),
    ("overshoot p95", "overshoot_p95"), ("tail mass", "tail_mass"), ("target NLL", "target_nll"),
]


def table_rows(summary: list[dict]) -> tuple[list[str], list[list[str]]]:
    head = [c for c, _ in COLUMNS] + ["seq KL (nats)", "score", "Δscore vs baseline", "McNemar p", "flag"]
    body = []
    for s in summary:
        body.append([_fmt(s[key]) if key != "config" else s[key] for _, key in COLUMNS] + [
            _pm(s["seq_kl"], s["seq_kl_ci"]), _score_text(s),
            _diff_text(s), _p_text(s), s["flag"],
        ])
    return head, body


def select_columns(head: list[str], body: list[list[str]],
                   columns: Sequence[str] | None) -> tuple[list[str], list[list[str]]]:
    """The table's `columns` (header names, in the order given; None: all of them)."""
    if columns is None:
        return head, body
    unknown = [c for c in columns if c not in head]
    if unknown or not columns:
        raise ValueError(f"unknown report column(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
                         f"the columns are: {', '.join(head)}")
    idx = [head.index(c) for c in columns]
    return [head[i] for i in idx], [[row[i] for i in idx] for row in body]


def _num(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) and math.isfinite(value) else "-"


def _ratio(value) -> str:
    """An overshoot ratio: two decimals, or three significant digits once it is large (9.07e+09, not
    digits the stored float32 does not hold)."""
    return _num(value, ".2f" if isinstance(value, (int, float)) and abs(value) < 1000 else ".3g")


def _against(s: dict, baseline: str) -> str:
    """A row's score against its baseline in words: its paired difference, and whether it is below."""
    diff, half = s.get("score_diff"), s.get("score_diff_ci")
    if not isinstance(diff, (int, float)) or not math.isfinite(diff):
        return f"no score pairs with {baseline}"
    finite = isinstance(half, float) and math.isfinite(half)
    interval = f"{diff:+.3f} ± {half:.3f}" if finite else f"{diff:+.3f}"
    verdict = ("significantly below" if s.get("flag") else "above, not significantly" if diff > 0
               else "below, not significantly")
    score = ("the target's log-likelihood a token (a shift measure)" if s["score_name"] == "target_loglik"
             else s["score_name"])
    return f"{score} {interval} against {baseline} ({verdict})"


def story(summary: list[dict]) -> list[str]:
    """What a run showed, in words with its numbers, one line per rule family present: truncation gates
    against honest truncation sampling of the target (their baseline), the collaborative rules by the
    draft's overshoot they let through, the budget rule against its bound, and lossless decoding's
    exactness. The demo's opening lines and the HTML report's lead."""
    lines = []
    by_rule = {s["rule"]: s for s in summary}
    gates = [s for s in summary if s["family"] == "truncation"]
    for s in gates:
        honest = by_rule.get(f"honest:{s['rule']}")
        name = s["rule"].split(",resample=")[0]
        lines.append(f"truncation gate {name}: {_num(s['speedup'], '.2f')}x plain's speed, TV "
                     f"{_num(s['tv'], '.3f')} from the target; "
                     + (_against(s, f"honest {name.split(':')[0]} sampling (the same truncation, "
                                    "done losslessly)") if honest is not None
                        else "no honest baseline in this run"))
    collaborative = [s for s in summary if s["family"] == "collaborative"]
    for s in collaborative:
        capped = s["rule"].startswith("lenience")
        lines.append(f"collaborative {s['rule']}: overshoot p95 {_ratio(s['overshoot_p95'])} ("
                     + ("capped at 1/l" if capped else "not capped") + f"), TV {_num(s['tv'], '.3f')}, "
                     f"{_num(s['speedup'], '.2f')}x plain's speed; " + _against(s, "lossless"))
    for s in (s for s in summary if s["rule"].startswith("budget")):
        bound = s["rule"].split("tv=")[1].split(",")[0] if "tv=" in s["rule"] else "?"
        within = isinstance(s["tv"], float) and s["tv"] <= float(bound) + 1e-9 if bound != "?" else False
        lines.append(f"bounded {s['rule']}: TV {_num(s['tv'], '.3f')} ({'within' if within else 'over'} its "
                     f"bound {bound}), overshoot p95 {_ratio(s['overshoot_p95'])}, "
                     f"{_num(s['speedup'], '.2f')}x plain's speed; " + _against(s, "lossless"))
    for s in (s for s in summary if s["rule"] == "lossless"):
        lines.append(f"lossless: TV {_num(s['tv'], '.3f')} (exact), {_num(s['speedup'], '.2f')}x plain's "
                     f"speed at acceptance {_num(s['acceptance_rate'], '.2f')}")
    return lines


STORY_COLUMNS = ("config", "speedup", "TV", "overshoot p95", "Δscore vs baseline")


def terminal_table(summary: list[dict], markdown: bool = False, columns: Sequence[str] | None = None) -> str:
    """The report table as aligned text, or (`markdown`) a GitHub markdown table, with its legend;
    `columns`: only these (header names, e.g. a README's narrower table)."""
    head, body = select_columns(*table_rows(summary), columns)
    score_name = summary[0]["score_name"] if summary else "score"
    legend = (f"(n = units (prompt x seed); score = {score_name} with its 95% CI (Wilson for 0/1 scores); "
              "Δscore is paired against each row's baseline on the units both have (95% interval: "
              "Newcombe's for 0/1 scores, else t); McNemar p: exact test on the discordant pairs "
              "(+row wins/-baseline wins), 0/1 scores only; WORSE = significantly below the baseline;"
              f" speedup vs plain decoding at the same batch size: {_batch_sizes(summary)})")
    if markdown:
        return markdown_table(head, body) + "\n\n" + legend
    return text_table(head, body) + "\n" + legend


def _batch_sizes(summary: list[dict]) -> str:
    """The batch sizes the table's speedups were measured at, or why there are none (a sweep whose rows
    were all copied by --reuse-from, plain's included, timed nothing beside plain)."""
    sizes = sorted({b for s in summary for b in s.get("speedup_batch_sizes", [])})
    return ", ".join(map(str, sizes)) or "none measured in this sweep (see the notes)"


# ------------------------------------------------------------------------------------------------
# plots (matplotlib, embedded as PNG)


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt  # plotting only: the text report never loads matplotlib

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points not dominated (higher speed x, lower shift y), sorted by speed."""
    keep = [i for i, (x, y) in enumerate(points)
            if not any((x2 >= x and y2 <= y) and (x2 > x or y2 < y) for x2, y2 in points)]
    return sorted(keep, key=lambda i: points[i][0])


def plots(summary: list[dict]) -> dict[str, str]:
    import matplotlib  # plotting only; the backend is chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for s in summary if s["rule"] != "plain"]
    speed_key = "speedup" if all(math.isfinite(s["speedup"]) for s in rows) else "block_efficiency"
    speed_label = "wall-clock speedup vs plain decoding" if speed_key == "speedup" else "block efficiency"
    out = {}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = [(s[speed_key], s["tv"]) for s in rows]
    for s, (x, y) in zip(rows, pts):
        ax.scatter(x, y, s=30)
        ax.annotate(s["config"].replace(",resample=target", ""), (x, y), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    front = pareto(pts)
    ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "k--", lw=1, label="Pareto frontier")
    ax.set_xlabel(speed_label)
    ax.set_ylabel("mean per-token TV to the target")
    ax.legend(fontsize=8)
    ax.set_title("speed vs fidelity")
    out["speed_vs_fidelity"] = _png(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in rows:
        lo, hi = s["score_interval"]
        yerr = [[s["score"] - lo], [hi - s["score"]]] if math.isfinite(lo) and math.isfinite(hi) else None
        ax.errorbar(s[speed_key], s["score"], yerr=yerr, fmt="o", ms=4, capsize=2)
        ax.annotate(s["config"].replace(",resample=target", ""), (s[speed_key], s["score"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel(speed_label)
    ax.set_ylabel(f"score ({summary[0]['score_name']})" if summary else "score")
    ax.set_title("quality vs speed")
    out["quality_vs_speed"] = _png(fig)

    fig, ax = plt.subplots(figsize=(7, 0.45 * max(4, len(rows)) + 1))
    data = [[math.log10(max(v, 1e-12)) for v in finite_values(s["accepted_overshoot"])] or [0.0]
            for s in rows]
    if rows:
        ax.boxplot(data, orientation="horizontal",
                   tick_labels=[s["config"].replace(",resample=target", "") for s in rows],
                   showfliers=True, flierprops={"markersize": 2})
    else:  # a sweep with plain decoding rows only: nothing was drafted
        ax.text(0.5, 0.5, "no speculative decoding rows", ha="center", va="center", transform=ax.transAxes)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_xlabel("log10 q(x)/p(x) of accepted draft tokens (overshoot > 0)")
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title("draft overshoot of accepted tokens")
    out["overshoot"] = _png(fig)
    return out


# ------------------------------------------------------------------------------------------------
# HTML


CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:1em 0}\
th,td{border:1px solid #ccc;padding:3px 7px;text-align:right}
th{background:#f0f0f0}td:first-child,th:first-child{text-align:left}tr.worse td{background:#fde2e2}
.note{color:#555;font-size:13px}img{max-width:100%;border:1px solid #eee;margin:.5em 0}"""


def html_table(head: list[str], body: list[list[str]], classes: list[str] | None = None) -> str:
    classes = classes or [""] * len(body)
    rows = "".join(
        f"<tr class='{c}'>" + "".join(f"<td>{html.escape(x)}</td>" for x in r) + "</tr>"
        for r, c in zip(body, classes)
    )
    return "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + f"</tr>{rows}</table>"


def render_html(summary: list[dict], title: str, meta: dict, outcomes: str = "") -> str:
    """The self-contained HTML report; `outcomes`: the text of `outcome_sections`, shown as it prints.
    It leads with what the run showed (`story`) and the speed-vs-shift plot."""
    head, body = table_rows(summary)
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    lead = story(summary)
    if lead:
        items = "".join(f"<li>{html.escape(line)}</li>" for line in lead)
        parts.append(f"<h2>What this run showed</h2><ul>{items}</ul>")
    parts.append("<p class='note'>" + " &middot; ".join(f"{html.escape(str(k))}: {html.escape(str(v))}"
                                                        for k, v in meta.items()) + "</p>")
    parts.append("<h2>Speed, shift and quality per rule</h2>")
    parts.append(html_table(head, body, ["worse" if s["flag"] else "" for s in summary]))
    parts.append("<p class='note'>accept: accepted/proposed draft tokens; tok/call: tokens per target "
                 "forward pass; drafted/call: draft tokens (tree nodes) per target pass; speedup: "
                 "throughput (tokens/s) vs plain decoding on the same units, "
                 f"interleaved, at the same batch size (batch sizes: {_batch_sizes(summary)}); TV, KL: "
                 "mean per-token distance of the rule's exact output law from the target's; TV-base: "
                 "from the honest truncation baseline; overshoot p95: 95th percentile of max law/p; "
                 "seq KL: mean exact log-likelihood ratio of a generated sequence's decoding path (rule "
                 "vs target): the path-level KL, an upper bound on the sequence-level KL "
                 "(docs/design/rules.md, 'Rule anatomy'), 95% CI; "
                 "Δscore: paired difference to the row's baseline (honest truncation sampler for truncation "
                 "rules, lossless SD otherwise, plain decoding for lossless) on the units both have, 95% "
                 "interval (Newcombe's paired score interval for 0/1 scores, else t); n: units (prompt x "
                 "seed) of the row; score: 95% CI (Wilson's for 0/1 scores "
                 "such as pass@1); McNemar p: exact two-sided test on the discordant pairs (+row wins / "
                 "-baseline wins), 0/1 scores only. tail mass: mean mass the rule's law puts on tokens the "
                 "target gives less than 1e-3; target NLL: the target model's own negative log-likelihood "
                 "per token of the generated text (temperature 1, no truncation), averaged over rows. "
                 "Rows in red are "
                 "significantly below their baseline.</p>")
    if outcomes.strip():
        parts.append("<h2>Length outcomes and planned comparisons</h2>"
                     f"<pre>{html.escape(outcomes.strip())}</pre>")
    figs = plots(summary)
    parts.insert(3 if lead else 2, "<h3>Speed vs shift (Pareto frontier dashed)</h3><img "
                 f"alt='speed_vs_fidelity_lead' src='data:image/png;base64,{figs['speed_vs_fidelity']}'>")
    for name, caption in (("speed_vs_fidelity", "Speed vs fidelity (Pareto frontier dashed)"),
                          ("quality_vs_speed", "Quality vs speed"), ("overshoot", "Overshoot distribution")):
        parts.append(f"<h3>{caption}</h3><img alt='{name}' src='data:image/png;base64,{figs[name]}'>")
    parts.append("<h2>Robustness across prompts</h2>")
    parts.append(html_table(["config", "units", "spread of per-prompt TV (sd)", "worst prompt TV",
                              "worst prompts"],
                             [[s["config"], str(s["units"]),
                               _fmt(s["prompt_tv_spread"], 4), _fmt(s["prompt_tv_max"], 4),
                               ", ".join(s["worst_prompts"])] for s in summary if s["rule"] != "plain"]))
    parts.append("<h2>Where fidelity is lost: the draft's overconfidence</h2>")
    parts.append("<p class='note'>Decided draft positions binned by the draft's confidence (max q): "
                 "acceptance and mean TV of the emitted law; accepted tokens binned by their overshoot "
                 "q(x)/p(x).</p>")
    conf_head = ["config"] + [f"max q {b['bin']}" for b in summary[0]["by_confidence"]] if summary else []
    parts.append(html_table(conf_head, [[s["config"]] + [
        f"n={b['positions']} acc={_fmt(b['acceptance'], 2)} TV={_fmt(b['tv'], 3)}"
        for b in s["by_confidence"]]
        for s in summary if s["rule"] != "plain"]))
    over_head = ["config"] + [f"q/p {b['bin']}" for b in summary[0]["by_overshoot"]] if summary else []
    parts.append(html_table(over_head, [[s["config"]] + [
        f"{b['accepted']} ({_fmt(b['share'], 2)}) TV={_fmt(b['tv'], 3)}" for b in s["by_overshoot"]]
        for s in summary if s["rule"] != "plain"]))
    parts.append("<p class='note'>Load the raw rows in pandas: "
                 "<code>verispec.evaluation.load_results(DIR)</code>.</p></body></html>")
    return "".join(parts)


def _lines_text(items: list, most: int = 8) -> str:
    """The first `most` items (line numbers, row names), and how many more."""
    shown = ", ".join(str(n) for n in items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def usable_rows(path: Path, rows: list[dict], lines: list[int],
                max_new_tokens: int | None = None) -> tuple[list[dict], list[str]]:
    """Rows the report can summarise, and one note per problem: duplicate units (the first copy is
    kept: two copies of one unit are one sample, not two), rows missing keys or with non-numbers
    (skipped, named with their keys and line numbers)."""
    notes: list[str] = []
    seen: set = set()
    kept: list[dict] = []
    duplicates: list[int] = []
    bad: dict[str, list[int]] = defaultdict(list)
    for row, line in zip(rows, lines):
        why = row_problem(row, max_new_tokens)
        if why is not None:
            bad[why].append(line)
            continue
        unit = row.get("unit")
        if unit is not None and unit in seen:
            duplicates.append(line)
            continue
        seen.add(unit)
        kept.append(row)
    for why, numbers in bad.items():
        notes.append(f"skipped {len(numbers)} row(s) of {path} ({why}): line(s) {_lines_text(numbers)}")
    if duplicates:
        notes.append(f"found {len(duplicates)} duplicate row(s) of units already present "
                     "(two writers, or copies); "
                     f"counted each unit once: line(s) {_lines_text(duplicates)}")
    return kept, notes


def unit_set_notes(rows: list[dict]) -> list[str]:
    """A note when the configurations do not all cover the same (prompt, seed) units, e.g. a sweep
    stopped part-way through a chunk: their score columns are then over different problems."""
    units: dict[str, set] = defaultdict(set)
    for row in rows:
        units[row["config"]].add((row["prompt_id"], row["seed"]))
    if len({frozenset(u) for u in units.values()}) <= 1:
        return []
    common = set.intersection(*units.values())
    counts = ", ".join(f"{config}: {len(u)}" for config, u in units.items())
    return [f"the configurations cover different units ({counts}; {len(common)} in all of them): each "
            "score is over its own units: compare configurations through the paired columns (Δscore, "
            "McNemar), or finish the sweep (--resume)"]


def speedup_notes(summary: list[dict]) -> list[str]:
    """Configurations whose speedup leaves out rows decoded in this sweep (copied rows have their own
    note): rows with no plain row timed in the same run at the same batch size."""
    notes = []
    for s in summary:
        if s.get("unpaired"):
            paired = s["units"] - s["unpaired"] - s["reused"]
            over = f"its speedup is over the other {paired}" if paired else "it has no speedup"
            notes.append(f"{s['config']}: {s['unpaired']} row(s) have no plain row timed in the same run "
                         "at the same batch size (a sweep resumed part-way through a chunk or with "
                         "another --batch-size, or whose plain rows were copied by --reuse-plain), "
                         f"so {over}")
    return notes


SLOW_CHUNK = 0.5  # a chunk below this fraction of its configuration's median chunk throughput is flagged
SLOW_PASS = 1.5  # ... and called load when its rows' seconds per target pass exceed this x their median


def _pass_seconds(group: list[dict]) -> float:
    """The median over a chunk's rows of a row's wall seconds per target pass (NaN without passes): the
    passes' own speed, whatever the batch's occupancy."""
    per_pass = [float(r["seconds"]) / r["target_calls"] for r in group if r.get("target_calls", 0) > 0]
    return median(per_pass) if per_pass else math.nan


def load_notes(rows: list[dict]) -> list[str]:
    """A note on chunks that ran far slower than their configuration's other chunks. A chunk is one work
    unit's rows of one configuration: the same run, batch size, chunk size and `batch_seconds` (the
    unit's wall time, which its rows share); rows without `batch_seconds` (written before chunks) and
    copied rows are left out. Its throughput (tokens over `row_seconds`) is compared with the median of
    its configuration's chunks at the same batch and chunk size (at least 4 of them); under SLOW_CHUNK x
    that median it is named. Why it was slow is read from its passes: where its rows' seconds per target
    pass (`_pass_seconds`) exceed SLOW_PASS x the median chunk's, the passes themselves ran slow (another
    job on the machine); otherwise they ran at their usual speed and the chunk was slow for its shape
    (reply lengths that leave the batch part-empty, long prompts). The speedup column pairs rows within
    a run, so it takes such a chunk at face value."""
    chunks: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        if "reused_from" not in row and "batch_seconds" in row and row_seconds(row) > 0:
            chunks[(row["config"], batch_size_of(row), chunk_size_of(row), row.get("run"),
                    row["batch_seconds"])].append(row)
    by_setting: dict[tuple, list[tuple[float, float, list[dict]]]] = defaultdict(list)
    for key, group in chunks.items():
        rate = sum(r["tokens"] for r in group) / sum(row_seconds(r) for r in group)  # tokens/s
        by_setting[key[:3]].append((rate, _pass_seconds(group), group))
    # slow: (share of the median, tokens/s, median tokens/s, pass time x the median's, rows) per slow chunk
    slow, total = [], 0
    for found in by_setting.values():
        if len(found) < 4:
            continue
        total += len(found)
        typical = median(rate for rate, _, _ in found)
        typical_pass = median(pass_s for _, pass_s, _ in found)
        slow += [(rate / typical, rate, typical, pass_s / typical_pass, group)
                 for rate, pass_s, group in found if rate < SLOW_CHUNK * typical]
    if not slow:
        return []
    timed = [s for s in slow if math.isfinite(s[3])]  # rows that record their target passes
    loaded = sum(1 for s in timed if s[3] > SLOW_PASS)
    why = (f"; in {loaded} of the {len(timed)} the target passes themselves ran over {SLOW_PASS:g}x as slow "
           "as in the median chunk (another job on the machine)") if timed else ""
    if loaded < len(timed):
        why += (f"; in {len(timed) - loaded} they ran at about their usual speed, so the chunk was slow for "
                "its shape (e.g. uneven reply lengths leaving the batch part-empty)")
    share, rate, typical, pass_ratio, group = min(slow, key=lambda s: s[0])
    units = sorted((r.get("prompt_index", 0), r["prompt_id"], r["seed"]) for r in group)
    return [f"speed: {len(slow)} of {total} chunks (a work unit's rows of one configuration) ran below "
            f"{SLOW_CHUNK:g}x their configuration's median throughput, the slowest {group[0]['config']} "
            f"({len(group)} rows, {units[0][1]} seed {units[0][2]} to {units[-1][1]} seed {units[-1][2]}) "
            f"at {rate:.3g} tokens/s against {typical:.3g} ({share:.2f}x"
            + (f"; its passes {pass_ratio:.2f}x as slow" if math.isfinite(pass_ratio) else "")
            + f"){why}. The speedup column counts them as decoded, so on a shared machine it measures "
            "the load as well as the rule (time speed on a quiet machine: benchmarks/)"]


def _machine_of(row: dict, runs: dict[str, dict]) -> str | None:
    """The kind of machine a decoded row ran on (`verispec.machine.kind`), or None where its run left no
    usable record (a run before runs were recorded, a Ray run: its workers decode, a malformed record)."""
    run = runs.get(row["run"]) if isinstance(row.get("run"), str) else None
    machine = run.get("machine") if isinstance(run, dict) else None
    return kind(machine) if isinstance(machine, dict) else None


def machine_notes(rows: list[dict], runs: dict[str, dict]) -> list[str]:
    """A note naming the machine kinds (CPU model and vector units) the rows decoded here ran on, from the
    runs' records (`store.read_runs`), with the rows whose machine is not recorded; nothing where no
    decoded row's machine is. Copied rows are left out (their machine is their source sweep's)."""
    decoded = [r for r in rows if "reused_from" not in r]
    counts = Counter(_machine_of(r, runs) for r in decoded)
    unknown = counts.pop(None, 0)
    if not counts:
        return []
    named = "; ".join(f"{k}: {n} row(s)" for k, n in counts.most_common())
    if unknown:
        named += f"; not recorded (a run before runs were recorded, or Ray workers): {unknown} row(s)"
    if len(counts) == 1:
        return [f"decoded on {named}"]
    return [f"decoded on {len(counts)} machine kinds ({named}): a speedup pairs rows of one run, so each "
            "pair is timed on one machine, but pooled speedups and throughputs mix the kinds; the scores "
            "are draws of the same laws wherever they ran, decoded with that machine's kernels (bf16 and "
            "int4 rounding differ between CPU kinds)"]


def score_notes(rows: list[dict]) -> list[str]:
    """A note counting and naming the rows whose score is not a finite number (NaN, inf, null, a string):
    they are left out of the score, its interval and the paired difference, so a column's n is smaller
    than its row count (the score column says `n=X of Y`)."""
    unscored = [r for r in rows if not is_score(r["score"])]
    if not unscored:
        return []
    named = _lines_text([f"{r['config']} / {r['prompt_id']} (seed {r['seed']}): {r['score']!r}"
                         for r in unscored])
    return [f"{len(unscored)} row(s) have no finite score and are left out of the score, its interval "
            f"and Δscore: {named}"]


def timed_out_rows(rows: list[dict]) -> list[dict]:
    """The rows an execution-scored suite failed by timeout (their metrics' `timed_out` is 1)."""
    return [r for r in rows if (r.get("metrics") or {}).get("timed_out") == 1]


def timeout_notes(rows: list[dict]) -> list[str]:
    """A note naming the rows an execution-scored suite failed by timeout: on a loaded machine a correct
    program can time out, so such a failure may be the machine's, not the rule's."""
    timed_out = timed_out_rows(rows)
    if not timed_out:
        return []
    named = _lines_text([f"{r['config']} / {r['prompt_id']} (seed {r['seed']})" for r in timed_out])
    return [f"{len(timed_out)} row(s) failed by timeout, not by a wrong answer: {named}; a correct "
            "program can time out on a loaded machine, so check them before reading their scores "
            "(in a checkout, `python study/sweep_stats.py DIR --timed-out 60` runs them again with a "
            "longer limit)"]


def _read_sweep(results_dir: str | Path) -> tuple[Path, list[dict], list[str]]:
    """(results file, its usable rows, notes on what was skipped); a missing file or rows of another
    schema version are errors."""
    path = results_file(results_dir)
    if not has_rows(path) and not path.exists():
        raise FileNotFoundError(f"no results file: {path} does not exist (give a sweep's --out directory)")
    scan = scan_rows(path)
    check_schema(path, scan.rows, scan.lines)
    cap = _read_settings(path, []).get("max_new_tokens")  # the sweep's cap, for rows that lack their own
    rows, notes = usable_rows(path, scan.rows, scan.lines,
                              cap if isinstance(cap, int) and not isinstance(cap, bool) else None)
    if scan.skipped:
        notes.insert(0, f"skipped {len(scan.skipped)} unreadable line(s) of {path} "
                        "(invalid JSON or not UTF-8): "
                        f"line(s) {_lines_text(scan.skipped_lines)}")
    return path, rows, notes


def first_problems(rows: list[dict], problems: int | None, settings: dict, notes: list[str]) -> list[dict]:
    """The rows of the suite's first `problems` problems (prompt_index below it; None: all rows), noted
    in `notes`: a sequential look read at its planned number of problems after the sweep went past it
    (the rows beyond are left out of the reading, so the look is taken on the information it planned).
    Under a declared sequential design (`settings`, the sweep.json) only a planned look's count is
    accepted, so no other prefix can be read; without one, the note says the reading counts as a look."""
    if problems is None:
        return rows
    if isinstance(problems, bool) or not isinstance(problems, int) or problems < 1:
        raise ValueError(f"--problems must be a positive number of problems; got {problems!r}")
    planned = planned_problems(settings)
    if planned is not None and problems > planned:
        raise ValueError(f"--problems {problems}: the sweep plans {planned} problems")
    if settings.get("sequential") and planned:
        _, looks = parse_sequential(settings["sequential"])
        counts = look_counts(looks, planned)
        if problems not in counts:
            raise ValueError(f"--problems {problems}: under the declared design {settings['sequential']} a "
                             f"reading is taken at a planned look's count ({', '.join(map(str, counts))} "
                             "problems), not at another prefix")
    bad = [r for r in rows if type(r.get("prompt_index")) is not int]
    if bad:
        raise ValueError(f"--problems: {len(bad)} row(s) have no integer prompt_index (e.g. config "
                         f"{bad[0].get('config')!r}, prompt {bad[0].get('prompt_id')!r}), so the suite's "
                         "order is unknown")
    kept = [r for r in rows if r["prompt_index"] < problems]
    decoded = len({r["prompt_index"] for r in rows})
    notes.insert(0, f"read on the suite's first {problems} problems only (--problems {problems}): "
                    f"{len(kept)} of {len(rows)} rows, {decoded} problems decoded"
                    + ("" if settings.get("sequential") else
                       "; with no declared sequential design a reading of a prefix is a look of its own "
                       "(count it in --looks-taken)")
                    + (f"; fewer problems than {problems} are decoded, so this is every row" if
                       decoded < problems else ""))
    return kept


def _read_settings(path: Path, notes: list[str]) -> dict:
    """The sweep.json beside a results file ({} when absent; an unreadable one is noted in `notes`)."""
    spec_file = path.parent / "sweep.json"
    try:
        settings = (json.loads(read_regular_file(spec_file, MAX_SETTINGS_BYTES, "sweep.json").decode("utf-8"))
                    if spec_file.exists() else {})
    except (OSError, ValueError, RecursionError) as err:
        notes.append(f"could not read {spec_file}: {err}")
        return {}
    return settings if isinstance(settings, dict) else {}


def planned_problems(settings: dict) -> int | None:
    """How many problems a sweep plans (its --limit, else its suite's size): what a sequential design's
    looks are shares of; None when neither is known."""
    if settings.get("limit"):
        return settings["limit"]
    try:
        return len(load_suite(settings["suite"]).items)
    except (KeyError, ValueError, OSError):
        return None


def planned_configs(settings: dict) -> list[str]:
    """The configuration ids a sweep.json plans (plain, lossless, each rule and its honest baseline, per k
    and temperature, trees included: `SweepSpec.configs`); [] when the settings lack the grid (no
    sweep.json) or do not parse."""
    if not all(settings.get(key) for key in ("rules", "ks", "temperatures")):
        return []
    fields = {f.name for f in dataclasses.fields(SweepSpec)}
    try:
        spec = SweepSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()
                            if k in fields})
        return [config.id for config in spec.configs()]
    except (TypeError, ValueError):
        return []


def pace_note(rows: list[dict], planned: int | None, seeds: int, last_write: float,
              configs: Sequence[str] = ()) -> list[str]:
    """How many rows a sweep has of those it plans (`planned` problems x `seeds` x its configurations:
    `configs`, the planned ones, with any others its rows show, so a rule with no row yet counts), and,
    from the latest run (run ids begin with their UTC start), its rows a minute between its start and
    `last_write` (the results file's modification time, epoch seconds) and the time the rest would take
    at that pace; no outcome in it. Copied rows count as done, not as pace."""
    if not rows or not planned:
        return []
    configs = set(configs) | {r["config"] for r in rows}
    total = planned * seeds * len(configs)
    done = len({(r["config"], r["prompt_id"], r["seed"]) for r in rows})
    text = f"{done} of {total} rows ({len(configs)} configurations x {planned} problems x {seeds} seed(s))"
    runs = sorted({r["run"] for r in rows if isinstance(r.get("run"), str) and "reused_from" not in r})
    start = run_started(runs[-1]) if runs else None
    minutes = (last_write - start) / 60 if start is not None else 0.0
    if minutes <= 1 or done >= total:
        return [f"progress: {text}"]
    latest = [r for r in rows if r.get("run") == runs[-1] and "reused_from" not in r]
    rate = len(latest) / minutes
    hours = (total - done) / rate / 60
    note = (f"progress: {text}; the latest run ({runs[-1]}) wrote {rate:.2f} rows a minute from its start "
            f"to the last write, so the other {total - done} rows take about {hours:.1f} h at that pace "
            "(on this machine and load)")
    # the median chunk's wall time per row (`row_seconds`: its `batch_seconds` over its `chunk_size`; a
    # chunk's rows share both) over this run's chunks, times the rows to go: one paused (SIGSTOP) or
    # loaded chunk does not move it, as it moves the pace from the run's start; but it mixes the
    # configurations' unlike speeds and leans low when a few chunks are slow for real
    chunks = {(r["config"], r["batch_seconds"]): row_seconds(r) for r in latest
              if is_score(r.get("batch_seconds")) and r["batch_seconds"] > 0}
    if len(chunks) >= 3:
        per_row = median(chunks.values())
        note += (f"; at the median chunk's {per_row:.1f} s a row ({len(chunks)} chunks of this run, all "
                 f"configurations; not moved by a paused or loaded chunk, but low when some chunks are slow "
                 f"for real) about {(total - done) * per_row / 3600:.1f} h")
    return [note]


def sweep_progress(results_dir: str | Path, problems: int | None = None) -> str:
    """`comparisons.progress_table` of a sweep's readable rows and its sweep.json: how far it is against
    its declared comparisons and looks, with no outcome in it (`problems`: as `write_report`)."""
    path, rows, notes = _read_sweep(results_dir)
    settings = _read_settings(path, notes)
    rows = first_problems(rows, problems, settings, notes)
    planned = planned_problems(settings)  # loads the suite: once
    notes += machine_notes(rows, read_runs(path))
    notes += pace_note(rows, problems or planned, len(settings.get("seeds") or [0]), path.stat().st_mtime,
                       planned_configs(settings))
    return progress_table(rows, list(settings.get("compare") or []), settings.get("sequential"),
                          planned) + "".join(f"\nnote: {n}" for n in notes)


def write_report(results_dir: str | Path, html_path: str | Path | None = None,
                 markdown: bool = False, columns: Sequence[str] | None = None,
                 looks_taken: int = 1, problems: int | None = None, brief: bool = False) -> tuple[str, Path]:
    """Summarise OUT_DIR/results.jsonl: returns the terminal table (`markdown`: as a GitHub markdown
    table, e.g. for a README; `columns`: only these, by header name) and the path of the HTML report
    (every column). `looks_taken`: how often a fixed-design sweep's comparisons have been read
    (`comparisons.comparisons_table`); `problems`: read only the suite's first N problems
    (`first_problems`).

    Unreadable lines and rows are skipped and said so (with file and line numbers); rows of another
    schema version are refused with both version numbers; an unreadable file is named with the reason."""
    path, rows, notes = _read_sweep(results_dir)
    settings = _read_settings(path, notes)
    rows = first_problems(rows, problems, settings, notes)
    for note in notes:
        logging.getLogger(__name__).warning(note)
    summary = summarize(rows) if rows else []
    notes += unit_set_notes(rows) + score_notes(rows) + timeout_notes(rows) + speedup_notes(summary)
    notes += load_notes(rows) + machine_notes(rows, read_runs(path))
    for source, count in Counter(r["reused_from"] for r in rows if "reused_from" in r).items():
        notes.append(f"{count} row(s) copied from {source} (--reuse-from): decoded and timed there, so "
                     "their speedup is that sweep's report's, not this one's")
    if not rows:
        raise ValueError(f"no usable results in {path}" + (": " + "; ".join(notes) if notes else ""))
    keys = ("suite", "target", "draft", "ks", "temperatures", "seeds", "limit", "dtype", "device", "backend",
            "compare", "sequential")
    meta = {k: v for k, v in settings.items() if k in keys}
    meta["rows"] = len(rows)
    for i, note in enumerate(notes):
        meta[f"note {i + 1}"] = note
    html_path = Path(html_path) if html_path else path.parent / "report.html"
    outcomes = outcome_sections(rows, settings, looks_taken)
    html_path.write_text(render_html(summary, "verispec report", meta, outcomes), encoding="utf-8")
    if brief:  # the demo: what it showed in words, then one compact table; the rest is in the HTML
        lines = ["what this run showed:", *(f"- {line}" for line in story(summary)), ""]
        return "\n".join(lines) + terminal_table(summary, markdown, list(STORY_COLUMNS)) + (
            f"\n(the full tables: {html_path}, or verispec report {path.parent})"), html_path
    table = terminal_table(summary, markdown, columns) + outcomes
    return table + "".join(f"\nnote: {n}" for n in notes), html_path


def outcome_sections(rows: list[dict], settings: dict, looks_taken: int = 1) -> str:
    """The length outcomes and the planned comparisons (`verispec.evaluation.comparisons`) under the
    table; `settings`: the sweep.json (its `compare` and `sequential`); `looks_taken`: readings of a
    fixed-design sweep so far."""
    out = "\n\nlength outcomes:\n" + length_table(rows, baseline_of)
    declared = list(settings.get("compare") or [])
    sequential = settings.get("sequential")
    planned = planned_problems(settings) if sequential else None
    table = comparisons_table(rows, declared, sequential, planned, looks_taken)
    out += "\n\nplanned comparisons:\n" + table if table else ""
    controls = loglik_controls_table(rows, declared)
    out += "\n\nwhat else moves the log-likelihood score:\n" + controls if controls else ""
    levels = level_table(rows, baseline_of)
    out += "\n\nby difficulty level:\n" + levels if levels else ""
    tiers = tier_table(rows, baseline_of)
    return out + ("\n\nby difficulty tier (plain decoding's pass rate on the other seeds):\n" + tiers
                  if tiers else "")
