"""TensorRT-LLM's relaxed acceptance (DeepSeek-R1 MTP speculative decoding, `relaxed_topk` /
`relaxed_delta` in tensorrt_llm's MTP sampler): accept iff x is in the target's top-n and
p(x) >= max p - delta."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from verispec.gates import relaxed_mask
from verispec.probability import at
from verispec.rules.registry import register
from verispec.rules.truncation import RESAMPLE, Param, TruncationRule


@register
@dataclass(frozen=True, kw_only=True)
class Relaxed(TruncationRule):
    name = "relaxed"
    source = "TensorRT-LLM relaxed acceptance (MTP sampler: relaxed_topk, relaxed_delta)"
    summary = "accept iff x in top-n of p and p(x) >= max p - delta"
    params = (
        Param("n", int, "integer n >= 1", lambda v: v >= 1),
        Param("delta", float, "0 <= delta <= 1", lambda v: 0 <= v <= 1),
        RESAMPLE,
    )
    n: int
    delta: float

    def gate(self, p: Tensor) -> Tensor:
        return relaxed_mask(p, self.n, self.delta)

    def gate_at(self, p: Tensor, x: Tensor) -> Tensor:
        return relaxed_mask(p, self.n, self.delta, values=at(p, x)[..., None])[..., 0]
