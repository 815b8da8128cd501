"""The verification-rule interface and the generic token-level sampling path.

At one draft position a single-draft verification rule is two functions of the target distribution
`p` (target_probs) and the draft distribution `q` (draft_probs) (docs/design.md, section 'Rule anatomy'):

    accept(p, q)[x]   probability that the drafted token x is kept;
    residual(p, q)    the distribution resampled from after a rejection;

and the exact law of the token it emits there follows in closed form:

    emitted(p, q) = q * accept + (1 - sum(q * accept)) * residual.

`verify` is speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2)
driven by the same two functions, so the law a rule is analysed with is the law it samples from.
Token roles follow vLLM's rejection sampler: *accepted* draft tokens, then one *recovered* token
(drawn from the residual at the first rejection) or, when every draft token is accepted, one *bonus*
token drawn from the target at position K. All randomness is drawn up front: one uniform per draft
position and one for the recovered/bonus token (`uniforms [B, K+1]`).

Inputs are validated (finite, non-negative, rows summing to 1, shapes, token range) and a clear
`ValueError` is raised otherwise; maths runs in the input dtype (float32 or float64).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from verispec.probability import at, check_pair, check_probs, sample_from
from verispec.spec import Param, check_ranges

__all__ = ["Param", "Rule", "VerifyResult", "assemble_tokens", "check_block"]

@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one block per row.

    num_accepted [B]: accepted draft tokens (0..K).
    tokens [B, K+1]: the accepted draft tokens, then the recovered or bonus token, then -1 padding.
    accept_probs [B, K]: the acceptance probability used at each draft position (beyond the first
        rejection they were computed but not used).
    bonus [B]: True where all K draft tokens were accepted and the last token is a bonus token.
    """

    num_accepted: Tensor
    tokens: Tensor
    accept_probs: Tensor
    bonus: Tensor


# ---------------------------------------------------------------------------------------------
# small pure helpers shared by the rules


def assemble_tokens(draft_tokens: Tensor, num_accepted: Tensor, last: Tensor) -> Tensor:
    """[B, K+1]: the first num_accepted draft tokens, then `last` (recovered or bonus), then -1."""
    b, k = draft_tokens.shape
    positions = torch.arange(k, device=draft_tokens.device)
    tokens = torch.where(positions < num_accepted[:, None], draft_tokens, -1)  # [B, K]
    tokens = torch.cat([tokens, torch.full_like(tokens[:, :1], -1)], dim=1)  # [B, K+1]
    tokens[torch.arange(b, device=tokens.device), num_accepted] = last
    return tokens


# ---------------------------------------------------------------------------------------------
# input validation


def check_block(target_probs: Tensor, draft_probs: Tensor, draft_tokens: Tensor) -> None:
    """Validate the inputs of `verify`: p [B,K+1,V], q [B,K,V], x [B,K] with q(x) > 0."""
    check_probs("target_probs", target_probs)
    check_probs("draft_probs", draft_probs)
    if target_probs.ndim != 3 or draft_probs.ndim != 3 or draft_tokens.ndim != 2:
        raise ValueError(
            "verify expects target_probs [B, K+1, V], draft_probs [B, K, V] and draft_tokens [B, K]; got "
            f"{tuple(target_probs.shape)}, {tuple(draft_probs.shape)}, {tuple(draft_tokens.shape)}"
        )
    b, k1, v = target_probs.shape
    if draft_probs.shape != (b, k1 - 1, v) or draft_tokens.shape != (b, k1 - 1):
        raise ValueError(
            "shape mismatch: target_probs [B, K+1, V] needs draft_probs [B, K, V] and draft_tokens [B, K]; got "
            f"{tuple(target_probs.shape)}, {tuple(draft_probs.shape)}, {tuple(draft_tokens.shape)}"
        )
    if k1 < 2:
        raise ValueError("verify needs at least one draft token (K >= 1)")
    if target_probs.dtype != draft_probs.dtype:
        raise ValueError(f"target_probs is {target_probs.dtype} but draft_probs is {draft_probs.dtype}")
    if draft_tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    if draft_tokens.numel() and (draft_tokens.min() < 0 or draft_tokens.max() >= v):
        raise ValueError(
            f"draft token outside the vocabulary: values must be in [0, {v}), got "
            f"[{draft_tokens.min().item()}, {draft_tokens.max().item()}]"
        )
    drafted_q = draft_probs.gather(-1, draft_tokens.long()[..., None])
    if (drafted_q <= 0).any():
        raise ValueError("a draft token has zero probability under draft_probs: it cannot have been drafted")


