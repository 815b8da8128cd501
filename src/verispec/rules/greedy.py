"""Greedy verification: keep the draft token iff it is the target's argmax.

Exact for greedy (argmax) decoding of the target, the standard greedy speculative decoding check
(Leviathan et al. 2023, section 2.3 with temperature 0). emitted = one-hot(argmax p), which is also its
baseline; it equals p only when p is one-hot, so `lossless` is False as a statement about sampling p.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from verispec.probability import one_hot_argmax
from verispec.rules.base import Rule
from verispec.rules.registry import register


@register
@dataclass(frozen=True, kw_only=True)
class Greedy(Rule):
    name = "greedy"
    family = "lossless"
    lossless = False
    source = "Leviathan et al. 2023, sec. 2.3 (temperature 0)"
    summary = "accept iff x = argmax p; exact for greedy decoding"
    lossless_when = "exact vs greedy (argmax) decoding"

    def _accept(self, p: Tensor, q: Tensor) -> Tensor:
        return one_hot_argmax(p)

    def _residual(self, p: Tensor, q: Tensor) -> Tensor:
        return one_hot_argmax(p)

    def _emitted(self, p: Tensor, q: Tensor) -> Tensor:
        return one_hot_argmax(p)

    def _bonus(self, p: Tensor) -> Tensor:
        return one_hot_argmax(p)

    def _baseline(self, p: Tensor) -> Tensor:
        return one_hot_argmax(p)
