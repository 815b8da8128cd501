"""Rules that verify losslessly against a law r(p, q), the target or another (docs/design/rules.md, 'Rule
anatomy'): speculative sampling (Leviathan et al. 2023, Algorithm 1) applied to r, so

    accept = min(1, r/q);   residual = norm((r - q)+) (r where r == q);   emitted = r exactly,

and the expected acceptance is sum_x min(q, r) (Leviathan et al. 2023, Theorem 3.5 with r for p).
Lossless (r = p), CoS (the mixture), the honest truncation baseline (p_A) and the budget rule (its
moved law) differ only in r; each defines `_law` and, to keep the verify path off the full vocabulary,
`_law_at` (r at the drafted tokens only).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from verispec.probability import at, normalize, overlap, ratio_accept
from verispec.rules.base import Rule


@dataclass(frozen=True)
class LawRule(Rule):
    """A rule of the form 'verify losslessly against r = _law(p, q)'."""

    def _law(self, p: Tensor, q: Tensor) -> Tensor:
        """r [..., V]: the law the rule verifies against (p, q [..., V])."""
        raise NotImplementedError

    def _law_at(self, p: Tensor, q: Tensor, x: Tensor) -> Tensor:
        """r at the drafted tokens: p, q [B, K, V], x [B, K] -> [B, K]; rules override it to skip
        building r over the whole vocabulary."""
        return at(self._law(p, q), x)

    def _accept(self, p: Tensor, q: Tensor) -> Tensor:
        return ratio_accept(self._law(p, q), q)

    def _accept_at(self, p: Tensor, q: Tensor, x: Tensor) -> Tensor:
        return ratio_accept(self._law_at(p, q, x), at(q, x))

    def _residual(self, p: Tensor, q: Tensor) -> Tensor:
        law = self._law(p, q)
        return normalize((law - q).clamp_min(0), law)

    def _emitted(self, p: Tensor, q: Tensor) -> Tensor:
        return self._law(p, q)  # a `_law` that returns its input (lossless) must override this with a copy

    def law_and_expected_acceptance(self, target_probs: Tensor, draft_probs: Tensor) -> tuple[Tensor, Tensor]:
        law = self._emitted(target_probs, draft_probs)  # built once: it is both the law and what q meets
        return law, overlap(draft_probs, law)
