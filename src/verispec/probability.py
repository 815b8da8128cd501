"""Pure probability helpers: the bottom layer of verispec (it imports nothing else from verispec).

Validation (`check_probs`, `check_pair`), normalisation (`normalize`, `renormalised_f64`),
inverse-CDF sampling (`sample_from`), gathering (`at`), the ratio `min(1, a/q)` (`ratio_accept`),
entropy and distances between distributions (`tv`, `kl`, `js`, `max_ratio`, `tail_mass`).
Everything works over the last dim and is vectorised over leading dims. Conventions for the
distances: they return float64 tensors [...]; 0 log 0 = 0; KL(a || b) is +inf where `a` has mass `b`
lacks (never NaN); `max_ratio` is max a/b over tokens with a > 0 (+inf if b = 0 there).
See docs/design.md, section 'Layering'.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# ---------------------------------------------------------------------------------------------
# normalisation, gathering, sampling


def normalize(weights: Tensor, fallback: Tensor) -> Tensor:
    """`weights / sum(weights)` along the last dim, `fallback` where the sum is zero."""
    total = weights.sum(-1, keepdim=True)
    return torch.where(total > 0, weights / total.clamp_min(torch.finfo(weights.dtype).tiny), fallback)


def one_hot_argmax(probs: Tensor) -> Tensor:
    """One-hot of argmax along the last dim (first index on ties), same dtype as `probs`."""
    out = torch.zeros_like(probs)
    return out.scatter_(-1, probs.argmax(-1, keepdim=True), 1.0)


def ratio_accept(numerator: Tensor, draft_probs: Tensor) -> Tensor:
    """`min(1, numerator / q)`, defined as 1 where q == 0 (such a token is never drafted)."""
    safe = draft_probs.clamp_min(torch.finfo(draft_probs.dtype).tiny)
    return torch.where(draft_probs > 0, (numerator / safe).clamp(max=1.0), torch.ones_like(draft_probs))


def at(probs: Tensor, tokens: Tensor) -> Tensor:
    """probs [..., V] at tokens [...] -> [...]."""
    return probs.gather(-1, tokens[..., None]).squeeze(-1)


def sample_from(probs: Tensor, uniform: Tensor) -> Tensor:
    """Inverse-CDF sample of one token per row: probs [B, V], uniform [B] in [0, 1) -> [B] long.

    Computed in float64; a token with zero probability is never returned. Raises ValueError on a
    row that is not a distribution up to scale (NaN, inf, a negative entry, or all zeros) or on
    mismatched shapes: never a token drawn from garbage. The check costs one reduction (min) plus
    the CDF's last column, which the sampling needs anyway.
    """
    if not isinstance(probs, Tensor) or probs.ndim != 2 or probs.shape[-1] < 1:
        got = getattr(probs, "shape", type(probs))
        raise ValueError(f"sample_from needs probs [B, V] with V >= 1, got {got}")
    if not isinstance(uniform, Tensor) or uniform.shape != probs.shape[:1]:
        got = getattr(uniform, "shape", uniform)
        raise ValueError(f"sample_from needs uniform [B] = [{probs.shape[0]}], got {got}")
    cdf = probs.to(torch.float64).cumsum(-1)  # [B, V]
    total = cdf[:, -1]  # [B]
    if probs.shape[0] and not bool((total > 0).all() & (total < math.inf).all() & (probs.amin() >= 0)):
        raise ValueError("sample_from got a row that is not a distribution (NaN, inf, negative or all-zero "
                         "probabilities); refusing to sample a token from it")
    target = uniform.to(torch.float64)[:, None] * cdf[:, -1:]  # [B, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [B]
    last_positive = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(-1)  # [B]
    return torch.minimum(idx, last_positive)


def entropy(probs: Tensor) -> Tensor:
    """Shannon entropy in nats along the last dim (0 log 0 = 0): [...]."""
    return -torch.special.xlogy(probs, probs).sum(-1)  # xlogy(0, 0) = 0


def renormalised_f64(probs: Tensor) -> Tensor:
    """float64 rows renormalised: float32 softmax rows sum to 1 only within ~1e-6."""
    probs = probs.to(torch.float64)
    return probs / probs.sum(-1, keepdim=True)


# ---------------------------------------------------------------------------------------------
# validation


def _sum_tolerance(dtype: torch.dtype, vocab: int) -> float:
    if dtype == torch.float64:
        return 1e-6
    # A worst-case bound for float32 softmax rows, not a typical error (eps*sqrt(V), used before, was
    # exceeded by a Qwen2.5-Coder bf16 row at V = 151,936: off by 5.09e-5 against 4.65e-5). torch's CPU
    # softmax divides by S, the sum of exp(x - max) accumulated in SIMD lanes (8 float32 lanes with AVX2,
    # 16 with AVX-512), each lane adding about V/8 terms in sequence: S's relative error is at most about
    # (V/8) eps (recursive summation, Higham 2002, eq. 4.4), and every p_i inherits it, so the row sums to
    # 1 within that plus the check's own sum (a cascade sum, about log2(V) eps) and the rounding of exp and
    # of the division (a few eps). At V = 151,936 that is 1.1e-3: still far below the errors this check
    # exists for (unnormalised or truncated rows, logits passed as probabilities).
    return max(1e-6, torch.finfo(dtype).eps * (vocab / 8 + math.log2(vocab) + 4))


def check_probs(name: str, probs: Tensor) -> None:
    """Raise ValueError unless `probs` is a float32/float64 tensor of distributions over the last dim."""
    if not isinstance(probs, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(probs).__name__}")
    if probs.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{name} must be float32 or float64 probabilities, got {probs.dtype}")
    if probs.ndim < 1 or probs.shape[-1] < 1:
        raise ValueError(f"{name} must have a non-empty vocabulary dimension, got shape {tuple(probs.shape)}")
    if probs.numel() == 0:
        return
    # two passes (min, row sums) catch everything: NaN fails `min >= 0`, +inf breaks a row sum
    low = probs.amin()
    sums = probs.sum(-1)
    tol = _sum_tolerance(probs.dtype, probs.shape[-1])
    err = (sums - 1).abs().max()
    if bool(low >= 0) and bool(err <= tol):
        return
    if not torch.isfinite(probs).all():
        raise ValueError(f"{name} contains NaN or inf")
    if bool(low < 0):
        raise ValueError(f"{name} contains negative probabilities (min {low.item():.3g})")
    raise ValueError(f"{name} rows must sum to 1 (worst row is off by {err.item():.3g}, tolerance {tol:.1g})")


def check_pair(target_probs: Tensor, draft_probs: Tensor) -> None:
    check_probs("target_probs", target_probs)
    check_probs("draft_probs", draft_probs)
    if target_probs.shape != draft_probs.shape:
        raise ValueError(
            f"target_probs and draft_probs must have the same shape, got {tuple(target_probs.shape)} "
            f"and {tuple(draft_probs.shape)}"
        )
    if target_probs.dtype != draft_probs.dtype:
        raise ValueError(f"target_probs is {target_probs.dtype} but draft_probs is {draft_probs.dtype}")


# ---------------------------------------------------------------------------------------------
# distances (float64)


def _f64(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    if a.shape != b.shape:
        raise ValueError(f"distributions must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    return a.to(torch.float64), b.to(torch.float64)


def overlap(draft_probs: Tensor, law: Tensor) -> Tensor:
    """sum_x min(q(x), r(x)) [...]: the expected acceptance sum_x q min(1, r/q) of a draft q verified
    losslessly against the law r (1 - TV(q, r) for laws), in their own dtype."""
    return torch.minimum(draft_probs, law).sum(-1)


def tv(a: Tensor, b: Tensor) -> Tensor:
    """Total variation distance: sum |a - b| / 2."""
    a, b = _f64(a, b)
    return (a - b).abs().sum(-1) / 2


def kl(a: Tensor, b: Tensor) -> Tensor:
    """KL(a || b) in nats; +inf where a > 0 and b = 0."""
    a, b = _f64(a, b)
    pos = a > 0
    terms = torch.where(pos, a * (a.clamp_min(1e-300).log() - b.clamp_min(1e-300).log()), 0.0)
    out = terms.sum(-1).clamp_min(0)  # KL >= 0; rounding can leave -1e-17
    return torch.where((pos & (b <= 0)).any(-1), torch.inf, out)


def js(a: Tensor, b: Tensor) -> Tensor:
    """Jensen-Shannon divergence in nats (0 .. ln 2): H(m) - (H(a) + H(b)) / 2 with m = (a + b) / 2,
    computed with xlogy (0 log 0 = 0; never infinite)."""
    a, b = _f64(a, b)
    xlogy = torch.special.xlogy
    m = (a + b) / 2
    out = (xlogy(a, a).sum(-1) + xlogy(b, b).sum(-1)) / 2 - xlogy(m, m).sum(-1)
    return out.clamp_min(0)


def max_ratio(emitted: Tensor, target: Tensor) -> Tensor:
    """Overshoot: max emitted / target over tokens with emitted > 0 (+inf where target is 0 there)."""
    e, t = _f64(emitted, target)
    ratio = torch.where(e > 0, e / t.clamp_min(1e-300), 0.0)
    ratio = torch.where((e > 0) & (t <= 0), torch.inf, ratio)
    return ratio.amax(-1)


def tail_mass(emitted: Tensor, target: Tensor, threshold: float = 1e-3) -> Tensor:
    """Mass `emitted` puts on tokens the target gives less than `threshold`."""
    e, t = _f64(emitted, target)
    return torch.where(t < threshold, e, 0.0).sum(-1)
