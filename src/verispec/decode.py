"""The decode engine: speculative decoding with any verification rule, and plain decoding beside it.

One block (Leviathan et al. 2023, Algorithm 1): the drafter proposes k tokens from its processed
distribution, the target scores all k+1 positions in **one** forward pass, the rule decides
(`Rule.verify`), and the committed sequence grows by the accepted tokens plus one recovered or bonus
token. Model sessions hold KV caches that follow the committed sequence by cropping (see
`verispec.models.base`). Sampling settings are applied identically to target and draft logits.

`BatchDecoder` is the only decode loop: rows join and leave between blocks (continuous batching),
and a single prompt is a batch of one. Plain decoding of the target (no drafter, no rule) is its
own mode of the same loop. Each row draws from its own generator in a fixed order, so a row's
tokens do not depend on the other rows (up to the float rounding of batched matmuls:
docs/design/rules.md, 'Token roles'). `decode_prompts` runs a list of prompts through it; the api,
sweeps, the server and Ray workers all decode through this one class.

Every emitted position is recorded with its exact shift statistics (`verispec.diagnostics.shift`):
the rule's law of that token given its prefix is known in closed form, so the per-token
log-likelihood ratio against the target is exact.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
from torch import Tensor

from verispec.diagnostics.shift import position_stats
from verispec.models.base import LanguageModel, batch_session
from verispec.rules import Rule, parse
from verispec.rules.base import refuse_diagnostics_without_law
from verispec.probability import sample_from
from verispec.sampling import SamplingConfig, process, process_rows
from verispec.speculation import AdaptivePolicy, Costs, RowAcceptance
from verispec.tree_decode import (TreeScorer, TreeVerification, draft_trees, refuse_tree_rule, shape_depth,
                                  tree_verification, verify_block)
from verispec.trees import DraftShape, MultiDraft, check_depth, parse_shape


# paced prefill (`DecodeConfig.prefill_paced`): its first chunk's tokens; the most prefill time per second
# of the other rows' blocks (a duty cycle); the chunk duration it aims at, in those rows' blocks (fewer,
# larger chunks read the weights fewer times than one small chunk a step)
PREFILL_START = 4
PREFILL_SHARE = 0.75
PREFILL_STEP = 2.0


@dataclass(frozen=True)
class DecodeConfig:
    k: int = 4
    max_new_tokens: int = 64
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_at_eos: bool = True  # end at the first of the target's stop tokens (`stop_ids`)
    diagnostics: bool = True
    keep_probs: bool = False  # keep the V-sized target/draft rows and raw logits of every emitted position
    keep_token_logits: bool = False  # keep each emitted token's raw logit (`Generation.token_logits`)
    # an extra stop condition, checked once per block: given every token the row has emitted so far
    # (this block's included), the number of tokens to keep when the row must stop there (finish
    # "stop"), else None. It must return None on every shorter prefix it was called on before (so a
    # cut always falls inside the newest block), e.g. the end of the first code block of a reply.
    stop_check: Callable[[list[int]], int | None] | None = field(default=None, compare=False)
    # choose k per block and row from measured costs and the row's acceptance so far, and turn
    # speculation off when it cannot pay (`verispec.speculation`); None: k drafts every block
    policy: AdaptivePolicy | None = None
    # tree or multi-draft blocks (`verispec.tree_decode`): a draft shape, `tree:widths=4,2,2,1` or
    # `drafts:n=3[,replacement=0][,depth=D]` (a spec string is parsed); None: chain drafts of k tokens
    tree: DraftShape | str | None = None
    # chain and plain rows of a BatchDecoder: a prompt longer than this many tokens is fed to the caches
    # in chunks, at most this many prompt tokens per `step` beside the other rows' blocks (the rows with
    # the fewest left first), so a long prompt cannot hold the others up; None: in one pass when the row
    # joins. Where chunks end depends on the other rows waiting; on a real model that changes the long
    # prompt's logits by float rounding only (the chunks attend through the cache)
    prefill_chunk: int | None = None
    # with rows decoding beside it, prefill takes at most PREFILL_SHARE of the time their blocks take (a
    # chunk runs once their blocks since the last one have paid for it), so their latency stays under
    # 2x while a long prompt is fed; a chunk aims at PREFILL_STEP of their blocks, from PREFILL_START
    # tokens: half as many more again after a chunk within that, scaled down by the overrun after one
    # beyond it (at least 1 token, at most prefill_chunk). Chunk sizes then follow measured times, so a
    # long prompt's logits can differ from run to run by float rounding.
    prefill_paced: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.tree, str):
            object.__setattr__(self, "tree", parse_shape(self.tree))
        if self.tree is not None and self.policy is not None:
            raise ValueError("adaptive speculation (policy) chooses a chain's k; it does not apply to tree "
                             f"drafts ({self.tree.spec}): give one or the other")
        if isinstance(self.tree, MultiDraft) and not self.tree.replacement and self.tree.n > 1 \
                and self.sampling.greedy:  # one token has positive draft probability at temperature 0
            raise ValueError(f"drafts without replacement ({self.tree.spec}) need n distinct first tokens, "
                             "but at temperature 0 the processed draft is one-hot: use replacement=1 or n=1")
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k (draft tokens per block) must be an integer >= 1, got {self.k!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        c = self.prefill_chunk
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"prefill_chunk must be an integer >= 1 or None, got {c!r}")


@dataclass(frozen=True)
class Block:
    proposed: int  # draft tokens proposed
    accepted: int  # of which the rule accepted (all of them, also those after a stop token)
    emitted: int  # tokens kept from this block (accepted + recovered/bonus, cut at EOS / max tokens)
    depth: int | None = None  # a tree block: the drafted tree's depth (proposed counts its nodes)


@dataclass(frozen=True)
class Generation:
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    blocks: tuple[Block, ...]
    steps: dict[str, list] | None  # per emitted position, see verispec.diagnostics.shift.FIELDS
    target_calls: int
    draft_calls: int
    seconds: float
    # "eos" (a stop token: the last token), "stop" (DecodeConfig.stop_check), "length", or "cancelled"
    # (`BatchDecoder.cancel`)
    finish: str
    rule: Rule | None  # the verification rule; None for plain decoding of the target
    probs: dict[str, list[Tensor]] | None = None
    # where the time went (seconds): target forward passes, drafting (draft passes, processing and
    # sampling of draft tokens), this row's own per-position diagnostics; the rest is the loop's own work
    # and, in a batch, the other rows' diagnostics (BatchDecoder)
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    diagnostics_seconds: float = 0.0
    # with an adaptive policy: its costs, the k of each block and the blocks it turned speculation off
    speculation: dict | None = None
    token_logits: tuple[float, ...] | None = None  # each emitted token's raw logit (keep_token_logits)

    @property
    def rule_spec(self) -> str:
        """The rule's spec string, or "plain" for plain decoding."""
        return "plain" if self.rule is None else self.rule.spec

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
        return float(sum(a - b if a != b else 0.0
                         for a, b in zip(self.steps["log_law"], self.steps["log_target"])))

    def stats(self, max_new_tokens: int | None = None, k: int | None = None) -> dict:
        """The generation's summary: the one place that aggregates a generation (the CLI's --json, the
        Python API's `.stats`, the server's responses and every sweep row use it). Definitions:
        docs/design.md, section 'Words'. Its "verification" entry is `verification_report(self,
        max_new_tokens, k)`, the object `verispec serve` returns with every response."""
        proposed = sum(b.proposed for b in self.blocks)
        out: dict[str, float | int | str | None] = {
            "rule": self.rule_spec,
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
        out["verification"] = verification_report(self, max_new_tokens, k)
        return out


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else x


def verification_report(gen: Generation, max_new_tokens: int | None = None, k: int | None = None) -> dict:
    """The verification report of one generation: what the rule did to this response's law.

    The one function that builds it (`Generation.stats()["verification"]`, `verispec run --json`,
    and every `verispec serve` response). Fields:
    - rule, lossless: the rule's spec and whether its output law is the target's (plain: lossless);
    - drafted / accepted tokens, acceptance_rate, tokens_per_target_call (block efficiency);
    - mean_tv, mean_kl: exact per-token TV / KL of the emitted tokens' laws to the processed target,
      averaged over the response's tokens; max_overshoot: max law/p over them (docs/design/diagnostics.md,
      'Diagnostics'); log_ratio: the exact path-level log-likelihood ratio of the response against
      the target (docs/design/rules.md, 'Rule anatomy'), and log_ratio_per_token. None without diagnostics;
    - tree: the draft shape of a tree-mode run (`tree:widths=...`, `drafts:n=...`), else None; then
      drafted_tokens counts tree nodes and acceptance_per_position is per depth;
    - acceptance_per_position: for draft positions j = 1..k: `drafts`, the blocks that proposed at
      least one token; `reached`, the blocks that proposed a token at position j (proposed >= j; a
      tree's depth >= j);
      `accepted`, the blocks that accepted it (accepted >= j); `rate` = accepted / drafts, vLLM's
      per-position acceptance rate (it falls with j); `rate_given_reached` = accepted / reached, the
      acceptance at j among blocks that drafted that far (None if none did);
    - certificate: for a `budget` rule, TV(response law, target's response law) <= n * tv with
      n = max_new_tokens (the maximum length: with a stop token, responses are padded to it;
      docs/design/rules.md, 'Certificate'), and KL(law_t || p_t) <= log(1 + ratio * tv) per token;
      None for other rules, and its bound None when max_new_tokens is unknown and the response stopped
      early (its own length is not a valid n then); `warning` says when n * tv >= 1 (a bound of 1
      certifies nothing), else None.
    """
    rule = gen.rule
    proposed = sum(b.proposed for b in gen.blocks)
    accepted = sum(b.accepted for b in gen.blocks)
    reach = [b.proposed if b.depth is None else b.depth for b in gen.blocks]  # a tree reaches its depth
    width = k if k is not None else max(reach, default=0)
    drafts = sum(1 for b in gen.blocks if b.proposed > 0)
    positions = []
    for j in range(1, width + 1):
        reached = sum(1 for d in reach if d >= j)
        hits = sum(1 for b in gen.blocks if b.accepted >= j)
        positions.append({"position": j, "drafts": drafts, "reached": reached, "accepted": hits,
                          "rate": hits / drafts if drafts else None,
                          "rate_given_reached": hits / reached if reached else None})
    certificate = None
    if rule is not None and rule.name == "budget":
        n = max_new_tokens
        if n is None and gen.finish == "length":
            n = gen.num_tokens
        vacuous = n is not None and n * rule.tv >= 1
        certificate = {
            "tv_per_token": rule.tv, "ratio": rule.ratio, "n": n, "n_is": "max_tokens",
            "tv_bound": None if n is None else min(1.0, n * rule.tv),
            "kl_per_token_bound": math.log1p(rule.ratio * rule.tv) if math.isfinite(rule.ratio) else None,
            "warning": (f"n * tv_per_token = {n * rule.tv:.3g} >= 1: the TV bound certifies nothing for a "
                        f"response of up to {n} tokens; lower tv to below {1 / n:.3g}") if vacuous else None,
        }
    steps = gen.steps
    n_steps = len(steps["tv"]) if steps else 0
    return {
        "rule": gen.rule_spec,
        "tree": rule.shape.spec if isinstance(rule, TreeVerification) else None,
        "lossless": True if rule is None else bool(rule.lossless),
        "tokens": gen.num_tokens,
        "finish": gen.finish,
        "drafted_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": _finite_or_none(gen.acceptance_rate),
        "tokens_per_target_call": _finite_or_none(gen.block_efficiency),
        "target_calls": gen.target_calls,
        "mean_tv": sum(steps["tv"]) / n_steps if n_steps else None,
        "mean_kl": sum(steps["kl"]) / n_steps if n_steps else None,
        "max_overshoot": max(steps["max_ratio"]) if n_steps else None,
        "log_ratio": gen.log_ratio if steps is not None else None,
        "log_ratio_per_token": gen.log_ratio / n_steps if n_steps else None,
        "certificate": certificate,
        "acceptance_per_position": positions,
        "speculation": gen.speculation,
    }


def _as_prompt(prompt_ids) -> Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"prompt_ids must be a list of token ids (batch size 1), "
                         f"got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("empty prompt: give at least one token")
    return ids


def _check_tokens(ids: Tensor, vocab_size: int) -> None:
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}), "
                         f"got [{ids.min().item()}, {ids.max().item()}]")


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


