"""The decode loop: speculative decoding with any verification rule, and plain decoding beside it.

One block (Leviathan et al. 2023, Algorithm 1): the drafter proposes k tokens from its processed
distribution, the target scores all k+1 positions in **one** forward pass, the rule decides
(`Rule.verify`), and the committed sequence grows by the accepted tokens plus one recovered or bonus
token. Both model sessions hold KV caches that follow the committed sequence by cropping (see
`verispec.models.base`). Sampling settings are applied identically to target and draft logits.

Every emitted position is recorded with its exact shift statistics (`verispec.diagnostics.shift`):
the rule's law of that token given its prefix is known in closed form, so the per-token
log-likelihood ratio against the target is exact.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from verispec.diagnostics.shift import position_stats
from verispec.models.base import LanguageModel
from verispec.rules import Rule, parse
from verispec.probability import sample_from
from verispec.sampling import SamplingConfig, process


@dataclass(frozen=True)
class DecodeConfig:
    k: int = 4
    max_new_tokens: int = 64
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_at_eos: bool = True
    diagnostics: bool = True
    keep_probs: bool = False  # keep the full V-sized target/draft rows of every emitted position

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k (draft tokens per block) must be an integer >= 1, got {self.k!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")


@dataclass(frozen=True)
class Block:
    proposed: int  # draft tokens proposed
    accepted: int  # of which the rule accepted
    emitted: int  # tokens kept from this block (accepted + recovered/bonus, cut at EOS / max tokens)


@dataclass(frozen=True)
class Generation:
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    blocks: tuple[Block, ...]
    steps: dict[str, list] | None  # per emitted position, see verispec.diagnostics.shift.FIELDS
    target_calls: int
    draft_calls: int
    seconds: float
    finish: str  # "eos" or "length"
    rule: str
    probs: dict[str, list[Tensor]] | None = None
    # where the time went (seconds): target forward passes, drafting (draft passes, processing and
    # sampling of draft tokens), per-position diagnostics; the rest is the loop's own work
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    diagnostics_seconds: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def acceptance_rate(self) -> float:
        proposed = sum(b.proposed for b in self.blocks)
        return sum(b.accepted for b in self.blocks) / proposed if proposed else math.nan

    @property
    def block_efficiency(self) -> float:
        return self.num_tokens / self.target_calls if self.target_calls else math.nan

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else math.nan

    @property
    def log_ratio(self) -> float:
        """Exact log-likelihood ratio of the output under the rule vs the target: sum log law - log p."""
        if not self.steps:
            return 0.0
        return float(sum(a - b if a != b else 0.0 for a, b in zip(self.steps["log_law"], self.steps["log_target"])))

    def stats(self) -> dict[str, float | int | str | None]:
        """The generation's summary: the one place that aggregates a generation (the CLI's --json, the
        Python API's `.stats` and every sweep row use it). Definitions: docs/design.md, section 'Words'."""
        proposed = sum(b.proposed for b in self.blocks)
        out: dict[str, float | int | str | None] = {
            "rule": self.rule,
            "tokens": self.num_tokens,
            "proposed": proposed,
            "accepted": sum(b.accepted for b in self.blocks),
            "acceptance_rate": self.acceptance_rate,
            "block_efficiency": self.block_efficiency,
            "tokens_per_second": self.tokens_per_second,
            "seconds": self.seconds,
            "target_calls": self.target_calls,
            "draft_calls": self.draft_calls,
            "finish": self.finish,
            "target_seconds": self.target_seconds,
            "draft_seconds": self.draft_seconds,
            "diagnostics_seconds": self.diagnostics_seconds,
        }
        if self.steps:
            steps, n = self.steps, len(self.steps["tv"])
            baseline = [x for x in steps["tv_baseline"] if math.isfinite(x)]
            out["log_ratio"] = self.log_ratio
            out["mean_tv"] = sum(steps["tv"]) / n
            out["mean_kl"] = sum(steps["kl"]) / n
            out["mean_tv_baseline"] = sum(baseline) / len(baseline) if baseline else None
            out["max_overshoot"] = max(steps["max_ratio"])
            out["mean_tail_mass"] = sum(steps["tail_mass"]) / n
            out["target_nll"] = -sum(steps["log_target_raw"]) / n  # per token, under the raw target
        return out


def _as_prompt(prompt_ids) -> Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"prompt_ids must be a list of token ids (batch size 1), got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("empty prompt: give at least one token")
    return ids


def _check_tokens(ids: Tensor, vocab_size: int) -> None:
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got [{ids.min().item()}, {ids.max().item()}]")


