"""Medusa's typical acceptance (Cai et al. 2024, "Medusa", section 2.3.1): accept the draft token
iff p(x) > min(eps, alpha * exp(-H(p))). Default alpha = sqrt(eps), the eta-sampling threshold
(Hewitt et al. 2022, eq. 4); Medusa's own default pair is eps = 0.09, alpha = 0.3."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from verispec.gates import eta_mask
from verispec.probability import at
from verispec.rules.registry import register
from verispec.rules.truncation import RESAMPLE, Param, TruncationRule


@register
@dataclass(frozen=True, kw_only=True)
class Typical(TruncationRule):
    name = "typical"
    source = "Cai et al. 2024 (Medusa, typical acceptance); Hewitt et al. 2022 (eta)"
    summary = "accept iff p(x) > min(eps, alpha*exp(-H(p)))"
    params = (
        Param("eps", float, "0 < eps < 1", lambda v: 0 < v < 1),
        Param("alpha", float, "0 < alpha <= 1 (default sqrt(eps))", lambda v: 0 < v <= 1),
        RESAMPLE,
    )
    eps: float
    alpha: float | None = None

    def __post_init__(self) -> None:
        if self.alpha is None and isinstance(self.eps, (int, float)) and self.eps > 0:
            object.__setattr__(self, "alpha", math.sqrt(self.eps))
        super().__post_init__()

    def gate(self, p: Tensor) -> Tensor:
        return eta_mask(p, self.eps, self.alpha)

    def gate_at(self, p: Tensor, x: Tensor) -> Tensor:
        return eta_mask(p, self.eps, self.alpha, values=at(p, x)[..., None])[..., 0]
