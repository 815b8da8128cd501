"""Collaborative decoding via speculation (CoS; Fu et al. 2025, "Fast Large Language Model
Collaborative Decoding via Speculation", eq. for the weighted-ensemble target): verify losslessly
against the mixture (1 - w) * p + w * q, w being the draft's weight. emitted = the mixture, whose
overshoot over p grows without bound as q/p grows."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from verispec.probability import at, normalize, overlap, ratio_accept
from verispec.rules.base import Param, Rule
from verispec.rules.registry import register


@register
@dataclass(frozen=True, kw_only=True)
class CoS(Rule):
    name = "cos"
    family = "collaborative"
    source = "Fu et al. 2025 (CoS, weighted ensemble verified losslessly)"
    summary = "lossless against (1-w)*p + w*q; overshoot unbounded"
    lossless_when = "only at w = 0"
    params = (Param("w", float, "0 <= w <= 1 (0 = lossless)", lambda v: 0 <= v <= 1),)
    w: float

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        return self.w == 0

    def mixture(self, p: Tensor, q: Tensor) -> Tensor:
        return (1 - self.w) * p + self.w * q

    def _accept(self, p: Tensor, q: Tensor) -> Tensor:
        return ratio_accept(self.mixture(p, q), q)

    def _accept_at(self, p: Tensor, q: Tensor, x: Tensor) -> Tensor:
        return ratio_accept(self.mixture(at(p, x), at(q, x)), at(q, x))

    def _residual(self, p: Tensor, q: Tensor) -> Tensor:
        mix = self.mixture(p, q)
        return normalize((mix - q).clamp_min(0), mix)

    def _emitted(self, p: Tensor, q: Tensor) -> Tensor:
        return self.mixture(p, q)

    def law_and_expected_acceptance(self, target_probs: Tensor, draft_probs: Tensor) -> tuple[Tensor, Tensor]:
        mix = self.mixture(target_probs, draft_probs)  # the law it verifies against
        return mix, overlap(draft_probs, mix)
