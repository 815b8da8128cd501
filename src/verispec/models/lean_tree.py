"""Tree attention for the lean forward: one target pass scores every node of a token tree.

docs/design/trees.md, section 'Trees'. Row b feeds M tree nodes after its cached prefix (cache slot
slots[b] of a `LeanBatchCache`, prefix length L_b = cache.lengths[slots[b]]; or row b of the batch-1
session's `LeanCache`, L_b = cache.length). parents[b, i] is -1 for a node attached
directly to the prefix (the tree's root: the last committed token) and otherwise the index of an
earlier node (parents[b, i] < i). Node i

- attends to the whole cached prefix and to its ancestors (itself included) only;
- sits at RoPE position L_b + depth(i), depth 0 for a node attached to the prefix;
- stores its key/value at cache position L_b + i (node order, not depth order).

So node i's logits are those of a plain causal pass over the prefix followed by the tokens of its
root-to-node path (equal up to float rounding; tests/test_lean_tree.py). After verification,
`compact_tree` keeps the accepted root-to-node path only: it copies those nodes' keys/values to the
contiguous positions L_b, L_b + 1, ... (where their RoPE positions already are) and sets the row's
length to L_b + path length; every other node is rolled back.

The maths per layer is `LeanLlama.forward`'s and `forward_batch`'s (RMSNorm, the same fused
projections, RoPE tables from the same `inv_freq`, grouped-query SDPA); only the mask, the RoPE
positions and where keys are written differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from verispec.models.lean import LeanBatchCache, LeanBatchSession, LeanCache, LeanLlama

__all__ = ["TreePass", "commit_paths", "compact_tree", "forward_tree", "score_tree", "tree_ancestors"]


def tree_ancestors(parents: Tensor) -> tuple[Tensor, Tensor]:
    """parents [B, M] -> (ancestors [B, M, M] bool, ancestors[b, i, j]: node j is node i or one of its
    ancestors; depths [B, M], 0 for nodes attached to the prefix). ValueError unless every parent is
    -1 or an earlier node."""
    if parents.ndim != 2:
        raise ValueError(f"parents must be [B, M], got shape {tuple(parents.shape)}")
    b, m = parents.shape
    index = torch.arange(m)
    if bool(((parents < -1) | (parents >= index[None])).any()):
        raise ValueError("tree parents must be -1 (attached to the prefix) or the index of an earlier node "
                         "(nodes in topological order)")
    ancestors = torch.eye(m, dtype=torch.bool).expand(b, m, m).clone()  # [B, M, M]
    depths = torch.zeros(b, m, dtype=torch.long)
    rows = torch.arange(b)
    for i in range(1, m):
        par = parents[:, i]  # [B]
        has = par >= 0
        up = par.clamp_min(0)
        ancestors[:, i] |= ancestors[rows, up] & has[:, None]  # [B, M]
        depths[:, i] = torch.where(has, depths[rows, up] + 1, 0)
    return ancestors, depths


def _rms(lean: LeanLlama, x: Tensor, weight: Tensor) -> Tensor:
    xf = x.float()  # the same ops as LeanLlama's RMSNorm
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + lean.eps)).to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)  # [..., hd]
    return x * cos + rotated * sin


def _rope_at(lean: LeanLlama, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin [..., hd] at integer positions, computed exactly as LeanLlama's tables."""
    freqs = positions.to(lean.device, torch.float)[..., None] * lean.inv_freq  # [..., hd/2]
    emb = torch.cat([freqs, freqs], -1)  # [..., hd]
    return emb.cos().to(lean.dtype), emb.sin().to(lean.dtype)


def _starts(cache: LeanBatchCache | LeanCache, slots: Tensor) -> Tensor:
    """[B]: each row's cached prefix length (a `LeanCache` has one length for all its rows)."""
    if isinstance(cache, LeanCache):
        return torch.full(slots.shape, cache.length, dtype=torch.long)
    return cache.lengths[slots]


