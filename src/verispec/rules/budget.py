"""The TV-budget rule (verispec's own; docs/design/rules.md, section 'The budget rule and its optimality'):
the rule with the largest acceptance among all rules whose emitted law r satisfies TV(r, p) <= tv
and r <= ratio * p.

From r = p move mass m = min(tv, sum((min(q, ratio*p) - p)+), TV(p, q)) from tokens where p > q
(proportionally to (p - q)+) to tokens where q > p (proportionally to (min(q, ratio*p) - p)+),
then verify losslessly against r. Acceptance = 1 - TV(p, q) + m. Certificate: each token's law is
within TV `tv` of the target's whatever the prefix, so an n-token response is within TV n*tv.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.rules.base import Param
from verispec.rules.law import LawRule
from verispec.rules.registry import register


def _rooms(p: Tensor, q: Tensor, ratio: float) -> tuple[Tensor, Tensor]:
    """(give_room, take_room) [..., V]: how much each token may receive (up to min(q, ratio*p)) and
    give (its (p - q)+, which sums to TV(p, q)); tokens with p = 0 stay impossible."""
    cap = torch.where(p > 0, ratio * p, 0.0)
    return (q.minimum(cap) - p).clamp_min(0), (p - q).clamp_min(0)


def _shares(give_room: Tensor, take_room: Tensor, tv_budget: float) -> tuple[Tensor, Tensor, Tensor]:
    """The moved mass m [..., 1] and the per-row normalisers of the give and take rooms."""
    give_total = give_room.sum(-1, keepdim=True)
    take_total = take_room.sum(-1, keepdim=True)
    moved = give_total.minimum(take_total).clamp(max=tv_budget)  # [..., 1]
    return moved, give_total, take_total


def _scale(moved: Tensor, total: Tensor) -> Tensor:
    """moved / total [..., 1], 0 where the total is 0: the factor that spreads the moved mass over a
    room in proportion to it (one division per row, not per token)."""
    return torch.where(total > 0, moved / total.clamp_min(torch.finfo(total.dtype).tiny), 0.0)


def budget_target(p: Tensor, q: Tensor, tv_budget: float, ratio: float) -> Tensor:
    """The law r the budget rule verifies against: [..., V]."""
    give_room, take_room = _rooms(p, q, ratio)
    moved, give_total, take_total = _shares(give_room, take_room, tv_budget)
    give_room.mul_(_scale(moved, give_total))  # [..., V]: what each token receives (the rooms are ours)
    return give_room.sub_(take_room.mul_(_scale(moved, take_total))).add_(p)


@register
@dataclass(frozen=True, kw_only=True)
class Budget(LawRule):
    name = "budget"
    family = "bounded"
    source = "verispec (docs/design.md, budget): max acceptance s.t. TV(r,p) <= tv, r <= ratio*p"
    summary = "largest acceptance with TV <= tv per token and overshoot <= ratio"
    lossless_when = "only at tv = 0"
    params = (
        Param("tv", float, "0 <= tv <= 1 (0 = lossless)", lambda v: 0 <= v <= 1),
        Param("ratio", float, "ratio >= 1 (may be inf)", lambda v: v >= 1 and not math.isnan(v)),
    )
    tv: float
    ratio: float = 2.0

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        return self.tv == 0 or self.ratio == 1

    def _law(self, p: Tensor, q: Tensor) -> Tensor:
        return budget_target(p, q, self.tv, self.ratio)

    def _law_at(self, p: Tensor, q: Tensor, x: Tensor) -> Tensor:
        give_room, take_room = _rooms(p, q, self.ratio)
        moved, give_total, take_total = _shares(give_room, take_room, self.tv)
        pick = lambda t: t.gather(-1, x[..., None])  # noqa: E731  [..., 1]: the drafted tokens only
        r_x = (pick(p) - _scale(moved, take_total) * pick(take_room)
               + _scale(moved, give_total) * pick(give_room))
        return r_x[..., 0]