# ---------------------------------------------------------------------------------------------
# the rule interface


@dataclass(frozen=True)
class Rule:
    """A verification rule. Subclasses are frozen dataclasses whose fields are the spec parameters."""

    name: ClassVar[str]
    family: ClassVar[str]  # lossless, truncation, baseline, collaborative or bounded
    lossless: ClassVar[bool] = False
    source: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    usage: ClassVar[str] = ""  # parameters in words, for rules whose spec is not key=value pairs
    block_level: ClassVar[bool] = False  # verifies whole blocks (no per-position accept/residual)
    lossless_when: ClassVar[str] = ""  # for parametrised rules: the setting at which they are lossless
    params: ClassVar[tuple[Param, ...]] = ()

    def __post_init__(self) -> None:
        check_ranges("rule", self.name, self.params, {p.key: getattr(self, p.key) for p in self.params})

    # -- the maths, on validated tensors (subclasses implement these) --------------------------
    def _accept(self, p: Tensor, q: Tensor) -> Tensor:
        raise NotImplementedError(f"rule '{self.name}' is not of the accept/residual form")

    def _residual(self, p: Tensor, q: Tensor) -> Tensor:
        raise NotImplementedError(f"rule '{self.name}' is not of the accept/residual form")

    def _accept_at(self, p: Tensor, q: Tensor, x: Tensor) -> Tensor:
        """Acceptance probability of the drafted tokens only: p, q [B, K, V], x [B, K] -> [B, K].

        Rules whose accept is elementwise override this to skip the full [B, K, V] pass."""
        return self._accept(p, q).gather(-1, x[..., None]).squeeze(-1)

    def _residual_after(self, p: Tensor, q: Tensor, rejected: Tensor) -> Tensor:
        """Residual given the rejected token (p, q [..., V], rejected [...]); most rules ignore it."""
        return self._residual(p, q)

    def _emitted(self, p: Tensor, q: Tensor) -> Tensor:
        accept = self._accept(p, q)
        kept = q * accept
        return kept + (1 - kept.sum(-1, keepdim=True)).clamp_min(0) * self._residual(p, q)

    def _bonus(self, p: Tensor) -> Tensor:
        """The law of the bonus token after K accepted draft tokens: the target itself."""
        return p

    def _baseline(self, p: Tensor) -> Tensor | None:
        return None

    # -- public, unchecked: for callers whose inputs are valid distributions by construction ----
    # (the decode loop and the diagnostics get p and q from `verispec.sampling.process`); the
    # checked methods below validate first. docs/design.md, section 'Layering'.
    def acceptance(self, target_probs: Tensor, draft_probs: Tensor) -> Tensor:
        """`accept` without input checks: [..., V]."""
        return self._accept(target_probs, draft_probs)

    def emitted_law(self, target_probs: Tensor, draft_probs: Tensor) -> Tensor:
        """`emitted` without input checks: the exact law of the token emitted at a draft position."""
        return self._emitted(target_probs, draft_probs)

    def bonus_law(self, target_probs: Tensor) -> Tensor:
        """The law of the bonus token (after every draft token was accepted): [..., V]."""
        return self._bonus(target_probs)

    def baseline_law(self, target_probs: Tensor) -> Tensor | None:
        """`baseline` without input checks: the honest truncation baseline, or None."""
        return self._baseline(target_probs)

    # -- public API (validates, then runs the maths) --------------------------------------------
    def accept(self, target_probs: Tensor, draft_probs: Tensor) -> Tensor:
        """Probability that each token, once drafted, is kept: [..., V] in [0, 1]."""
        check_pair(target_probs, draft_probs)
        return self._accept(target_probs, draft_probs)

    def residual(self, target_probs: Tensor, draft_probs: Tensor) -> Tensor:
        """The distribution a rejected position is resampled from: [..., V]."""
        check_pair(target_probs, draft_probs)
        return self._residual(target_probs, draft_probs)

    def residual_after(self, target_probs: Tensor, draft_probs: Tensor, rejected_tokens: Tensor) -> Tensor:
        """The residual given the rejected draft token (rejected_tokens [...]): [..., V].

        Equal to `residual` for every rule except those whose residual depends on the rejected token.
        """
        check_pair(target_probs, draft_probs)
        if rejected_tokens.shape != target_probs.shape[:-1]:
            raise ValueError(f"rejected_tokens must have shape {tuple(target_probs.shape[:-1])}")
        return self._residual_after(target_probs, draft_probs, rejected_tokens.long())

    def emitted(self, target_probs: Tensor, draft_probs: Tensor) -> Tensor:
        """Exact law of the token emitted at one draft position (docs/design.md, section 'Rule anatomy'): [..., V]."""
        check_pair(target_probs, draft_probs)
        return self._emitted(target_probs, draft_probs)

    def baseline(self, target_probs: Tensor) -> Tensor | None:
        """The honest truncation baseline `norm(p * 1_A)` for truncation rules, else None."""
        check_probs("target_probs", target_probs)
        return self._baseline(target_probs)

    def verify(
        self,
        target_probs: Tensor,
        draft_probs: Tensor,
        draft_tokens: Tensor,
        generator: torch.Generator | None = None,
    ) -> VerifyResult:
        """Verify one block per row: p [B,K+1,V], q [B,K,V], x [B,K]. Randomness only from `generator`."""
        b, k = draft_tokens.shape if draft_tokens.ndim == 2 else (0, 0)
        uniforms = torch.rand((b, k + 1), generator=generator, dtype=torch.float64, device=target_probs.device)
        return self.verify_with_uniforms(target_probs, draft_probs, draft_tokens, uniforms)

    def verify_with_uniforms(
        self, target_probs: Tensor, draft_probs: Tensor, draft_tokens: Tensor, uniforms: Tensor,
        validate: bool = True,
    ) -> VerifyResult:
        """`verify` with its randomness given: uniforms [B, K+1] in [0, 1) (same noise, same output).

        validate=False skips the input checks, for callers that built the inputs themselves (the decode
        loop gets p and q from `verispec.sampling.process`)."""
        if validate:
            check_block(target_probs, draft_probs, draft_tokens)
        return self._verify(target_probs, draft_probs, draft_tokens.long(), uniforms)

    def _verify(self, p: Tensor, q: Tensor, x: Tensor, uniforms: Tensor) -> VerifyResult:
        b, k = x.shape
        accept_probs = self._accept_at(p[:, :k], q, x)  # [B, K]
        accepted = uniforms[:, :k] < accept_probs.to(torch.float64)  # [B, K]
        num_accepted = accepted.to(torch.int64).cumprod(-1).sum(-1)  # [B]
        rows = torch.arange(b, device=p.device)
        j = num_accepted.clamp(max=k - 1)  # position of the first rejection, where there is one
        recovered = self._residual_after(p[rows, j], q[rows, j], x[rows, j])  # [B, V]
        bonus = num_accepted == k
        law = torch.where(bonus[:, None], self._bonus(p[:, k]), recovered)  # [B, V]
        tokens = assemble_tokens(x, num_accepted, sample_from(law, uniforms[:, k]))
        return VerifyResult(num_accepted=num_accepted, tokens=tokens, accept_probs=accept_probs, bonus=bonus)

    # -- description ----------------------------------------------------------------------------
    @classmethod
    def describe(cls) -> dict[str, str]:
        """One row of the catalogue table: name, family, lossless, parameters, summary, source."""
        if cls.lossless_when:
            lossless = cls.lossless_when
        else:
            lossless = "yes" if cls.lossless is True else "no"
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        params = []
        for param in cls.params:
            default = defaults.get(param.key, dataclasses.MISSING)
            shown = "" if default is dataclasses.MISSING or default is None else f", default {default}"
            params.append(f"{param.key} ({param.allowed}{shown})")
        return {"rule": cls.name, "family": cls.family, "lossless": lossless,
                "parameters": "; ".join(params) or cls.usage or "-", "what it does": cls.summary, "source": cls.source}

    @property
    def spec(self) -> str:
        """The canonical spec string; `parse(rule.spec) == rule`."""
        parts = [f"{param.key}={getattr(self, param.key)}" for param in self.params]
        return self.name + (":" + ",".join(parts) if parts else "")

    def __str__(self) -> str:
        return self.spec
