"""The report's outcome and comparison tables (docs/design/evaluation.md, 'Planned comparisons'): length
outcomes per configuration (cap-hit, output length, stopped by itself) paired against the baseline, and the
planned comparisons a sweep declares up front (`verispec bench --compare A:B`), each per seed and pooled
over (problem x seed) with the test clustered by problem, Holm-corrected over the declared family, with
an optional group-sequential threshold for interim looks (a comparison rejected at an earlier look stays
rejected and leaves the family: Maurer and Bretz 2013) and the minimum detectable effect beside it.
Lossless speculative decoding against plain decoding (the same law) is printed as the calibration row
whenever both are present. The maths is in `verispec.evaluation.stats`.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from statistics import mean
from typing import Callable

from verispec.evaluation import scorers, stats
from verispec.evaluation.graded import level_of
from verispec.evaluation.suites import TARGET_LOGLIK
from verispec.rules import parse
from verispec.tables import text_table
from verispec.tree_decode import tree_verification_rule
from verispec.trees import parse_shape

PLAIN = "plain"


def exact_number(value: float) -> str:
    """`value` in its shortest `:g` form when that reads back as exactly `value` (1.0 -> '1', 0.7 ->
    '0.7': the ids of every sweep written so far), else Python's round-tripping repr (1.0000001 ->
    '1.0000001', which `:g` wrote as '1' and so merged two temperatures into one unit)."""
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))
ALPHA = 0.05
POWER = 0.8


_CONFIG_TAIL = re.compile(r"^(?P<rule>.*?)(?: (?P<tree>(?:tree|drafts):\S+))?(?: k=(?P<k>\d+))?"
                          r"(?: T=(?P<t>[0-9.eE+-]+))?$")


def _split_side(text: str) -> tuple[str, int | None, float | None, str | None]:
    """A side -> (rule or plain, k or None, temperature or None, tree shape or None): a config id
    ('lossless k=4 T=1', 'plain T=0.7', 'lossless tree:widths=2,1 k=2 T=1') pins k and temperature, a
    bare rule spec covers every k and temperature; a side without a shape means chain drafts."""
    match = _CONFIG_TAIL.match(text.strip())
    rule, tree, k, t = match["rule"].strip(), match["tree"], match["k"], match["t"]
    return rule, int(k) if k else None, float(t) if t else None, tree


def canonical_side(text: str) -> str:
    """A comparison side as the rows name it: `plain` or a rule spec in its canonical form (a tree rule
    with its canonical shape after it, as a tree configuration's id has it), with the config id's
    ` k=K T=T` kept when given."""
    rule, k, t, tree = _split_side(text)
    if tree is not None:
        shape = parse_shape(tree)
        rule = f"{tree_verification_rule(rule, shape).spec} {shape.spec}"
    else:
        rule = PLAIN if rule == PLAIN else parse(rule).spec
    return rule + (f" k={k}" if k is not None else "") + (f" T={exact_number(t)}" if t is not None else "")


def parse_comparison(text: str) -> tuple[str, str]:
    """`A:B` or `A vs B` (A, B rule specs, `plain`, or config ids such as 'lossless k=4 T=1') -> canonical
    (A, B): the difference A - B is tested.
    Rule specs contain colons themselves, so `A:B` is split at the one colon where both sides parse; an
    ambiguous or unparseable text is a ValueError saying to write `A vs B`."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"a comparison is A:B or 'A vs B' (rule specs or plain), got {text!r}")
    if " vs " in text:
        a, _, b = text.partition(" vs ")
        try:
            return canonical_side(a), canonical_side(b)
        except ValueError as err:
            raise ValueError(f"comparison {text!r}: {err}") from None
    found = set()
    for i, char in enumerate(text):
        if char != ":":
            continue
        try:
            found.add((canonical_side(text[:i]), canonical_side(text[i + 1:])))
        except ValueError:
            continue
    if len(found) != 1:
        why = "no split into two rule specs parses" if not found else f"it splits {len(found)} ways"
        raise ValueError(f"comparison {text!r}: {why}; write it as 'A vs B' (e.g. 'lossless vs plain', "
                         "'cos:w=0.9 vs lossless')")
    return found.pop()


def comparison_text(pair: tuple[str, str]) -> str:
    return f"{pair[0]} vs {pair[1]}"


# ----------------------------------------------------------------------------------------------- rows


def config_key(row: dict) -> tuple[str, int, float, str | None]:
    """A row's configuration: (rule, k, temperature, tree shape or None for chain drafts); a tree
    configuration (`--tree`) shares its rule, k and temperature with a chain one, never its shape."""
    return row["rule"], row["k"], row["temperature"], row.get("tree") or None


def _units(rows: list[dict]) -> dict[tuple, dict]:
    """`config_key` -> {(prompt_id, seed): row}."""
    out: dict[tuple, dict] = defaultdict(dict)
    for r in rows:
        out[config_key(r)][(r["prompt_id"], r["seed"])] = r
    return out


def _side(key: tuple) -> str:
    """The comparison side that names a configuration's rule and shape (any k and temperature)."""
    return key[0] + (f" {key[3]}" if key[3] else "")


def _covers(key: tuple, side: tuple) -> bool:
    rule, k, t, tree = side
    if tree is not None:
        rule = f"{rule} {tree}"
    return _side(key) == rule and (k is None or key[1] == k) and (t is None or key[2] == t)


def _matching(units: dict, a: str, b: str) -> list[tuple[tuple, tuple]]:
    """The (config A, config B) keys a comparison covers: the same temperature and k (plain has none),
    unless both sides pin them (config ids), which may then differ."""
    side_a, side_b = _split_side(a), _split_side(b)
    out = []
    for key_a in units:
        if not _covers(key_a, side_a):
            continue
        for key_b in units:
            if not _covers(key_b, side_b):
                continue
            same_t = key_a[2] == key_b[2] or (side_a[2] is not None and side_b[2] is not None)
            same_k = (key_a[1] == key_b[1] or PLAIN in (side_a[0], side_b[0])
                      or (side_a[1] is not None and side_b[1] is not None))
            if same_t and same_k:
                out.append((key_a, key_b))
    return out


def config_name(key: tuple) -> str:
    """A `config_key`'s name as comparisons print it (`Comparison.config_a`): the temperature exactly
    (`units.exact_number`: 1.0000001 is not printed as 1, which would name another configuration)."""
    rule, k, temperature, tree = key
    shape = f" {tree}" if tree else ""
    t = exact_number(temperature)
    return f"plain T={t}" if rule == PLAIN else f"{rule}{shape} k={k} T={t}"


@dataclass(frozen=True)
class Comparison:
    name: str  # "A vs B"
    config_a: str
    config_b: str
    per_seed: dict  # seed -> PairedEstimate
    pooled: stats.PairedEstimate
    planned: bool
    cap_part: tuple[float, int] = (math.nan, 0)  # (part of the mean difference from cap-hit pairs, pairs)


def _score(row: dict) -> object:
    return row.get("score")


def _pairs(units: dict, key_a: tuple, key_b: tuple, value: Callable[[dict], object] = _score) -> list[tuple]:
    """(problem, seed, value A, value B, row A, row B) for every (problem, seed) both configurations
    have where both values are finite numbers."""
    out = []
    for (problem, seed), row in units[key_a].items():
        other = units[key_b].get((problem, seed))
        if other is None:
            continue
        va, vb = value(row), value(other)
        if all(isinstance(v, (int, float)) and math.isfinite(v) for v in (va, vb)):
            out.append((problem, seed, float(va), float(vb), row, other))
    return out


def compare(rows: list[dict], a: str, b: str, value: Callable[[dict], object] = _score, planned: bool = True
            ) -> list[Comparison]:
    """A - B on every (problem, seed) both configurations have, per seed and pooled (clustered by
    problem), for each temperature / k where both are present. `value(row)`: the outcome (the score by
    default); rows whose value is not a finite number, or missing, are left out."""
    units = _units(rows)
    out = []
    for key_a, key_b in _matching(units, a, b):
        triples = defaultdict(list)  # seed -> [(problem, a, b)]
        capped = []  # differences of the pairs where either row hit the cap
        for problem, seed, va, vb, row, other in _pairs(units, key_a, key_b, value):
            triples[seed].append((problem, va, vb))
            if _cap_hit(row) or _cap_hit(other):
                capped.append(va - vb)
        pooled = [t for seed in sorted(triples) for t in triples[seed]]
        cap_part = (sum(capped) / len(pooled) if pooled else math.nan, len(capped))
        out.append(Comparison(f"{a} vs {b}", config_name(key_a), config_name(key_b),
                              {seed: stats.clustered_paired(triples[seed]) for seed in sorted(triples)},
                              stats.clustered_paired(pooled), planned, cap_part))
    return out


def planned_look(clusters: int, planned_clusters: int | None, looks: int) -> int:
    """The look a report is at: the share of the planned problems paired so far, rounded up to the next
    of `looks` equally spaced looks (the last look once every problem is in)."""
    if looks == 1 or not planned_clusters:
        return looks
    return max(1, min(looks, math.ceil(looks * clusters / planned_clusters - 1e-9)))


def look_counts(looks: int, planned_clusters: int) -> list[int]:
    """The number of paired problems each planned look is at: the last count of each look's share (as
    `planned_look`), e.g. 54, 109, 164 for three looks over 164 problems."""
    return [math.floor(j * planned_clusters / looks + 1e-9) for j in range(1, looks + 1)]


def sequential_design(kind: str, looks: int, paired: int | None, planned_clusters: int | None) -> str:
    """The legend's words for a group-sequential design at this reading: where its looks are planned
    (equally spaced shares of the planned problems), which look this reading is, and whether it comes
    before that look's count (an early reading takes the look's threshold: the design allows one
    reading per look). `paired` None: no declared comparison has rows yet."""
    if paired is None:
        return f"{kind} boundary, {looks} planned looks; no declared comparison has paired rows yet"
    if not planned_clusters:
        return (f"{kind} boundary, {looks} planned looks; the planned number of problems is unknown, so "
                f"this reading is taken as the last look")
    counts = look_counts(looks, planned_clusters)
    look = planned_look(paired, planned_clusters, looks)
    early = (f"; early: look {look} is planned at {counts[look - 1]} problems, and this reading takes its "
             f"threshold (one reading per look)" if paired < counts[look - 1] else "")
    return (f"{kind} boundary, {looks} planned looks at {', '.join(map(str, counts))} paired problems; this "
            f"reading is look {look}, {paired} of {planned_clusters} problems paired{early}")


def progress_table(rows: list[dict], declared: list[str], sequential: str | None = None,
                   planned_clusters: int | None = None) -> str:
    """How far a sweep is, without any outcome (no score, no difference, no p): rows per configuration,
    and per declared comparison (and the calibration pair) the problems and (problem, seed) pairs both
    sides have, with the look a report would take now under a declared sequential design. So a sweep in
    progress can be checked against its looks without spending one (`verispec report DIR --progress`)."""
    units = _units(rows)
    lines = ["rows per configuration:"]
    for key, have in units.items():
        lines.append(f"  {config_name(key)}: {len(have)} rows, {len({p for p, _ in have})} problems")
    pairs = [parse_comparison(d) for d in declared]
    planned = set(pairs) or {("lossless", PLAIN)}  # the looks follow these (not an added calibration row)
    if ("lossless", PLAIN) not in pairs:  # as comparisons_table: the calibration row unless declared
        pairs.append(("lossless", PLAIN))
    kind, looks = stats.parse_sequential(sequential) if sequential else ("pocock", 1)
    lines.append("paired so far (both sides decoded):")
    fullest = 0
    for a, b in pairs:
        for key_a, key_b in _matching(units, a, b):
            both = units[key_a].keys() & units[key_b].keys()
            problems = len({p for p, _ in both})
            if (a, b) in planned:
                fullest = max(fullest, problems)
            where = ""
            if looks > 1:
                where = "; a report now reads: " + sequential_design(kind, looks, problems, planned_clusters)
            lines.append(f"  {config_name(key_a)} - {config_name(key_b)}: {problems} problems, "
                         f"{len(both)} (problem, seed) pairs{where}")
    passed = [(j, n) for j, n in enumerate(look_counts(looks, planned_clusters), start=1)
              if 1 <= n < fullest and j < looks] if looks > 1 and planned_clusters else []
    if passed:
        look, count = passed[-1]
        lines.append(f"the fullest planned comparison has passed look {look}'s count ({count} problems): if "
                     f"look {look} has not been read, read it on the suite's first {count} problems "
                     f"(verispec report DIR --problems {count}), not on these rows, which would take look "
                     f"{look + 1}")
    return "\n".join(lines)


def _fmt(x: float, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.{digits}f}"


def _p(x: float) -> str:
    """A p-value or a threshold: two significant figures below 0.01 (a look-1 threshold of 0.00146 printed
    as 0.001 read as a third lower than it is), three decimals above (from 0.00995, which two figures
    would round up to "0.01")."""
    return "-" if math.isnan(x) else (f"{x:.2g}" if x < 0.00995 else f"{x:.3f}")


def _interval(e: stats.PairedEstimate) -> str:
    return f"{_fmt(e.estimate)} [{_fmt(e.low)}, {_fmt(e.high)}]"


def earlier_rejections(rows: list[dict], declared: list[str], kind: str, looks: int, planned_clusters: int,
                       now: int) -> dict[tuple[str, str], tuple[int, float, int, float]]:
    """The declared comparisons rejected at a look before look `now` of a group-sequential design, {(config
    A, config B): (look, threshold, paired problems, p at that look)}: each earlier look is taken again on
    the suite's first `look_counts` problems (prompt_index below the count) by Holm's step-down over the
    comparisons still open, at that look's threshold for each Holm level. A comparison rejected at a look
    stays rejected and leaves the family, its alpha passing to the others (Holm as a graphical procedure
    under a group-sequential design: Maurer and Bretz 2013, Statistics in Biopharmaceutical Research
    5(4)). The family at every look is the comparisons the rows have now, less those already rejected: one
    with no pairs or no p in a look's prefix counts in Holm's m with p = 1 (so it is never rejected there
    and never raises the others' levels). {} when `now` is 1 or a row has no integer prompt_index (no
    prefix to take)."""
    if now <= 1 or any(type(r.get("prompt_index")) is not int for r in rows):
        return {}
    keys = list(dict.fromkeys((c.config_a, c.config_b)
                              for text in declared for c in compare(rows, *parse_comparison(text))))
    counts = look_counts(looks, planned_clusters)
    rejected: dict[tuple[str, str], tuple[int, float, int, float]] = {}
    for look in range(1, now):
        prefix = [r for r in rows if r["prompt_index"] < counts[look - 1]]
        at: dict[tuple[str, str], Comparison] = {}
        for text in declared:
            for c in compare(prefix, *parse_comparison(text)):
                at.setdefault((c.config_a, c.config_b), c)
        family = [k for k in keys if k not in rejected]
        p_values = [at[k].pooled.p_value if k in at and not math.isnan(at[k].pooled.p_value) else 1.0
                    for k in family]
        steps = holm_step_down(p_values, lambda _, level: stats.sequential_threshold(kind, looks, look,
                                                                                      level))
        for key, (threshold, reject) in zip(family, steps):
            if reject:
                rejected[key] = (look, threshold, at[key].pooled.clusters, at[key].pooled.p_value)
    return rejected


def holm_step_down(p_values: list[float],
                   threshold: Callable[[int, float], float]) -> list[tuple[float, bool]]:
    """Holm's step-down (Holm 1979) with each level turned into a threshold: for the hypothesis i at Holm
    level alpha / (m - j) (`stats.holm_levels`, the j-th smallest p), its threshold is `threshold(i,
    level)` (a group-sequential design's nominal threshold for that level, or the level itself), and
    hypotheses are rejected in ascending order of p while p < threshold; the first kept stops it. A NaN p
    gets a NaN threshold and is kept (it does not count in m). -> [(threshold, rejected)] per hypothesis."""
    levels = stats.holm_levels(p_values, ALPHA)
    out = [(math.nan, False)] * len(p_values)
    rejecting = True
    for i in sorted(range(len(p_values)), key=lambda i: (math.isnan(p_values[i]), p_values[i])):
        at = threshold(i, levels[i]) if not math.isnan(levels[i]) else math.nan
        rejecting = rejecting and p_values[i] < at
        out[i] = (at, rejecting)
    return out


def comparisons_table(rows: list[dict], declared: list[str], sequential: str | None = None,
                      planned_clusters: int | None = None, looks_taken: int = 1) -> str:
    """The planned comparisons (declared in sweep.json) and the calibration row (lossless vs plain, when
    both are present and it was not declared), as text: per seed and pooled estimates with 95% intervals,
    the clustered p, Holm's adjusted p over the declared comparisons still open, the threshold at this
    look (Holm's step-down level, turned into the group-sequential design's nominal threshold when one
    is declared; a comparison rejected at an earlier look, `earlier_rejections`, keeps that look's), the
    decision, and the minimum detectable effect at that threshold with power 0.8.
    `looks_taken` (a fixed design read N times, this reading included; not with `sequential`, whose
    thresholds already count its planned looks): every threshold is divided by N and every Holm p
    multiplied by N (Bonferroni over the looks, conservative)."""
    if isinstance(looks_taken, bool) or not isinstance(looks_taken, int) or looks_taken < 1:
        raise ValueError(f"looks taken must be a positive integer, got {looks_taken!r}")
    if sequential and looks_taken > 1:
        raise ValueError(f"the sweep declares a group-sequential design ({sequential}), whose thresholds "
                         "already count its planned looks; --looks-taken is for fixed-design sweeps read "
                         "more than once")
    family, missing = [], []
    for text in declared:
        found = compare(rows, *parse_comparison(text))
        # a pair of configurations declared twice (or matched by two declarations) counts once in Holm's m
        have = {(f.config_a, f.config_b) for f in family}
        family += [c for c in found if (c.config_a, c.config_b) not in have]
        if not found:
            missing.append(comparison_text(parse_comparison(text)))
    if not any(c.name == f"lossless vs {PLAIN}" for c in family):
        family += [replace_planned(c) for c in compare(rows, "lossless", PLAIN)]
    if not family:
        return "".join(f"no rows for the declared comparison {m}\n" for m in missing).strip()
    planned = [c for c in family if c.planned]
    kind, looks = stats.parse_sequential(sequential) if sequential else ("pocock", 1)
    now = planned_look(max(c.pooled.clusters for c in planned), planned_clusters, looks) if planned else 1
    carried = (earlier_rejections(rows, declared, kind, looks, planned_clusters, now)
               if looks > 1 and planned_clusters else {})
    is_open = [(c.config_a, c.config_b) not in carried for c in planned]
    # Holm's adjusted p and levels over the comparisons still open (one rejected at an earlier look left
    # the family: its row shows that look's threshold and no Holm p)
    open_planned = [c for c, o in zip(planned, is_open) if o]
    open_p = [c.pooled.p_value for c in open_planned]
    open_adjusted = iter([min(1.0, p * looks_taken) for p in stats.holm(open_p)])
    adjusted = [next(open_adjusted) if o else math.nan for o in is_open]

    def threshold_at(i: int, level: float) -> float:  # at the open comparison i's own look
        look = planned_look(open_planned[i].pooled.clusters, planned_clusters, looks)
        return stats.sequential_threshold(kind, looks, look, level) / looks_taken

    open_steps = iter(holm_step_down(open_p, threshold_at))
    seeds = sorted({s for c in family for s in c.per_seed})
    head = ["comparison (A - B)", "problems", *[f"seed {s}" for s in seeds], "pooled [95% CI]", "p",
            "Holm p", "threshold", "decision", "MDE", "from cap-hit pairs"]
    body = []
    decisions: dict[int, tuple[float, str]] = {}
    for i, c in enumerate(planned):
        if not is_open[i]:
            look, threshold, paired, _ = carried[(c.config_a, c.config_b)]
            decisions[i] = (threshold, f"rejected at look {look} (retaken, {paired} problems)")
        else:
            threshold, reject = next(open_steps)
            decisions[i] = (threshold, "reject" if reject else "keep")
    for i, c in enumerate(family):
        per_seed = [_interval(c.per_seed[s]) if s in c.per_seed else "-" for s in seeds]
        if c.planned:
            j = planned.index(c)
            threshold, decision = decisions[j]
            holm_p = _p(adjusted[j]) if is_open[j] else "-"
        else:
            threshold, holm_p = ALPHA, "-"
            decision = "differs" if c.pooled.p_value < ALPHA else "no difference"
        # se 0: no spread, no power statement; none either for a comparison decided at an earlier look
        decided = c.planned and not is_open[planned.index(c)]
        usable = c.pooled.se > 0 and not math.isnan(threshold) and not decided
        mde = stats.minimum_detectable_effect(c.pooled.se, threshold, POWER) if usable else math.nan
        label = f"{c.config_a} - {c.config_b}" + ("" if c.planned else " (calibration)")
        body.append([label, str(c.pooled.clusters), *per_seed, _interval(c.pooled), _p(c.pooled.p_value),
                     holm_p, _p(threshold), decision, f"{mde:.3f}" if not math.isnan(mde) else "-",
                     f"{_fmt(c.cap_part[0])} ({c.cap_part[1]} of {c.pooled.units})"])
    paired = sorted({c.pooled.clusters for c in planned})
    design = (sequential_design(kind, looks, paired[-1] if paired else None, planned_clusters)
              + ("" if len(paired) < 2 else f" (the fullest comparison; each row's threshold is at its own "
                 f"look, from its own paired problems: {', '.join(map(str, paired))})")
              if looks > 1 else "one look (fixed design)" if looks_taken == 1 else
              f"a fixed design read {looks_taken} times (--looks-taken): each threshold divided by "
              f"{looks_taken} and each Holm p multiplied by {looks_taken}, Bonferroni over the looks")
    legend = ("(planned comparisons declared in sweep.json (--compare), A - B on the score; per seed and "
              "pooled over (problem x seed) with 95% intervals; p: cluster-robust paired t-test on "
              "per-problem mean differences (clustered by problem, problems - 1 df); Holm p: adjusted over "
              f"the {sum(is_open)} open declared comparison(s); threshold: Holm's step-down level at "
              f"alpha {ALPHA}, {design}; decision: reject while the ordered p stay under their thresholds"
              + ("; a comparison rejected at an earlier look stays rejected, shows that look's threshold, "
                 "and leaves the family, so the open ones' Holm p and levels count only them (Maurer and "
                 "Bretz 2013); its estimate here is descriptive. Each earlier look is retaken here on the "
                 "suite's first problems up to its planned count (the problems paired there in brackets): "
                 "if a look was read at the time on other rows (an early reading, fewer problems), that "
                 "reading is the record, not this retake" if carried else "") + "; "
              f"MDE: the true difference detected with power {POWER} at that threshold, from the pooled "
              "standard error; from cap-hit pairs: the part of the pooled difference (the sum of A - B "
              "over all pairs divided by their number) carried by the pairs where A or B hit the length "
              "cap, and how many pairs those are; the rest comes from pairs where both stopped by "
              "themselves; the calibration row compares two samplers of the same law, so a "
              "difference there is chance, not a rule effect)")
    notes = "".join(f"\nnote: the declared comparison {m} has no rows on both sides (not in this sweep, "
                    "or not yet decoded)" for m in missing)
    unindexed = any(type(r.get("prompt_index")) is not int for r in rows)
    if looks > 1 and planned_clusters and now > 1 and unindexed:
        notes += (f"\nnote: this reading is look {now}, but rows without an integer prompt_index leave no "
                  "earlier look's prefix to retake: Holm runs over every declared comparison, as if none "
                  "had been rejected before")
    counts = look_counts(looks, planned_clusters) if carried else []
    notes += "".join(f"\nnote: {a} - {b}: rejected at look {look} retaken on {paired} paired problems, "
                     f"fewer than that look's planned {counts[look - 1]}"
                     for (a, b), (look, _, paired, _) in carried.items() if paired < counts[look - 1])
    notes += "".join(f"\nnote: {c.config_a} - {c.config_b}: every problem's difference is the same "
                     f"({_fmt(c.pooled.estimate)}), so the t-test has no spread to work with: its p is a "
                     "convention (1 for a zero difference, 0 otherwise) and no MDE is given"
                     for c in family if c.pooled.se == 0)
    return text_table(head, body) + "\n" + legend + notes


def replace_planned(c: Comparison) -> Comparison:
    return Comparison(c.name, c.config_a, c.config_b, c.per_seed, c.pooled, planned=False,
                      cap_part=c.cap_part)


# ------------------------------------------------------------------------------------ length outcomes


def _cap_hit(row: dict) -> float:
    return float(row.get("finish") == "length")


def _stopped(row: dict) -> float:
    return float(row.get("finish") in ("eos", "stop"))


def _tokens(row: dict) -> float:
    return float(row["tokens"])


OUTCOMES = (("cap-hit", _cap_hit), ("tokens", _tokens), ("stopped itself", _stopped))


def length_table(rows: list[dict], baseline_of) -> str:
    """Per configuration: cap-hit rate (finish "length"), mean output length in tokens and the rate of
    rows that stopped by themselves (a stop token, or the suite's stop condition such as the end of the
    first code block), each with its paired difference to the configuration's baseline (`baseline_of`,
    the report's) and a 95% interval clustered by problem; the protocol the rows were scored under."""
    units = _units(rows)
    configs = list(dict.fromkeys(config_key(r) for r in rows))
    protocols = sorted({str(r.get("protocol") or _legacy_protocol(r)) for r in rows})
    head = ["config", "n"] + [h for name, _ in OUTCOMES for h in (name, f"Δ{name} vs baseline")]
    body = []
    for key in configs:
        group = list(units[key].values())
        cells = [config_name(key), str(len(group))]
        # a tree configuration is paired with plain decoding, the target's own law (as the main table)
        base_rule = PLAIN if key[3] else baseline_of(key[0])
        for name, value in OUTCOMES:
            level = mean(value(r) for r in group)
            cells.append(f"{level:.1f}" if name == "tokens" else f"{level:.3f}")
            diffs = [c for c in compare(rows, _side(key), base_rule, value)
                     if c.config_a == config_name(key)] if base_rule else []
            cells.append(_interval(diffs[0].pooled) if diffs else "-")
        body.append(cells)
    legend = (f"(protocol: {', '.join(protocols)}; cap-hit = finish 'length'; stopped itself = a stop token "
              "or the suite's stop condition; Δ: paired against the row's baseline (the report's), mean "
              "and 95% interval clustered by problem)")
    return text_table(head, body) + "\n" + legend


# ----------------------------------------------------------------- controls of a log-likelihood score


def _loglik(row: dict) -> float | None:
    return row.get("score") if row.get("score_name") == TARGET_LOGLIK else math.nan


def _body_length(row: dict) -> int:
    """The reply's tokens before its own stop token (a reply that stopped by itself ends on one)."""
    return len(row["steps"]["log_target_raw"]) - int(_stopped(row) == 1.0)


def _same_length(key_a: tuple, key_b: tuple, units: dict, value: Callable[[dict, dict], tuple | None]
                 ) -> list[tuple[str, float, float]]:
    """(problem, A's value, B's value) for every (problem, seed) both configurations have, where
    `value(row A, row B)` gives a pair of finite numbers (None: the unit is left out)."""
    out = []
    for unit, row in units[key_a].items():
        other = units[key_b].get(unit)
        values = value(row, other) if other is not None else None
        if values is not None and all(math.isfinite(v) for v in values):
            out.append((unit[0], *values))
    return out


def _prefix_loglik(row: dict, other: dict) -> tuple[float, float] | None:
    """Both replies' mean raw-target log-likelihood per token over their first m tokens, m the shorter
    reply's length without its stop token (so neither side's prefix holds its ending and the other's
    does not): the score at equal length."""
    if not all((r.get("steps") or {}).get("log_target_raw") for r in (row, other)):
        return None
    m = min(_body_length(row), _body_length(other))
    if m < 1:
        return None
    return mean(row["steps"]["log_target_raw"][:m]), mean(other["steps"]["log_target_raw"][:m])


def _prefix_repetition(row: dict, other: dict) -> tuple[float, float] | None:
    """Both texts' repetition_4 over their first w words, w the shorter text's word count: repetition
    at equal length (the share of repeated 4-grams grows with a text's length even when nothing loops)."""
    a, b = str(row.get("text", "")).split(), str(other.get("text", "")).split()
    w = min(len(a), len(b))
    if w < 4:
        return None
    return scorers.repetition(" ".join(a[:w]), 4), scorers.repetition(" ".join(b[:w]), 4)


def _whole(value: Callable[[dict], object]) -> Callable[[dict, dict], tuple | None]:
    def both(row: dict, other: dict) -> tuple | None:
        va, vb = value(row), value(other)
        return (float(va), float(vb)) if all(isinstance(v, (int, float)) for v in (va, vb)) else None
    return both


def _repetition(row: dict) -> object:
    return (row.get("metrics") or {}).get("repetition_4")


CONTROLS = (("loglik/token (planned)", _whole(_loglik)), ("same-length loglik/token", _prefix_loglik),
            ("repetition_4", _whole(_repetition)), ("same-length repetition_4", _prefix_repetition))


def loglik_controls_table(rows: list[dict], declared: list[str]) -> str:
    """For a sweep scored by the target's log-likelihood per token (`TARGET_LOGLIK`: suites without a
    task, such as MT-Bench), what else could move that score, per declared comparison (and the
    calibration pair): the score as planned, the score at equal length (the replies' shared first tokens,
    stop tokens left out), and the text's repetition of word 4-grams, whole and at equal length (a
    looping reply is likely under the target). Each is A - B paired on (problem, seed), clustered by
    problem, with its 95% interval and uncorrected p: secondary readings, never decisions. Empty when no
    row has that score."""
    if not any(r.get("score_name") == TARGET_LOGLIK for r in rows):
        return ""
    units = _units(rows)
    declared_keys = [keys for text in declared for keys in _matching(units, *parse_comparison(text))]
    calibration = [keys for keys in _matching(units, "lossless", PLAIN) if keys not in declared_keys]
    head = ["comparison (A - B)", "pairs"] + [h for name, _ in CONTROLS for h in (name, "p")]
    body = []
    for key_a, key_b in dict.fromkeys(declared_keys + calibration):
        estimates = [stats.clustered_paired(_same_length(key_a, key_b, units, value))
                     for _, value in CONTROLS]
        if not estimates[0].units:
            continue
        cells = [f"{config_name(key_a)} - {config_name(key_b)}"
                 + (" (calibration)" if (key_a, key_b) in calibration else ""), str(estimates[0].units)]
        for e in estimates:
            fewer = f" (n={e.units})" if e.units != estimates[0].units else ""
            cells += [_interval(e) + fewer, _p(e.p_value)]
        body.append(cells)
    if not body:
        return ""
    legend = ("(secondary readings of the declared comparisons and the calibration pair, not in the "
              "corrected family: A - B, mean and 95% interval clustered by problem, uncorrected p; "
              "pairs: the planned score's pairs (a column with fewer says n=); loglik/token: the planned "
              "score, the target's mean log-likelihood per generated token (temperature 1, no "
              "truncation); same-length: that mean over the first m tokens of both replies, m the shorter "
              "reply's length without its stop token; repetition_4: the share of word 4-grams that repeat "
              "an earlier one, over the whole reply (it grows with length) and over both texts' first w "
              "words, w the shorter text's word count. A score gap that shrinks at equal length, or comes "
              "with more repetition at equal length, is consistent with length or looping carrying part "
              "of it; a gap in the same direction at equal length is not explained by length)")
    return text_table(head, body) + "\n" + legend


def _legacy_protocol(row: dict) -> str:
    """The protocol of rows written before rows recorded one: HumanEval and MBPP ran the first code
    block as it was ("extract"); other suites had one scoring ("default")."""
    return "extract" if row.get("suite") in ("humaneval", "mbpp") else "default"


# ------------------------------------------------------------------------------ difficulty levels


def _differences(rows: list[dict], key: tuple, base: str) -> list[tuple[str, int, float]]:
    """(problem, seed, score of config `key` minus score of `base`) for every (problem, seed) both have,
    `base` at the same temperature (and k, unless it is plain)."""
    units = _units(rows)
    base_key = next((k for k in units if k[0] == base and k[3] is None and k[2] == key[2]
                     and (base == PLAIN or k[1] == key[1])), None)
    if base_key is None:
        return []
    return [(problem, seed, va - vb) for problem, seed, va, vb, _, _ in _pairs(units, key, base_key)]


def _rule_configs(rows: list[dict], baseline_of) -> list[tuple[tuple, str]]:
    """(config key, its baseline) for every rule among the chain rows that has one besides plain: a
    truncation rule's honest truncation sampler, lossless SD for the others (collaborative, bounded),
    where the baseline has rows at the rule's k and temperature (what `_differences` pairs); truncation
    rules first. Tree rows are left out: a tree has no honest baseline nor one single-draft law
    (docs/design/trees.md, 'Trees')."""
    configs = list(dict.fromkeys(config_key(r) for r in rows if not r.get("tree")))
    present = {key[:3] for key in configs}
    out = []
    for key in configs:
        base = baseline_of(key[0]) if key[0] != PLAIN else None
        if base is not None and base != PLAIN and (base, key[1], key[2]) in present:
            out.append((key, base))
    return sorted(out, key=lambda pair: not pair[1].startswith("honest:"))


def _baseline_suffix(base: str) -> str:
    """How a level or tier row names its baseline: ' - honest' (a truncation rule's honest sampler),
    ' - lossless' (the other rules), ' - plain (same law)' (lossless, the calibration row)."""
    return " - plain (same law)" if base == PLAIN else " - lossless" if base == "lossless" else " - honest"


def _calibration_configs(rows: list[dict]) -> list[tuple[tuple, str]]:
    """(lossless config key, plain) when both are among the rows: the same law, so no gap and no trend
    is expected; printed beside the rules as a check of the per-level table itself."""
    keys = list(dict.fromkeys(config_key(r) for r in rows if not r.get("tree")))
    return [(key, PLAIN) for key in keys if key[0] == "lossless"
            and any(k[0] == PLAIN and k[2] == key[2] for k in keys)]


def _slope_text(e: stats.PairedEstimate) -> str:
    return f"{_fmt(e.estimate)} [{_fmt(e.low)}, {_fmt(e.high)}] p {_p(e.p_value)}"


def level_table(rows: list[dict], baseline_of) -> str:
    """For a graded suite (prompt ids 'graded-L<level>-<nn>' or 'graded-steps-L<level>-<nn>',
    `verispec.evaluation.graded`): per level, each rule's score minus its baseline's (`baseline_of`:
    a truncation rule's honest truncation sampler, lossless SD for the others), with its 95% interval
    clustered by problem, the trend (the slope of that difference per level, clustered by problem:
    `stats.clustered_slope`), the same for lossless
    minus plain (the same law) as a check, and plain decoding's score per level with its own slope (the
    difficulty itself: a trend in the gap reads as a difficulty trend only where that slope is negative);
    empty when the rows have no levels or no rule with a baseline."""
    levels = sorted({lv for r in rows if (lv := level_of(r["prompt_id"])) is not None})
    if not levels:
        return ""
    head = ["config - baseline", *[f"level {lv}" for lv in levels], "trend per level"]
    body = []
    ruled = _rule_configs(rows, baseline_of)
    for key, base in ruled + (_calibration_configs(rows) if ruled else []):
        cells = [config_name(key) + _baseline_suffix(base)]
        for lv in levels:
            subset = [r for r in rows if level_of(r["prompt_id"]) == lv]
            found = [c for c in compare(subset, key[0], base) if c.config_a == config_name(key)]
            cells.append(f"{_interval(found[0].pooled)} n={found[0].pooled.clusters}" if found else "-")
        points = [(problem, float(level_of(problem)), d) for problem, _, d in _differences(rows, key, base)
                  if level_of(problem) is not None]
        cells.append(_slope_text(stats.clustered_slope(points)))
        body.append(cells)
    plain = [r for r in rows if r["rule"] == PLAIN and isinstance(r.get("score"), (int, float))]
    if plain:
        # plain's own slope on the level says whether the levels are difficulty levels at all (it must be
        # negative for the rules' trend to read as a difficulty trend)
        plain_points = [(r["prompt_id"], float(lv), float(r["score"])) for r in plain
                        if (lv := level_of(r["prompt_id"])) is not None]
        body.append(["plain score (difficulty)", *[
            f"{mean(r['score'] for r in plain if level_of(r['prompt_id']) == lv):.3f}"
            if any(level_of(r["prompt_id"]) == lv for r in plain) else "-" for lv in levels],
            _slope_text(stats.clustered_slope(plain_points))])
    if len(body) == (1 if plain else 0):
        return ""
    return text_table(head, body) + ("\n(per level: the rule's score minus its baseline's (a truncation "
                                     "rule's honest truncation sampler, lossless SD for the others) "
                                     "on the same (problem, seed), mean [95% interval clustered by "
                                     "problem], whatever its direction; trend: the least-squares slope of "
                                     "that difference on the level, cluster-robust by problem, with its "
                                     "95% interval and p, one uncorrected test a row (a difference "
                                     "is bounded by the baseline's own score: a rule far behind "
                                     "cannot lose where the baseline fails, so part of a trend can be "
                                     "that floor); same law: lossless minus plain, "
                                     "so neither a gap nor a trend is expected; plain score: plain "
                                     "decoding's mean score per level, and its slope on the level, negative "
                                     "where the levels are difficulty levels)")


TIERS = ("hard", "middle", "easy")


def difficulty_tiers(rows: list[dict], reference: str = PLAIN) -> dict[tuple[str, int, float], float]:
    """(problem, seed, temperature) -> the reference configuration's mean score on that problem over the
    *other* seeds at that temperature (leave one seed out), for suites without graded levels (e.g.
    HumanEval split by plain decoding's pass rate). Leaving the row's own seed out keeps the tier
    independent of the rows compared within it: rows of one seed share random draws across
    configurations, so a tier read from the same seed would correlate with the baseline's own outcome
    and the gap would regress toward the mean by tier. Units whose problem the reference has on no other
    seed get no tier."""
    scores: dict[tuple[str, float], dict[int, float]] = defaultdict(dict)
    for r in rows:
        if r["rule"] == reference and isinstance(r.get("score"), (int, float)) and math.isfinite(r["score"]):
            scores[(r["prompt_id"], r["temperature"])][r["seed"]] = float(r["score"])
    out = {}
    for r in rows:
        seen = scores.get((r["prompt_id"], r["temperature"]), {})
        others = [v for s, v in seen.items() if s != r["seed"]]
        if others:
            out[(r["prompt_id"], r["seed"], r["temperature"])] = mean(others)
    return out


def tier_name(rate: float) -> str:
    """A leave-one-seed-out pass rate -> 'hard' (never solved on the other seeds), 'easy' (always), or
    'middle'."""
    return "hard" if rate == 0 else "easy" if rate == 1 else "middle"


def tier_table(rows: list[dict], baseline_of, reference: str = PLAIN) -> str:
    """For suites without graded levels, on sweeps with at least two seeds of the reference
    configuration: each rule's score minus its baseline's (a truncation rule's honest truncation
    sampler, lossless SD for the others) per difficulty tier (`difficulty_tiers`, `tier_name`), with its
    95% interval clustered by problem, the trend (the slope of that difference on the reference's
    leave-one-seed-out pass rate, clustered by problem), the same for lossless minus plain (the same law)
    as a check, and the reference's own score per tier on the held-out seed (how hard the tier is on
    fresh draws); empty when there is nothing to tier or the reference's scores are not 0/1."""
    if any(level_of(r["prompt_id"]) is not None for r in rows):
        return ""
    reference_scores = [v for r in rows if r["rule"] == reference
                        and isinstance(v := r.get("score"), (int, float)) and math.isfinite(v)]
    if not all(v in (0, 1) for v in reference_scores):
        return ""  # tiers are read from a pass rate: a score that is not 0/1 (log-likelihood) has none
    rate = difficulty_tiers(rows, reference)
    configs = _rule_configs(rows, baseline_of)
    if not rate or not configs:
        return ""
    configs += _calibration_configs(rows)

    def tier(r: dict) -> str | None:
        x = rate.get((r["prompt_id"], r["seed"], r["temperature"]))
        return None if x is None else tier_name(x)
    head = ["config - baseline", *TIERS, "trend per unit pass rate"]
    body = []
    for key, base in configs:
        cells = [config_name(key) + _baseline_suffix(base)]
        points = [(problem, rate[(problem, seed, key[2])], d)
                  for problem, seed, d in _differences(rows, key, base) if (problem, seed, key[2]) in rate]
        for name in TIERS:
            # weighted by (problem, seed) pair, not by problem: how often a problem falls in a tier
            # depends on plain's held-out outcome (stats.clustered_mean)
            found = stats.clustered_mean([(problem, d) for problem, x, d in points if tier_name(x) == name])
            cells.append(f"{_interval(found)} n={found.units}" if found.units else "-")
        cells.append(_slope_text(stats.clustered_slope(points)))
        body.append(cells)
    ref_rows = [r for r in rows if r["rule"] == reference and isinstance(r.get("score"), (int, float))]
    by_tier = {name: [r["score"] for r in ref_rows if tier(r) == name] for name in TIERS}
    body.append([f"{reference} score on the held-out seed", *[
        f"{mean(v):.3f} n={len(v)}" if v else "-" for v in by_tier.values()], "-"])
    return text_table(head, body) + (
        f"\n(tiers: {reference}'s pass rate on the same problem over the other seeds (leave one seed out): "
        "hard = never solved, easy = always, middle = in between; per tier: the rule's score minus its "
        "baseline's (a truncation rule's honest truncation sampler, lossless SD for the others) on the "
        "same (problem, seed), the mean over (problem, seed) pairs "
        "[95% interval, cluster-robust by problem], n = pairs, whatever its direction; trend: the "
        "least-squares slope of that difference on the leave-one-seed-out pass rate, cluster-robust by "
        "problem (positive: the rule falls further behind on harder problems), one uncorrected test a "
        "row (a difference is bounded by the baseline's own pass rate: a rule far behind cannot lose "
        "where the baseline fails, so part of a trend can be that floor); same law: lossless "
        "minus plain, the same law, so neither a gap nor a trend is expected (plain's own row is in no "
        f"tier it was read from); last line: {reference}'s score in each tier on the held-out seed)")
