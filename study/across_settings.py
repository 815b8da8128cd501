"""The min-p gate against honest min-p sampling across the settings where the two met: each setting's
Holm-adjusted p (over that sweep's declared family, at the reading that decided it) and that p times the
number of settings (Bonferroni across settings, capped at 1), recomputed from the committed rows with
the report's own code (`verispec.evaluation.comparisons`, `stats.holm`): the README's "Bonferroni over
the five settings" figures, as a command instead of arithmetic in prose.

Each setting is its own declared family; this correction is not any plan's, and is printed as a reading
across plans (docs/findings.md, 'Findings on the Qwen2.5-Coder pair'). A reading that decided at an
interim look
(MT-Bench seed 0: look 1, 40 questions) is taken on that look's prefix, where its Holm p was computed;
one read at a later look after other comparisons were rejected at an earlier one (MT-Bench T = 0.7: cos
at look 1) takes Holm over the comparisons still open, as the report does (docs/design/evaluation.md, 'Planned
comparisons').

    python study/across_settings.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from verispec.evaluation import comparisons, stats
from verispec.evaluation.report import planned_problems
from verispec.evaluation.store import read_rows

REPO = Path(__file__).resolve().parents[1]
GATE = "speccascade:min_p=0.1 vs honest:speccascade:min_p=0.1"

# (setting, sweep, the problems the deciding reading read: None for all); the five settings of the
# README's correction (a setting is a task at a temperature), with graded-steps' four readings (seed 0
# declared, seed 1, the two pooled, seed 2 on 400 other problems)
SETTINGS = (
    ("HumanEval T = 1, seeds 0-2", "qwen-humaneval-sanitized-seeds", None),
    ("HumanEval T = 0.7, seeds 0-2", "qwen-humaneval-t07", None),
    ("graded-steps, seed 0", "qwen-graded-steps", None),
    ("graded-steps, seed 1", "qwen-graded-steps-seed1", None),
    ("graded-steps, seeds 0-1", "qwen-graded-steps-seeds01", None),
    ("graded-steps, held-out problems", "qwen-graded-steps-heldout", None),
    ("MT-Bench T = 1, seed 0 (look 1)", "qwen-mtbench", 40),
    ("MT-Bench T = 0.7, seed 0 (look 2)", "qwen-mtbench-t07", None),
)
N_SETTINGS = 5  # HumanEval T = 1, HumanEval T = 0.7, graded-steps T = 0.7, MT-Bench T = 1, MT-Bench T = 0.7
ALPHA = 0.05


def _is_gate(c: comparisons.Comparison) -> bool:
    """Whether a comparison is GATE's pair (the report's names: speccascade:min_p=0.1 with its
    resample, against honest:speccascade:min_p=0.1)."""
    a, b = comparisons.parse_comparison(GATE)  # canonical specs, as the config ids begin
    return c.config_a.startswith(f"{a} ") and c.config_b.startswith(f"{b} ")


def gate_holm_p(sweep: str, problems: int | None) -> tuple[float, float, int]:
    """(the gate's estimate, its Holm p over the sweep's declared family, the problems paired) on the
    sweep's rows (the first `problems` problems when given); under a group-sequential design, Holm over
    the comparisons still open at that look (one rejected at an earlier look left the family), provided
    each carried rejection also holds at the level this correction gives the setting (alpha / N_SETTINGS,
    at Holm's smallest level over the family then): a rejection carried at alpha but not there would take
    a comparison out of the family that the stricter reading keeps in (refused). A gate itself rejected
    at an earlier look is refused: its Holm p is that look's (pass its problems)."""
    directory = REPO / "study" / "sweeps" / sweep
    settings = json.loads((directory / "sweep.json").read_text())
    declared = settings["compare"]
    rows = read_rows(directory / "results.jsonl")
    if problems is not None:
        rows = [r for r in rows if r["prompt_index"] < problems]
    family = list({(c.config_a, c.config_b): c for text in declared
                   for c in comparisons.compare(rows, *comparisons.parse_comparison(text))}.values())
    planned = planned_problems(settings)
    if settings.get("sequential") and planned:
        kind, looks = stats.parse_sequential(settings["sequential"])
        now = comparisons.planned_look(max(c.pooled.clusters for c in family), planned, looks)
        carried = comparisons.earlier_rejections(rows, declared, kind, looks, planned, now)
        if any(_is_gate(c) for c in family if (c.config_a, c.config_b) in carried):
            raise ValueError(f"{sweep}: the gate was rejected at an earlier look; read it on that look's "
                             "problems")
        for (a, b), (look, _, _, p_then) in carried.items():
            strict = stats.sequential_threshold(kind, looks, look, ALPHA / N_SETTINGS / len(family))
            if not p_then < strict:
                raise ValueError(f"{sweep}: {a} - {b}, carried from look {look} (p {p_then:.3g}), would not "
                                 f"be rejected there at alpha / {N_SETTINGS} (threshold {strict:.3g})")
        family = [c for c in family if (c.config_a, c.config_b) not in carried]
    adjusted = stats.holm([c.pooled.p_value for c in family])
    for c, p in zip(family, adjusted):
        if _is_gate(c):
            return c.pooled.estimate, p, c.pooled.clusters
    raise ValueError(f"{sweep}: no declared comparison {GATE!r}")


def main() -> int:
    print(f"the gate - honest min-p: each setting's Holm p, and x {N_SETTINGS} (Bonferroni across the "
          f"{N_SETTINGS} settings, capped at 1)")
    for label, sweep, problems in SETTINGS:
        estimate, holm_p, paired = gate_holm_p(sweep, problems)
        print(f"  {label:34s} {estimate:+.3f} ({paired} problems): Holm p {holm_p:.3g} -> "
              f"{min(1.0, N_SETTINGS * holm_p):.3g}  [{sweep}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
