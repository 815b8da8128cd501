"""Distances between distributions over the last dim, vectorised over leading dims.

All return float64 tensors of shape [...]. Conventions: 0 log 0 = 0; KL(a || b) is +inf where `a`
has mass `b` lacks (never NaN); `max_ratio` is max a/b over tokens with a > 0 (+inf if b = 0 there).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _f64(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    if a.shape != b.shape:
        raise ValueError(f"distributions must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    return a.to(torch.float64), b.to(torch.float64)


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
