"""Tree attention for the lean forward: one target pass scores every node of a token tree.

docs/design.md, section 'Trees'. Row b feeds M tree nodes after its cached prefix (cache slot
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

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from verispec.models.lean import LeanBatchCache, LeanCache, LeanLlama

__all__ = ["compact_tree", "forward_tree", "tree_ancestors"]


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
