"""Verification rules on token trees, each with its exact law (docs/design/trees.md, section 'Trees').

A tree is verified top-down. At a *frontier* (the accepted path so far; several nodes only for
unmerged sampled chains that share it) with target distribution `p`, the candidates are the
frontier's children c_1..c_m in proposal order. A rule gives, in closed form,

    accept_j   the probability that c_j is accepted given that c_1..c_{j-1} were rejected;
    residual   the law of the token emitted when all m are rejected (the bonus law when m = 0);

so the law of the next emitted token at the frontier is

    emitted(y) = sum_j reach_j * accept_j * [c_j = y] + reach_{m+1} * residual(y),
    reach_j    = prod_{i<j} (1 - accept_i),

and the law of a whole block (accepted path plus the recovered or bonus token) follows by recursion
(`block_law`). `verify_tree` samples the same rule with uniforms given up front: uniforms[node] for
node's acceptance test, uniforms[0] for the final token (inverse-CDF, as the chain rules).

Rules (`parse_tree_rule`): `lossless` (recursive rejection sampling over siblings, SpecInfer, Miao
et al. 2024; with each candidate's proposal law, one-hot for deterministic top-k children),
`greedy`, `lenience:l=` (q taken as 1), `speccascade:min_p=`, `typical:eps=[,alpha=]` and
`sglang:single=,acc=` (SGLang `tree_speculative_sampling_target_only`, one coin per depth) and
`budget:tv=[,ratio=]` (q taken as 1 on the candidates). Traversal Verification: `verispec.trees.traversal`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from verispec.gates import eta_mask, min_p_mask
from verispec.probability import check_probs, normalize, one_hot_argmax, sample_from
from verispec.rules.budget import budget_target
from verispec.spec import Param, Registry, check_ranges, parse_params, split
from verispec.trees.structure import TokenTree

__all__ = ["FrontierLaw", "TreeRule", "TreeVerifyResult", "block_law", "parse_tree_rule",
           "recursive_rejection", "step_laws", "tree_rule_names", "verify_tree"]


@dataclass(frozen=True)
class FrontierLaw:
    """accept [m]: conditional acceptance of each candidate; residual [V]: law after all are rejected."""

    accept: Tensor
    residual: Tensor

    def emitted(self, candidate_tokens: Tensor) -> Tensor:
        """[V]: the law of the next emitted token at the frontier."""
        rejected_before = torch.cat([self.accept.new_ones(1), torch.cumprod(1 - self.accept, 0)])  # [m+1]
        out = self.residual * rejected_before[-1]
        return out.index_add(0, candidate_tokens, rejected_before[:-1] * self.accept)


@dataclass(frozen=True)
class TreeVerifyResult:
    """nodes: accepted node indices, one per depth; tokens [len(nodes)+1]: their tokens, then the
    recovered or bonus token; bonus: whether the last token is a bonus token (the path reached a leaf)."""

    nodes: tuple[int, ...]
    tokens: tuple[int, ...]
    bonus: bool


@dataclass(frozen=True)
class TreeRule:
    """A tree verification rule: `frontier` gives its exact law at one frontier."""

    name: ClassVar[str]
    family: ClassVar[str]
    source: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    params: ClassVar[tuple[Param, ...]] = ()

    def __post_init__(self) -> None:
        check_ranges("tree rule", self.name, self.params, {p.key: getattr(self, p.key) for p in self.params})

    def lossless_for(self, proposal: str) -> bool:
        """Whether the rule's block law is the target's on trees drafted with this proposal kind."""
        return False

    def frontier(self, target_probs: Tensor, candidate_tokens: Tensor, proposal_probs: Tensor) -> FrontierLaw:
        """target_probs [V] at the frontier, candidate_tokens [m], proposal_probs [m, V] -> FrontierLaw."""
        raise NotImplementedError

    def decide(self, law: FrontierLaw, target_probs: Tensor, candidate_tokens: Tensor,
               uniforms: Tensor) -> int:
        """Index of the accepted candidate (or -1): the first j with uniforms[j] < accept_j."""
        hits = (uniforms < law.accept.to(torch.float64)).nonzero()
        return int(hits[0]) if hits.numel() else -1

    @property
    def spec(self) -> str:
        parts = [f"{param.key}={getattr(self, param.key)}" for param in self.params]
        return self.name + (":" + ",".join(parts) if parts else "")


def _zero(w: Tensor, token: Tensor) -> Tensor:
    """norm(w with `token` zeroed); w itself if nothing would remain."""
    return normalize(w.index_fill(0, token.reshape(1), 0.0), w)


def recursive_rejection(law: Tensor, candidate_tokens: Tensor, proposal_probs: Tensor) -> FrontierLaw:
    """Lossless verification of the candidates against `law` [V] (docs/design/trees.md, 'Trees'): accept
    c_j with min(1, w(c_j) / r_j(c_j)), else w <- norm((w - r_j)+), from w = law; emits `law`."""
    w = law
    accept = []
    for tok, r in zip(candidate_tokens, proposal_probs):
        accept.append((w[tok] / r[tok]).clamp(max=1.0))  # r[tok] > 0: the candidate was proposed
        w = normalize((w - r).clamp_min(0), w)
    return FrontierLaw(torch.stack(accept) if accept else w.new_zeros(0), w)


TREE_RULES: Registry[type[TreeRule]] = Registry("tree rule")


def _register(cls: type[TreeRule]) -> type[TreeRule]:
    return TREE_RULES.add(cls.name, cls)


@_register
@dataclass(frozen=True)
class TreeLossless(TreeRule):
    """Recursive rejection sampling over siblings (SpecInfer, Miao et al. 2024, Algorithm 2 'multi-step
    speculative sampling'): accept c_j with min(1, w(c_j) / r_j(c_j)), then w <- norm((w - r_j)+),
    with w = p at first and r_j the law c_j was proposed from (one-hot for top-k children)."""

    name = "lossless"
    family = "lossless"
    source = "Miao et al. 2024 (SpecInfer, multi-step speculative sampling)"
    summary = "recursive rejection sampling over siblings with each candidate's proposal law"

    def lossless_for(self, proposal: str) -> bool:
        return True

    def frontier(self, target_probs: Tensor, candidate_tokens: Tensor, proposal_probs: Tensor) -> FrontierLaw:
        return recursive_rejection(target_probs, candidate_tokens, proposal_probs)


@_register
@dataclass(frozen=True)
class TreeGreedy(TreeRule):
    """Accept the first child equal to argmax p (first index on ties); else emit argmax p."""

    name = "greedy"
    family = "lossless"
    source = "Leviathan et al. 2023, sec. 2.3 (temperature 0), on trees"
    summary = "accept the child equal to argmax p; exactly greedy decoding"

    def frontier(self, target_probs: Tensor, candidate_tokens: Tensor, proposal_probs: Tensor) -> FrontierLaw:
        best = int(target_probs.argmax())
        accept = (candidate_tokens == best).to(target_probs.dtype)  # [m]
        return FrontierLaw(accept, one_hot_argmax(target_probs))


@_register
@dataclass(frozen=True)
class TreeLenience(TreeRule):
    """The founding paper's tree lenience, q taken as 1: accept c_j with min(1, w(c_j) / l), then
    w <- norm(w with c_j zeroed) (w = p at first); lossless at l = 1 on every tree (given the tree each
    candidate is a constant), but on sampled children it accepts less than `lossless`."""

    name = "lenience"
    family = "collaborative"
    source = "Leviathan et al. 2023, sec. 3.5 (lenience); tree form with q = 1"
    summary = "accept min(1, w(c)/l), w <- w without c"
    params = (Param("l", float, "0 < l <= 1 (1 = lossless)", lambda v: 0 < v <= 1),)
    l: float  # noqa: E741 (the rule's public parameter name)

    def lossless_for(self, proposal: str) -> bool:
        return self.l == 1

    def frontier(self, target_probs: Tensor, candidate_tokens: Tensor, proposal_probs: Tensor) -> FrontierLaw:
        w = target_probs
        accept = []
        for tok in candidate_tokens:
            accept.append((w[tok] / self.l).clamp(max=1.0))
            w = _zero(w, tok)
        return FrontierLaw(torch.stack(accept) if accept else w.new_zeros(0), w)


@dataclass(frozen=True)
class _GateRule(TreeRule):
    """Accept c_j iff it lies in the gate A(p) of the frontier's target; a rejected child is zeroed
    in p and p renormalised; after all are rejected the token is drawn from that p."""

    family = "truncation"

    def gate(self, p: Tensor) -> Tensor:
        raise NotImplementedError

    def frontier(self, target_probs: Tensor, candidate_tokens: Tensor, proposal_probs: Tensor) -> FrontierLaw:
        accept = self.gate(target_probs)[candidate_tokens].to(target_probs.dtype)  # [m]
        rejected = candidate_tokens[accept == 0]
        kept = target_probs.index_fill(0, rejected, 0.0)
        return FrontierLaw(accept, normalize(kept, target_probs))


@_register
@dataclass(frozen=True)
class TreeSpecCascade(_GateRule):
    name = "speccascade"
    source = "Narasimhan et al. 2025 (SpecCascade, min-p deferral), tree form"
    summary = "accept the first child with p(c) >= min_p * max p; rejected children zeroed"
    params = (Param("min_p", float, "0 < min_p <= 1", lambda v: 0 < v <= 1),)
    min_p: float

    def gate(self, p: Tensor) -> Tensor:
        return min_p_mask(p, self.min_p)


@_register
@dataclass(frozen=True)
class TreeTypical(_GateRule):
    name = "typical"
    source = "Cai et al. 2024 (Medusa, typical acceptance), tree form"
    summary = "accept the first child with p(c) > min(eps, alpha*exp(-H(p))); rejected children zeroed"
    params = (Param("eps", float, "0 < eps < 1", lambda v: 0 < v < 1),
              Param("alpha", float, "0 < alpha <= 1 (default sqrt(eps))", lambda v: 0 < v <= 1))
    eps: float
    alpha: float | None = None

    def __post_init__(self) -> None:
        if self.alpha is None and isinstance(self.eps, (int, float)) and self.eps > 0:
            object.__setattr__(self, "alpha", math.sqrt(self.eps))
        super().__post_init__()

    def gate(self, p: Tensor) -> Tensor:
        return eta_mask(p, self.eps, self.alpha)


@_register
@dataclass(frozen=True)
class TreeSGLang(TreeRule):
    """SGLang `tree_speculative_sampling_target_only`: ONE coin u per depth; with P_j = p(c_1) + ... +
    p(c_j), child c_j is accepted iff p(c_j) >= single or u <= P_j / acc (the first such child); after
    all are rejected the token is drawn from p with the tried children zeroed. Conditionally on
    reaching c_j (u > t_{j-1}, t_j = min(1, P_j / acc)): accept_j = (t_j - t_{j-1}) / (1 - t_{j-1})."""

    name = "sglang"
    family = "collaborative"
    source = "SGLang tree_speculative_sampling_target_only (threshold_single, threshold_acc)"
    summary = "one coin per depth: accept iff p(c) >= single or u <= cumsum p / acc"
    params = (Param("single", float, "0 < single <= 1", lambda v: 0 < v <= 1),
              Param("acc", float, "0 < acc <= 1", lambda v: 0 < v <= 1))
    single: float
    acc: float

    def lossless_for(self, proposal: str) -> bool:
        """At single = acc = 1 with distinct siblings; i.i.d. duplicates count twice in the sum P_j."""
        return self.single == 1 and self.acc == 1 and proposal in ("topk", "distinct")

    def _thresholds(self, target_probs: Tensor, candidate_tokens: Tensor) -> Tensor:
        return (target_probs[candidate_tokens].cumsum(0) / self.acc).clamp(max=1.0)  # [m]

    def frontier(self, target_probs: Tensor, candidate_tokens: Tensor, proposal_probs: Tensor) -> FrontierLaw:
        if candidate_tokens.numel() == 0:
            return FrontierLaw(target_probs.new_zeros(0), target_probs)
        values = target_probs[candidate_tokens]  # [m]
        t = self._thresholds(target_probs, candidate_tokens)
        before = torch.cat([t.new_zeros(1), t[:-1]])  # t_{j-1}, [m]
        room = 1 - before
        by_coin = torch.where(room > 0, (t - before) / room.clamp_min(torch.finfo(t.dtype).tiny), 1.0)
        accept = torch.where(values >= self.single, torch.ones_like(t), by_coin)
        kept = target_probs.index_fill(0, candidate_tokens, 0.0)
        return FrontierLaw(accept, normalize(kept, target_probs))

    def decide(self, law: FrontierLaw, target_probs: Tensor, candidate_tokens: Tensor,
               uniforms: Tensor) -> int:
        """The kernel's own test, with uniforms[0] as the depth's coin."""
        t = self._thresholds(target_probs, candidate_tokens).to(torch.float64)
        hit = (uniforms[0] < t) | (target_probs[candidate_tokens] >= self.single)
        found = hit.nonzero()
        return int(found[0]) if found.numel() else -1


@_register
@dataclass(frozen=True)
class TreeBudget(TreeRule):
    """`budget` on trees, q taken as 1 on the candidates: r = budget_target(p, 1_C) moves
    m = min(tv, sum over candidates of (min(1, ratio*p) - p)+, p(not C)) from the other tokens
    (in proportion to p) to the candidates (in proportion to their room), then verifies losslessly
    against r, so emitted = r: TV(r, p) = m <= tv, r <= ratio * p. On top-k trees its acceptance
    r(C) = p(C) + m is the largest any rule with those two constraints can have."""

    name = "budget"
    family = "bounded"
    source = "verispec (docs/design/trees.md, 'Trees'): budget with q taken as 1 on the candidates"
    summary = "largest acceptance with TV <= tv per token and overshoot <= ratio"
    params = (Param("tv", float, "0 <= tv <= 1 (0 = lossless)", lambda v: 0 <= v <= 1),
              Param("ratio", float, "ratio >= 1 (may be inf)", lambda v: v >= 1 and not math.isnan(v)))
    tv: float
    ratio: float = 2.0

    def lossless_for(self, proposal: str) -> bool:
        return self.tv == 0 or self.ratio == 1

    def target(self, target_probs: Tensor, candidate_tokens: Tensor) -> Tensor:
        """r [V], the law the candidates are verified against."""
        ones = torch.zeros_like(target_probs).index_fill(0, candidate_tokens, 1.0)  # q taken as 1 on C
        return budget_target(target_probs, ones, self.tv, self.ratio)

    def frontier(self, target_probs: Tensor, candidate_tokens: Tensor, proposal_probs: Tensor) -> FrontierLaw:
        law = self.target(target_probs, candidate_tokens)
        return recursive_rejection(law, candidate_tokens, proposal_probs)


# ---------------------------------------------------------------------------------------------
# registry and parsing


def tree_rule_names() -> list[str]:
    return TREE_RULES.names()


def parse_tree_rule(spec: str) -> TreeRule:
    """A tree rule from its spec string, e.g. `lossless`, `lenience:l=0.5`, `sglang:single=0.9,acc=0.5`."""
    name, args = split(spec, "tree rule", "lenience:l=0.5")
    cls = TREE_RULES.get(name)
    optional = {TreeTypical: "alpha", TreeBudget: "ratio"}.get(cls)
    required = tuple(p.key for p in cls.params if p.key != optional)
    return cls(**parse_params("tree rule", cls.name, args, cls.params, required))


# ---------------------------------------------------------------------------------------------
# sampling and exact laws


def _check(tree: TokenTree, target_probs: Tensor) -> None:
    check_probs("target_probs", target_probs)
    if target_probs.shape != tree.draft_probs.shape:
        raise ValueError(f"target_probs must be [N+1, V] = {tuple(tree.draft_probs.shape)} (one row per tree "
                         f"node, the root first), got {tuple(target_probs.shape)}")


def _frontier_law(rule: TreeRule, tree: TokenTree, proposals: Tensor, target_probs: Tensor,
                  frontier: list[int]) -> tuple[list[int], FrontierLaw]:
    candidates = tree.children(frontier)
    idx = torch.tensor(candidates, dtype=torch.long)
    return candidates, rule.frontier(target_probs[frontier[0]], tree.tokens[idx], proposals[idx])


def verify_tree(rule: TreeRule, tree: TokenTree, target_probs: Tensor, uniforms: Tensor,
                validate: bool = True) -> TreeVerifyResult:
    """Verify one tree: target_probs [N+1, V] (row i: the target after node i's path), uniforms [N+1]
    float64 in [0, 1) (uniforms[i] for node i's test, uniforms[0] for the final token)."""
    if validate:
        _check(tree, target_probs)
        if not isinstance(uniforms, Tensor) or uniforms.shape != (tree.size + 1,):
            raise ValueError(f"uniforms must be a tensor [N+1] = [{tree.size + 1}]")
    proposals = tree.proposal_probs()
    frontier, accepted = [0], []
    while True:
        candidates, law = _frontier_law(rule, tree, proposals, target_probs, frontier)
        p = target_probs[frontier[0]]
        j = -1
        if candidates:
            idx = torch.tensor(candidates, dtype=torch.long)
            j = rule.decide(law, p, tree.tokens[idx], uniforms[idx])
        if j < 0:
            last = sample_from(law.residual[None], uniforms[:1])[0]
            tokens = tuple(int(tree.tokens[n]) for n in accepted) + (int(last),)
            return TreeVerifyResult(nodes=tree.ancestry(accepted[-1]) if accepted else (), tokens=tokens,
                                    bonus=not candidates)
        node = candidates[j]
        accepted.append(node)
        frontier = tree.same_path(frontier, int(tree.tokens[node]))


def block_law(rule: TreeRule, tree: TokenTree, target_probs: Tensor) -> dict[tuple[int, ...], float]:
    """Exact law of the tokens one block emits on this tree: {token tuple: probability} (float64)."""
    _check(tree, target_probs)
    proposals = tree.proposal_probs()
    out: dict[tuple[int, ...], float] = {}

    def walk(frontier: list[int], prefix: tuple[int, ...], weight: float) -> None:
        candidates, law = _frontier_law(rule, tree, proposals, target_probs, frontier)
        reach = weight
        for j, node in enumerate(candidates):
            a = float(law.accept[j])
            if reach * a > 0:
                tok = int(tree.tokens[node])
                walk(tree.same_path(frontier, tok), prefix + (tok,), reach * a)
            reach *= 1 - a
        if reach > 0:
            for tok, pr in enumerate(law.residual.tolist()):
                if pr > 0:
                    out[prefix + (tok,)] = out.get(prefix + (tok,), 0.0) + reach * pr

    walk([0], (), 1.0)
    return out


def step_laws(rule: TreeRule, tree: TokenTree, target_probs: Tensor, result: TreeVerifyResult) -> Tensor:
    """[n+1, V]: the law of each emitted token given the tree and the accepted path before it (the
    per-step laws of the diagnostics). On a top-k tree the tree is a function of the prefix, so these
    are the laws given the prefix; a lossless rule's are p only after averaging over sampled trees."""
    proposals = tree.proposal_probs()
    frontier, laws = [0], []
    for node in (*result.nodes, None):
        candidates, law = _frontier_law(rule, tree, proposals, target_probs, frontier)
        idx = torch.tensor(candidates, dtype=torch.long)
        laws.append(law.emitted(tree.tokens[idx]))
        if node is not None:
            frontier = tree.same_path(frontier, int(tree.tokens[node]))
    return torch.stack(laws)  # [n+1, V]
