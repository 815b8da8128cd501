"""Collaborative decoding via speculation (CoS; Fu et al. 2025, "Fast Large Language Model
Collaborative Decoding via Speculation", eq. for the weighted-ensemble target): verify losslessly
against the mixture (1 - w) * p + w * q, w being the draft's weight. emitted = the mixture, whose
overshoot over p grows without bound as q/p grows."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from verispec.probability import at
from verispec.rules.base import Param
from verispec.rules.law import LawRule
from verispec.rules.registry import register


@register
@dataclass(frozen=True, kw_only=True)
class CoS(LawRule):
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

    def _law(self, p: Tensor, q: Tensor) -> Tensor:
        return self.mixture(p, q)

    def _law_at(self, p: Tensor, q: Tensor, x: Tensor) -> Tensor:
        return self.mixture(at(p, x), at(q, x))
