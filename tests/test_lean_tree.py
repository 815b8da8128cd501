"""Tree attention in the lean forward (verispec.models.lean_tree) on the tiny default target.

Every node's logits must equal a plain causal pass over the prefix plus its root-to-node path, and
after `compact_tree` the cache must give the same next-token logits as a fresh pass over the prefix
plus the accepted path. Rows of different trees and prefix lengths in one pass must match each row
alone.

Tolerance (float32): the tree pass and the reference differ only in float rounding, from different
matmul shapes (oneDNN's packed GEMM over M tree nodes vs the sequence length of the reference) and
different SDPA shapes and masks; the maths is the same. Measured: 8.6e-6 max abs logit difference
over the 22 nodes of `test_tree_logits_match_causal_paths` (printed with -s; logits of magnitude
~10-20). TOL = 1e-4 leaves ~10x headroom, as in tests/test_models_batched.py, whose batched-vs-single
comparisons differ for the same reasons (1.05e-5 measured there). float32 rounding of a sum over d terms is
bounded by ~d * eps * sum|terms| whatever the summation order, so no CPU kernel choice (AVX2 or
AVX-512 blocking) can move a logit by more than a few 1e-5 on a model this small.
"""

from __future__ import annotations

import pytest
import torch

from verispec.models import load_model
from verispec.models.lean import LeanBatchCache, LeanCache, LeanLlama, forward_batch
from verispec.models.lean_tree import compact_tree, forward_tree, tree_ancestors
from verispec.trees import TreeWidths, parse_tree_rule, topk_tree, verify_tree

TOL = 1e-4


@pytest.fixture(scope="module")
def target():
    return load_model("default")


@pytest.fixture(scope="module")
def lean(target):
    return LeanLlama(target.model)


