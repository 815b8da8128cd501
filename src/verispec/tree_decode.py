"""Tree and multi-draft blocks of the decode engine (`BatchDecoder` with `DecodeConfig.tree`).

docs/design.md, sections 'Trees' and 'Tree decoding'. One block per row: the drafter expands a token
tree after the row's committed tokens (`tree:widths=...`, the draft's top-k children;
`tree:nodes=...,depth=...,topk=...`, EAGLE-2's dynamic tree; or `drafts:n=...`, n chains sampled from
the draft), the target scores every node, the tree rule (or
Traversal Verification) picks the accepted path and the last token, and the row's target cache keeps
the committed tokens plus the accepted path only.

Target scoring: a `LeanBatchSession` scores all rows' trees in ONE tree-attention pass
(`verispec.models.lean_tree.score_tree`) and keeps the accepted paths with `commit_paths`. Any other
backend takes the per-row FALLBACK: one `BatchSession.logits_for` call per root-to-leaf path of each
row's tree (correct, not fast; the block still counts as one target call). Drafting: deterministic
trees (top-k, dynamic) grow for all rows together, one draft pass per level scoring the nodes to expand
and their ancestors on the drafter's own session (`draft_trees`); multi-drafts row by row, each
`draft_fn` call scoring the requested paths as a small tree.

Randomness per row, from the row's own generator in a fixed order: `drafts:n=` draws n x D float64
uniforms for its chains (`sample_chains`), then every block draws N+1 float64 uniforms for the
verification (`verify_tree` / `traversal_verify`; N drafted nodes). Top-k and dynamic trees draw
nothing to draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from verispec.models.base import BatchSession, batch_session
from verispec.models.lean import LeanBatchSession
from verispec.models.lean_tree import TreePass, commit_paths, score_tree
from verispec.rules import Rule
from verispec.sampling import SamplingConfig, process
from verispec.trees import (DraftShape, MultiDraft, TokenTree, TreeRule, TreeVerifyResult, chain_tree, grow,
                            growth, parse_tree_rule, sample_chains, step_laws, traversal_verify, verify_tree)

__all__ = ["TRAVERSAL", "TreeBlock", "TreeScorer", "TreeVerification", "draft_tree", "draft_trees",
           "refuse_tree_rule", "shape_depth", "shape_nodes", "tree_verification", "tree_verification_rule",
           "verify_block"]

TRAVERSAL = "traversal"


def shape_depth(shape: DraftShape, k: int) -> int:
    """The tree's depth: the number of widths, a dynamic tree's depth, or the chains' depth (default:
    the run's k)."""
    return shape.depth if shape.depth is not None else k


def shape_nodes(shape: DraftShape, k: int) -> int:
    """The drafted nodes of a full block: `TreeWidths.nodes`, a dynamic tree's `nodes`, or n chains x
    their depth (kept unmerged)."""
    if isinstance(shape, MultiDraft):
        return shape.n * shape_depth(shape, k)
    return shape.nodes


@dataclass(frozen=True)
class TreeVerification:
    """A tree rule (None: Traversal Verification) with the draft shape it verifies: what a tree-mode
    `Generation.rule` holds. `lossless` says whether the block law is the target's on this shape
    (`TreeRule.lossless_for`; Traversal always); other attributes (a budget's tv, ratio) are the rule's."""

    rule: TreeRule | None
    shape: DraftShape

    block_level = False

    @property
    def name(self) -> str:
        return TRAVERSAL if self.rule is None else self.rule.name

    @property
    def spec(self) -> str:
        return TRAVERSAL if self.rule is None else self.rule.spec

    @property
    def family(self) -> str:
        return "lossless" if self.rule is None else self.rule.family

    @property
    def proposal(self) -> str:
        return self.shape.proposal

    @property
    def lossless(self) -> bool:
        return self.rule is None or self.rule.lossless_for(self.proposal)

    def __getattr__(self, key: str):
        if key.startswith("__") or self.rule is None:
            raise AttributeError(key)
        return getattr(self.rule, key)


