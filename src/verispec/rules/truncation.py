"""Truncation-based verification: accept the draft token iff it lies in a gate set A(p).

emitted = q * 1_A + (1 - q(A)) * residual (docs/design/rules.md, section 'The catalogue'). Inside A the
output follows the *draft's* shape, not the target's, which is why these rules must be compared with
the honest truncation baseline `p_A = norm(p * 1_A)` (lossless verification against the truncated
target).

The residual after a rejection differs between published implementations (`resample=`):
`target` (the full target p, as in the reference implementation of the lossy-verification study),
`truncated` (p_A) or `greedy` (argmax p).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.probability import at, normalize, one_hot_argmax
from verispec.rules.base import Param, Rule

RESAMPLE = Param("resample", str, "target | truncated | greedy",
                 lambda v: v in ("target", "truncated", "greedy"))


@dataclass(frozen=True, kw_only=True)
class TruncationRule(Rule):
    family = "truncation"
    resample: str = "target"

    def gate(self, p: Tensor) -> Tensor:
        """The boolean gate set A(p) [..., V]; always contains argmax p."""
        raise NotImplementedError

    def gate_at(self, p: Tensor, x: Tensor) -> Tensor:
        """Whether the tokens x [...] are in A(p), p [..., V] -> bool [...] (same decisions as `gate`)."""
        return at(self.gate(p), x)

    def _accept(self, p: Tensor, q: Tensor) -> Tensor:
        return self.gate(p).to(p.dtype)

    def _accept_at(self, p: Tensor, q: Tensor, x: Tensor) -> Tensor:
        return self.gate_at(p, x).to(p.dtype)

    def _emitted(self, p: Tensor, q: Tensor) -> Tensor:
        return self.law_and_expected_acceptance(p, q)[0]

    def law_and_expected_acceptance(self, target_probs: Tensor, draft_probs: Tensor) -> tuple[Tensor, Tensor]:
        p, q = target_probs, draft_probs
        gate = self.gate(p)
        kept = torch.where(gate, q, 0.0)  # q * 1_A
        accepted = kept.sum(-1, keepdim=True)  # [..., 1]: the expected acceptance q(A)
        rejected = (1 - accepted).clamp_min_(0)
        if self.resample == "truncated":  # the baseline from the same gate, not recomputed
            residual = normalize(torch.where(gate, p, 0.0), p)
        else:
            residual = self._residual(p, q)
        return kept.add_(residual * rejected), accepted[..., 0]

    def _residual(self, p: Tensor, q: Tensor) -> Tensor:
        if self.resample == "target":
            return p
        if self.resample == "truncated":
            return self._baseline(p)
        return one_hot_argmax(p)

    def _baseline(self, p: Tensor) -> Tensor:
        return normalize(p * self.gate(p), p)