def random_tree(widths: tuple[int, ...], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, parents [M] of a tree whose node 0 is the root (parent -1); node i's children follow."""
    gen = torch.Generator().manual_seed(seed)
    parents, level = [-1], [0]
    for width in widths:
        nxt = []
        for node in level:
            for _ in range(width):
                parents.append(node)
                nxt.append(len(parents) - 1)
        level = nxt
    tokens = torch.randint(0, vocab, (len(parents),), generator=gen)
    return tokens, torch.tensor(parents)


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = int(parents[node])
    return out[::-1]


@torch.no_grad()
def causal_logits(lean: LeanLlama, seq: torch.Tensor) -> torch.Tensor:
    """Plain causal pass over the whole sequence from an empty cache: [L, V]."""
    return lean.forward(seq[None], LeanCache(lean))[0]


@torch.no_grad()
def prefill(lean: LeanLlama, cache: LeanBatchCache, prefix: torch.Tensor) -> int:
    """Cache the prefix in a fresh slot (forward_batch); returns the slot."""
    slot = cache.acquire()
    forward_batch(lean, prefix[None], torch.tensor([prefix.shape[0]]), torch.tensor([slot]), cache)
    return slot


def test_ancestors_and_depths():
    parents = torch.tensor([[-1, 0, 0, 1, 3, -1]])
    anc, depth = tree_ancestors(parents)
    assert depth[0].tolist() == [0, 1, 1, 2, 3, 0]
    assert anc[0, 4].nonzero().flatten().tolist() == [0, 1, 3, 4]
    assert anc[0, 2].nonzero().flatten().tolist() == [0, 2]
    assert anc[0, 5].nonzero().flatten().tolist() == [5]
    with pytest.raises(ValueError, match="earlier node"):
        tree_ancestors(torch.tensor([[-1, 1]]))


@torch.no_grad()
def test_tree_logits_match_causal_paths(lean):
    vocab = lean.embed.shape[0]
    prefix = torch.randint(0, vocab, (23,), generator=torch.Generator().manual_seed(1))
    tokens, parents = random_tree((3, 2, 2), vocab, seed=2)  # M = 1 + 3 + 6 + 12 = 22
    cache = LeanBatchCache(lean)
    slot = prefill(lean, cache, prefix)
    logits = forward_tree(lean, tokens[None], parents[None], cache, torch.tensor([slot]))[0]  # [M, V]
    assert int(cache.lengths[slot]) == prefix.shape[0] + tokens.shape[0]
    worst = 0.0
    for node in range(tokens.shape[0]):
        path = path_to(parents, node)
        want = causal_logits(lean, torch.cat([prefix, tokens[path]]))[-1]  # [V]
        worst = max(worst, (logits[node] - want).abs().max().item())
    print(f"tree vs causal paths: max abs logit difference {worst:.3g}")
    assert worst <= TOL, worst


@torch.no_grad()
def test_rows_in_one_pass_match_each_row_alone(lean):
    vocab = lean.embed.shape[0]
    gen = torch.Generator().manual_seed(5)
    prefixes = [torch.randint(0, vocab, (n,), generator=gen) for n in (5, 17)]
    trees = [random_tree((2, 2), vocab, seed=6), random_tree((4, 1), vocab, seed=7)]  # M = 7 and 9
    m = max(t.shape[0] for t, _ in trees)
    tokens = torch.zeros(2, m, dtype=torch.long)
    parents = torch.full((2, m), -1)  # padding nodes: attached to the prefix, nobody's ancestor
    for b, (tok, par) in enumerate(trees):
        tokens[b, : tok.shape[0]], parents[b, : par.shape[0]] = tok, par
    cache = LeanBatchCache(lean)
    slots = torch.tensor([prefill(lean, cache, p) for p in prefixes])
    both = forward_tree(lean, tokens, parents, cache, slots)  # [2, M, V]
    for b, (tok, par) in enumerate(trees):
        alone_cache = LeanBatchCache(lean)
        alone_slot = prefill(lean, alone_cache, prefixes[b])
        alone = forward_tree(lean, tok[None], par[None], alone_cache, torch.tensor([alone_slot]))[0]
        assert (both[b, : tok.shape[0]] - alone).abs().max().item() <= TOL


@torch.no_grad()
def test_compaction_keeps_only_the_accepted_path(lean):
    vocab = lean.embed.shape[0]
    gen = torch.Generator().manual_seed(8)
    prefixes = [torch.randint(0, vocab, (n,), generator=gen) for n in (9, 14)]
    tokens, parents = random_tree((2, 3, 2), vocab, seed=9)  # M = 1 + 2 + 6 + 12 = 21
    cache = LeanBatchCache(lean)
    slots = torch.tensor([prefill(lean, cache, p) for p in prefixes])
    starts = cache.lengths[slots].clone()
    m = tokens.shape[0]
    forward_tree(lean, tokens.expand(2, m), parents.expand(2, m), cache, slots)
    leaf = m - 1  # the last leaf: its path is stored out of order (nodes 0, 2, 8, 20)
    keep = [torch.tensor(path_to(parents, leaf)), torch.tensor(path_to(parents, 3))]  # full path, partial one
    compact_tree(cache, slots, starts, parents.expand(2, m), keep)
    nxt = torch.randint(0, vocab, (2, 1), generator=gen)
    got = forward_batch(lean, nxt, torch.tensor([1, 1]), slots, cache)  # [2, V]
    for b in range(2):
        assert int(cache.lengths[slots[b]]) == prefixes[b].shape[0] + keep[b].shape[0] + 1
        want = causal_logits(lean, torch.cat([prefixes[b], tokens[keep[b]], nxt[b]]))[-1]
        assert (got[b] - want).abs().max().item() <= TOL
    with pytest.raises(ValueError, match="not a root-to-node path"):
        compact_tree(cache, slots[:1], starts[:1], parents[None], [torch.tensor([0, 3])])


@torch.no_grad()
def test_batch_one_lean_cache(lean):
    """The batch-1 session's LeanCache: same logits as causal paths, compaction, then `forward` continues."""
    vocab = lean.embed.shape[0]
    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, vocab, (12,), generator=gen)
    tokens, parents = random_tree((2, 2), vocab, seed=12)  # M = 7
    cache = LeanCache(lean)
    lean.forward(prefix[None], cache)
    logits = forward_tree(lean, tokens[None], parents[None], cache)[0]  # [M, V]
    assert cache.length == prefix.shape[0] + tokens.shape[0]
    for node in range(tokens.shape[0]):
        want = causal_logits(lean, torch.cat([prefix, tokens[path_to(parents, node)]]))[-1]
        assert (logits[node] - want).abs().max().item() <= TOL
    keep = torch.tensor(path_to(parents, 6))  # nodes 0, 2, 6
    compact_tree(cache, torch.tensor([0]), torch.tensor([prefix.shape[0]]), parents[None], [keep])
    assert cache.length == prefix.shape[0] + 3
    nxt = torch.randint(0, vocab, (1, 2), generator=gen)
    got = lean.forward(nxt, cache)[0]  # [2, V]
    want = causal_logits(lean, torch.cat([prefix, tokens[keep], nxt[0]]))[-2:]
    assert (got - want).abs().max().item() <= TOL
    with pytest.raises(ValueError, match="one length"):
        two = LeanCache(lean, batch=2)
        compact_tree(two, torch.arange(2), torch.zeros(2, dtype=torch.long), parents.expand(2, 7),
                     [keep, keep[:2]])


