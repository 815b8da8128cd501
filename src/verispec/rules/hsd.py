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

Ragged rows (drafts padded with -1 after k_i real ones): row i's block is its k_i drafts. Padded
positions get ratio 1 (so a_j = a_{k_i} beyond k_i), levels above k_i get h = 0 (never stop) and
level k_i is the full acceptance h = a_{k_i}; a row with k_i = 0 stops at level 0 and draws its bonus
from p_0. This equals verifying the row alone (B=1, K=k_i) with the same uniforms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.probability import at, normalize, sample_from
from verispec.rules.base import BlockLaw, Rule, VerifyResult, assemble_tokens, blank_padding, draft_counts
from verispec.rules.registry import register


def _prefix_weights(p: Tensor, q: Tensor, x: Tensor) -> Tensor:
    """a [B, K+1] in float64: a_k = R_k / max_{i<=k} R_i, R_k the prefix joint ratio (R_0 = 1).

    Padded positions (x = -1) get ratio 1: a stays at a_{k_i} after a row's last real draft."""
    k = x.shape[1]
    real = x >= 0  # [B, K]
    xs = x.clamp_min(0)
    ratio = torch.where(real, at(p[:, :k], xs).double() / at(q, xs).double(), 1.0)  # [B, K]
    log_ratio = torch.cumsum(ratio.log(), -1)  # L_1..L_K, -inf after a zero target probability
    log_prefix = torch.cat([log_ratio.new_zeros(len(log_ratio), 1), log_ratio], -1)  # [B, K+1], L_0 = 0
    return torch.exp(log_prefix - torch.cummax(log_prefix, -1).values)


def _stop_probs(p: Tensor, q: Tensor, a: Tensor, num_drafts: Tensor | None = None) -> Tensor:
    """h [B, K+1] in float64 from the residual masses A_k = sum((a_k p_k - q_k)+).

    num_drafts [B] (ragged rows): level k_i is the full acceptance a_{k_i}, levels above it get h = 0."""
    k = q.shape[1]
    weight = a[:, :k, None].to(p.dtype)  # [B, K, 1]
    mass = torch.addcmul(-q, weight, p[:, :k]).clamp_min_(0).sum(-1).double()  # [B, K], one temporary
    h = torch.where(mass > 0, mass / (mass + 1 - a[:, :k]).clamp_min(1e-300), 0.0).clamp(0, 1)  # [B, K]
    if k:
        h[:, 0] = 1.0
    h = torch.cat([h, a[:, k:]], -1)  # [B, K+1]
    if num_drafts is None:
        return h
    levels = torch.arange(k + 1, device=a.device)  # [K+1]
    top = num_drafts[:, None]  # [B, 1]
    return torch.where(levels < top, h, torch.where(levels == top, a, 0.0))  # [B, K+1]


def _residual(p_k: Tensor, q_k: Tensor, a_k: Tensor) -> Tensor:
    """norm((a_k p_k - q_k)+) for rows p_k, q_k [..., V], a_k [...]; p_k where the mass is zero."""
    w = torch.addcmul(-q_k, a_k[..., None].to(p_k.dtype), p_k).clamp_min_(0)
    return normalize(w, p_k)


def hsd_levels(p: Tensor, q: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """Stop probabilities h [B, K+1] (h[:, 0] = 1, h[:, K] = full acceptance) and the residual laws
    [B, K, V] of every level, for p [B, K+1, V], q [B, K, V], drafts x [B, K] (computed in the
    input dtype; float64 in, float64 out). Ragged rows (x padded with -1): h[i, k_i] is the full
    acceptance, h = 0 above it, and the residual laws at levels >= k_i are meaningless."""
    a = _prefix_weights(p, q, x)
    num_drafts = draft_counts(x)
    return _stop_probs(p, q, a, num_drafts), _residual(p[:, : x.shape[1]], q, a[:, : x.shape[1]])


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

    def _block_law(self, p: Tensor, q: Tensor, x: Tensor) -> BlockLaw:
        """P(n = m) = h_m prod_{l > m} (1 - h_l): the backward scan stops at the highest level whose
        coin falls under h."""
        b, k = x.shape
        num_drafts = draft_counts(x)
        p, q = blank_padding(p, q, x, num_drafts)
        h, residual = hsd_levels(p.double(), q.double(), x)  # [B, K+1], [B, K, V]
        above = torch.cat([(1 - h[:, 1:]).flip(-1).cumprod(-1).flip(-1), h.new_ones(b, 1)], -1)  # [B, K+1]
        last = torch.cat([residual.to(p.dtype), p[:, k:]], 1)  # [B, K+1, V]
        rows = torch.arange(b, device=x.device)
        last[rows, num_drafts] = p[rows, num_drafts]
        return BlockLaw(num_accepted_probs=h * above, last_laws=last, num_drafts=num_drafts)

    def _verify(self, p: Tensor, q: Tensor, x: Tensor, uniforms: Tensor) -> VerifyResult:
        b, k = x.shape
        if k == 0:
            return self._verify_bonus_only(p, uniforms)
        num_drafts = draft_counts(x)  # [B]
        ragged = bool((num_drafts < k).any())
        if ragged:
            p, q = blank_padding(p, q, x, num_drafts)
        a = _prefix_weights(p, q, x)
        h = _stop_probs(p, q, a, num_drafts if ragged else None)
        stops = uniforms[:, :k] < h[:, 1:]  # [B, K]: level k+1 stops the backward scan (never above k_i)
        levels = torch.arange(1, k + 1, device=p.device)
        num_accepted = torch.where(stops, levels, 0).amax(-1)  # [B], highest stopping level, else 0
        rows = torch.arange(b, device=p.device)
        bonus = num_accepted == num_drafts
        j = num_accepted.clamp(max=k - 1)
        if ragged:
            x = x.clamp_min(0)  # padded positions are never accepted nor read below
            bonus_p, u_last = p[rows, num_drafts], uniforms[rows, num_drafts]  # [B, V], [B]
        else:
            bonus_p, u_last = p[:, k], uniforms[:, k]
        law = torch.where(bonus[:, None], bonus_p, _residual(p[rows, j], q[rows, j], a[rows, j]))  # [B, V]
        tokens = assemble_tokens(x, num_accepted, sample_from(law, u_last))
        return VerifyResult(num_accepted=num_accepted, tokens=tokens, accept_probs=h[:, 1:].to(p.dtype),
                            bonus=bonus, num_drafts=num_drafts)
