"""Top-k gate (as in top-k sampling, Fan et al. 2018, used as a lossy verifier): accept iff x is
among the k most probable target tokens (ties with the k-th kept)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from verispec.gates import top_k_mask
from verispec.probability import at
from verispec.rules.registry import register
from verispec.rules.truncation import RESAMPLE, Param, TruncationRule


@register
@dataclass(frozen=True, kw_only=True)
class TopK(TruncationRule):
    name = "topk"
    source = "top-k gate (Fan et al. 2018 truncation as verifier)"
    summary = "accept iff x in top-k of p"
    params = (Param("k", int, "integer k >= 1", lambda v: v >= 1), RESAMPLE)
    k: int

    def gate(self, p: Tensor) -> Tensor:
        return top_k_mask(p, self.k)

    def gate_at(self, p: Tensor, x: Tensor) -> Tensor:
        return top_k_mask(p, self.k, values=at(p, x)[..., None])[..., 0]
