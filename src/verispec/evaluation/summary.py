"""Per-configuration summaries of a sweep's rows: speed, shift and quality of every rule, with their
intervals (the statistics themselves are `verispec.evaluation.stats`); `verispec.evaluation.report`
renders them.

`summarize(rows)` aggregates the results rows per config. Definitions (docs/design.md, section 'Words'):
acceptance rate = accepted / proposed draft tokens; block efficiency = emitted tokens / target forward
passes; speedup = throughput of the config / throughput of plain decoding over the same (prompt, seed)
units of the same sweep, run interleaved at the same batch size (a row's time is its batch's wall time /
batch size; a unit whose plain row was decoded at another batch size, as after a resume with another
--batch-size, is left out of it). Confidence intervals are 95% Student-t intervals over units (sequence
KL) or over paired units (score differences against the config's baseline: the honest truncation sampler
for a truncation rule, lossless speculative decoding otherwise, plain decoding for lossless itself).
Where every score is 0 or 1 (pass@1, exact match) the score's interval is Wilson's (Wilson 1927), the
paired difference's is Newcombe's square-and-add interval (Newcombe 1998, method 10) and the paired test
is McNemar's exact test (McNemar 1947: a two-sided binomial test on the discordant pairs); a row is
flagged WORSE when its paired difference is negative and significant at 5%. Configurations that cover
different units (a sweep stopped part-way through a chunk) are named in a note: their scores are over
different problems, and only the paired columns compare like with like.
"""

from __future__ import annotations

import math
from collections import defaultdict
from statistics import mean, stdev

from verispec.evaluation.stats import (mcnemar_exact, newcombe_paired_interval, paired_table, percentile,
                                       t_interval, wilson_interval)
from verispec.rules import honest_baseline, parse

CONF_BINS = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0000001]
OVER_BINS = [0.0, 1.0, 2.0, 5.0, 20.0, math.inf]


def _binary(values: list) -> bool:
    return bool(values) and all(v in (0, 1) for v in values)


def baseline_of(config_rule: str) -> str | None:
    """The config a row's score is compared with: the honest truncation sampler for a truncation rule,
    plain decoding for lossless, lossless otherwise; None for plain and the honest samplers themselves."""
    if config_rule == "plain":
        return None
    if config_rule == "lossless":
        return "plain"
    rule = parse(config_rule)
    if rule.name == "honest":  # a baseline itself: the sampling the user asked for, compared with nothing
        return None
    honest = honest_baseline(rule)
    return honest.spec if honest is not None else "lossless"


def row_seconds(row: dict) -> float:
    """A row's share of the wall time of the work unit it was decoded in (its own time at batch 1), so
    tokens / seconds is throughput at that batch size: the unit's seconds over its rows (`chunk_size`;
    rows written before chunks existed: the batch size, their unit's row count then)."""
    if "batch_seconds" in row:
        return float(row["batch_seconds"]) / max(1, chunk_size_of(row))
    return float(row["seconds"])


def batch_size_of(row: dict) -> int:
    return int(row.get("batch_size", 1))


def chunk_size_of(row: dict) -> int:
    return int(row.get("chunk_size", batch_size_of(row)))


def is_score(x) -> bool:
    """A finite number (None, NaN and inf are not)."""
    return isinstance(x, (int, float)) and math.isfinite(x)


def finite_values(xs) -> list[float]:
    return [x for x in xs if is_score(x)]


