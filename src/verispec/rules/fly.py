"""FLy: entropy-gated deferred verification (Li et al. 2025, "Training-Free Loosely Speculative
Decoding", arXiv 2511.22972; vLLM `rejection_sample_method="fly"`, docs features/speculative_decoding/fly).

Block-level and lossy (docs/design/rules.md, section 'fly'). Each draft x_i is first judged natively,
N_i = [u_i < a_i] with a_i = min(1, p_i(x_i) / q_i(x_i)) (Leviathan et al. 2023, Algorithm 1). A native
rejection at position i is *deferred* (the draft is kept anyway) when

    i + W < k                                   (W more drafts follow it in this block),
    H_m(p_i) >= tau                             (the target is uncertain there),
    p_i(x_i) > 0,
    N_{i+1}, ..., N_{i+W} all hold              (the next W drafts pass native verification),

with H_m(p) = -sum over the m largest entries of p of p log p (nats; vLLM's `compute_fly_entropy`
on the processed target probabilities, m = 3 by default). Draft i is kept iff N_i or it is deferred;
the first draft not kept is replaced by a sample of norm((p_i - q_i)+), and a block whose k drafts are
all kept adds a bonus token from p_k, exactly as lossless speculative sampling does. With every
position ineligible (tau above log m, or k <= W) the rule is lossless.

Deferral at i looks at drafts after i, which were drafted given x_i: the law of the emitted token at a
position depends on drafts the block did not take, so FLy has no per-position law. Its exact law is a
block law (`block_law`): given the drafts x, the N_i are independent, and a forward recursion over the
number of positions already known to be natively accepted gives P(n = m | x) in O(k W).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.probability import at, normalize, sample_from
from verispec.rules.base import (BlockLaw, Param, Rule, VerifyResult, assemble_tokens, blank_padding,
                                 draft_counts)
from verispec.rules.registry import register


def top_entropy(probs: Tensor, top_k: int) -> Tensor:
    """H_m(p) [...] = -sum of p log p over the m = min(top_k, V) largest entries of probs [..., V]
    (nats; 0 log 0 = 0): vLLM FLy's entropy gate on processed target probabilities."""
    top = probs.topk(min(top_k, probs.shape[-1]), dim=-1).values
    return -torch.special.xlogy(top, top).sum(-1)


