"""Lossless speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2).

accept = min(1, p/q); residual = norm((p - q)+) (p where p == q); emitted = p exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from verispec.probability import at, normalize, ratio_accept
from verispec.rules.base import Rule
from verispec.rules.registry import register


@register
@dataclass(frozen=True, kw_only=True)
class Lossless(Rule):
    name = "lossless"
    family = "lossless"
    lossless = True
    source = "Leviathan et al. 2023 (Alg. 1); Chen et al. 2023 (Alg. 2)"
    summary = "accept min(1, p/q); resample norm((p-q)+)"

    def _accept(self, p: Tensor, q: Tensor) -> Tensor:
        return ratio_accept(p, q)

    def _accept_at(self, p: Tensor, q: Tensor, x: Tensor) -> Tensor:
        return ratio_accept(at(p, x), at(q, x))

    def _residual(self, p: Tensor, q: Tensor) -> Tensor:
        return normalize((p - q).clamp_min(0), p)

    def _emitted(self, p: Tensor, q: Tensor) -> Tensor:
        return p.clone()
