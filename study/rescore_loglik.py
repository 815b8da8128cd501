r"""Held-out re-scoring of a sweep scored by the target's log-likelihood per token (MT-Bench), for
study/NOTEBOOK.md: each chosen row's reply is scored again by one cache-free forward pass of the
target over prompt + reply (teacher forcing), not by the decode loop that wrote the row, and the two are
compared per row and through the declared comparisons.

The decode loop scored the tokens in batched, cached passes of a few positions; this pass scores the
whole sequence at once, so in bfloat16 the two round differently: the script prints the per-row score
difference (max and mean absolute) and each declared comparison's pooled estimate and p on the
rows' scores and on the re-scored ones, so what rounding does to a published figure is on the page.

The same pass gives a check of when replies end. At each position t of a reply the target gives the
probability of a stop token, P_t; a sampler of the target's own law (plain sampling at T = 1 without
truncation, and lossless SD) emits a stop with exactly that probability, so the stops a reply emits
minus the sum of its P_t has mean 0 (a martingale stopped at the reply's end, optional stopping). The
script prints that residual per configuration with its 95% interval, clustered by question: for plain
and lossless rows it is 0 up to chance, and a rule that ends replies too late (or too early) reads below
(above) 0. For lossy rules it need not be 0.

    python study/rescore_loglik.py study/sweeps/qwen-mtbench --every 3
    python study/rescore_loglik.py study/sweeps/qwen-mtbench --every 2 \
        --configs "plain T=1" "lossless k=4 T=1"
    python study/rescore_loglik.py study/sweeps/qwen-mtbench-seeds --every 2 --offset 1 \
        --configs "plain T=1" "lossless k=4 T=1"
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from fresh import FreshPass

from verispec.decode import stop_ids
from verispec.diagnostics.law_check import stop_residual
from verispec.evaluation import stats
from verispec.evaluation.comparisons import compare, parse_comparison
from verispec.evaluation.suites import TARGET_LOGLIK
from verispec.evaluation.units import backend_of


def teacher_forced(fresh: FreshPass, row: dict, stops: list[int]) -> tuple[float, float]:
    """From one cache-free pass over prompt + reply (`FreshPass.logits`), under the raw target
    (temperature 1, no truncation): the reply's mean log-likelihood per token, and its stop residual,
    the stop tokens it emitted minus the sum over its positions of the probability of a stop token."""
    reply = torch.tensor(row["token_ids"])  # [n]
    log_probs = fresh.logits(row).log_softmax(-1)  # [n, V]
    emitted = log_probs.gather(-1, reply[:, None])[:, 0]  # [n]
    return emitted.mean().item(), stop_residual(log_probs, reply, stops)


def residual_line(config: str, points: list[tuple[str, float]]) -> str:
    """One configuration's stop residual from (question, residual) points: the mean with its 95% interval
    and p clustered by question (`stats.clustered_mean`; a question's seeds share its prompt, so they are
    not independent draws of the residual's spread)."""
    e = stats.clustered_mean(points)
    if math.isnan(e.p_value):
        return f"  {config}: {e.units} row(s), {e.clusters} question(s), stop residual {e.estimate:+.3f}"
    return (f"  {config}: {e.units} rows, {e.clusters} questions, stop residual {e.estimate:+.3f} "
            f"[{e.low:+.3f}, {e.high:+.3f}] p {e.p_value:.3g}")


def chosen(rows: list[dict], every: int, offset: int = 0, configs: list[str] | None = None) -> list[dict]:
    """The rows to re-score: scored by the target's log-likelihood, with a reply, on the questions whose
    index is `offset` modulo `every` (so every configuration on a question is kept and the comparisons
    stay paired), of the named configurations (all when None)."""
    if every < 1 or not 0 <= offset < every:
        raise ValueError(f"need every >= 1 and 0 <= offset < every, got every={every}, offset={offset}")
    return [r for r in rows if r.get("score_name") == TARGET_LOGLIK and isinstance(r.get("score"), float)
            and r["token_ids"] and r["prompt_index"] % every == offset
            and (not configs or r["config"] in configs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", help="a sweep's --out directory (score: target_loglik)")
    parser.add_argument("--configs", nargs="+", metavar="CONFIG",
                        help="only these configurations (ids as the rows name them, e.g. 'plain T=1')")
    parser.add_argument("--every", type=int, default=1,
                        help="re-score the questions whose index is a multiple of N, every configuration "
                             "on them (so each comparison stays paired); 1: all rows")
    parser.add_argument("--offset", type=int, default=0,
                        help="with --every N: the questions whose index is this modulo N instead (0 to N-1; "
                             "--every 2 --offset 1: the odd ones)")
    args = parser.parse_args()
    if args.every < 1 or not 0 <= args.offset < args.every:
        parser.error(f"need --every >= 1 and 0 <= --offset < --every, got {args.every} and {args.offset}")
    settings = json.loads((Path(args.sweep) / "sweep.json").read_text())
    fresh = FreshPass(args.sweep)
    if backend_of(fresh.target) != settings.get("backend"):
        raise SystemExit(f"the target loaded on the {backend_of(fresh.target)} backend, the sweep ran on "
                         f"{settings.get('backend')}: set VERISPEC_BACKEND to match")
    rows = chosen(fresh.rows, args.every, args.offset, args.configs)
    if not rows:
        raise SystemExit(f"{args.sweep}: no rows scored by {TARGET_LOGLIK} to re-score")
    stops = sorted(stop_ids(fresh.target))
    began = time.perf_counter()
    passes = {r["unit"]: teacher_forced(fresh, r, stops) for r in rows}
    seconds = time.perf_counter() - began
    again = {unit: loglik for unit, (loglik, _) in passes.items()}
    bad = [r["unit"] for r in rows if not math.isfinite(again[r["unit"]])]
    if bad:
        raise SystemExit(f"{len(bad)} rows re-scored to a non-finite value: {bad[:5]}")
    diffs = [abs(again[r["unit"]] - r["score"]) for r in rows]
    print(f"re-scored {len(rows)} rows ({len({r['prompt_id'] for r in rows})} questions, index {args.offset} "
          f"modulo {args.every}) in {seconds:.0f} s: |row score - re-scored| max {max(diffs):.2g}, "
          f"mean {sum(diffs) / len(diffs):.2g}")
    rescored = [dict(r, score=again[r["unit"]]) for r in rows]
    for text in settings.get("compare") or []:
        a, b = parse_comparison(text)
        for before, after in zip(compare(rows, a, b), compare(rescored, a, b)):
            e, f = before.pooled, after.pooled
            print(f"  {before.config_a} - {before.config_b}: rows ({e.clusters} questions) {e.estimate:+.4f} "
                  f"[{e.low:+.4f}, {e.high:+.4f}] p {e.p_value:.3g}; re-scored ({f.clusters} questions) "
                  f"{f.estimate:+.4f} [{f.low:+.4f}, {f.high:+.4f}] p {f.p_value:.3g}")
    print(f"stop residual (stop tokens emitted - sum of P(stop) over the reply's positions, stop ids "
          f"{stops}; mean 0 for samplers of the target's law: plain and lossless at T = 1, no truncation):")
    for config in dict.fromkeys(r["config"] for r in rows):
        print(residual_line(config, [(r["prompt_id"], passes[r["unit"]][1]) for r in rows
                                     if r["config"] == config]))


if __name__ == "__main__":
    main()