def fly_parts(p: Tensor, q: Tensor, x: Tensor, window: int, threshold: float,
              top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Native acceptance a [B, K], eligibility e [B, K] (bool) and drafts per row k_i [B], for p [B, K+1, V]
    (rows after k_i blanked), q [B, K, V], x [B, K] (-1 after k_i). Padded positions get a = 0, e = False."""
    k = x.shape[1]
    real = x >= 0  # [B, K]
    xs = x.clamp_min(0)
    p_x = at(p[:, :k], xs)  # [B, K]
    a = torch.where(real, (p_x / at(q, xs)).clamp(max=1.0), 0.0)  # q(x) > 0 at real drafts (check_block)
    num_drafts = draft_counts(x)
    positions = torch.arange(k, device=x.device)
    e = real & (positions + window < num_drafts[:, None]) & (p_x > 0)
    e &= top_entropy(p[:, :k], top_k) >= threshold
    return a, e, num_drafts


def fly_num_accepted_probs(a: Tensor, e: Tensor, num_drafts: Tensor, window: int) -> Tensor:
    """P(n = m | x) [B, K+1] in float64, for native acceptances a [B, K], eligibility e [B, K].

    Forward recursion on c, the number of upcoming positions already known to pass natively (a deferral
    at i fixes N_{i+1..i+W}, paid for when it is made): from c > 0 the draft is kept and c falls by one;
    from c = 0 it is kept natively (a_i, c stays 0), deferred ((1 - a_i) e_i prod_{j=i+1}^{i+W} a_j,
    c = W), or the block stops at i. docs/design/rules.md, section 'fly'."""
    b, k = a.shape
    a = a.double()
    out = torch.zeros(b, k + 1, dtype=torch.float64, device=a.device)
    state = torch.zeros(b, window + 1, dtype=torch.float64, device=a.device)  # [B, W+1]: P(at i, c)
    state[:, 0] = 1.0
    padded = torch.cat([a, a.new_zeros(b, window)], -1)  # [B, K+W]: a_j = 0 past the block
    for i in range(k):
        live = i < num_drafts  # [B]: rows still inside their block
        window_pass = padded[:, i + 1: i + 1 + window].prod(-1)  # [B]
        defer = (1 - a[:, i]) * e[:, i].double() * window_pass
        stop = state[:, 0] * (1 - a[:, i] - defer)
        nxt = torch.zeros_like(state)
        nxt[:, 0] = state[:, 0] * a[:, i] + state[:, 1]  # kept natively, or one known pass used up
        nxt[:, 1:window] = state[:, 2:]
        nxt[:, window] += state[:, 0] * defer
        out[:, i] = torch.where(live, stop.clamp_min(0), 0.0)
        state = torch.where(live[:, None], nxt, state)
    out[torch.arange(b, device=a.device), num_drafts] += state.sum(-1)  # every draft kept
    return out


@register
@dataclass(frozen=True, kw_only=True)
class FLy(Rule):
    name = "fly"
    family = "collaborative"
    block_level = True
    source = "Li et al. 2025 (FLy, arXiv 2511.22972); vLLM rejection_sample_method=fly"
    summary = "block-level: defer a native rejection where H_m(p) >= threshold if the next W drafts pass"
    lossless_when = "never defers (threshold > log top_k)"
    params = (
        Param("window", int, "integer window >= 1", lambda v: v >= 1),
        Param("threshold", float, "threshold >= 0, nats", lambda v: v >= 0),
        Param("top_k", int, "integer top_k >= 1", lambda v: v >= 1),
    )
    window: int = 6
    threshold: float = 0.3
    top_k: int = 3

    def _emitted(self, p: Tensor, q: Tensor) -> Tensor:
        raise NotImplementedError(
            "rule 'fly' has no per-position law: whether a draft is kept depends on the drafts after it "
            "(docs/design/rules.md, section 'fly'); its exact law is `block_law`")

    def _parts(self, p: Tensor, q: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return fly_parts(p, q, x, self.window, self.threshold, self.top_k)

    def _block_law(self, p: Tensor, q: Tensor, x: Tensor) -> BlockLaw:
        num_drafts = draft_counts(x)
        p, q = blank_padding(p, q, x, num_drafts)
        a, e, num_drafts = self._parts(p, q, x)
        probs = fly_num_accepted_probs(a, e, num_drafts, self.window)
        k = x.shape[1]
        residual = normalize((p[:, :k] - q).clamp_min(0), p[:, :k])  # [B, K, V]
        last = torch.cat([residual, p[:, k:]], 1)  # [B, K+1, V]
        rows = torch.arange(len(x), device=x.device)
        last[rows, num_drafts] = p[rows, num_drafts]  # the bonus after row i's k_i drafts
        return BlockLaw(num_accepted_probs=probs, last_laws=last, num_drafts=num_drafts)

    def _verify(self, p: Tensor, q: Tensor, x: Tensor, uniforms: Tensor) -> VerifyResult:
        b, k = x.shape
        if k == 0:
            return self._verify_bonus_only(p, uniforms)
        num_drafts = draft_counts(x)  # [B]
        p, q = blank_padding(p, q, x, num_drafts)
        a, e, num_drafts = self._parts(p, q, x)
        native = uniforms[:, :k] < a.double()  # [B, K]; never at a padded position (a = 0)
        run = torch.zeros(b, k + 1, dtype=torch.int64, device=x.device)  # natives in a row from position i
        for i in range(k - 1, -1, -1):
            run[:, i] = torch.where(native[:, i], run[:, i + 1] + 1, 0)
        kept = native | (e & (run[:, 1:] >= self.window))  # [B, K]
        num_accepted = kept.to(torch.int64).cumprod(-1).sum(-1)  # [B]
        window_pass = torch.cat([a, a.new_zeros(b, self.window)], -1).unfold(1, self.window, 1)[:, 1:k + 1]
        accept_probs = a + (1 - a) * e.to(a.dtype) * window_pass.prod(-1)  # [B, K]: P(kept | x)
        rows = torch.arange(b, device=p.device)
        j = num_accepted.clamp(max=k - 1)
        residual = normalize((p[rows, j] - q[rows, j]).clamp_min(0), p[rows, j])  # [B, V]
        bonus = num_accepted == num_drafts
        law = torch.where(bonus[:, None], p[rows, num_drafts], residual)
        tokens = assemble_tokens(x.clamp_min(0), num_accepted, sample_from(law, uniforms[rows, num_drafts]))
        return VerifyResult(num_accepted=num_accepted, tokens=tokens, accept_probs=accept_probs,
                            bonus=bonus, num_drafts=num_drafts)