def forward_tree(lean: LeanLlama, tokens: Tensor, parents: Tensor, cache: LeanBatchCache | LeanCache,
                 slots: Tensor | None = None) -> Tensor:
    """Score M tree nodes per row in one pass: tokens, parents [B, M] -> logits [B, M, V] float32 (CPU).

    Row b's nodes go after the cached prefix of slot slots[b] of a `LeanBatchCache` (see the module
    docstring), or of row b of a `LeanCache` (the batch-1 session's cache; slots default to its rows);
    the cache length grows by M (every node's key/value stays until `compact_tree` keeps the accepted
    path). Rows may be different trees of the same node count M (pad a smaller tree with nodes of
    parent -1: nobody's ancestor, their logits are ignored)."""
    if slots is None:
        slots = torch.arange(tokens.shape[0] if tokens.ndim == 2 else 0)
    if tokens.shape != parents.shape or tokens.ndim != 2 or slots.shape != tokens.shape[:1]:
        raise ValueError(f"forward_tree needs tokens [B, M], parents [B, M] and slots [B], got "
                         f"{tuple(tokens.shape)}, {tuple(parents.shape)}, {tuple(slots.shape)}")
    if isinstance(cache, LeanCache) and not torch.equal(slots, torch.arange(cache.batch)):
        raise ValueError(f"a LeanCache holds {cache.batch} rows that share one length: feed all of them, "
                         "in order (slots = 0 .. B-1)")
    b, m = tokens.shape
    dev = lean.device
    ancestors, depths = tree_ancestors(parents.cpu())
    starts = _starts(cache, slots)  # [B]
    positions = starts[:, None] + depths  # [B, M] RoPE positions
    stores = starts[:, None] + torch.arange(m)[None]  # [B, M] cache positions
    length = int(stores[:, -1].max()) + 1
    cache.reserve(length)
    keys_at = torch.arange(length)
    rel = keys_at[None] - starts[:, None]  # [B, L]: key position relative to the row's first node
    inside = (rel >= 0) & (rel < m)
    index = rel.clamp(0, m - 1)[:, None, :].expand(b, m, length)  # [B, M, L]
    sees_node = ancestors.gather(2, index) & inside[:, None, :]  # [B, M, L]
    sees_prefix = (rel < 0)[:, None, :]  # [B, 1, L]
    mask = (sees_node | sees_prefix)[:, None].to(dev)  # [B, 1, M, L]
    cos, sin = _rope_at(lean, positions)  # [B, M, hd]
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, M, hd]
    slot_dev, store_dev = slots.to(dev), stores.to(dev)
    nq, nkv, hd = lean.n_heads * lean.head_dim, lean.n_kv * lean.head_dim, lean.head_dim
    x = lean.embed[tokens.to(dev)]  # [B, M, d]
    for i, w in enumerate(lean.layers):
        h = _rms(lean, x, w["norm_in"])
        qkv = w["qkv"](h)  # [B, M, nq + 2 nkv]
        q = qkv[..., :nq].view(b, m, lean.n_heads, hd).transpose(1, 2)  # [B, H, M, hd]
        k = qkv[..., nq : nq + nkv].view(b, m, lean.n_kv, hd).transpose(1, 2)  # [B, Hkv, M, hd]
        v = qkv[..., nq + nkv :].view(b, m, lean.n_kv, hd)  # [B, M, Hkv, hd]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # scatter: cache[slot_b, :, L_b + j] = node j's key (advanced indices first: [B, M, Hkv, hd])
        cache.k[i][slot_dev[:, None], :, store_dev] = k.transpose(1, 2)
        cache.v[i][slot_dev[:, None], :, store_dev] = v
        keys, values = cache.k[i][slot_dev, :, :length], cache.v[i][slot_dev, :, :length]  # [B, Hkv, L, hd]
        att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=lean.n_kv != lean.n_heads)
        x = x + w["o"](att.transpose(1, 2).reshape(b, m, nq))  # [B, M, d]
        h = _rms(lean, x, w["norm_post"])
        gate, up = w["gate_up"](h).chunk(2, -1)
        x = x + w["down"](F.silu(gate) * up)
    _set_lengths(cache, slots, starts + m)
    return lean.head(_rms(lean, x, lean.norm)).float().cpu()  # [B, M, V]


