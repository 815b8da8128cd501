"""Hierarchical speculative decoding (HSD; Zhou et al. 2026, "Overcoming Joint Intractability with
Lossless Hierarchical Speculative Decoding", Algorithm 2 with capped branch resampling, eqs. 16-20).

Block-level and lossless: the whole drafted block is judged by its joint ratio. With per-token
ratios r_k = p_k(x_k) / q_k(x_k) and the capped prefix weight a_0 = 1, a_{k+1} = min(1, a_k r_k)
(the prefix joint ratio over its running maximum), level k < K has the residual weights
w_k = (a_k p_k - q_k)+ with mass A_k and stop probability h_k = A_k / (A_k + 1 - a_k) (h_0 = 1);
the whole block is accepted with h_K = a_K. A backward scan (one uniform per level) picks the
number of accepted tokens n = max{k : u_k < h_k}; then one token is drawn from norm(w_n), or the
bonus from p_K when n = K.

These formulas coincide term for term with block verification (Sun et al. 2024, "Block
Verification Accelerates Speculative Decoding", Algorithm 2), which is optimal among lossless
single-draft verifiers. The authors' public code accepts the whole block with the *uncapped*
min(1, R_K) instead, which is not lossless (verispec's exact test rejects that variant).

Per-token laws do not describe a block rule; `emitted` is p (it is lossless) and `verify` is the
block algorithm. `accept_probs` in its result holds the level stop probabilities h_1..h_K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.rules.base import Rule, VerifyResult, assemble_tokens, normalize, sample_from
from verispec.rules.registry import register


def hsd_levels(p: Tensor, q: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """Stop probabilities h [B, K+1] (h[:, 0] = 1, h[:, K] = full acceptance) and the residual laws
    [B, K, V] of each level, for p [B, K+1, V], q [B, K, V], drafts x [B, K]; float64."""
    p, q = p.to(torch.float64), q.to(torch.float64)
    b, k = x.shape
    ratio = p[:, :k].gather(-1, x[..., None]).squeeze(-1) / q.gather(-1, x[..., None]).squeeze(-1)  # [B, K]
    log_ratio = torch.cumsum(ratio.log(), -1)  # L_1..L_K, -inf after a zero target probability
    log_prefix = torch.cat([torch.zeros_like(log_ratio[:, :1]), log_ratio], -1)  # [B, K+1], L_0 = 0
    a = torch.exp(log_prefix - torch.cummax(log_prefix, -1).values)  # [B, K+1], a_k = R_k / max_{i<=k} R_i
    w = (a[:, :k, None] * p[:, :k] - q).clamp_min(0)  # [B, K, V]
    mass = w.sum(-1)  # [B, K]
    h = torch.where(mass > 0, mass / (mass + 1 - a[:, :k]).clamp_min(1e-300), 0.0).clamp(0, 1)  # [B, K]
    h[:, 0] = 1.0
    h = torch.cat([h, a[:, k:]], -1)  # [B, K+1]
    residuals = normalize(w, p[:, :k])  # p_k only where level k has no residual mass (never reached)
    return h, residuals


@register
@dataclass(frozen=True, kw_only=True)
class HSD(Rule):
    name = "hsd"
    family = "lossless"
    lossless = True
    block_level = True
    source = "Zhou et al. 2026 (HSD, Alg. 2, eqs. 16-20) = Sun et al. 2024 (block verification)"
    summary = "block-level: accept by capped joint ratio, hierarchical resampling"

    def _emitted(self, p: Tensor, q: Tensor) -> Tensor:
        return p.clone()

    def _verify(self, p: Tensor, q: Tensor, x: Tensor, uniforms: Tensor) -> VerifyResult:
        b, k = x.shape
        h, residuals = hsd_levels(p, q, x)
        stops = uniforms[:, :k] < h[:, 1:]  # [B, K]: level k+1 stops the backward scan
        levels = torch.arange(1, k + 1, device=p.device)
        num_accepted = torch.where(stops, levels, 0).amax(-1)  # [B], highest stopping level, else 0
        rows = torch.arange(b, device=p.device)
        bonus = num_accepted == k
        j = num_accepted.clamp(max=k - 1)
        law = torch.where(bonus[:, None], p[:, k].to(torch.float64), residuals[rows, j])  # [B, V]
        tokens = assemble_tokens(x, num_accepted, sample_from(law, uniforms[:, k]))
        return VerifyResult(num_accepted=num_accepted, tokens=tokens, accept_probs=h[:, 1:].to(p.dtype), bonus=bonus)
