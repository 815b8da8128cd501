"""Traversal Verification (Weng et al. 2025, "Traversal Verification for Speculative Tree Decoding"):
leaf-to-root, sequence-level acceptance on a token tree (docs/design/trees.md, section 'Trees').

State per node u: an acceptance probability `alpha_u` and a target distribution `W_u` for u's
children (`W_u = p_u` at first, `alpha_root = 1`). The child c of u that is currently first among
u's remaining children, with proposal law r_c (`TokenTree.proposal_probs`), has

    alpha_c = min(1, alpha_u * W_u(c) / r_c(c))          (computed when c is first reached).

Repeat: descend from the root through first remaining children to a node without remaining
children (the first leaf in post-order) and test it: with probability alpha_leaf accept the whole
path root -> leaf and draw the last token from W_leaf. Otherwise delete the leaf and update its
parent u:

    S       = sum((alpha_u * W_u - r_leaf)+)
    W_u    <- norm((alpha_u * W_u - r_leaf)+)
    alpha_u <- S / (S + 1 - alpha_u)                       (1 when the denominator is 0).

The root keeps alpha = 1, so it is accepted once all its children are gone. On a chain this is
block verification (Sun et al. 2024; verispec's `hsd`): alpha_k is the capped prefix weight a_k
and the update is the stop probability h_k = A_k / (A_k + 1 - a_k). The tests enumerate the exact
law of the generated stream (tests/test_tree_rules.py).

Uniforms: the t-th leaf test (t = 1, 2, ...) uses uniforms[t], the last token uniforms[0]; a tree
of N nodes makes at most N tests, so uniforms [N+1] suffice (the root is accepted without a test).
"""

from __future__ import annotations

from typing import Iterator

from torch import Tensor

from verispec.probability import check_probs, normalize, sample_from
from verispec.trees.rules import TreeVerifyResult
from verispec.trees.structure import TokenTree

__all__ = ["traversal_block_law", "traversal_verify"]


def _tests(tree: TokenTree, target_probs: Tensor) -> Iterator[tuple[list[int], float, Tensor]]:
    """The leaf tests in order, each (path root -> leaf, alpha_leaf, W_leaf) given that every earlier
    test rejected; the caller sends nothing and simply stops iterating at an acceptance."""
    proposals = tree.proposal_probs()
    kids = [tree.children([u]) for u in range(tree.size + 1)]
    alive = [True] * (tree.size + 1)
    alpha: dict[int, float] = {0: 1.0}
    weights: dict[int, Tensor] = {0: target_probs[0]}
    while True:
        path = [0]
        while True:
            u = path[-1]
            nxt = next((c for c in kids[u] if alive[c]), None)
            if nxt is None:
                break
            if nxt not in alpha:
                tok = int(tree.tokens[nxt])
                ratio = alpha[u] * float(weights[u][tok]) / float(proposals[nxt, tok])
                alpha[nxt], weights[nxt] = min(1.0, ratio), target_probs[nxt]
            path.append(nxt)
        leaf = path[-1]
        yield path, (1.0 if leaf == 0 else alpha[leaf]), weights[leaf]
        if leaf == 0:
            return
        u = int(tree.parents[leaf])
        excess = (alpha[u] * weights[u] - proposals[leaf]).clamp_min(0)  # [V]
        mass = float(excess.sum())
        weights[u] = normalize(excess, weights[u])
        denominator = mass + 1 - alpha[u]
        alpha[u] = mass / denominator if denominator > 0 else 1.0
        alive[leaf] = False


def _check(tree: TokenTree, target_probs: Tensor) -> None:
    check_probs("target_probs", target_probs)
    if target_probs.shape != tree.draft_probs.shape:
        raise ValueError(f"target_probs must be [N+1, V] = {tuple(tree.draft_probs.shape)} (one row per tree "
                         f"node, the root first), got {tuple(target_probs.shape)}")


def traversal_verify(tree: TokenTree, target_probs: Tensor, uniforms: Tensor,
                     validate: bool = True) -> TreeVerifyResult:
    """Verify one tree: target_probs [N+1, V], uniforms [N+1] float64 in [0, 1). validate=False skips
    the input checks, as `verify_tree`'s does, for the decode loop's processed rows (whose float32 sums
    over a 152k vocabulary can leave `check_probs`' tolerance)."""
    if validate:
        _check(tree, target_probs)
        if not isinstance(uniforms, Tensor) or uniforms.shape != (tree.size + 1,):
            raise ValueError(f"uniforms must be a tensor [N+1] = [{tree.size + 1}]")
    for t, (path, accept, law) in enumerate(_tests(tree, target_probs), start=1):
        if path[-1] == 0 or float(uniforms[t]) < accept:
            last = int(sample_from(law[None], uniforms[:1])[0])
            nodes = tuple(path[1:])
            tokens = tuple(int(tree.tokens[n]) for n in nodes) + (last,)
            return TreeVerifyResult(nodes=nodes, tokens=tokens, bonus=not tree.children([path[-1]]))
    raise AssertionError("unreachable: the root is always accepted")


def traversal_block_law(tree: TokenTree, target_probs: Tensor) -> dict[tuple[int, ...], float]:
    """Exact law of the tokens one Traversal Verification block emits on this tree (float64)."""
    _check(tree, target_probs)
    out: dict[tuple[int, ...], float] = {}
    reach = 1.0
    for path, accept, law in _tests(tree, target_probs):
        prefix = tuple(int(tree.tokens[n]) for n in path[1:])
        for tok, pr in enumerate(law.tolist()):
            if pr > 0:
                out[prefix + (tok,)] = out.get(prefix + (tok,), 0.0) + reach * accept * pr
        reach *= 1 - accept
        if reach <= 0:
            break
    return out