def _set_lengths(cache: LeanBatchCache | LeanCache, slots: Tensor, lengths: Tensor) -> None:
    if isinstance(cache, LeanCache):
        if bool((lengths != lengths[0]).any()):
            raise ValueError("a LeanCache has one length for all its rows: keep paths of the same length in "
                             "every row, or use a LeanBatchCache")
        cache.length = int(lengths[0])
    else:
        cache.lengths[slots] = lengths


def compact_tree(cache: LeanBatchCache | LeanCache, slots: Tensor, starts: Tensor, parents: Tensor,
                 keep: Sequence[Tensor]) -> None:
    """Keep only the accepted path of each row's tree in the cache.

    starts [B]: the rows' prefix lengths before `forward_tree`; parents [B, M] as given to it;
    keep[b]: node indices of row b's accepted path from its root (parent -1) down, each the child of
    the one before. Their keys/values move to positions starts[b] + 0, 1, ... (which are their RoPE
    positions) and row b's length becomes starts[b] + len(keep[b]); the other nodes are rolled back."""
    if len(keep) != slots.shape[0] or starts.shape != slots.shape:
        raise ValueError("compact_tree needs one start and one kept path per slot")
    lengths = starts + torch.tensor([int(path.numel()) for path in keep], dtype=torch.long)  # [B]
    if isinstance(cache, LeanCache) and bool((lengths != lengths[0]).any()):
        raise ValueError("a LeanCache has one length for all its rows: keep paths of the same length in "
                         "every row, or use a LeanBatchCache")
    for b, path in enumerate(keep):
        path = path.to(torch.long).cpu()
        expected = torch.cat([torch.tensor([-1]), path[:-1]])  # [n]: each node's required parent
        if path.numel() and not torch.equal(parents[b, path].cpu(), expected):
            raise ValueError(f"row {b}: kept nodes {path.tolist()} are not a root-to-node path of its tree")
        slot, start, n = int(slots[b]), int(starts[b]), path.numel()
        src = start + path  # [n]
        if not torch.equal(src, torch.arange(start, start + n)):
            for store in (cache.k, cache.v):
                for layer in store:
                    layer[slot, :, start : start + n] = layer[slot, :, src.to(layer.device)]  # [Hkv, n, hd]
    _set_lengths(cache, slots, lengths)


# -- a session's tree pass: the decode engine's entry point ----------------------------------------


@dataclass(frozen=True)
class TreePass:
    """What `score_tree` fed, for `commit_paths`: per row its committed context [L_b], the number of
    uncached context tokens fed before the root (`lead`), and the padded pass's slots, starts, tokens and
    parents [B, M]."""

    rows: tuple[int, ...]
    contexts: tuple[Tensor, ...]
    lead: tuple[int, ...]
    slots: Tensor
    starts: Tensor
    tokens: Tensor
    parents: Tensor


