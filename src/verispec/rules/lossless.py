"""Lossless speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2).

accept = min(1, p/q); residual = norm((p - q)+) (p where p == q); emitted = p exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from verispec.probability import at
from verispec.rules.law import LawRule
from verispec.rules.registry import register


@register
@dataclass(frozen=True, kw_only=True)
class Lossless(LawRule):
    name = "lossless"
    family = "lossless"
    lossless = True
    source = "Leviathan et al. 2023 (Alg. 1); Chen et al. 2023 (Alg. 2)"
    summary = "accept min(1, p/q); resample norm((p-q)+)"

    def _law(self, p: Tensor, q: Tensor) -> Tensor:
        return p

    def _law_at(self, p: Tensor, q: Tensor, x: Tensor) -> Tensor:
        return at(p, x)

    def _emitted(self, p: Tensor, q: Tensor) -> Tensor:
        return p.clone()  # the emitted law is the caller's to keep: never the input itself