def check_tree_room(model, prompt_len: int, config: DecodeConfig) -> None:
    """Refuse (ValueError) a tree deeper than the positions the model's context leaves after the prompt."""
    limit = max_context(model)
    if config.tree is not None and limit is not None:
        check_depth(shape_depth(config.tree, config.k), limit - prompt_len)


def stop_ids(model) -> frozenset[int]:
    """The token ids that end a generation: the model's `stop_token_ids` (all its end-of-sequence
    tokens, e.g. Qwen's <|im_end|> and <|endoftext|>), else its single `eos_token_id`."""
    ids = getattr(model, "stop_token_ids", None)
    if ids is None:
        eos = getattr(model, "eos_token_id", None)
        ids = () if eos is None else (eos,)
    return frozenset(int(i) for i in ids)


def first_stop(tokens: list[int], stops: frozenset[int]) -> int | None:
    """The index of the first stop token in a block's emitted tokens, or None."""
    return next((j for j, tok in enumerate(tokens) if tok in stops), None)


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

    def __init__(self, rule: Rule | None, config: DecodeConfig):
        if config.diagnostics and rule is not None:
            refuse_diagnostics_without_law(rule)
        self.rule, self.config = rule, config
        self.steps: dict[str, list] | None = {} if config.diagnostics else None
        self.probs: dict[str, list[Tensor]] | None = (
            {"target": [], "draft": [], "raw": []} if config.keep_probs else None)  # raw: the logits
        self.token_logits: list[float] | None = [] if config.keep_token_logits else None
        self._rows: list[tuple[Tensor, Tensor, Tensor, list[str], Tensor, Tensor | None]] = []
        self._pending = 0
        self.seconds = 0.0  # time spent on diagnostics

    def add(self, logits: Tensor, p: Tensor, q: Tensor, tokens: Tensor, roles: list[str],
            laws: Tensor | None = None) -> None:
        """logits, p [n, V] at the kept positions; q [m, V] for the first m (drafted) positions;
        laws [n, V]: the positions' exact laws when the caller has them (tree blocks)."""
        if self.steps is not None:
            start = time.perf_counter()
            raw = logits.gather(-1, tokens[:, None]).squeeze(-1) - logits.logsumexp(-1)  # raw target log-prob
            # [n, V]
            q_rows = q if q.shape[0] == p.shape[0] else torch.cat([q, torch.zeros_like(p[q.shape[0]:])])
            self._rows.append((p, q_rows, tokens, roles, raw, laws))
            self._pending += len(roles)
            self.seconds += time.perf_counter() - start
            if self._pending >= self.FLUSH:
                self.flush()
        if self.token_logits is not None:
            self.token_logits.extend(logits.gather(-1, tokens[:, None]).squeeze(-1).tolist())  # [n]
        if self.probs is not None:
            self.probs["target"].append(p.clone())
            self.probs["draft"].append(q.clone())
            self.probs["raw"].append(logits.clone())

    def flush(self) -> None:
        if self.steps is None or not self._rows:
            return
        start = time.perf_counter()
        p, q, tokens, roles, raw, laws = zip(*self._rows)
        stats = position_stats(self.rule, torch.cat(p), torch.cat(q), torch.cat(tokens),
                               [r for rs in roles for r in rs],
                               None if laws[0] is None else torch.cat(laws))  # one kind per decoder
        stats["log_target_raw"] = torch.cat(raw).double().tolist()
        for key, values in stats.items():
            self.steps.setdefault(key, []).extend(values)
        self._rows, self._pending = [], 0
        self.seconds += time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# the engine: many rows, each with its own length, generator and stopping point (a batch of one too)


