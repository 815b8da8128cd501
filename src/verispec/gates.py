"""Truncation gates: the supports A(p) that truncation sampling and truncation verifiers keep.

Every gate returns a boolean mask [..., V], always contains argmax p (so `norm(p * 1_A)` is
defined) and never contains a token the target gives probability 0 (a truncated *support*).
Ties are kept together: a token is in or out by its probability alone, never by its index.
Shared by `verispec.sampling` (honest truncation sampling of the target) and the truncation rules
(`verispec.rules.speccascade`, `typical`, `topk`, `topp`, `relaxed`), so both use the same sets.

Gates decided by per-row thresholds also accept `values` [..., n]: the probabilities of a few
tokens of each row to test (the drafted ones) against the row's threshold, which gives exactly the
same decisions as gathering the full mask, without a full [..., V] mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verispec.probability import entropy


def min_p_mask(probs: Tensor, min_p: float, values: Tensor | None = None) -> Tensor:
    """Min-p (Nguyen et al. 2024; SpecCascade's gate): keep p(x) >= min_p * max p."""
    values = probs if values is None else values
    return values >= min_p * probs.amax(-1, keepdim=True)


def eta_mask(probs: Tensor, eps: float, alpha: float, values: Tensor | None = None) -> Tensor:
    """Eta / typical gate (Hewitt et al. 2022; Medusa, Cai et al. 2024, eq. for typical acceptance):
    keep p(x) > min(eps, alpha * exp(-H(p))), plus argmax p."""
    values = probs if values is None else values
    threshold = (alpha * torch.exp(-entropy(probs))[..., None]).clamp(max=eps)  # [..., 1]
    return (values > threshold) | (values >= probs.amax(-1, keepdim=True))


def top_k_mask(probs: Tensor, k: int, values: Tensor | None = None) -> Tensor:
    """Top-k: keep tokens at least as probable as the k-th most probable one (ties kept)."""
    values = probs if values is None else values
    k = min(k, probs.shape[-1])
    kth = probs.topk(k, dim=-1).values[..., -1:]  # [..., 1]
    return (values >= kth) & (values > 0)


def top_p_mask(probs: Tensor, top_p: float) -> Tensor:
    """Top-p / nucleus (Holtzman et al. 2020): keep x when the mass strictly more probable than x
    is below top_p — the smallest high-probability set reaching mass top_p, ties kept together.

    top_p >= 1 keeps every token of positive probability. The cumulative mass is summed in float64: a
    float32 sum over a 150k vocabulary reaches 1.0 before its tail, and `< 1.0` then cut tens of
    thousands of tail tokens (the law then put mass where the processed target has none: infinite KL)."""
    if top_p >= 1:
        return probs > 0
    desc = probs.sort(-1, descending=True).values  # [..., V]
    wide = desc.double()
    mass_before = wide.cumsum(-1) - wide  # exclusive cumulative mass in sorted order, float64
    # number of tokens strictly more probable than each token: searchsorted on the ascending -desc
    n_above = torch.searchsorted((-desc).contiguous(), (-probs).contiguous(), side="left")  # [..., V], <= V-1
    return (mass_before.gather(-1, n_above) < top_p) & (probs > 0)


def relaxed_mask(probs: Tensor, top_n: int, delta: float, values: Tensor | None = None) -> Tensor:
    """TensorRT-LLM relaxed acceptance: in the top-n and p(x) >= max p - delta."""
    values = probs if values is None else values
    return top_k_mask(probs, top_n, values) & (values >= probs.amax(-1, keepdim=True) - delta)
