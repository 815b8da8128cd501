"""SpecCascade's min-p gate (Narasimhan et al. 2025, "Faster Cascades via Speculative Decoding",
token-specific deferral rule in min-p form): A = {x : p(x) >= min_p * max p}."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from verispec.gates import min_p_mask
from verispec.probability import at
from verispec.rules.registry import register
from verispec.rules.truncation import RESAMPLE, Param, TruncationRule


@register
@dataclass(frozen=True, kw_only=True)
class SpecCascade(TruncationRule):
    name = "speccascade"
    source = "Narasimhan et al. 2025 (SpecCascade, min-p deferral)"
    summary = "accept iff p(x) >= min_p * max p"
    params = (Param("min_p", float, "0 < min_p <= 1", lambda v: 0 < v <= 1), RESAMPLE)
    min_p: float

    def gate(self, p: Tensor) -> Tensor:
        return min_p_mask(p, self.min_p)

    def gate_at(self, p: Tensor, x: Tensor) -> Tensor:
        return min_p_mask(p, self.min_p, values=at(p, x)[..., None])[..., 0]