def tree_verification_rule(rule, shape: DraftShape) -> TreeVerification:
    """Pair a tree rule with a draft shape, checked without any model (the api and sweeps call it
    before loading). rule: a tree rule spec (`lossless`, `greedy`, `lenience:l=0.5`, ..., or
    `traversal`), a `TreeRule`, or a `TreeVerification`. ValueError: a chain rule object, and a lossy
    rule on sampled drafts (its per-step law is known exactly only given the drafted tree, not given
    the prefix; top-k trees are a function of the prefix)."""
    if isinstance(rule, TreeVerification):
        rule = rule.rule if rule.rule is not None else TRAVERSAL
    if isinstance(rule, Rule):
        raise ValueError(f"rule '{rule.spec}' is a chain rule; a tree draft ({shape.spec}) needs a tree "
                         "rule: lossless, greedy, lenience:l=, speccascade:min_p=, typical:eps=, "
                         "sglang:single=,acc=, budget:tv= or traversal")
    if rule is None:
        raise ValueError("tree decoding needs a verification rule, e.g. 'lossless' or 'traversal'")
    if isinstance(rule, str):
        try:
            rule = None if rule.strip() == TRAVERSAL else parse_tree_rule(rule)
        except ValueError as err:
            raise ValueError(f"{err} (or traversal)") from None
    verification = TreeVerification(rule, shape)
    if isinstance(shape, MultiDraft) and not verification.lossless:
        raise ValueError(f"rule '{verification.spec}' is lossy on sampled drafts ({shape.spec}): its exact "
                         "per-token law is known given the prefix only on top-k trees; use tree:widths=... "
                         "or a lossless rule (lossless, traversal)")
    return verification


def refuse_tree_rule(rule) -> None:
    """ValueError if `rule` (a spec str or a rule object) is a tree rule, `traversal`, a `TreeRule` or a
    `TreeVerification`, given for chain drafts (no tree shape)."""
    tree_only = isinstance(rule, str) and rule.strip() == TRAVERSAL
    if tree_only or isinstance(rule, (TreeRule, TreeVerification)):
        spec = rule if isinstance(rule, str) else rule.spec
        raise ValueError(f"'{spec.strip()}' is a tree rule: give a tree draft (e.g. tree:widths=4,2,2,1 or "
                         "drafts:n=3: DecodeConfig.tree, generate(tree=...), --tree, or a served request's "
                         "verification.tree), or a chain rule")


def tree_verification(rule, shape: DraftShape, drafter, vocab_size: int) -> TreeVerification:
    """`tree_verification_rule`, then the drafter and vocabulary (before any forward pass): ValueError
    for no drafter or a model-free one, and a width above the vocabulary."""
    verification = tree_verification_rule(rule, shape)
    if drafter is None or getattr(drafter, "model", None) is None:
        got = "no drafter" if drafter is None else getattr(drafter, "name", drafter)
        raise ValueError(f"a tree draft ({shape.spec}) needs a model drafter (its distribution at every "
                         f"node); got {got}")
    if not isinstance(shape, MultiDraft) and shape.widest > vocab_size:
        raise ValueError(f"tree width {shape.widest} exceeds the vocabulary ({vocab_size} tokens); "
                         "use widths (or topk) of at most the vocabulary size")
    return verification


# ---------------------------------------------------------------------------------------------
# scoring trees on a session: batched on the lean backend, per path elsewhere


def _leaves(parents: Tensor) -> list[int]:
    has_child = torch.zeros(parents.shape[0], dtype=torch.bool)
    has_child[parents[1:].clamp_min(0)] = True
    return (~has_child).nonzero().flatten().tolist()


class TreeScorer:
    """Scores token trees after each row's context on one model's `BatchSession`.

    `score` then `commit` (or `rollback`), always in that order: the lean backend keeps the pass's
    nodes in the cache until then."""

    def __init__(self, model) -> None:
        self.session: BatchSession = batch_session(model)
        self.batched = isinstance(self.session, LeanBatchSession)
        self._pass: TreePass | None = None
        self.passes = 0  # forward passes made (the fallback makes one per root-to-leaf path)

    def score(self, rows: Sequence[int], contexts: Sequence[Tensor], tokens: Sequence[Tensor],
              parents: Sequence[Tensor]) -> list[Tensor]:
        """Per row: context [L], tree tokens, parents [M] (node 0 the root = context[-1], parent -1)
        -> logits [M, V] (node i: after the context plus node i's path)."""
        if self.batched:
            logits, self._pass = score_tree(self.session, rows, contexts, tokens, parents)
            self.passes += 1
            return logits
        out = []
        for row, ctx, tok, par in zip(rows, contexts, tokens, parents):
            # FALLBACK (not a tree pass): one causal pass per root-to-leaf path, prefix-cached
            logits: list[Tensor | None] = [None] * tok.shape[0]
            for leaf in _leaves(par):
                path, node = [], leaf
                while node > 0:
                    path.append(node)
                    node = int(par[node])
                path.reverse()  # nodes below the root, root side first
                seq = torch.cat([ctx, tok[path]]) if path else ctx  # [L + len(path)]
                got = self.session.logits_for([row], [seq], [len(path) + 1])[0]  # [len(path)+1, V]
                self.passes += 1
                for j, n in enumerate([0, *path]):
                    if logits[n] is None:
                        logits[n] = got[j]
            out.append(torch.stack(logits))  # [M, V]
        return out

    def commit(self, kept: Sequence[Sequence[int]]) -> None:
        """Row b's cache keeps its context plus the tree nodes kept[b] (a path below the root)."""
        if self._pass is not None:
            commit_paths(self.session, self._pass, kept)
            self._pass = None

    def rollback(self) -> None:
        """Every row's cache goes back to its context minus the root (the state before `score`)."""
        if self._pass is not None:
            commit_paths(self.session, self._pass, None)
            self._pass = None

    def release(self, row: int) -> None:
        self.session.release(row)