def max_context(model) -> int | None:
    """The most positions `model` can attend to (prompt + generated tokens), or None if unlimited.

    HF/lean models expose `config.max_position_embeddings` as `max_context`; a drafter wrapping a
    model (`.model`) inherits its model's limit; toy models are unlimited unless given one."""
    limit = getattr(model, "max_context", None)
    if limit is None and getattr(model, "model", None) is not None:
        limit = getattr(model.model, "max_context", None)
    return int(limit) if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def check_context(model, prompt_len: int, max_new_tokens: int, drafter=None) -> None:
    """Refuse (ValueError) a prompt + max_new_tokens longer than the model's (or drafter's) context.

    Beyond `max_position_embeddings` a model still produces logits (RoPE simply extrapolates) but
    they are garbage: the check runs before any forward pass, with the numbers and what to change."""
    for who, obj in (("target", model), ("draft", drafter)):
        limit = max_context(obj) if obj is not None else None
        if limit is not None and prompt_len + max_new_tokens > limit:
            name = getattr(obj, "name", None) or getattr(getattr(obj, "model", None), "name", who)
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
                f"{prompt_len + max_new_tokens} "
                f"exceeds the {who} model '{name}' context of {limit} tokens (max_position_embeddings): "
                f"shorten the prompt or lower max_new_tokens to at most {max(0, limit - prompt_len)}"
            )


def _calls(obj) -> int:
    """Forward passes counted by a model (or by a drafter's model); 0 for model-free drafters."""
    if hasattr(obj, "calls"):
        return int(obj.calls)
    return int(getattr(getattr(obj, "model", None), "calls", 0))


class _Recorder:
    """Collects the rows of emitted positions and computes their statistics in batches.

    Shift statistics are a handful of small tensor ops; batching FLUSH positions at a time keeps
    their per-call overhead out of the decode loop (diagnostics stay on by default)."""

    FLUSH = 64

    def __init__(self, rule: Rule, config: DecodeConfig):
        self.rule, self.config = rule, config
        self.steps: dict[str, list] | None = {} if config.diagnostics else None
        self.probs: dict[str, list[Tensor]] | None = {"target": [], "draft": []} if config.keep_probs else None
        self._rows: list[tuple[Tensor, Tensor, Tensor, list[str], Tensor]] = []
        self._pending = 0
        self.seconds = 0.0  # time spent on diagnostics

    def add(self, logits: Tensor, p: Tensor, q: Tensor, tokens: Tensor, roles: list[str]) -> None:
        """logits, p [n, V] at the kept positions; q [m, V] for the first m (drafted) positions."""
        if self.steps is not None:
            start = time.perf_counter()
            raw = logits.gather(-1, tokens[:, None]).squeeze(-1) - logits.logsumexp(-1)  # raw target log-prob
            q_rows = q if q.shape[0] == p.shape[0] else torch.cat([q, torch.zeros_like(p[q.shape[0]:])])  # [n, V]
            self._rows.append((p, q_rows, tokens, roles, raw))
            self._pending += len(roles)
            self.seconds += time.perf_counter() - start
            if self._pending >= self.FLUSH:
                self.flush()
        if self.probs is not None:
            self.probs["target"].append(p.clone())
            self.probs["draft"].append(q.clone())

    def flush(self) -> None:
        if self.steps is None or not self._rows:
            return
        start = time.perf_counter()
        p, q, tokens, roles, raw = zip(*self._rows)
        stats = position_stats(self.rule, torch.cat(p), torch.cat(q), torch.cat(tokens), [r for rs in roles for r in rs])
        stats["log_target_raw"] = torch.cat(raw).double().tolist()
        for key, values in stats.items():
            self.steps.setdefault(key, []).extend(values)
        self._rows, self._pending = [], 0
        self.seconds += time.perf_counter() - start


