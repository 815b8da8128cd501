"""Per-position shift of a verification rule on a real run (DESIGN.md section 3).

At every emitted position the token's exact law given its prefix is known: `rule.emitted(p, q)` at a
draft position (accepted or recovered token), the rule's bonus law (p for every rule but greedy) at
the bonus position. From it, in float64: TV and KL to the target, TV to the rule's honest baseline,
overshoot (max law/p, mass on tokens with p below a tail threshold), the token's log-likelihood
ratio log law(x) - log p(x) (summed over a sequence: an unbiased estimate of sequence-level
KL(rule || target) when averaged over samples), and acceptance expected vs realised.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verispec.diagnostics.distances import kl, max_ratio, tail_mass, tv
from verispec.rules.base import Rule

ROLES = ("accepted", "recovered", "bonus", "plain")
TAIL = 1e-3

# one column per field, one row per emitted position
FIELDS = (
    "token", "role", "log_target", "log_law", "tv", "kl", "tv_baseline", "max_ratio", "tail_mass",
    "expected_accept", "draft_confidence", "draft_over_target",
)


def _f64(probs: Tensor) -> Tensor:
    """float64 rows renormalised: float32 softmax rows sum to 1 only within ~1e-6."""
    probs = probs.to(torch.float64)
    return probs / probs.sum(-1, keepdim=True)


def position_stats(rule: Rule, target_probs: Tensor, draft_probs: Tensor, tokens: Tensor, roles: list[str]) -> dict:
    """Shift statistics of emitted positions, computed in one batch.

    target_probs [n, V]: the processed target at each emitted position; draft_probs [n, V]: the draft
    distribution at positions whose role is "accepted" or "recovered" (rows of other roles are
    ignored); tokens [n]; roles: one of ROLES per position. Returns {field: list}, one entry per position.
    """
    p = _f64(target_probs)
    n = p.shape[0]
    drafted = torch.tensor([r in ("accepted", "recovered") for r in roles], dtype=torch.bool)
    idx = tokens.long()[:, None]
    nan = torch.full((n,), torch.nan, dtype=torch.float64)
    expected, confidence, over = nan.clone(), nan.clone(), nan.clone()
    law = p if rule.lossless else torch.empty_like(p)  # [n, V]; a lossless rule's law is p, bonus included
    if drafted.any():
        q = _f64(draft_probs[drafted])
        pd = p[drafted]
        if not rule.lossless:
            law[drafted] = rule._emitted(pd, q)
        if not rule.block_level:  # a block rule has no per-position acceptance probability
            expected[drafted] = (q * rule._accept(pd, q)).sum(-1)
        confidence[drafted] = q.amax(-1)
        over[drafted] = q.gather(-1, idx[drafted]).squeeze(-1) / pd.gather(-1, idx[drafted]).squeeze(-1)
    if not rule.lossless and not drafted.all():
        law[~drafted] = rule._bonus(p[~drafted])
    base = rule._baseline(p)
    log_target = p.gather(-1, idx).squeeze(-1).log()
    zeros = torch.zeros(n, dtype=torch.float64)
    stats = {
        "token": tokens.long(),
        "log_target": log_target,
        "log_law": log_target if rule.lossless else law.gather(-1, idx).squeeze(-1).log(),
        "tv": zeros if rule.lossless else tv(law, p),
        "kl": zeros if rule.lossless else kl(law, p),
        "tv_baseline": tv(law, base) if base is not None else nan,
        "max_ratio": torch.ones(n, dtype=torch.float64) if rule.lossless else max_ratio(law, p),
        "tail_mass": tail_mass(law, p, TAIL),
        "expected_accept": expected,
        "draft_confidence": confidence,
        "draft_over_target": over,
    }
    out = {k: v.tolist() for k, v in stats.items()}
    out["role"] = list(roles)
    return out
