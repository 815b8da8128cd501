"""Drafters: what proposes the k draft tokens of a block, with their draft distributions.

- `ModelDrafter`: a small language model sampled from its processed distribution (the classic draft);
- `NGramDrafter`: prompt lookup (Saxena 2023, "Prompt Lookup Decoding"): copy the continuation of the
  most recent earlier occurrence of the last n tokens. Deterministic, so its draft law is one-hot.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from verispec.models.base import BatchSession, LanguageModel, batch_session
from verispec.probability import sample_from
from verispec.sampling import SamplingConfig, process_rows


class ModelDrafter:
    def __init__(self, model: LanguageModel):
        self.model = model
        self.name = model.name
        self.vocab_size = model.vocab_size

    def start_batch(self) -> None:
        self._batch: BatchSession = batch_session(self.model)

    def release(self, row: int) -> None:
        self._batch.release(row)

    def prefill(self, row: int, context: Tensor) -> None:
        """Feed `context` [L] to row `row`'s draft cache (a chunk of a long prompt, `BatchDecoder.step`)."""
        self._batch.logits_for([row], [context], [1])

    def propose_batch(self, rows: list[int], contexts: list[Tensor], ks: list[int],
                      sampling: SamplingConfig | Sequence[SamplingConfig],
                      generators: list[torch.Generator]) -> list[tuple[Tensor, Tensor]]:
        """Per row: context [L_i] -> (draft tokens [k_i], draft distributions [k_i, V]); one batched
        draft pass per draft position over the rows still drafting. Row i draws k_i uniforms from
        generators[i], one per draft position, so its drafts do not depend on the other rows; its draft
        law is processed with its own sampling settings (one setting for all rows, or one per row)."""
        settings = [sampling] * len(rows) if isinstance(sampling, SamplingConfig) else list(sampling)
        seqs = list(contexts)
        tokens: list[list[Tensor]] = [[] for _ in rows]
        probs: list[list[Tensor]] = [[] for _ in rows]
        for step in range(max(ks, default=0)):
            active = [i for i, k in enumerate(ks) if k > step]
            logits = self._batch.logits_for([rows[i] for i in active], [seqs[i] for i in active],
                                            [1] * len(active))
            q = process_rows(torch.cat(logits), [settings[i] for i in active])  # [A, V]
            uniforms = torch.cat([torch.rand(1, generator=generators[i], dtype=torch.float64)
                                  for i in active])  # [A]
            drawn = sample_from(q, uniforms)  # [A]
            for j, i in enumerate(active):
                tokens[i].append(drawn[j])
                probs[i].append(q[j])
                seqs[i] = torch.cat([seqs[i], drawn[j : j + 1]])
        vocab = self.vocab_size
        return [(torch.stack(t) if t else torch.zeros(0, dtype=torch.long),
                 torch.stack(p) if p else torch.zeros(0, vocab)) for t, p in zip(tokens, probs)]


class NGramDrafter:
    """Prompt-lookup drafting from the context, longest match first (n down to 1)."""

    def __init__(self, n: int, vocab_size: int):
        if n < 1:
            raise ValueError(f"ngram drafter needs n >= 1, got {n}")
        self.n = n
        self.vocab_size = vocab_size
        self.name = f"ngram:n={n}"

    def lookup(self, context: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """context [L] -> up to k draft tokens [k'] and their one-hot draft distributions [k', V]."""
        seq = context
        length = seq.shape[0]
        found = seq.new_zeros(0)
        for size in range(min(self.n, length - 1), 0, -1):
            pattern = seq[length - size :]
            # [length - size, size]; excludes the suffix itself
            windows = seq[: length - 1].unfold(0, size, 1)
            hits = (windows == pattern).all(1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + size  # the most recent occurrence
                found = seq[start : start + k]
                break
        probs = torch.zeros(found.shape[0], self.vocab_size)
        probs.scatter_(-1, found[:, None], 1.0)  # [k', V], one-hot
        return found, probs

    def start_batch(self) -> None:
        pass

    def release(self, row: int) -> None:
        pass

    def propose_batch(self, rows: list[int], contexts: list[Tensor], ks: list[int],
                      sampling: SamplingConfig | Sequence[SamplingConfig],
                      generators: list[torch.Generator]) -> list[tuple[Tensor, Tensor]]:
        """Per row: (draft tokens [k_i'], one-hot draft distributions [k_i', V]), k_i' <= k_i (model-free)."""
        return [self.lookup(context, k) if k > 0 else (context[:0], torch.zeros(0, self.vocab_size))
                for context, k in zip(contexts, ks)]