def speculative_decode(target: LanguageModel, drafter, prompt_ids, rule: Rule | str, config: DecodeConfig,
                       generator: torch.Generator | None = None) -> Generation:
    """Speculative decoding of one prompt (batch size 1)."""
    rule = parse(rule) if isinstance(rule, str) else rule
    if drafter.vocab_size != target.vocab_size:
        raise ValueError(f"draft vocabulary ({drafter.vocab_size}) differs from the target's ({target.vocab_size})")
    prompt = _as_prompt(prompt_ids)
    _check_tokens(prompt, target.vocab_size)
    check_context(target, prompt.shape[1], config.max_new_tokens, drafter)
    sampling, eos = config.sampling, target.eos_token_id if config.stop_at_eos else None
    session = target.session()
    drafter.start()
    record = _Recorder(rule, config)
    blocks: list[Block] = []
    calls0 = (_calls(target), _calls(drafter))
    seq, new, finish = prompt, 0, "length"
    target_seconds = draft_seconds = 0.0
    start = time.perf_counter()
    while new < config.max_new_tokens:
        remaining = config.max_new_tokens - new
        k = min(config.k, remaining - 1)  # a block emits up to k + 1 tokens
        t0 = time.perf_counter()
        if k > 0:
            drafts, q = drafter.propose(seq, k, sampling, generator)  # [1, k'], [1, k', V] (k' <= k)
        else:
            drafts, q = seq[:, :0], torch.zeros(1, 0, target.vocab_size)
        kk = drafts.shape[1]
        t1 = time.perf_counter()
        logits = session.logits_for(torch.cat([seq, drafts], 1), kk + 1)[0]  # [kk+1, V], one target pass
        t2 = time.perf_counter()
        draft_seconds += t1 - t0
        target_seconds += t2 - t1
        p = process(logits, sampling)  # [kk+1, V]
        if kk:
            uniforms = torch.rand((1, kk + 1), generator=generator, dtype=torch.float64)
            # p and q come from `process` (validated logits, exact distributions): skip re-validation
            result = rule.verify_with_uniforms(p[None], q.to(p.dtype), drafts, uniforms, validate=False)
            n = int(result.num_accepted[0])
            out = result.tokens[0, : n + 1]
        else:
            n = 0
            out = sample_from(rule.bonus_law(p[:1]), torch.rand(1, generator=generator, dtype=torch.float64))
        roles = ["accepted"] * n + ["bonus" if n == kk else "recovered"]
        keep = min(len(out), remaining)
        if eos is not None and (out[:keep] == eos).any():
            keep = int((out[:keep] == eos).nonzero()[0]) + 1
            finish = "eos"
        record.add(logits[:keep], p[:keep], q[0, : min(kk, keep)], out[:keep], roles[:keep])
        blocks.append(Block(proposed=kk, accepted=n, emitted=keep))
        seq = torch.cat([seq, out[None, :keep]], 1)
        new += keep
        if finish == "eos":
            break
    record.flush()
    seconds = time.perf_counter() - start
    return Generation(
        prompt_ids=tuple(prompt[0].tolist()), token_ids=tuple(seq[0, prompt.shape[1]:].tolist()),
        blocks=tuple(blocks), steps=record.steps, target_calls=_calls(target) - calls0[0],
        draft_calls=_calls(drafter) - calls0[1], seconds=seconds, finish=finish, rule=rule.spec, probs=record.probs,
        target_seconds=target_seconds, draft_seconds=draft_seconds, diagnostics_seconds=record.seconds,
    )


def autoregressive_decode(target: LanguageModel, prompt_ids, config: DecodeConfig,
                          generator: torch.Generator | None = None) -> Generation:
    """Plain decoding of the target with the same sampling settings: the baseline."""
    prompt = _as_prompt(prompt_ids)
    _check_tokens(prompt, target.vocab_size)
    check_context(target, prompt.shape[1], config.max_new_tokens)
    rule = parse("lossless")
    eos = target.eos_token_id if config.stop_at_eos else None
    session = target.session()
    record = _Recorder(rule, config)
    calls0 = _calls(target)
    seq, finish = prompt, "length"
    empty_q = torch.zeros(0, target.vocab_size)
    target_seconds = 0.0
    start = time.perf_counter()
    for _ in range(config.max_new_tokens):
        t0 = time.perf_counter()
        logits = session.logits_for(seq, 1)[0]  # [1, V]
        target_seconds += time.perf_counter() - t0
        p = process(logits, config.sampling)  # [1, V]
        tok = sample_from(p, torch.rand(1, generator=generator, dtype=torch.float64))  # [1]
        record.add(logits, p, empty_q.to(p.dtype), tok, ["plain"])
        seq = torch.cat([seq, tok[None]], 1)
        if eos is not None and int(tok) == eos:
            finish = "eos"
            break
    record.flush()
    seconds = time.perf_counter() - start
    n = seq.shape[1] - prompt.shape[1]
    return Generation(
        prompt_ids=tuple(prompt[0].tolist()), token_ids=tuple(seq[0, prompt.shape[1]:].tolist()),
        blocks=tuple(Block(0, 0, 1) for _ in range(n)), steps=record.steps, target_calls=_calls(target) - calls0,
        draft_calls=0, seconds=seconds, finish=finish, rule="plain", probs=record.probs,
        target_seconds=target_seconds, diagnostics_seconds=record.seconds,
    )
