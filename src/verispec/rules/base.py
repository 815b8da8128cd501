"""The verification-rule interface and the generic token-level sampling path.

At one draft position a single-draft verification rule is two functions of the target distribution
`p` (target_probs) and the draft distribution `q` (draft_probs) (docs/design/rules.md, section
'Rule anatomy'):

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

Batched verification (docs/design/rules.md, section 'Token roles'): rows may have ragged draft lengths,
draft_tokens padded with -1 after row i's last real draft (k_i real drafts, 0 <= k_i <= K); row i
uses uniforms[i, :k_i] for its drafts and uniforms[i, k_i] for its recovered/bonus token, and a
sequence of B generators draws k_i + 1 uniforms per row, so a row verified in a batch gives the
same result as verified alone with the same generator state.

Inputs are validated (finite, non-negative, rows summing to 1, shapes, token range) and a clear
`ValueError` is raised otherwise; maths runs in the input dtype (float32 or float64).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from verispec.probability import check_pair, check_probs, sample_from
from verispec.spec import Param, check_ranges

__all__ = ["BlockLaw", "Param", "Rule", "VerifyResult", "assemble_tokens", "blank_padding", "check_block",
           "draft_counts", "draw_uniforms", "refuse_diagnostics_without_law"]

@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one block per row.

    num_accepted [B]: accepted draft tokens (0..k_i).
    tokens [B, K+1]: the accepted draft tokens, then the recovered or bonus token (at column
        num_accepted), then -1 padding.
    accept_probs [B, K]: the acceptance probability used at each draft position (beyond the first
        rejection they were computed but not used); 0 at padded positions (j >= k_i).
    bonus [B]: True where all k_i draft tokens were accepted and the last token is a bonus token.
    num_drafts [B]: k_i, the number of real (non -1) draft tokens of each row.
    """

    num_accepted: Tensor
    tokens: Tensor
    accept_probs: Tensor
    bonus: Tensor
    num_drafts: Tensor


@dataclass(frozen=True)
class BlockLaw:
    """The exact law of one verified block given its drafts (docs/design/rules.md, 'Rule anatomy').

    num_accepted_probs [B, K+1]: P(n = m | drafts) for m = 0..K (0 for m > k_i), in float64.
    last_laws [B, K+1, V]: the law of the token emitted after m accepted drafts: the recovered token's
        law for m < k_i, the bonus law at m = k_i (rows past k_i are meaningless).
    num_drafts [B]: k_i.
    The block emits x_1..x_m then one token y with probability num_accepted_probs[m] * last_laws[m, y].
    """

    num_accepted_probs: Tensor
    last_laws: Tensor
    num_drafts: Tensor


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
# randomness


def draft_counts(draft_tokens: Tensor) -> Tensor:
    """k_i [B]: the number of real (non -1) draft tokens of each row of draft_tokens [B, K]."""
    return (draft_tokens >= 0).sum(-1)


