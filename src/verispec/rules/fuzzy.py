"""Fuzzy speculative decoding (Holsman et al. 2025, "Fuzzy Speculative Decoding for a Tunable
Accuracy-Runtime Tradeoff", Algorithm 1): where div(p, q) <= threshold keep the draft token
(emitted = q), otherwise verify losslessly (emitted = p). div is the Jensen-Shannon divergence
(natural log) by default; `tv` and `kl` (KL(p || q)) are offered too."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.probability import at, js, kl, normalize, ratio_accept, tv
from verispec.rules.base import Param, Rule
from verispec.rules.registry import register
from verispec.spec import Registry

DIVERGENCES: Registry = Registry("divergence")
for _name, _fn in (("js", js), ("tv", tv), ("kl", kl)):
    DIVERGENCES.add(_name, _fn)


@register
@dataclass(frozen=True, kw_only=True)
class Fuzzy(Rule):
    name = "fuzzy"
    family = "collaborative"
    source = "Holsman et al. 2025 (Fuzzy SD, Alg. 1)"
    summary = "keep the draft where div(p, q) <= threshold, else lossless"
    lossless_when = "only at threshold = 0"
    params = (
        Param("threshold", float, "threshold >= 0 (0 = lossless)", lambda v: v >= 0),
        Param("div", str, "js | tv | kl", lambda v: v in DIVERGENCES),
    )
    threshold: float
    div: str = "js"

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        return self.threshold == 0

    def close(self, p: Tensor, q: Tensor) -> Tensor:
        """Boolean [..., 1]: positions where the draft is close enough to be kept outright."""
        return (DIVERGENCES.get(self.div)(p, q) <= self.threshold)[..., None]

    def _accept(self, p: Tensor, q: Tensor) -> Tensor:
        return torch.where(self.close(p, q), torch.ones_like(q), ratio_accept(p, q))

    def _accept_at(self, p: Tensor, q: Tensor, x: Tensor) -> Tensor:
        qx = at(q, x)
        return torch.where(self.close(p, q)[..., 0], torch.ones_like(qx), ratio_accept(at(p, x), qx))

    def _residual(self, p: Tensor, q: Tensor) -> Tensor:
        return normalize((p - q).clamp_min(0), p)

    def _emitted(self, p: Tensor, q: Tensor) -> Tensor:
        return torch.where(self.close(p, q), q, p)
