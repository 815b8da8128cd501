"""Sampling settings: temperature, top-k, top-p, min-p and eta applied to logits.

They define the *reference target distribution* the user asked for; honest truncation sampling is
then simply `lossless` verification against the processed target. Processors apply in the order of
Hugging Face's logits warpers (temperature, top-k, top-p, min-p, eta), each to the renormalised
output of the previous one, using the same gates as the truncation verifiers (`verispec.gates`).
Temperature 0 means greedy: the processed distribution is one-hot on the argmax; so does a positive
temperature small enough that the scaled logits overflow (see `process`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.gates import eta_mask, min_p_mask, top_k_mask, top_p_mask
from verispec.probability import normalize, one_hot_argmax


def _whole(value) -> bool:
    """A finite int or integral float (never a bool)."""
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and int(value) == value)


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings; the defaults are plain sampling at temperature 1."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    eta: float | None = None

    def __post_init__(self) -> None:
        checks = [
            ("temperature", self.temperature, self.temperature is not None and math.isfinite(self.temperature)
             and self.temperature >= 0, ">= 0 (0 = greedy)"),
            ("top_k", self.top_k, self.top_k is None or _whole(self.top_k) and self.top_k >= 1,
             "integer >= 1"),
            ("top_p", self.top_p, self.top_p is None or 0 < self.top_p <= 1, "0 < top_p <= 1"),
            ("min_p", self.min_p, self.min_p is None or 0 < self.min_p <= 1, "0 < min_p <= 1"),
            ("eta", self.eta, self.eta is None or 0 < self.eta < 1, "0 < eta < 1"),
        ]
        for key, value, ok, allowed in checks:
            if not ok:
                raise ValueError(f"sampling setting {key}={value!r} is out of range; allowed: {allowed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        return any(v is not None for v in (self.top_k, self.top_p, self.min_p, self.eta))


def truncate(probs: Tensor, config: SamplingConfig) -> Tensor:
    """Apply the truncation settings of `config` to probabilities [..., V] (renormalising each time)."""
    gates = [
        (config.top_k, lambda pr: top_k_mask(pr, int(config.top_k))),
        (config.top_p, lambda pr: top_p_mask(pr, config.top_p)),
        (config.min_p, lambda pr: min_p_mask(pr, config.min_p)),
        (config.eta, lambda pr: eta_mask(pr, config.eta, math.sqrt(config.eta))),
    ]
    for value, gate in gates:
        if value is not None:
            probs = normalize(probs * gate(probs), probs)
    return probs


def process(logits: Tensor, config: SamplingConfig, dtype: torch.dtype = torch.float32) -> Tensor:
    """Logits [..., V] -> the processed target distribution [..., V] in `dtype`.

    Raises ValueError on NaN logits or rows that are all -inf (no token possible).

    A temperature so small that `logits / temperature` overflows (e.g. 1e-39 in float32: the scaled
    row is +-inf and its softmax NaN) is decoded as greedy decoding, row by row: the processed law is
    one-hot on the argmax, the limit of the tempered softmax as the temperature goes to 0 (for a
    unique maximum). The check is on the scaled logits, after the division, in one reduction.
    """
    row_max = logits.amax(-1)  # one pass: NaN propagates, +inf shows, an all -inf row shows
    if not bool(torch.isfinite(row_max).all()):
        if torch.isnan(logits).any():
            raise ValueError("logits contain NaN (the model produced invalid scores)")
        raise ValueError("logits contain +inf or a row that is all -inf")
    logits = logits.to(dtype)
    if config.greedy:
        return one_hot_argmax(logits)
    scaled = logits / config.temperature
    overflow = ~torch.isfinite(scaled.amax(-1))  # [...]: +-inf max after the division (finite before)
    probs = scaled.softmax(-1)
    if bool(overflow.any()):
        probs = torch.where(overflow[..., None], one_hot_argmax(logits), probs)
    return truncate(probs, config) if config.truncates else probs


def process_rows(logits: Tensor, configs: Sequence[SamplingConfig],
                 dtype: torch.dtype = torch.float32) -> Tensor:
    """Logits [N, V] whose row i has its own sampling settings configs[i] -> the processed laws [N, V]:
    `process` on each group of rows that share a setting. Its maths is row by row, so a row's law is
    the one it gets processed alone (a batch of mixed requests decodes as each would alone)."""
    if len(configs) != logits.shape[0]:
        raise ValueError(f"one sampling setting per row: {len(configs)} for {logits.shape[0]} rows")
    first = configs[0] if configs else SamplingConfig()
    if all(c == first for c in configs):
        return process(logits, first, dtype)
    out = torch.empty(logits.shape, dtype=dtype)  # [N, V]
    groups: dict[SamplingConfig, list[int]] = {}
    for i, config in enumerate(configs):
        groups.setdefault(config, []).append(i)
    for config, rows in groups.items():
        index = torch.tensor(rows)
        out[index] = process(logits[index], config, dtype)  # [n_group, V]
    return out