@pytest.mark.slow
@torch.no_grad()
def test_greedy_tree_decoding_on_the_default_pair_is_plain_greedy(target, lean):
    """End to end without the decode loop: top-k trees drafted by the default draft, one
    `forward_tree` pass of the target per block, greedy tree verification, `compact_tree`; the tokens
    must be the target's plain greedy decoding (argmax of step-by-step `forward`)."""
    draft = LeanLlama(load_model("default-draft").model)
    prompt = torch.tensor(target.encode("ROMEO: But soft, what light through yonder window breaks?"))
    length = 40

    plain, cache = prompt.clone(), LeanCache(lean)
    logits = lean.forward(plain[None], cache)[0, -1]
    for _ in range(length):
        plain = torch.cat([plain, logits.argmax()[None]])
        logits = lean.forward(plain[None, -1:], cache)[0, -1]

    rule = parse_tree_rule("greedy")
    shape = TreeWidths((3, 2, 1))
    cache = LeanCache(lean)
    lean.forward(prompt[None, :-1], cache)  # the cache holds every committed token but the last
    out, blocks = prompt.clone(), 0
    while out.shape[0] < prompt.shape[0] + length:
        def draft_fn(paths):
            rows = []
            for path in paths:  # the draft's distribution after the committed tokens plus the path
                seq = torch.cat([out, torch.tensor(path, dtype=torch.long)])
                rows.append(torch.softmax(draft.forward(seq[None], LeanCache(draft))[0, -1].double(), -1))
            return torch.stack(rows)  # [len(paths), V]

        tree = topk_tree(shape, draft_fn)
        tokens = tree.tokens.clone()
        tokens[0] = out[-1]  # the root is the last committed token
        start = torch.tensor([cache.length])
        scores = forward_tree(lean, tokens[None], tree.parents[None], cache)[0]  # [M, V]
        target_probs = torch.softmax(scores.double(), -1)
        result = verify_tree(rule, tree, target_probs, torch.zeros(tree.size + 1, dtype=torch.float64))
        compact_tree(cache, torch.tensor([0]), start, tree.parents[None], [torch.tensor([0, *result.nodes])])
        out = torch.cat([out, torch.tensor(result.tokens)])
        blocks += 1
    print(f"greedy {shape.spec}: {out.shape[0] - prompt.shape[0]} tokens in {blocks} target passes")
    assert torch.equal(out[: plain.shape[0]], plain)
    assert blocks < length  # some drafted tokens were accepted
