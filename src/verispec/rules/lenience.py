"""Lenient speculative sampling (Leviathan et al. 2023, section 3.5 / appendix A.5, "lenience"):
accept min(1, p / (l * q)), residual norm((p - q)+).

Closed form (derived in docs/design/rules.md, section 'The catalogue'): emitted = D*p + (1-D)*q where
q <= p; q where p < q < p/l; p/l where q >= p/l; with D = sum((q - p/l)+) / TV(p, q). Overshoot
is capped: emitted / p <= 1/l.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.probability import at, normalize, ratio_accept
from verispec.rules.base import Param, Rule
from verispec.rules.registry import register


@register
@dataclass(frozen=True, kw_only=True)
class Lenience(Rule):
    name = "lenience"
    family = "collaborative"
    source = "Leviathan et al. 2023, sec. 3.5 (lenience)"
    summary = "accept min(1, p/(l*q)); overshoot capped at p/l"
    lossless_when = "only at l = 1"
    params = (Param("l", float, "0 < l <= 1 (1 = lossless)", lambda v: 0 < v <= 1),)
    l: float  # noqa: E741 (the rule's public parameter name, as in `lenience:l=0.5`)

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        return self.l == 1

    def _accept(self, p: Tensor, q: Tensor) -> Tensor:
        return ratio_accept(p / self.l, q)

    def _accept_at(self, p: Tensor, q: Tensor, x: Tensor) -> Tensor:
        return ratio_accept(at(p, x) / self.l, at(q, x))

    def _emitted(self, p: Tensor, q: Tensor) -> Tensor:
        return self.law_and_expected_acceptance(p, q)[0]

    def law_and_expected_acceptance(self, target_probs: Tensor, draft_probs: Tensor) -> tuple[Tensor, Tensor]:
        p, q = target_probs, draft_probs
        kept = p / self.l
        torch.minimum(kept, q, out=kept)  # q * accept = min(q, p/l), in place
        accepted = kept.sum(-1, keepdim=True)  # [..., 1]: the expected acceptance, sum_x min(q, p/l)
        rejected = (1 - accepted).clamp_min_(0)  # [..., 1]
        deficit = (p - q).clamp_min_(0)  # (p - q)+, normalised below (p itself where p == q)
        mass = deficit.sum(-1, keepdim=True)
        residual = deficit.div_(mass.clamp_min(torch.finfo(p.dtype).tiny))
        if not bool((mass > 0).all()):
            residual = torch.where(mass > 0, residual, p)
        return kept.add_(residual.mul_(rejected)), accepted[..., 0]

    def _residual(self, p: Tensor, q: Tensor) -> Tensor:
        return normalize((p - q).clamp_min(0), p)
