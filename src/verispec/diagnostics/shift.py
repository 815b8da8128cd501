"""Per-position shift of a verification rule on a real run (docs/design/diagnostics.md, section
'Diagnostics').

At every emitted position the token's exact law given its prefix is known: `rule.emitted(p, q)` at a
draft position (accepted or recovered token), the rule's bonus law (p for every rule but greedy) at
the bonus position. From it, in float64: TV and KL to the target, TV to the rule's honest baseline,
overshoot (max law/p, mass on tokens with p below a tail threshold), the token's log-likelihood
ratio log law(x) - log p(x) (summed over a sequence and averaged over samples: an unbiased estimate
of the path-level KL, an upper bound on the sequence-level KL(rule || target); docs/design/rules.md, 'Rule
anatomy'), and acceptance expected vs realised.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verispec.probability import kl, max_ratio, renormalised_f64
from verispec.rules.base import Rule

ROLES = ("accepted", "recovered", "bonus", "plain")
TAIL = 1e-3

# one column per field, one row per emitted position
FIELDS = (
    "token", "role", "log_target", "log_law", "tv", "kl", "tv_baseline", "max_ratio", "tail_mass",
    "expected_accept", "draft_confidence", "draft_over_target", "log_target_raw",
)  # log_target_raw (the raw target's log-probability of the token) is added by the decode loop


def _lossless_stats(target_probs: Tensor, draft_probs: Tensor, tokens: Tensor, roles: list[str],
                    block_level: bool) -> dict:
    """The same statistics when the law is p itself (a lossless rule, bonus included): the shift terms
    are exactly 0 (TV, KL) and 1 (max ratio), so only reductions remain, accumulated in float64
    without materialising float64 copies of the rows (this is the cheap path that stays on)."""
    n = target_probs.shape[0]
    drafted = torch.tensor([r in ("accepted", "recovered") for r in roles], dtype=torch.bool)
    idx = tokens.long()[:, None]
    p_sum = target_probs.sum(-1, dtype=torch.float64)  # [n]; float32 rows sum to 1 within ~1e-6
    p_x = target_probs.gather(-1, idx).squeeze(-1).double() / p_sum
    log_target = p_x.log()
    nan = torch.full((n,), torch.nan, dtype=torch.float64)
    expected, confidence, over = nan.clone(), nan.clone(), nan.clone()
    if drafted.any():
        p, q = target_probs[drafted], draft_probs[drafted]
        q_sum = q.sum(-1, dtype=torch.float64)
        if not block_level:  # a block rule has no per-position acceptance probability
            expected[drafted] = torch.minimum(p / p_sum[drafted, None].to(p.dtype),
                                              q / q_sum[:, None].to(q.dtype)).sum(
                -1, dtype=torch.float64)  # sum(q * min(1, p/q)) = sum(min(p, q))
        confidence[drafted] = q.amax(-1).double() / q_sum
        over[drafted] = q.gather(-1, idx[drafted]).squeeze(-1).double() / q_sum / p_x[drafted]
    tail = torch.where(target_probs < TAIL * p_sum[:, None].to(target_probs.dtype), target_probs, 0.0)
    zeros = torch.zeros(n, dtype=torch.float64)
    return {
        "token": tokens.long(), "log_target": log_target, "log_law": log_target, "tv": zeros, "kl": zeros,
        "tv_baseline": nan, "max_ratio": torch.ones(n, dtype=torch.float64),
        "tail_mass": tail.sum(-1, dtype=torch.float64) / p_sum,
        "expected_accept": expected, "draft_confidence": confidence, "draft_over_target": over,
    }


def shift_distances(law: Tensor, target_probs: Tensor, baseline_law: Tensor | None) -> dict:
    """tv, kl, max_ratio, tail_mass of law [n, V] against target_probs [n, V] (float64 rows; p below), and
    tv_baseline against baseline_law [n, V] (None: NaN), with the definitions of `verispec.probability`
    (docs/design/diagnostics.md, 'Diagnostics'). Rows where p >= 1e-300 everywhere (the usual case: p comes
    from float32 rows) take one ratio `law / p` shared by KL (xlogy(law, law / p), one log instead of two)
    and the overshoot: 0.38x the separate functions' time at Qwen's vocabulary
    (benchmarks/kernels/diagnostics_cost.py), equal to them within float64 rounding (tests). Other rows (a
    zero in p: a truncated target, an underflowed softmax) go through the separate functions, which clamp
    p at 1e-300 and hold the +inf cases. law is a law (finite, >= 0), as position_stats builds it."""
    p, base = target_probs, baseline_law
    n = p.shape[0]
    out = {"tv": (law - p).abs_().sum(-1) / 2,
           "tv_baseline": (law - base).abs_().sum(-1) / 2 if base is not None
           else torch.full((n,), torch.nan, dtype=torch.float64),
           "tail_mass": torch.where(p < TAIL, law, 0.0).sum(-1)}
    dense = p.amin(-1) >= 1e-300  # [n]; the separate functions' clamp, so law / p <= 1e300 stays finite
    out["kl"], out["max_ratio"] = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
    if dense.any():
        law_d, p_d = (law, p) if dense.all() else (law[dense], p[dense])
        ratio = law_d / p_d  # [n_dense, V]; finite, 0 where law is 0
        out["max_ratio"][dense] = ratio.amax(-1)  # law has mass somewhere: the max over law > 0
        out["kl"][dense] = torch.special.xlogy(law_d, ratio).sum(-1).clamp_min(0)  # 0 log 0 = 0
    if not dense.all():
        sparse = ~dense
        out["kl"][sparse] = kl(law[sparse], p[sparse])
        out["max_ratio"][sparse] = max_ratio(law[sparse], p[sparse])
    return out


def position_stats(rule: Rule | None, target_probs: Tensor, draft_probs: Tensor, tokens: Tensor,
                   roles: list[str], laws: Tensor | None = None) -> dict:
    """Shift statistics of emitted positions, computed in one batch.

    target_probs [n, V]: the processed target at each emitted position; draft_probs [n, V]: the draft
    distribution at positions whose role is "accepted" or "recovered" (rows of other roles are
    ignored); tokens [n]; roles: one of ROLES per position; rule None for plain decoding (law p).
    laws [n, V]: the positions' exact laws given by the caller (tree verification, docs/design.md
    'Trees'); the rule is then not consulted, and a tree has no honest baseline and no per-position
    acceptance of a single draft (tv_baseline, expected_accept NaN).
    Returns {field: list}, one entry per position.
    """
    if laws is None and (rule is None or rule.lossless):
        block_level = rule is not None and rule.block_level
        stats = _lossless_stats(target_probs, draft_probs, tokens, roles, block_level)
    else:
        p = renormalised_f64(target_probs)
        n = p.shape[0]
        drafted = torch.tensor([r in ("accepted", "recovered") for r in roles], dtype=torch.bool)
        idx = tokens.long()[:, None]
        nan = torch.full((n,), torch.nan, dtype=torch.float64)
        expected, confidence, over = nan.clone(), nan.clone(), nan.clone()
        law = torch.empty_like(p) if laws is None else renormalised_f64(laws)  # [n, V]
        if drafted.any():
            q = renormalised_f64(draft_probs[drafted])
            pd = p[drafted]
            if laws is None and rule.block_level:  # a block rule has no per-position acceptance probability
                law[drafted] = rule.emitted_law(pd, q)
            elif laws is None:
                law[drafted], expected[drafted] = rule.law_and_expected_acceptance(pd, q)
            confidence[drafted] = q.amax(-1)
            over[drafted] = q.gather(-1, idx[drafted]).squeeze(-1) / pd.gather(-1, idx[drafted]).squeeze(-1)
        if laws is None and not drafted.all():
            law[~drafted] = rule.bonus_law(p[~drafted])
        base = rule.baseline_law(p) if laws is None else None
        stats = {
            "token": tokens.long(),
            "log_target": p.gather(-1, idx).squeeze(-1).log(),
            "log_law": law.gather(-1, idx).squeeze(-1).log(),
            **shift_distances(law, p, base),
            "expected_accept": expected,
            "draft_confidence": confidence,
            "draft_over_target": over,
        }
    out = {k: v.tolist() for k, v in stats.items()}
    out["role"] = list(roles)
    return out