def _trie(paths: Sequence[tuple[int, ...]], root: int) -> tuple[Tensor, Tensor, dict[tuple[int, ...], int]]:
    """The tree of every prefix of `paths`: tokens, parents [M] (node 0 the root) and path -> node."""
    index: dict[tuple[int, ...], int] = {(): 0}
    tokens, parents = [root], [-1]
    for path in sorted(set(paths), key=len):
        for d in range(1, len(path) + 1):
            if path[:d] not in index:
                index[path[:d]] = len(tokens)
                tokens.append(path[d - 1])
                parents.append(index[path[: d - 1]])
    return torch.tensor(tokens), torch.tensor(parents), index


class _RowDraft:
    """A row's `draft_fn(paths) -> [n, V]`: the draft's processed distribution after the row's context
    plus each path, scored as a small tree on the drafter's session (memoised within the block)."""

    def __init__(self, scorer: TreeScorer, row: int, context: Tensor, sampling: SamplingConfig):
        self.scorer, self.row, self.context, self.sampling = scorer, row, context, sampling
        self.memo: dict[tuple[int, ...], Tensor] = {}

    def __call__(self, paths: Sequence[tuple[int, ...]]) -> Tensor:
        missing = [tuple(p) for p in paths if tuple(p) not in self.memo]
        if missing:
            tokens, parents, index = _trie(missing, int(self.context[-1]))
            logits = self.scorer.score([self.row], [self.context], [tokens], [parents])[0]  # [M, V]
            self.scorer.rollback()
            q = process(logits, self.sampling)  # [M, V]
            for path, node in index.items():
                self.memo[path] = q[node]
        return torch.stack([self.memo[tuple(p)] for p in paths])  # [n, V]


def _root_only(vocab: int, proposal: str) -> TokenTree:
    """The tree without drafted nodes: the block emits one token from the target (the bonus law)."""
    return TokenTree(parents=torch.tensor([-1]), depths=torch.tensor([0]), tokens=torch.tensor([-1]),
                     draft_probs=torch.zeros(1, vocab), proposal=proposal)


def draft_tree(scorer: TreeScorer, row: int, context: Tensor, shape: DraftShape, depth: int,
               sampling: SamplingConfig, generator: torch.Generator | None, vocab: int) -> TokenTree:
    """Draft one row's tree of at most `depth` levels after `context` (the shape cut to the room left).

    Top-k and dynamic trees rank children (and dynamic trees their nodes) by the draft's own distribution
    (softmax of its logits, temperature 1, no truncation), as EAGLE does: it orders tokens as the
    processed one does wherever that one is positive, and still ranks them where it is zero (at
    temperature 0 every token but the argmax). The children are deterministic, so their proposal law is
    one-hot whatever the ranking, and no tree rule reads q on deterministic trees; their `draft_probs`
    (the diagnostics' q) are that distribution. Sampled drafts draw from the processed draft, as chains do
    (their proposal law is q itself)."""
    if depth < 1:
        return _root_only(vocab, shape.proposal)
    if not isinstance(shape, MultiDraft):
        return grow(growth(shape, depth), _RowDraft(scorer, row, context, SamplingConfig()), vocab)
    draft_fn = _RowDraft(scorer, row, context, sampling)
    uniforms = torch.rand(shape.n, depth, generator=generator, dtype=torch.float64)  # [n, D]
    chains = sample_chains(shape.n, depth, draft_fn, uniforms, bool(shape.replacement))  # [n, D]
    return chain_tree(chains, draft_fn, bool(shape.replacement))