def _pad_rows(flat: Tensor, lengths: list[int], width: int, fill: float | int = 0) -> Tensor:
    """Ragged rows concatenated, flat [sum(lengths), ...] -> [B, width, ...] padded with `fill`."""
    if len(lengths) == 1 and lengths[0] == width:
        return flat[None]  # [1, width, ...]: one row needs no padding
    out = flat.new_full((len(lengths), width, *flat.shape[1:]), fill)
    if flat.shape[0]:
        counts = torch.tensor(lengths)
        row_index = torch.repeat_interleave(torch.arange(len(lengths)), counts)  # [sum]
        starts = torch.cumsum(counts, 0) - counts
        pos_index = torch.arange(flat.shape[0]) - torch.repeat_interleave(starts, counts)  # [sum]
        out[row_index, pos_index] = flat
    return out


@dataclass
class _Row:
    """The state of one row of a `BatchDecoder` (bookkeeping only)."""

    prompt: Tensor  # [L0]
    seq: Tensor  # [L], the committed sequence (prompt + emitted)
    generator: torch.Generator | None
    config: DecodeConfig
    stops: frozenset[int]  # the token ids that end the row (empty: run to max_new_tokens)
    record: _Recorder
    start: float
    blocks: list[Block] = field(default_factory=list)
    new: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    acceptance: RowAcceptance | None = None  # in a decoder with an adaptive policy
    rule: Rule | None = None  # the rule that verifies the row's blocks (the decoder's unless given)
    fed: int = 0  # prompt tokens already in the caches by chunked prefill (`DecodeConfig.prefill_chunk`)
    to_feed: int = 0  # prompt tokens chunked prefill feeds before the row's first block (0: none)

    @property
    def adaptive(self) -> bool:
        """Whether the row's k is chosen by the decoder's policy (else its config's k)."""
        return self.config.policy is not None

    def cut(self, out: list[int]) -> tuple[int, str | None]:
        """How many of a block's tokens `out` the row keeps, and why it finishes (None: it goes on):
        the length limit, then the first stop token, then `DecodeConfig.stop_check`."""
        keep = min(len(out), self.config.max_new_tokens - self.new)
        finish = "length" if self.new + keep >= self.config.max_new_tokens else None
        stop = first_stop(out[:keep], self.stops)
        if stop is not None:
            keep, finish = stop + 1, "eos"
        check = self.config.stop_check
        if check is not None:
            emitted = self.seq[self.prompt.shape[0]:].tolist() + out[:keep]
            end = check(emitted)
            if end is not None:
                if not self.new < end <= self.new + keep:
                    raise ValueError(f"stop_check returned {end}: a cut must fall inside the newest block "
                                     f"(tokens {self.new + 1}..{self.new + keep})")
                if end < self.new + keep or finish != "eos":
                    keep, finish = end - self.new, "stop"
        return keep, finish


