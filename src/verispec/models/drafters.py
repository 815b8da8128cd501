"""Drafters: what proposes the k draft tokens of a block, with their draft distributions.

- `ModelDrafter`: a small language model sampled from its processed distribution (the classic draft);
- `NGramDrafter`: prompt lookup (Saxena 2023, "Prompt Lookup Decoding"): copy the continuation of the
  most recent earlier occurrence of the last n tokens. Deterministic, so its draft law is one-hot.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verispec.models.base import LanguageModel, Session
from verispec.probability import sample_from
from verispec.sampling import SamplingConfig, process


class ModelDrafter:
    def __init__(self, model: LanguageModel):
        self.model = model
        self.name = model.name
        self.vocab_size = model.vocab_size
        self._session: Session | None = None

    def start(self) -> None:
        self._session = self.model.session()

    def propose(self, context: Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
        """context [1, L] -> draft tokens [1, k] and their draft distributions [1, k, V]."""
        assert self._session is not None, "call start() first"
        seq = context
        tokens, probs = [], []
        for _ in range(k):
            logits = self._session.logits_for(seq, 1)[:, -1]  # [1, V]
            q = process(logits, sampling)  # [1, V]
            tok = sample_from(q, torch.rand(q.shape[0], generator=generator, dtype=torch.float64))  # [1]
            tokens.append(tok)
            probs.append(q)
            seq = torch.cat([seq, tok[:, None]], 1)
        return torch.stack(tokens, 1), torch.stack(probs, 1)


class NGramDrafter:
    """Prompt-lookup drafting from the context, longest match first (n down to 1)."""

    def __init__(self, n: int, vocab_size: int):
        if n < 1:
            raise ValueError(f"ngram drafter needs n >= 1, got {n}")
        self.n = n
        self.vocab_size = vocab_size
        self.name = f"ngram:n={n}"

    def start(self) -> None:
        pass

    def propose(self, context: Tensor, k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
        seq = context[0]
        length = seq.shape[0]
        found = seq.new_zeros(0)
        for size in range(min(self.n, length - 1), 0, -1):
            pattern = seq[length - size :]
            windows = seq[: length - 1].unfold(0, size, 1)  # [length - size, size], excludes the suffix itself
            hits = (windows == pattern).all(1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + size  # the most recent occurrence
                found = seq[start : start + k]
                break
        tokens = found[None]  # [1, k'] with k' <= k
        probs = torch.zeros(1, tokens.shape[1], self.vocab_size)
        probs.scatter_(-1, tokens[..., None], 1.0)  # [1, k', V], one-hot
        return tokens, probs
