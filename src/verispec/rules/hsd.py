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

from verispec.probability import at, normalize, sample_from
from verispec.rules.base import Rule, VerifyResult, assemble_tokens
from verispec.rules.registry import register


def _prefix_weights(p: Tensor, q: Tensor, x: Tensor) -> Tensor:
    """a [B, K+1] in float64: a_k = R_k / max_{i<=k} R_i, R_k the prefix joint ratio (R_0 = 1)."""
    k = x.shape[1]
    ratio = at(p[:, :k], x).double() / at(q, x).double()  # [B, K]
    log_ratio = torch.cumsum(ratio.log(), -1)  # L_1..L_K, -inf after a zero target probability
    log_prefix = torch.cat([torch.zeros_like(log_ratio[:, :1]), log_ratio], -1)  # [B, K+1], L_0 = 0
    return torch.exp(log_prefix - torch.cummax(log_prefix, -1).values)


def _stop_probs(p: Tensor, q: Tensor, a: Tensor) -> Tensor:
    """h [B, K+1] in float64 from the residual masses A_k = sum((a_k p_k - q_k)+)."""
    k = q.shape[1]
    weight = a[:, :k, None].to(p.dtype)  # [B, K, 1]
    mass = torch.addcmul(-q, weight, p[:, :k]).clamp_min_(0).sum(-1).double()  # [B, K], one temporary
    h = torch.where(mass > 0, mass / (mass + 1 - a[:, :k]).clamp_min(1e-300), 0.0).clamp(0, 1)  # [B, K]
    h[:, 0] = 1.0
    return torch.cat([h, a[:, k:]], -1)  # [B, K+1]


def _residual(p_k: Tensor, q_k: Tensor, a_k: Tensor) -> Tensor:
    """norm((a_k p_k - q_k)+) for rows p_k, q_k [..., V], a_k [...]; p_k where the mass is zero."""
    w = torch.addcmul(-q_k, a_k[..., None].to(p_k.dtype), p_k).clamp_min_(0)
    return normalize(w, p_k)


def hsd_levels(p: Tensor, q: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """Stop probabilities h [B, K+1] (h[:, 0] = 1, h[:, K] = full acceptance) and the residual laws
    [B, K, V] of every level, for p [B, K+1, V], q [B, K, V], drafts x [B, K] (computed in the
    input dtype; float64 in, float64 out)."""
    a = _prefix_weights(p, q, x)
    return _stop_probs(p, q, a), _residual(p[:, : x.shape[1]], q, a[:, : x.shape[1]])


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
        a = _prefix_weights(p, q, x)
        h = _stop_probs(p, q, a)
        stops = uniforms[:, :k] < h[:, 1:]  # [B, K]: level k+1 stops the backward scan
        levels = torch.arange(1, k + 1, device=p.device)
        num_accepted = torch.where(stops, levels, 0).amax(-1)  # [B], highest stopping level, else 0
        rows = torch.arange(b, device=p.device)
        bonus = num_accepted == k
        j = num_accepted.clamp(max=k - 1)
        law = torch.where(bonus[:, None], p[:, k], _residual(p[rows, j], q[rows, j], a[rows, j]))  # [B, V]
        tokens = assemble_tokens(x, num_accepted, sample_from(law, uniforms[:, k]))
        return VerifyResult(num_accepted=num_accepted, tokens=tokens, accept_probs=h[:, 1:].to(p.dtype), bonus=bonus)
