"""Top-p (nucleus) gate (Holtzman et al. 2020, eq. 2, used as a lossy verifier): accept iff x is in
the smallest set of most probable target tokens with mass >= p (ties kept together)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from verispec.gates import top_p_mask
from verispec.rules.registry import register
from verispec.rules.truncation import RESAMPLE, Param, TruncationRule


@register
@dataclass(frozen=True, kw_only=True)
class TopP(TruncationRule):
    name = "topp"
    source = "nucleus gate (Holtzman et al. 2020, eq. 2, as verifier)"
    summary = "accept iff x in the top-p nucleus of p"
    params = (Param("p", float, "0 < p <= 1", lambda v: 0 < v <= 1), RESAMPLE)
    p: float

    def gate(self, probs: Tensor) -> Tensor:
        return top_p_mask(probs, self.p)