@torch.inference_mode()  # as LeanBatchSession.logits_for (verispec.models.lean)
def score_tree(session: LeanBatchSession, rows: Sequence[int], contexts: Sequence[Tensor],
               tokens: Sequence[Tensor], parents: Sequence[Tensor]) -> tuple[list[Tensor], TreePass]:
    """Score one token tree per row in ONE `forward_tree` pass of a `LeanBatchSession`.

    Row b: contexts[b] [L_b], the committed tokens; tokens[b], parents[b] [M_b], its tree with node 0
    the root (tokens[b][0] = contexts[b][-1], parent -1) and parents[b][i] < i. The row's cache keeps
    its longest cached prefix agreeing with contexts[b][:-1]; the rest of the context is fed as a chain
    leading to the root, in the same pass. Returns per row logits [M_b, V] (node i: the target after
    the context plus node i's path) and the `TreePass` for `commit_paths`, which must follow."""
    feeds, parent_rows, lead, slots, starts = [], [], [], [], []
    for row, ctx, tok, par in zip(rows, contexts, tokens, parents):
        ctx = ctx.to(torch.long).cpu()
        if tok.shape != par.shape or tok.ndim != 1 or int(par[0]) != -1 or int(tok[0]) != int(ctx[-1]):
            raise ValueError(f"row {row}: a tree needs tokens, parents [M] with node 0 the root (the last "
                             "context token, parent -1)")
        slot = session.slot(row)
        held, want = session.cached(row), ctx[:-1]
        common = min(held.shape[0], want.shape[0])
        if common > 0:  # length of the agreeing prefix
            common = int((held[:common] == want[:common]).to(torch.int64).cumprod(0).sum())
        session.cache.lengths[slot] = common
        chain = want[common:]  # [c]: uncached context, fed as a chain ending at the root
        c = chain.shape[0]
        chain_parents = torch.arange(-1, c - 1)  # [c]
        root_parent = torch.tensor([c - 1])  # [1]: the root hangs below the chain (-1 without one)
        feeds.append(torch.cat([chain, tok.to(torch.long).cpu()]))  # [c + M_b]
        parent_rows.append(torch.cat([chain_parents, root_parent, par[1:].cpu() + c]))  # [c + M_b]
        lead.append(c)
        slots.append(slot)
        starts.append(common)
    width = max(f.shape[0] for f in feeds)
    padded = torch.zeros(len(feeds), width, dtype=torch.long)  # [B, M]: pads are token 0, parent -1
    padded_parents = torch.full((len(feeds), width), -1, dtype=torch.long)  # [B, M]
    for b, (f, par) in enumerate(zip(feeds, parent_rows)):
        padded[b, : f.shape[0]], padded_parents[b, : f.shape[0]] = f, par
    slot_ids = torch.tensor(slots)
    session.owner.calls += 1
    logits = forward_tree(session.lean, padded, padded_parents, session.cache, slot_ids)  # [B, M, V]
    out = [logits[b, c : c + tok.shape[0]] for b, (c, tok) in enumerate(zip(lead, tokens))]  # [M_b, V]
    return out, TreePass(tuple(rows), tuple(ctx.to(torch.long).cpu() for ctx in contexts), tuple(lead),
                         slot_ids, torch.tensor(starts), padded, padded_parents)


def commit_paths(session: LeanBatchSession, scored: TreePass, kept: Sequence[Sequence[int]] | None = None
                 ) -> None:
    """After `score_tree`: row b keeps its context and the tree nodes kept[b] (a root-to-node path
    below the root, node indices of its tree), so its cache holds the context plus their tokens; every
    other node is rolled back (`compact_tree`). kept None: keep the context minus its last token (the
    root), the state before the pass (a draft that only scored its tree)."""
    keep = []
    for b, c in enumerate(scored.lead):
        if kept is None:
            keep.append(torch.arange(c))  # [c]: the chain only
        else:
            path = torch.as_tensor(list(kept[b]), dtype=torch.long) + c  # tree node i sits at c + i
            keep.append(torch.cat([torch.arange(c + 1), path]))  # [c + 1 + n]
    compact_tree(session.cache, scored.slots, scored.starts, scored.parents, keep)
    for b, (row, ctx) in enumerate(zip(scored.rows, scored.contexts)):
        held = ctx[:-1] if kept is None else torch.cat([ctx, scored.tokens[b, keep[b][scored.lead[b] + 1:]]])
        session.set_cached(row, held)
