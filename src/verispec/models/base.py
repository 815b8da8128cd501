"""The model protocol the decode loop needs: a session that scores tokens with a KV cache.

A `Session` holds the cache of one generation. `logits_for(tokens, n)` makes the cache hold exactly
the sequence `tokens` and returns the logits at its last `n` positions: it keeps the longest cached
prefix that agrees with `tokens` (so rejected draft tokens are rolled back by cropping, never by
copying), feeds the rest in one forward pass, and always re-feeds at least the last `n` tokens.
Because the session compares what it holds with what it is asked for, a rollback mistake cannot
silently corrupt the context a model conditions on.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

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
    """What decoding needs of a model. Optional: `stop_token_ids`, every id that ends a generation
    (HFModel and TabularModel have it); without it `decode.stop_ids` uses `eos_token_id` alone."""

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

    # backends whose kernels depend on a pass's width (int4 with dense twins, verispec.models.int4) feed a
    # call's context (the positions before the last n) separately, so that plain and speculative decoding
    # split a prompt the same way
    split_context = False

    def _feed_context(self, tokens: Tensor) -> None:  # tokens [B, c]: extend the cache, no logits
        raise NotImplementedError

    def logits_for(self, tokens: Tensor, n: int) -> Tensor:
        if tokens.ndim != 2 or tokens.shape[1] < n or n < 1:
            raise ValueError(
                f"logits_for needs tokens [B, L] with L >= n >= 1, got {tuple(tokens.shape)} and n={n}")
        held = self._cached
        common = min(held.shape[1], tokens.shape[1] - n)
        if common > 0:
            # length of the agreeing prefix: first position where they differ (all rows must agree)
            same = (held[:, :common] == tokens[:, :common]).all(0)  # [common]
            common = int(same.to(torch.int64).cumprod(0).sum())
        if common < held.shape[1]:
            self._crop(common)
        feed = tokens[:, common:]  # [B, L - common]
        if self.split_context and feed.shape[1] > n:  # the positions before the last n in a pass of their own
            self._feed_context(feed[:, :-n])
            feed = feed[:, -n:]  # [B, n]
        logits = self._feed(feed)  # [B, m, V]
        self._cached = tokens.clone()
        return logits[:, -n:]


class BatchSession(Protocol):
    """KV caches for many rows at once, each row with its own length (batched decoding).

    Rows are named by caller-chosen integer ids. `logits_for(rows, tokens, n)` makes the cache of each
    row `rows[i]` hold exactly the sequence `tokens[i]` (a 1-D LongTensor; rows may differ in length),
    in ONE forward pass where the backend supports it, and returns, per row, the logits [n[i], V]
    (float32, CPU) predicting its last n[i] positions; the same prefix-matching contract as `Session`,
    per row. A row seen for the first time gets a fresh cache; `release(row)` frees it (rows leave
    the batch; a released id may be reused for a new row).
    """

    def logits_for(self, rows: Sequence[int], tokens: Sequence[Tensor], n: Sequence[int]) -> list[Tensor]: ...

    def release(self, row: int) -> None: ...


def named_token_ids(tokenizer, names: Sequence[str]) -> list[int]:
    """The ids of vocabulary strings (e.g. Qwen's "<|endoftext|>", a stop token its GGUF leaves out of the
    generation config); ValueError naming any that the vocabulary lacks, or the missing tokenizer."""
    if not names:
        return []
    if tokenizer is None:
        raise ValueError(f"stop tokens {list(names)} need a tokenizer")
    vocab = tokenizer.get_vocab()
    unknown = [t for t in names if t not in vocab]
    if unknown:
        raise ValueError(f"stop tokens {unknown} are not in the vocabulary")
    return [int(vocab[t]) for t in names]


def check_batch_request(rows: Sequence[int], tokens: Sequence[Tensor], n: Sequence[int]) -> None:
    """The checks every `BatchSession.logits_for` makes: clear ValueErrors on bad requests."""
    if len(rows) == 0:
        raise ValueError("logits_for needs at least one row, got an empty rows list")
    if not len(rows) == len(tokens) == len(n):
        raise ValueError(f"rows, tokens and n must have the same length, got "
                         f"{len(rows)}, {len(tokens)}, {len(n)}")
    if len(set(rows)) != len(rows):
        raise ValueError(f"each row may appear once per call, got rows {list(rows)}")
    for row, seq, count in zip(rows, tokens, n):
        if not isinstance(seq, Tensor) or seq.ndim != 1:
            got = getattr(seq, "shape", type(seq))
            raise ValueError(f"row {row}: tokens must be a 1-D LongTensor, got {got}")
        if not 1 <= count <= seq.shape[0]:
            raise ValueError(f"row {row}: need 1 <= n <= len(tokens), got n={count} for {len(seq)} tokens")


class PerRowBatchSession:
    """The generic `BatchSession`: one `Session` per row, fed one after the other.

    Correct for every backend (each row is exactly batch-1 decoding), not fast: backends that can
    run rows in one forward pass provide their own `batch_session()`."""

    def __init__(self, model: LanguageModel):
        self.model = model
        self._sessions: dict[int, Session] = {}

    def logits_for(self, rows: Sequence[int], tokens: Sequence[Tensor], n: Sequence[int]) -> list[Tensor]:
        check_batch_request(rows, tokens, n)
        out = []
        for row, seq, count in zip(rows, tokens, n):
            session = self._sessions.get(row)
            if session is None:
                session = self._sessions[row] = self.model.session()
            out.append(session.logits_for(seq[None], count)[0])  # [count, V]
        return out

    def release(self, row: int) -> None:
        self._sessions.pop(row, None)


def batch_session(model: LanguageModel) -> BatchSession:
    """The model's own batched session if it has one, else the per-row fallback."""
    make = getattr(model, "batch_session", None)
    return make() if callable(make) else PerRowBatchSession(model)
