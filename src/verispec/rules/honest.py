"""The honest truncation baseline of a truncation rule: lossless verification against the truncated
target p_A = norm(p * 1_A), i.e. min-p / eta / top-k / top-p sampling of the target done exactly
(Leviathan et al. 2023 applied to the truncated target). Spec: `honest:<truncation rule spec>`,
e.g. `honest:speccascade:min_p=0.1`. emitted = p_A (and so is the bonus token's law).

A truncation verifier is only worth its speed if it is not worse than this baseline at the same
threshold: the baseline samples the truncated target's shape, the verifier the draft's shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.probability import at
from verispec.rules.base import Rule
from verispec.rules.law import LawRule
from verispec.rules.registry import register
from verispec.rules.truncation import TruncationRule


@register
@dataclass(frozen=True, kw_only=True)
class Honest(LawRule):
    name = "honest"
    family = "baseline"
    lossless_when = "exact vs truncation sampling of p"
    source = "Leviathan et al. 2023 (Alg. 1) against the truncated target p_A"
    summary = "lossless against p_A = norm(p * 1_A) of a truncation rule"
    usage = "a truncation rule spec, e.g. honest:speccascade:min_p=0.1"
    inner: TruncationRule

    def __post_init__(self) -> None:
        if not isinstance(self.inner, TruncationRule):
            raise ValueError(f"rule 'honest' wraps a truncation rule (speccascade, typical, topk, topp, "
                             f"relaxed), got {getattr(self.inner, 'name', self.inner)!r}")

    def _baseline(self, p: Tensor) -> Tensor:
        return self.inner._baseline(p)

    def _law(self, p: Tensor, q: Tensor) -> Tensor:
        return self._baseline(p)

    def _law_at(self, p: Tensor, q: Tensor, x: Tensor) -> Tensor:
        kept = torch.where(self.inner.gate(p), p, 0.0)  # p * 1_A
        total = kept.sum(-1)  # the baseline at the drafted tokens, as `normalize` computes it
        return torch.where(total > 0, at(kept, x) / total.clamp_min(torch.finfo(p.dtype).tiny), at(p, x))

    def _bonus(self, p: Tensor) -> Tensor:
        return self._baseline(p)

    @property
    def spec(self) -> str:
        return f"honest:{self.inner.spec}"


def honest_baseline(rule: Rule) -> Honest | None:
    """The honest truncation sampler a truncation rule must be compared with (the same gate, sampled
    losslessly), or None for every other rule. The one place that pairs the two."""
    return Honest(inner=rule) if isinstance(rule, TruncationRule) else None