def _bins(values: list[float], edges: list[float]) -> list[int]:
    out = []
    for v in values:
        for i in range(len(edges) - 1):
            if edges[i] <= v < edges[i + 1]:
                out.append(i)
                break
        else:
            out.append(len(edges) - 2)
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """One summary dict per config: plain decoding first (the speed reference), then the others, each
    in first-seen order (a sweep extended by --reuse-from writes its copied rows first)."""
    by_config: dict[str, list[dict]] = defaultdict(list)
    for row in sorted(rows, key=lambda r: r["rule"] != "plain"):  # stable: first-seen order otherwise
        by_config[row["config"]].append(row)
    index = {(r["config"], r["prompt_id"], r["seed"]): r for r in rows}
    config_of = {}  # (rule, k, T, tree shape) -> config id
    for cid, group in by_config.items():
        r = group[0]
        config_of[(r["rule"], r["k"], r["temperature"], r.get("tree"))] = cid
    out = []
    for cid, group in by_config.items():
        r0 = group[0]
        s: dict = {"config": cid, "rule": r0["rule"], "family": r0["family"], "k": r0["k"],
                   "temperature": r0["temperature"], "units": len(group), "score_name": r0["score_name"]}
        proposed = sum(r["proposed"] for r in group)
        s["acceptance_rate"] = sum(r["accepted"] for r in group) / proposed if proposed else math.nan
        s["block_efficiency"] = (sum(r["tokens"] for r in group)
                                 / max(1, sum(r["target_calls"] for r in group)))
        # drafted tokens (tree nodes) per target call: a chain of k = 6 beside a 6-node tree
        s["drafted_per_call"] = proposed / max(1, sum(r["target_calls"] for r in group))
        plain_id = config_of.get(("plain", 0, r0["temperature"], None))
        pairs = [(r, index.get((plain_id, r["prompt_id"], r["seed"]))) for r in group]
        # only pairs decoded at the same batch size and chunk: a sweep resumed with another --batch-size
        # (--chunk) may hold a row at one size and its plain row at another, and throughput grows with
        # the batch (and with the slots kept full); and only
        # pairs timed in the same run: a sweep resumed part-way through a chunk timed the chunk's other
        # configurations in another process (rows record their `run`; rows written before they did
        # pair as before), and a row copied by --reuse-from was timed beside another sweep's plain row
        # (a copied row is left out even beside a plain row copied from its own run, by --reuse-plain:
        # its speedup is the source sweep's, which that sweep's report gives)
        pairs = [(a, b) for a, b in pairs if b is not None and row_seconds(a) > 0 and row_seconds(b) > 0
                 and batch_size_of(a) == batch_size_of(b) and chunk_size_of(a) == chunk_size_of(b)
                 and a.get("run") == b.get("run")
                 and "reused_from" not in a and "reused_from" not in b]
        s["unpaired"] = (0 if plain_id is None or r0["rule"] == "plain" else
                         sum(1 for r in group if "reused_from" not in r) - len(pairs))
        if pairs:
            mine = sum(a["tokens"] for a, _ in pairs) / sum(row_seconds(a) for a, _ in pairs)
            plain = sum(b["tokens"] for _, b in pairs) / sum(row_seconds(b) for _, b in pairs)
            s["speedup"] = mine / plain
        else:
            s["speedup"] = math.nan
        s["tokens_per_second"] = (sum(r["tokens"] for r in group)
                                  / max(1e-9, sum(row_seconds(r) for r in group)))
        # the batch sizes a rule's speedup was measured at (none where no row has a plain row timed beside
        # it); plain's rows pair with themselves (its 1.000), which measures nothing
        s["speedup_batch_sizes"] = ([] if r0["rule"] == "plain" else
                                    sorted({batch_size_of(a) for a, _ in pairs}))
        s["reused"] = sum(1 for r in group if "reused_from" in r)
        steps = defaultdict(list)
        for r in group:
            for key, values in r.get("steps", {}).items():
                steps[key].extend(values)
        n_steps = max(1, len(steps["tv"]))
        s["tv"] = sum(finite_values(steps["tv"])) / n_steps
        kls = steps["kl"]
        s["kl"] = math.inf if any(x == math.inf for x in kls) else sum(finite_values(kls)) / n_steps
        tvb = finite_values(steps["tv_baseline"])
        s["tv_baseline"] = sum(tvb) / len(tvb) if tvb else math.nan
        ratios = sorted(finite_values(steps["max_ratio"])
                        + [math.inf] * sum(1 for x in steps["max_ratio"] if x == math.inf))
        s["overshoot_p95"] = percentile(ratios, 0.95)
        s["overshoot_max"] = ratios[-1] if ratios else math.nan
        s["tail_mass"] = sum(finite_values(steps["tail_mass"])) / n_steps
        s["seq_kl"], s["seq_kl_ci"] = t_interval([r["log_ratio"] for r in group])
        if any(r["log_ratio"] == math.inf for r in group):  # a token the target gives probability 0
            s["seq_kl"], s["seq_kl_ci"] = math.inf, math.nan
        tokens = sum(r["tokens"] for r in group)
        s["seq_kl_per_token"] = sum(r["log_ratio"] for r in group) / tokens if tokens else math.nan
        s["target_nll"] = mean(finite_values([r["target_nll"] for r in group]) or [math.nan])
        scores = [r["score"] for r in group if is_score(r["score"])]
        s["scored"] = len(scores)  # rows with a finite score (`score_notes` names the others)
        s["score"], s["score_ci"] = t_interval(scores)
        s["binary_score"] = _binary(scores)
        s["score_interval"] = (wilson_interval(int(sum(scores)), len(scores)) if s["binary_score"] else
                               (s["score"] - s["score_ci"], s["score"] + s["score_ci"]))
        base_rule = baseline_of(r0["rule"]) if not r0.get("tree") else "plain"  # tree rows: the target's own
        base_id = config_of.get((base_rule, 0 if base_rule == "plain" else r0["k"], r0["temperature"], None))
        s["baseline"] = base_id
        paired = []  # (row's score, baseline's score) on the same (prompt, seed)
        if base_id:
            for r in group:
                b = index.get((base_id, r["prompt_id"], r["seed"]))
                if b is not None and is_score(r["score"]) and is_score(b["score"]):
                    paired.append((r["score"], b["score"]))
        s["score_diff"], s["score_diff_ci"] = t_interval([a - b for a, b in paired])
        diff, half = s["score_diff"], s["score_diff_ci"]
        s["score_diff_interval"] = (diff - half, diff + half)
        s["paired_units"] = len(paired)
        if paired and _binary([v for pair in paired for v in pair]):
            both, better, worse_count, neither = paired_table(paired)
            s["discordant"] = (better, worse_count)
            s["p_value"] = mcnemar_exact(better, worse_count)
            s["score_diff_interval"] = newcombe_paired_interval(both, better, worse_count, neither)
            worse = s["score_diff"] < 0 and s["p_value"] < 0.05
        else:
            s["discordant"], s["p_value"] = None, math.nan
            worse = s["score_diff"] + s["score_diff_ci"] < 0 if math.isfinite(s["score_diff_ci"]) else False
        s["flag"] = "WORSE" if worse else ""
        # robustness across prompts
        per_prompt = defaultdict(list)
        for r in group:
            per_prompt[r["prompt_id"]].append(r["mean_tv"])
        prompt_tv = {p: mean(v) for p, v in per_prompt.items()}
        s["prompt_tv_spread"] = stdev(prompt_tv.values()) if len(prompt_tv) > 1 else 0.0
        s["prompt_tv_max"] = max(prompt_tv.values()) if prompt_tv else math.nan
        s["worst_prompts"] = sorted(prompt_tv, key=prompt_tv.get, reverse=True)[:3]
        # where fidelity is lost: bins of draft confidence and of the accepted token's overshoot q/p
        roles = steps["role"]
        decided = [i for i, role in enumerate(roles) if role in ("accepted", "recovered")]
        conf = [steps["draft_confidence"][i] for i in decided]
        s["by_confidence"] = []
        conf_bins = _bins(conf, CONF_BINS)  # once, not once per bin
        for b, (lo, hi) in enumerate(zip(CONF_BINS, CONF_BINS[1:])):
            idx = [i for i, bi in zip(decided, conf_bins) if bi == b]
            s["by_confidence"].append({
                "bin": f"{lo:.1f}-{min(hi, 1):.1f}", "positions": len(idx),
                "acceptance": sum(roles[i] == "accepted" for i in idx) / len(idx) if idx else math.nan,
                "tv": mean(steps["tv"][i] for i in idx) if idx else math.nan,
            })
        acc = [i for i, role in enumerate(roles) if role == "accepted"]
        over = [steps["draft_over_target"][i] for i in acc]
        s["by_overshoot"] = []
        over_bins = _bins(over, OVER_BINS)
        for b, (lo, hi) in enumerate(zip(OVER_BINS, OVER_BINS[1:])):
            idx = [i for i, bi in zip(acc, over_bins) if bi == b]
            s["by_overshoot"].append({
                "bin": f"{lo:g}-{hi:g}", "accepted": len(idx),
                "share": len(idx) / len(acc) if acc else math.nan,
                "tv": mean(steps["tv"][i] for i in idx) if idx else math.nan,
            })
        s["accepted_overshoot"] = over
        out.append(s)
    return out
