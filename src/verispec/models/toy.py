"""Toy tabular Markov models with known laws, for exact end-to-end tests of the decode loop.

The next-token logits depend only on the last `order` tokens: `table[c_1, ..., c_order]` is a row of
V logits, where index V stands for "no token" (positions before the start of the sequence). The
exact probability of any continuation is therefore a product of table rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verispec.models.base import CachedSession, PerRowBatchSession


class TabularModel:
    """An order-n Markov language model over V tokens given by a logits table [(V+1)]*n + [V]."""

    def __init__(self, table: Tensor, name: str = "toy", eos_token_id: int | None = None,
                 max_context: int | None = None, stop_token_ids: tuple[int, ...] | None = None):
        order = table.ndim - 1
        v = table.shape[-1]
        if order < 1 or any(s != v + 1 for s in table.shape[:-1]):
            raise ValueError(f"table must have shape [(V+1)]*order + [V], got {tuple(table.shape)}")
        self.table = table.to(torch.float32)
        self.order = order
        self.vocab_size = v
        self.name = name
        self.eos_token_id = eos_token_id
        self._stop_token_ids = None if stop_token_ids is None else frozenset(stop_token_ids)
        self.max_context = max_context  # None: unlimited (a Markov table has no position limit)
        self.calls = 0

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens that end a generation: those given, else eos_token_id alone."""
        if self._stop_token_ids is not None:
            return self._stop_token_ids
        return frozenset() if self.eos_token_id is None else frozenset({self.eos_token_id})

    @classmethod
    def random(cls, vocab_size: int, order: int = 1, seed: int = 0, sharpness: float = 1.5,
               **kw) -> TabularModel:
        gen = torch.Generator().manual_seed(seed)
        shape = [vocab_size + 1] * order + [vocab_size]
        return cls(torch.randn(shape, generator=gen, dtype=torch.float64) * sharpness, **kw)

    def context_logits(self, context: Tensor) -> Tensor:
        """Logits [B, V] of the next token after context [B, L] (L may be 0)."""
        b = context.shape[0]
        pad = torch.full((b, self.order), self.vocab_size, dtype=torch.long)
        ctx = torch.cat([pad, context.long()], 1)[:, -self.order :]  # [B, order]
        return self.table[tuple(ctx.T)]  # [B, V]

    def session(self) -> TabularSession:
        return TabularSession(self)

    def batch_session(self) -> PerRowBatchSession:
        """Row by row (the toy exists for exact tests, not speed)."""
        return PerRowBatchSession(self)


class TabularSession(CachedSession):
    def __init__(self, model: TabularModel):
        super().__init__()
        self.model = model
        self._context = torch.zeros((1, 0), dtype=torch.long)

    def _crop(self, length: int) -> None:
        self._context = self._context[:, :length]

    def _feed(self, tokens: Tensor) -> Tensor:
        self.model.calls += 1
        seq = torch.cat([self._context, tokens], 1)
        start = self._context.shape[1]
        rows = [self.model.context_logits(seq[:, : start + i + 1]) for i in range(tokens.shape[1])]
        self._context = seq
        return torch.stack(rows, 1)  # [B, m, V]