def draw_uniforms(
    draft_tokens: Tensor,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """The randomness of `verify`: uniforms [B, K+1] in float64 for draft_tokens [B, K].

    One generator (or None, the global one): a single [B, K+1] draw. A sequence of B generators:
    row i draws exactly k_i + 1 uniforms from its own generator (`torch.rand(k_i + 1, generator=g_i)`)
    into uniforms[i, :k_i+1]; the columns after k_i are 0 and never read. So a row draws the same
    numbers whether it is verified alone (B=1, K=k_i) or in any batch (docs/design/rules.md, 'Token roles').
    """
    b, k = draft_tokens.shape
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand((b, k + 1), generator=generator, dtype=torch.float64, device=device)
    if isinstance(generator, (str, bytes)) or not isinstance(generator, Sequence):
        raise TypeError(
            "generator must be a torch.Generator, a sequence of B torch.Generator or None, got "
            f"{type(generator).__name__}"
        )
    if len(generator) != b:
        raise ValueError(f"per-row generators: got {len(generator)} generators for a batch of B = {b} rows")
    for i, g in enumerate(generator):
        if not isinstance(g, torch.Generator):
            raise TypeError(f"per-row generators: entry {i} is a {type(g).__name__}, not a torch.Generator")
    uniforms = torch.zeros((b, k + 1), dtype=torch.float64, device=device)
    for i, (g, k_i) in enumerate(zip(generator, draft_counts(draft_tokens).tolist())):
        uniforms[i, : k_i + 1] = torch.rand(k_i + 1, generator=g, dtype=torch.float64, device=device)
    return uniforms


def blank_padding(p: Tensor, q: Tensor, x: Tensor, num_drafts: Tensor) -> tuple[Tensor, Tensor]:
    """Copies of p [B, K+1, V] and q [B, K, V] whose unused rows (p after position k_i, q from k_i on)
    are uniform: padded rows may hold zeros or garbage (NaN) that the maths must never see."""
    k1, v = p.shape[1], p.shape[2]
    used_p = torch.arange(k1, device=p.device) <= num_drafts[:, None]  # [B, K+1]
    return torch.where(used_p[..., None], p, 1.0 / v), torch.where((x >= 0)[..., None], q, 1.0 / v)


# ---------------------------------------------------------------------------------------------
# input validation


def _check_kind(name: str, probs: Any) -> None:
    if not isinstance(probs, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(probs).__name__}")
    if probs.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{name} must be float32 or float64 probabilities, got {probs.dtype}")


def check_block(target_probs: Tensor, draft_probs: Tensor, draft_tokens: Tensor) -> None:
    """Validate the inputs of `verify`: p [B,K+1,V], q [B,K,V], x [B,K] (K >= 0).

    Row i may be ragged: k_i real draft tokens in [0, V), then only -1 (padding). Only the rows that
    are used are checked and read: p[i, :k_i+1] and q[i, :k_i] must be distributions (padded rows may
    hold zeros or garbage), and each real draft token must have q > 0 (it cannot have been drafted
    otherwise). Raises ValueError on: -1 followed by a real token, a token < -1 or >= V, bad shapes.
    """
    _check_kind("target_probs", target_probs)
    _check_kind("draft_probs", draft_probs)
    if not isinstance(draft_tokens, Tensor):
        raise ValueError(f"draft_tokens must be a torch.Tensor, got {type(draft_tokens).__name__}")
    if target_probs.ndim != 3 or draft_probs.ndim != 3 or draft_tokens.ndim != 2:
        raise ValueError(
            "verify expects target_probs [B, K+1, V], draft_probs [B, K, V] and draft_tokens [B, K]; got "
            f"{tuple(target_probs.shape)}, {tuple(draft_probs.shape)}, {tuple(draft_tokens.shape)}"
        )
    b, k1, v = target_probs.shape
    if k1 < 1 or v < 1 or draft_probs.shape != (b, k1 - 1, v) or draft_tokens.shape != (b, k1 - 1):
        raise ValueError(
            "shape mismatch: target_probs [B, K+1, V] needs draft_probs [B, K, V] and draft_tokens [B, K] "
            f"(K >= 0, V >= 1); got {tuple(target_probs.shape)}, {tuple(draft_probs.shape)}, "
            f"{tuple(draft_tokens.shape)}"
        )
    if target_probs.dtype != draft_probs.dtype:
        raise ValueError(f"target_probs is {target_probs.dtype} but draft_probs is {draft_probs.dtype}")
    if draft_tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    x = draft_tokens.long()
    ragged = False
    if x.numel():
        low, high = x.min().item(), x.max().item()
        if low < -1 or high >= v:
            raise ValueError(
                f"draft token outside the vocabulary: values must be in [0, {v}) (or -1 for padding after a "
                f"row's last real draft), got [{low}, {high}]"
            )
        ragged = low == -1
    if not ragged:  # the fast path: every position is used
        check_probs("target_probs", target_probs)
        check_probs("draft_probs", draft_probs)
        drafted_q = draft_probs.gather(-1, x[..., None])
    else:
        real = x >= 0  # [B, K]
        misplaced = real[:, 1:] & ~real[:, :-1]  # a real token right after a -1
        if misplaced.any():
            row, col = (int(i) for i in misplaced.nonzero()[0])
            raise ValueError(
                f"draft_tokens row {row}: -1 padding at position {col} is followed by a real draft token at "
                f"position {col + 1}; -1 may only pad a row after its last real draft"
            )
        used = torch.arange(k1, device=x.device) <= real.sum(-1, keepdim=True)  # [B, K+1]: positions 0..k_i
        check_probs("target_probs (positions 0..k_i)", target_probs[used])  # [N, V]
        check_probs("draft_probs (positions < k_i)", draft_probs[real])  # [M, V]
        drafted_q = draft_probs[real].gather(-1, x[real][:, None])  # [M, 1]
    if (drafted_q <= 0).any():
        raise ValueError("a draft token has zero probability under draft_probs: it cannot have been drafted")


def refuse_diagnostics_without_law(rule: "Rule") -> None:
    """ValueError for a lossy block rule (fly) asked for per-position diagnostics: whether its drafts are
    kept depends on the drafts after them, so no per-position law exists (docs/design/rules.md, 'fly')."""
    if rule.block_level and not rule.lossless:
        raise ValueError(
            f"rule '{rule.spec}' is block-level and lossy: a token's law depends on the drafts after it, so "
            "there is no per-position law for the diagnostics. Run it with diagnostics off "
            "(--no-diagnostics, diagnostics=False); its exact law is Rule.block_law, and `verispec audit` "
            "measures its shift on a served model")


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

    def law_and_expected_acceptance(self, target_probs: Tensor, draft_probs: Tensor) -> tuple[Tensor, Tensor]:
        """(`emitted_law` [..., V], the expected acceptance sum_x q(x) accept(x) [...]) without input
        checks: what the diagnostics need at a drafted position. A rule whose two share work overrides
        it (`LawRule`: its law is the one it verifies against, built once)."""
        accept = self._accept(target_probs, draft_probs)
        return self._emitted(target_probs, draft_probs), (draft_probs * accept).sum(-1)

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
        """Exact law of the token emitted at one draft position: [..., V] (docs/design/rules.md,
        'Rule anatomy')."""
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
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
    ) -> VerifyResult:
        """Verify one block per row: p [B,K+1,V], q [B,K,V], x [B,K]. Randomness only from `generator`.

        generator: one torch.Generator (or None): one [B, K+1] draw of uniforms; or a sequence of B
        generators, one per row: row i draws exactly k_i + 1 float64 uniforms from its own generator,
        so its result equals verifying that row alone (B=1, K=k_i) with the same generator state.
        Rows may be ragged (draft_tokens padded with -1 after k_i real drafts; k_i = 0 draws only the
        bonus token) and K may be 0. See `verify_with_uniforms` for how the uniforms are used.
        """
        if not isinstance(generator, torch.Generator) and generator is not None:
            check_block(target_probs, draft_probs, draft_tokens)  # k_i must be well defined to draw
            uniforms = draw_uniforms(draft_tokens, generator, target_probs.device)
            return self.verify_with_uniforms(target_probs, draft_probs, draft_tokens, uniforms,
                                             validate=False)
        b, k = draft_tokens.shape if draft_tokens.ndim == 2 else (0, 0)
        uniforms = torch.rand((b, k + 1), generator=generator, dtype=torch.float64,
                              device=target_probs.device)
        return self.verify_with_uniforms(target_probs, draft_probs, draft_tokens, uniforms)

    def verify_with_uniforms(
        self, target_probs: Tensor, draft_probs: Tensor, draft_tokens: Tensor, uniforms: Tensor,
        validate: bool = True,
    ) -> VerifyResult:
        """`verify` with its randomness given: uniforms [B, K+1] in [0, 1) (same noise, same output).

        Row i (k_i real drafts, the rest -1): uniforms[i, :k_i] decide its drafts (draft j is accepted
        iff uniforms[i, j] < accept), uniforms[i, k_i] draws its recovered or bonus token; columns after
        k_i are ignored. Padded positions are never accepted, their draft_probs rows and the
        target_probs rows after position k_i are never used (they may be zeros or garbage).

        validate=False skips the input checks, for callers that built the inputs themselves (the decode
        loop gets p and q from `verispec.sampling.process`)."""
        if validate:
            check_block(target_probs, draft_probs, draft_tokens)
            b, k1 = target_probs.shape[0], target_probs.shape[1]
            if not isinstance(uniforms, Tensor) or uniforms.shape != (b, k1):
                shape = tuple(uniforms.shape) if isinstance(uniforms, Tensor) else type(uniforms).__name__
                raise ValueError(f"uniforms must be a tensor of shape [B, K+1] = {(b, k1)}, got {shape}")
        return self._verify(target_probs, draft_probs, draft_tokens.long(), uniforms)

    def block_law(self, target_probs: Tensor, draft_probs: Tensor, draft_tokens: Tensor) -> BlockLaw:
        """The exact law of one verified block given its drafts: p [B,K+1,V], q [B,K,V], x [B,K] (rows
        may be ragged as in `verify`). For a token-wise rule P(n = m) = a_1...a_m (1 - a_{m+1}) with a_j
        the acceptance of draft j; block rules (hsd, fly) override `_block_law`."""
        check_block(target_probs, draft_probs, draft_tokens)
        return self._block_law(target_probs, draft_probs, draft_tokens.long())

    def _block_law(self, p: Tensor, q: Tensor, x: Tensor) -> BlockLaw:
        b, k = x.shape
        num_drafts = draft_counts(x)
        p, q = blank_padding(p, q, x, num_drafts)
        xs = x.clamp_min(0)
        a = self._accept_at(p[:, :k], q, xs).double().masked_fill(x < 0, 0.0)  # [B, K]
        reach = torch.cat([a.new_ones(b, 1), a.cumprod(-1)], -1)  # [B, K+1]: all drafts before m kept
        probs = reach * torch.cat([1 - a, a.new_ones(b, 1)], -1)  # stop at m, or keep all K
        probs = torch.where(torch.arange(k + 1, device=x.device) <= num_drafts[:, None], probs, 0.0)
        rows = torch.arange(b, device=x.device)
        probs[rows, num_drafts] = reach[rows, num_drafts]  # row i's block ends after k_i drafts
        residuals = self._residual_after(p[:, :k], q, xs) if k else p[:, :0]  # [B, K, V]
        last = torch.cat([residuals, p[:, k:]], 1)  # [B, K+1, V]
        last[rows, num_drafts] = self._bonus(p[rows, num_drafts])
        return BlockLaw(num_accepted_probs=probs, last_laws=last, num_drafts=num_drafts)

    def _verify_bonus_only(self, p: Tensor, uniforms: Tensor) -> VerifyResult:
        """K = 0: every row draws one bonus token from the bonus law of p[:, 0]."""
        b = p.shape[0]
        last = sample_from(self._bonus(p[:, 0]), uniforms[:, 0])  # [B]
        zeros = torch.zeros(b, dtype=torch.int64, device=p.device)
        return VerifyResult(num_accepted=zeros, tokens=last[:, None], accept_probs=p.new_zeros(b, 0),
                            bonus=torch.ones(b, dtype=torch.bool, device=p.device), num_drafts=zeros.clone())

    def _verify(self, p: Tensor, q: Tensor, x: Tensor, uniforms: Tensor) -> VerifyResult:
        b, k = x.shape
        if k == 0:
            return self._verify_bonus_only(p, uniforms)
        num_drafts = draft_counts(x)  # [B]
        ragged = bool((num_drafts < k).any())
        if ragged:
            real = x >= 0  # [B, K]
            p, q = blank_padding(p, q, x, num_drafts)
            x = x.clamp_min(0)  # padded positions read token 0 of a uniform row; their results are masked out
            accept_probs = self._accept_at(p[:, :k], q, x).masked_fill(~real, 0)  # [B, K]
        else:
            accept_probs = self._accept_at(p[:, :k], q, x)  # [B, K]
        accepted = uniforms[:, :k] < accept_probs.to(torch.float64)  # [B, K], never at a padded position
        num_accepted = accepted.to(torch.int64).cumprod(-1).sum(-1)  # [B]
        rows = torch.arange(b, device=p.device)
        j = num_accepted.clamp(max=k - 1)  # position of the first rejection, where there is one
        recovered = self._residual_after(p[rows, j], q[rows, j], x[rows, j])  # [B, V]
        bonus = num_accepted == num_drafts
        if ragged:
            bonus_p, u_last = p[rows, num_drafts], uniforms[rows, num_drafts]  # [B, V], [B]
        else:
            bonus_p, u_last = p[:, k], uniforms[:, k]
        law = torch.where(bonus[:, None], self._bonus(bonus_p), recovered)  # [B, V]
        tokens = assemble_tokens(x, num_accepted, sample_from(law, u_last))
        return VerifyResult(num_accepted=num_accepted, tokens=tokens, accept_probs=accept_probs, bonus=bonus,
                            num_drafts=num_drafts)

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
                "parameters": "; ".join(params) or cls.usage or "-", "what it does": cls.summary,
                "source": cls.source}

    @property
    def spec(self) -> str:
        """The canonical spec string; `parse(rule.spec) == rule`."""
        parts = [f"{param.key}={getattr(self, param.key)}" for param in self.params]
        return self.name + (":" + ",".join(parts) if parts else "")

    def __str__(self) -> str:
        return self.spec