def _rule_groups(rules: list[Rule]) -> list[list[int]]:
    """The row indices of each distinct rule (by spec), in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, rule in enumerate(rules):
        groups.setdefault(rule.spec, []).append(i)
    return list(groups.values())


def _verify_rows(rules: list[Rule], p: Tensor, q: Tensor, drafts: Tensor,
                 uniforms: Tensor) -> tuple[list[int], list[list[int]]]:
    """(accepted drafts per row, each row's tokens [K+1] as lists) for rows that each have their own
    rule: one `verify_with_uniforms` call per rule over its rows (p [B, K+1, V], q [B, K, V], drafts and
    uniforms [B, K(+1)])."""
    if all(rule.spec == rules[0].spec for rule in rules):
        result = rules[0].verify_with_uniforms(p, q, drafts, uniforms, validate=False)
        return result.num_accepted.tolist(), result.tokens.tolist()
    accepted, tokens = [0] * len(rules), [[]] * len(rules)
    for rows in _rule_groups(rules):
        index = torch.tensor(rows)
        result = rules[rows[0]].verify_with_uniforms(p[index], q[index], drafts[index], uniforms[index],
                                                     validate=False)  # [b, K+1, V] ... of the group's rows
        for j, i in enumerate(rows):
            accepted[i], tokens[i] = int(result.num_accepted[j]), result.tokens[j].tolist()
    return accepted, tokens


def _bonus_laws(rules: list[Rule], p: Tensor) -> Tensor:
    """Each row's bonus law (`Rule.bonus_law`) of p [B, V], one call per rule over its rows."""
    if all(rule.spec == rules[0].spec for rule in rules):
        return rules[0].bonus_law(p)
    law = torch.empty_like(p)
    for rows in _rule_groups(rules):
        index = torch.tensor(rows)
        law[index] = rules[rows[0]].bonus_law(p[index]).to(p.dtype)  # [b, V] of the group's rows
    return law


class BatchDecoder:
    """The decode engine. Continuous batching: rows join (`add`) and leave (finish, `cancel`) between
    blocks; `step` runs one block for every active row. A single prompt is a batch of one.

    Two modes. Speculative (a drafter and a rule): the drafter proposes k_i tokens per row
    (`propose_batch`), the target scores each row's k_i + 1 positions in one `BatchSession.logits_for`
    call, the rule verifies all rows, and each row advances by its own count. Plain (no drafter, no
    rule): one target pass per token, sampled from the processed target. Each row draws its
    randomness from its own generator in a fixed order (per block: k_i draft draws, then k_i + 1
    verification draws; plain: one draw per token), so a row's output does not depend on the other
    rows (give every row its own generator: rows sharing one interleave their draws).

    Tree mode (`DecodeConfig.tree`, a tree rule): each block drafts a token tree or several chains per
    row and verifies it with a tree rule or Traversal Verification (`verispec.tree_decode`, docs/design.md
    'Tree decoding'); one target pass scores every row's tree on the lean backend.

    Per row (`add(config=..., rule=...)`): chain rows their own rule (rows sharing one are verified in
    one call) and sampling settings (each row's logits processed with its own,
    `sampling.process_rows`); every row its k, max_new_tokens, stop_at_eos, stop_check, diagnostics,
    keep_probs and chunked prefill. Tree mode keeps one rule and one sampling setting; plain decoding has
    no rule.

    A row's `seconds` is the wall time from its `add` to its finish; `target_calls` / `draft_calls`
    count the (shared) passes the row took part in, and `target_seconds` / `draft_seconds` the full
    time of those shared passes (attributed to every row in them, so they add up to more than the
    wall time across rows). `diagnostics_seconds` is the row's own diagnostics work (computed per
    row, not shared): the batch's diagnostics time is the sum over its rows, so at batch B a row's
    diagnostics_seconds / seconds under-states the diagnostics' share of the wall time up to B-fold.
    """

    def __init__(self, target: LanguageModel, drafter=None, rule: Rule | str | None = None,
                 config: DecodeConfig | None = None, pools: dict | None = None):
        """pools: adaptive rows' acceptance tests by (rule, sampling settings), the prior of the rows that
        join after them (`AdaptivePolicy.new_row`, when its `pool_tests` is set); pass one dict to
        decoders that follow one another (the server's) so it outlives each of them."""
        self.config = config or DecodeConfig()
        shape = self.config.tree
        if shape is not None:  # tree mode: every check before any forward pass
            rule = tree_verification(rule, shape, drafter, target.vocab_size)
        else:
            refuse_tree_rule(rule)
        self.plain = drafter is None
        rule = parse(rule) if isinstance(rule, str) else rule
        if self.plain and rule is not None and not rule.lossless:
            raise ValueError(f"plain decoding samples the target itself; rule '{rule.spec}' needs a "
                             "drafter (give one, or no rule)")
        if not self.plain and rule is None:
            raise ValueError("speculative decoding needs a verification rule, e.g. 'lossless'")
        self.rule: Rule | None = None if self.plain else rule
        if drafter is not None and drafter.vocab_size != target.vocab_size:
            raise ValueError(f"draft vocabulary ({drafter.vocab_size}) differs from the target's "
                             f"({target.vocab_size})")
        self.target, self.drafter = target, drafter
        # tree mode: (target scorer, draft scorer)
        self._trees = None if shape is None else (TreeScorer(target), TreeScorer(drafter.model))
        self._session = batch_session(target) if shape is None else self._trees[0].session
        if drafter is not None:
            drafter.start_batch()
        self._rows: dict[int, _Row] = {}
        self._next_id = 0
        self._paced: tuple[int, float] | None = None  # last paced prefill step: (tokens, seconds)
        self._credit = 0.0  # paced prefill: seconds of prefill the other rows' blocks have paid for
        self._block_seconds: float | None = None  # wall seconds of the last block of decoding rows
        self._pools: dict[tuple, RowAcceptance] = {} if pools is None else pools

    def _pool_key(self, rule: Rule | None, config: DecodeConfig) -> tuple:
        """Rows that share acceptance evidence: the same rule and sampling settings."""
        rule = rule or self.rule
        return (None if rule is None else rule.spec, config.sampling)

    @property
    def active(self) -> list[int]:
        """Ids of the rows still decoding, in the order they joined."""
        return list(self._rows)

    def add(self, prompt_ids, generator: torch.Generator | None = None,
            config: DecodeConfig | None = None, rule: Rule | str | None = None) -> int:
        """A new row (joins at the next `step`); returns its id. `config` overrides the decoder's
        per-row settings (in tree mode its sampling must be the decoder's); `rule`, the decoder's rule
        for this row (chain drafts: each row is verified by its own rule)."""
        config = config or self.config
        if rule is not None:
            if self._trees is not None or self.plain:
                raise ValueError("a row's own rule needs a speculative chain decoder (plain and tree "
                                 "decoders verify every row by the decoder's rule)")
            refuse_tree_rule(rule)
            rule = parse(rule) if isinstance(rule, str) else rule
        if config.sampling != self.config.sampling and self._trees is not None:
            raise ValueError("every row of a tree-mode BatchDecoder uses the decoder's sampling settings "
                             f"({self.config.sampling}), got {config.sampling}")
        if config.policy is not None and config.policy != self.config.policy:
            raise ValueError("an adaptive row of a BatchDecoder uses the decoder's speculation policy "
                             "(a row without one keeps its own k)")
        if config.tree != self.config.tree:
            raise ValueError(f"every row of a BatchDecoder uses the decoder's draft shape "
                             f"({self.config.tree})")
        prompt = _as_prompt(prompt_ids)[0]  # [L0]
        _check_tokens(prompt, self.target.vocab_size)
        check_context(self.target, prompt.shape[0], config.max_new_tokens, self.drafter)
        check_tree_room(self.target, prompt.shape[0], config)
        row = self._next_id
        self._next_id += 1
        stops = stop_ids(self.target) if config.stop_at_eos else frozenset()
        self._rows[row] = _Row(prompt=prompt, seq=prompt, generator=generator, config=config, stops=stops,
                               record=_Recorder(rule or self.rule, config), start=time.perf_counter(),
                               rule=rule or self.rule,
                               acceptance=None if self.config.policy is None
                               else self.config.policy.new_row(self._pools.get(self._pool_key(rule, config))))
        chunk = config.prefill_chunk
        if chunk is not None and self._trees is None and prompt.shape[0] - 1 > chunk:
            self._rows[row].to_feed = prompt.shape[0] - 1  # all but the last: its first block scores it
        return row

    def prefilling(self, row: int) -> bool:
        """Whether a row is still having its prompt fed in chunks (it decodes once that is done)."""
        r = self._rows.get(row)
        return r is not None and r.fed < r.to_feed

    def _prefill_some(self) -> None:
        """One step's prefill: up to `prefill_chunk` prompt tokens, to the rows still prefilling with the
        fewest tokens left first (a short prompt is not held up behind a long one; a long one goes on
        whenever no shorter one waits)."""
        waiting = sorted((r.to_feed - r.fed, i) for i, r in self._rows.items() if r.fed < r.to_feed)
        if not waiting:
            return
        config = self._rows[waiting[0][1]].config
        budget = config.prefill_chunk
        decoding = len(waiting) < len(self._rows)
        paced = config.prefill_paced and decoding
        if paced:  # once the others' blocks have paid for the last chunk; about PREFILL_STEP blocks long
            if self._credit < 0:
                return
            if self._paced is None or self._block_seconds is None:
                size = PREFILL_START
            else:
                tokens, seconds = self._paced
                aim = PREFILL_STEP * self._block_seconds
                size = tokens + max(1, tokens // 2) if seconds <= aim else int(tokens * aim / seconds)
            budget = max(1, min(budget, size))
        start, fed = time.perf_counter(), 0
        for left, row in waiting:
            if budget <= 0:
                break
            self._prefill(row, min(left, budget))
            fed += min(left, budget)
            budget -= min(left, budget)
        seconds = time.perf_counter() - start
        self._paced = (fed, seconds) if paced else None
        self._credit = self._credit - seconds if paced else 0.0

    def _prefill(self, row: int, count: int) -> None:
        """Feed the next `count` tokens of a row's prompt to the target's cache and the drafter's (one
        pass each, scoring only the last position fed, which nobody reads)."""
        r = self._rows[row]
        end = r.fed + count
        start = time.perf_counter()
        self._session.logits_for([row], [r.prompt[:end]], [1])
        prefill = getattr(self.drafter, "prefill", None)
        if prefill is not None:
            prefill(row, r.prompt[:end])
        r.fed = end
        r.target_seconds += time.perf_counter() - start

    def tokens(self, row: int) -> list[int]:
        """The token ids a row has committed so far (its prompt excluded), e.g. for streaming."""
        if row not in self._rows:
            raise ValueError(f"no active row {row}")
        r = self._rows[row]
        return r.seq[r.prompt.shape[0]:].tolist()

    def cancel(self, row: int) -> Generation:
        """Remove a row; returns what it generated so far (finish "cancelled")."""
        if row not in self._rows:
            raise ValueError(f"no active row {row}")
        return self._finish(row, "cancelled")

    def step(self) -> list[tuple[int, Generation]]:
        """One block for every active row whose prompt is in the caches, after up to one chunk of
        prompt tokens for the rows still prefilling (`DecodeConfig.prefill_chunk`, `_prefill_some`);
        returns the rows that finished in it, with their output."""
        self._prefill_some()
        ids = [i for i in self._rows if not self.prefilling(i)]
        if not ids:
            return []
        rows = [self._rows[i] for i in ids]
        start = time.perf_counter()
        if self._trees is not None:
            ends = self._tree_step(ids, rows)
        else:
            ends = self._plain_step(ids, rows) if self.plain else self._speculative_step(ids, rows)
        self._block_seconds = time.perf_counter() - start
        if any(self.prefilling(i) for i in self._rows):  # the block pays for some prefill (paced)
            self._credit += PREFILL_SHARE * self._block_seconds
        return [(row, self._finish(row, how)) for row, how in ends]

    # -- one block -------------------------------------------------------------------------------
    def _speculative_step(self, ids: list[int], rows: list[_Row]) -> list[tuple[int, str]]:
        policy = self.config.policy
        sampling = [r.config.sampling for r in rows]  # each row's own settings
        if policy is None:
            wanted = [r.config.k for r in rows]
        else:  # each adaptive row's k from its own acceptance (a row without the policy keeps its k);
            # then whether the batch's block pays at all: if not, the adaptive rows draft nothing
            estimates = [r.acceptance.estimate for r in rows]
            wanted = [policy.choose_k(a, *r.acceptance.evidence) if r.adaptive
                      else r.config.k for a, r in zip(estimates, rows)]
            # the adaptive rows weighed among themselves (a pinned row drafts its own k whatever this
            # decides, and may pin a k wider than the costs were measured for)
            mine = [(a, k) for a, k, r in zip(estimates, wanted, rows) if r.adaptive]
            off = (policy.by_batch and any(k for _, k in mine)
                   and not policy.pays([a for a, _ in mine], [k for _, k in mine]))
            wanted = [0 if off and r.adaptive else k for k, r in zip(wanted, rows)]
            for r, k in zip(rows, wanted):
                r.acceptance.choices.append(k)
                r.acceptance.off += int(off and r.adaptive)
        # a block emits up to k + 1 tokens
        ks = [min(k, r.config.max_new_tokens - r.new - 1) for k, r in zip(wanted, rows)]
        if not any(ks):  # nobody drafts: one token per row from its rule's bonus law, as a plain block
            return self._plain_step(ids, rows, bonus=True)
        t0 = time.perf_counter()
        calls0 = _calls(self.drafter)
        generators = [r.generator for r in rows]
        proposals = self.drafter.propose_batch(ids, [r.seq for r in rows], ks, sampling, generators)
        drafted = _calls(self.drafter) > calls0  # a model-free drafter makes no passes
        t1 = time.perf_counter()
        kks = [int(d.shape[0]) for d, _ in proposals]  # k_i' <= k_i
        logits = self._session.logits_for(ids, [torch.cat([r.seq, d]) for r, (d, _) in zip(rows, proposals)],
                                          [kk + 1 for kk in kks])  # per row [kk+1, V], one target pass
        t2 = time.perf_counter()
        lengths = [kk + 1 for kk in kks]
        p_flat = process_rows(torch.cat(logits), [s for s, n in zip(sampling, lengths) for _ in range(n)])
        # [sum(kk+1), V]
        k_max = max(kks)
        p = _pad_rows(p_flat, lengths, k_max + 1)  # [B, K+1, V]
        q = _pad_rows(torch.cat([qi for _, qi in proposals]).to(p_flat.dtype), kks, k_max)  # [B, K, V]
        drafts = _pad_rows(torch.cat([d for d, _ in proposals]).long(), kks, k_max, -1)  # [B, K]
        # each row's verification draws: k_i + 1 uniforms from its own generator
        draws = [torch.rand(kk + 1, generator=g, dtype=torch.float64) for g, kk in zip(generators, kks)]
        uniforms = _pad_rows(torch.cat(draws), lengths, k_max + 1)  # [B, K+1]
        # p and q come from `process` (validated logits, exact distributions): skip re-validation; each
        # row by its own rule (rows sharing a rule in one call: the rules' maths is row by row)
        num_accepted, token_lists = _verify_rows([r.rule for r in rows], p, q, drafts, uniforms)
        p_rows = p_flat.split(lengths)  # per row [kk+1, V]
        ends = []
        for i, (row_id, r) in enumerate(zip(ids, rows)):
            kk, n = kks[i], num_accepted[i]
            keep, finish = r.cut(token_lists[i][: n + 1])
            roles = ["accepted"] * n + ["bonus" if n == kk else "recovered"]
            kept = torch.tensor(token_lists[i][:keep], dtype=torch.long)
            q_kept = proposals[i][1][: min(kk, keep)]
            r.record.add(logits[i][:keep], p_rows[i][:keep], q_kept, kept, roles[:keep])
            r.blocks.append(Block(proposed=kk, accepted=n, emitted=keep))
            if r.acceptance is not None:
                r.acceptance.update(kk, n)
                if r.adaptive:
                    self._pools.setdefault(self._pool_key(r.rule, r.config), RowAcceptance()).update(kk, n)
            r.seq = torch.cat([r.seq, kept])
            r.new += keep
            r.target_calls += 1
            r.draft_calls += kk if drafted else 0
            r.target_seconds += t2 - t1
            r.draft_seconds += t1 - t0
            if finish is not None:
                ends.append((row_id, finish))
        return ends

    def _tree_step(self, ids: list[int], rows: list[_Row]) -> list[tuple[int, str]]:
        """One tree block per row (`verispec.tree_decode`): draft each row's tree, score every row's
        nodes in one target pass, verify per row, keep each row's accepted path in the target cache."""
        sampling, verification = self.config.sampling, self.rule
        target, draft = self._trees
        vocab = self.target.vocab_size
        shape = self.config.tree
        t0 = time.perf_counter()
        # a block emits up to depth + 1 tokens
        depths = [min(shape_depth(shape, r.config.k), r.config.max_new_tokens - r.new - 1) for r in rows]
        trees, draft_passes = draft_trees(draft, ids, [r.seq for r in rows], shape, depths, sampling,
                                          [r.generator for r in rows], vocab)
        t1 = time.perf_counter()
        roots = [torch.cat([r.seq[-1:], tree.tokens[1:]]) for r, tree in zip(rows, trees)]  # root first
        # per row [N+1, V]: one tree pass for all rows
        logits = target.score(ids, [r.seq for r in rows], roots, [tree.parents for tree in trees])
        t2 = time.perf_counter()
        blocks, ends = [], []
        for r, tree, row_logits in zip(rows, trees, logits):
            target_probs = process(row_logits, sampling)  # [N+1, V]
            uniforms = torch.rand(tree.size + 1, generator=r.generator, dtype=torch.float64)  # [N+1]
            blocks.append((verify_block(verification, tree, target_probs, uniforms), target_probs))
        target.commit([list(block.result.nodes) for block, _ in blocks])
        for row_id, r, tree, row_logits, (block, target_probs), passes in zip(
                ids, rows, trees, logits, blocks, draft_passes):
            out = list(block.result.tokens)
            keep, finish = r.cut(out)
            kept = torch.tensor(out[:keep])
            at = block.frontiers[:keep]
            r.record.add(row_logits[at], target_probs[at], block.draft_probs[:keep], kept, block.roles[:keep],
                         block.laws[:keep])
            r.blocks.append(Block(proposed=tree.size, accepted=len(block.result.nodes), emitted=keep,
                                  depth=tree.depth))
            r.seq = torch.cat([r.seq, kept])
            r.new += keep
            r.target_calls += 1
            r.draft_calls += passes
            r.target_seconds += t2 - t1
            r.draft_seconds += t1 - t0
            if finish is not None:
                ends.append((row_id, finish))
        return ends

    def _plain_step(self, ids: list[int], rows: list[_Row], bonus: bool = False) -> list[tuple[int, str]]:
        """One token per row in one target pass. `bonus`: a speculative block where no row drafts (k = 0):
        each row's token is drawn from its rule's bonus law with the one uniform such a block draws
        (`Rule.verify_with_uniforms` at K = 0), so its tokens are the speculative loop's, without its
        padding and verification."""
        t0 = time.perf_counter()
        logits = torch.cat(self._session.logits_for(ids, [r.seq for r in rows], [1] * len(rows)))  # [B, V]
        seconds = time.perf_counter() - t0
        p = process_rows(logits, [r.config.sampling for r in rows])  # [B, V]: each row's own settings
        uniforms = torch.cat([torch.rand(1, generator=r.generator, dtype=torch.float64) for r in rows])  # [B]
        law = _bonus_laws([r.rule for r in rows], p) if bonus else p  # [B, V]
        tokens = sample_from(law, uniforms)  # [B]
        empty_q = p.new_zeros(0, p.shape[1])
        role = "bonus" if bonus else "plain"
        ends = []
        for i, (row_id, r, tok) in enumerate(zip(ids, rows, tokens.tolist())):
            keep, finish = r.cut([tok])
            r.record.add(logits[i : i + 1], p[i : i + 1], empty_q, tokens[i : i + 1], [role])
            r.seq = torch.cat([r.seq, tokens[i : i + 1]])
            r.new += 1
            r.blocks.append(Block(0, 0, 1))
            r.target_calls += 1
            r.target_seconds += seconds
            if finish is not None:
                ends.append((row_id, finish))
        return ends

    def _finish(self, row: int, finish: str) -> Generation:
        r = self._rows.pop(row)
        self._session.release(row)
        if self._trees is not None:
            self._trees[1].release(row)
        if self.drafter is not None:
            self.drafter.release(row)
        return self._generation(r, finish)

    def so_far(self, row: int) -> Generation:
        """What an active row has generated so far (finish "running"; its per-token record flushed), e.g.
        for streamed log-probabilities; the row goes on decoding."""
        if row not in self._rows:
            raise ValueError(f"no active row {row}")
        return self._generation(self._rows[row], "running")

    def _generation(self, r: _Row, finish: str) -> Generation:
        r.record.flush()
        n0 = r.prompt.shape[0]
        return Generation(
            prompt_ids=tuple(r.prompt.tolist()), token_ids=tuple(r.seq[n0:].tolist()), blocks=tuple(r.blocks),
            steps=r.record.steps, target_calls=r.target_calls, draft_calls=r.draft_calls,
            seconds=time.perf_counter() - r.start, finish=finish, rule=r.rule,
            probs=r.record.probs, target_seconds=r.target_seconds, draft_seconds=r.draft_seconds,
            diagnostics_seconds=r.record.seconds, speculation=self._speculation(r),
            token_logits=None if r.record.token_logits is None else tuple(r.record.token_logits),
        )

    def _speculation(self, r: _Row) -> dict | None:
        policy, seen = self.config.policy, r.acceptance
        if policy is None or seen is None or not r.adaptive:
            return None
        return {"policy": "adaptive", "k_max": policy.k_max, "by_batch": policy.by_batch,
                "costs": policy.costs.summary(), "k_per_block": list(seen.choices), "blocks_off": seen.off,
                "acceptance_estimate": seen.estimate, "prior_tests": seen.prior_tests}


def position_costs(costs: Costs, target: LanguageModel, drafter, prompt_ids: list[int], k: int | None = None,
                   blocks: int = 4, diagnostics: bool = True) -> Costs:
    """`costs` with each measured batch size's other work per position and row (`Costs.position`): B rows
    of `prompt_ids` decode `blocks` lossless blocks of k drafts after an untimed first one, and the median
    block's seconds less its passes (k draft steps and a (k + 1)-token target pass, as measured), spread
    over its B * (2k + 1) positions (k + 1 target, k draft), floored at 0. With `diagnostics` as the
    decoder will run: the exact law of each position is part of that work. k: 2 (or the widest measured)
    by default."""
    k = min(2, costs.k_max) if k is None else k
    if not isinstance(k, int) or not 1 <= k <= costs.k_max or not isinstance(blocks, int) or blocks < 1:
        raise ValueError(f"k must be in 1..{costs.k_max} and blocks >= 1, got k={k!r}, blocks={blocks!r}")
    config = DecodeConfig(k=k, max_new_tokens=(blocks + 2) * (k + 1), stop_at_eos=False,
                          diagnostics=diagnostics)
    position = {}
    for b in sorted(costs.target):
        decoder = BatchDecoder(target, drafter, "lossless", config)
        for i in range(b):
            decoder.add(prompt_ids, torch.Generator().manual_seed(i))
        decoder.step()  # prompts fed, first block: untimed
        times = []
        for _ in range(blocks):
            start = time.perf_counter()
            decoder.step()
            times.append(time.perf_counter() - start)
        for row in decoder.active:
            decoder.cancel(row)
        block = sorted(times)[len(times) // 2]
        passes = k * costs.draft[b] + costs.target[b][k]
        position[b] = max(0.0, block - passes) / (b * (2 * k + 1))
    return replace(costs, position=position)


def decode_prompts(target: LanguageModel, prompts: Sequence, generators: Sequence[torch.Generator | None],
                   config: DecodeConfig, drafter=None, rule: Rule | str | None = None,
                   batch_size: int | None = None) -> list[Generation]:
    """Decode every prompt through one `BatchDecoder`, at most `batch_size` rows at once (None: all); a
    finished row's place is taken by the next prompt between blocks (continuous batching).

    Speculative with a drafter and a rule, plain decoding of the target without (drafter None, rule
    None or lossless). Row i draws from generators[i] only, so it equals decoding prompts[i] alone with
    that generator (up to the rounding of batched matmuls). Every prompt is checked before any work."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts (lists of token ids)")
    if len(generators) != len(prompts):
        raise ValueError(f"need one generator per prompt: {len(prompts)} prompts, "
                         f"{len(generators)} generators")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    decoder = BatchDecoder(target, drafter, rule, config)
    for i, prompt in enumerate(prompts):  # every row checked before any work: a bad row names itself
        try:
            ids = _as_prompt(prompt)
            _check_tokens(ids, target.vocab_size)
            check_context(target, ids.shape[1], config.max_new_tokens, drafter)
            check_tree_room(target, ids.shape[1], config)
        except ValueError as err:
            raise ValueError(f"prompt {i}: {err}" if len(prompts) > 1 else str(err)) from None
    waiting = list(zip(prompts, generators))
    limit = batch_size or len(waiting)
    ids: list[int] = []
    done: dict[int, Generation] = {}
    while waiting or decoder.active:
        while waiting and len(decoder.active) < limit:
            prompt, gen = waiting.pop(0)
            ids.append(decoder.add(prompt, gen))
        done.update(decoder.step())
    return [done[i] for i in ids]


# Conveniences over `decode_prompts` (one engine; these only name the mode and the batch shape).


def speculative_decode(target: LanguageModel, drafter, prompt_ids, rule: Rule | str, config: DecodeConfig,
                       generator: torch.Generator | None = None) -> Generation:
    """Speculative decoding of one prompt (a batch of one)."""
    return decode_prompts(target, [prompt_ids], [generator], config, drafter, rule)[0]


def autoregressive_decode(target: LanguageModel, prompt_ids, config: DecodeConfig,
                          generator: torch.Generator | None = None) -> Generation:
    """Plain decoding of the target with the same sampling settings (a batch of one): the baseline."""
    return decode_prompts(target, [prompt_ids], [generator], config)[0]


def speculative_decode_batch(target: LanguageModel, drafter, prompts: list[list[int]], rule: Rule | str,
                             config: DecodeConfig, generators: list[torch.Generator],
                             batch_size: int | None = None) -> list[Generation]:
    """Speculative decoding of many prompts; row i equals `speculative_decode(target, drafter,
    prompts[i], rule, config, generators[i])` (same draws from its own generator, in the same order)."""
    return decode_prompts(target, prompts, generators, config, drafter, rule, batch_size)


def autoregressive_decode_batch(target: LanguageModel, prompts: list[list[int]], config: DecodeConfig,
                                generators: list[torch.Generator], batch_size: int | None = None
                                ) -> list[Generation]:
    """Plain decoding of many prompts; row i equals `autoregressive_decode(target, prompts[i], config,
    generators[i])`."""
    return decode_prompts(target, prompts, generators, config, batch_size=batch_size)
