"""SGLang's threshold acceptance (sglang `tree_speculative_sampling_target_only`, `threshold_single`
/ `threshold_acc`, derived in docs/design/rules.md, section 'The catalogue'): accept iff p(x) >= single or
u <= p(x) / acc; after a rejection resample from p with the rejected token removed.

The residual depends on the rejected token, so the rule supplies its own closed form:
emitted(y) = q(y) a(y) + p(y) * sum_{x != y} q(x) (1 - a(x)) / (1 - p(x)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.probability import at, normalize
from verispec.rules.base import Param, Rule
from verispec.rules.registry import register


@register
@dataclass(frozen=True, kw_only=True)
class SGLang(Rule):
    name = "sglang"
    family = "collaborative"
    source = "SGLang tree_speculative_sampling_target_only (threshold_single, threshold_acc)"
    summary = "accept iff p(x) >= single or u <= p(x)/acc; resample p without x"
    params = (
        Param("single", float, "0 < single <= 1", lambda v: 0 < v <= 1),
        Param("acc", float, "0 < acc <= 1", lambda v: 0 < v <= 1),
    )
    single: float
    acc: float

    def _accept(self, p: Tensor, q: Tensor) -> Tensor:
        return torch.where(p >= self.single, torch.ones_like(p), (p / self.acc).clamp(max=1.0))

    def _accept_at(self, p: Tensor, q: Tensor, x: Tensor) -> Tensor:
        return self._accept(at(p, x), at(q, x))

    def _residual(self, p: Tensor, q: Tensor) -> Tensor:
        raise NotImplementedError("sglang's residual depends on the rejected token; see _residual_after")

    def _residual_after(self, p: Tensor, q: Tensor, rejected: Tensor) -> Tensor:
        without = p.scatter(-1, rejected[..., None], 0.0)  # [B, V]
        return normalize(without, p)

    def _emitted(self, p: Tensor, q: Tensor) -> Tensor:
        accept = self._accept(p, q)
        rest = 1 - p
        reject_w = torch.where(rest > 0, q * (1 - accept) / rest.clamp_min(torch.finfo(p.dtype).tiny), 0.0)
        return q * accept + p * (reject_w.sum(-1, keepdim=True) - reject_w)
