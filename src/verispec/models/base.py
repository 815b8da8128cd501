"""The model protocol the decode loop needs: a session that scores tokens with a KV cache.

A `Session` holds the cache of one generation. `logits_for(tokens, n)` makes the cache hold exactly
the sequence `tokens` and returns the logits at its last `n` positions: it keeps the longest cached
prefix that agrees with `tokens` (so rejected draft tokens are rolled back by cropping, never by
copying), feeds the rest in one forward pass, and always re-feeds at least the last `n` tokens.
Because the session compares what it holds with what it is asked for, a rollback mistake cannot
silently corrupt the context a model conditions on.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


class Session(Protocol):
    def logits_for(self, tokens: Tensor, n: int) -> Tensor:
        """tokens [B, L] -> logits [B, n, V] (float32) predicting positions L-n+1 .. L."""
        ...

    @property
    def cached(self) -> Tensor:
        """The token ids the cache currently holds, [B, length]."""
        ...


@runtime_checkable
class LanguageModel(Protocol):
    name: str
    vocab_size: int
    eos_token_id: int | None

    def session(self) -> Session: ...


class CachedSession:
    """Generic session logic over a backend that can `_feed` tokens and `_crop` its cache."""

    def __init__(self) -> None:
        self._cached = torch.zeros((1, 0), dtype=torch.long)

    @property
    def cached(self) -> Tensor:
        return self._cached

    def _feed(self, tokens: Tensor) -> Tensor:  # tokens [B, m] -> logits [B, m, V]
        raise NotImplementedError

    def _crop(self, length: int) -> None:
        raise NotImplementedError

    def logits_for(self, tokens: Tensor, n: int) -> Tensor:
        if tokens.ndim != 2 or tokens.shape[1] < n or n < 1:
            raise ValueError(f"logits_for needs tokens [B, L] with L >= n >= 1, got {tuple(tokens.shape)} and n={n}")
        held = self._cached
        common = min(held.shape[1], tokens.shape[1] - n)
        if common > 0:
            # length of the agreeing prefix: first position where they differ (all rows must agree)
            same = (held[:, :common] == tokens[:, :common]).all(0)  # [common]
            common = int(same.to(torch.int64).cumprod(0).sum())
        if common < held.shape[1]:
            self._crop(common)
        logits = self._feed(tokens[:, common:])  # [B, L - common, V]
        self._cached = tokens.clone()
        return logits[:, -n:]