def draft_trees(scorer: TreeScorer, rows: Sequence[int], contexts: Sequence[Tensor], shape: DraftShape,
                depths: Sequence[int], sampling: SamplingConfig, generators: Sequence[torch.Generator | None],
                vocab: int) -> tuple[list[TokenTree], list[int]]:
    """Every row's tree for this block, and the draft passes each row took part in.

    Deterministic trees (top-k, dynamic) grow for all rows together, one draft pass per step over the
    rows still growing; each pass scores the nodes the step needs and their ancestors (for top-k trees
    the whole tree so far), then rolls them back. Node for node the tree `topk_tree` / `dynamic_tree`
    builds (tested). Multi-drafts are drawn row by row (`draft_tree`)."""
    if isinstance(shape, MultiDraft):
        trees, passes = [], []
        for row, context, depth, gen in zip(rows, contexts, depths, generators):
            before = scorer.passes
            trees.append(draft_tree(scorer, row, context, shape, depth, sampling, gen, vocab))
            passes.append(scorer.passes - before)
        return trees, passes
    states = [growth(shape, depth) for depth in depths]
    passes = [0] * len(rows)
    while active := [i for i, state in enumerate(states) if state.wanted]:
        indices = []  # per row: node id -> its place in the scored subtree (the root first)
        tokens, parents = [], []
        for i in active:
            nodes = states[i].scored()
            index = {node: j for j, node in enumerate(nodes)}
            indices.append(index)
            tokens.append(torch.tensor([int(contexts[i][-1])] + [states[i].tokens[n] for n in nodes[1:]]))
            parents.append(torch.tensor([-1] + [index[states[i].parents[n]] for n in nodes[1:]]))
        logits = scorer.score([rows[i] for i in active], [contexts[i] for i in active], tokens,
                              parents)  # per row [len(nodes), V]
        scorer.rollback()
        for i, index, row_logits in zip(active, indices, logits):
            at = [index[n] for n in states[i].wanted]
            states[i].step(process(row_logits[at], SamplingConfig()))  # [len(wanted), V], the draft's own law
            passes[i] += 1
    return [state.tree(vocab) for state in states], passes


# ---------------------------------------------------------------------------------------------
# verifying one row's block


@dataclass(frozen=True)
class TreeBlock:
    """One row's verified block: the rule's result, and per emitted position (n + 1 of them) the
    frontier node it was emitted at, its exact law and its role; the draft's q at the first m positions
    (those with candidates: m = n, or n + 1 when the last token was recovered)."""

    result: TreeVerifyResult
    frontiers: list[int]
    draft_probs: Tensor  # [m, V]
    laws: Tensor  # [n + 1, V]
    roles: list[str]


def verify_block(verification: TreeVerification, tree: TokenTree, target_probs: Tensor,
                 uniforms: Tensor) -> TreeBlock:
    """Verify one tree: target_probs [N+1, V] (processed, row i after node i's path), uniforms [N+1].

    Per-step laws: the target's own rows for a lossless pairing (Traversal included: its block law is
    the target's, docs/design.md 'Trees'), else `step_laws` (exact given the prefix on top-k trees)."""
    rule = verification.rule
    # processed probabilities are exact distributions: no re-validation
    if rule is None:
        result = traversal_verify(tree, target_probs, uniforms, validate=False)
    else:
        result = verify_tree(rule, tree, target_probs, uniforms, validate=False)
    frontiers = [0, *result.nodes]
    if verification.lossless:
        laws = target_probs[frontiers]  # [n+1, V]
    else:
        laws = step_laws(rule, tree, target_probs, result)  # [n+1, V]
    q_rows = [tree.draft_probs[node] for node in result.nodes]  # q at each accepted node's parent
    if not result.bonus:  # the last token was recovered at a frontier with candidates
        q_rows.append(tree.draft_probs[tree.children([frontiers[-1]])[0]])
    roles = ["accepted"] * len(result.nodes) + ["bonus" if result.bonus else "recovered"]
    draft = torch.stack(q_rows) if q_rows else target_probs.new_zeros(0, tree.vocab)  # [m, V]
    return TreeBlock(result, frontiers, draft, laws, roles)
