"""Token trees as flat tensors, their shapes (`tree:widths=...`, `drafts:n=...`) and drafting them.

docs/design/trees.md, section 'Trees'. Node 0 is the root: the last committed position, which holds no
drafted token. Nodes 1..N are drafted tokens in topological order (parent index < child index),
siblings in the order they were proposed. Per node: `parents` (-1 for the root), `depths` (0 for the
root), `tokens` (-1 for the root) and `draft_probs`, the draft's distribution at the node's parent
(the q the node was chosen from; the root's row is zeros and never read).

Three ways to grow a tree from a draft (`draft_fn(paths) -> [len(paths), V]`, the draft's next-token
distribution after each path of tokens below the root):

- `topk_tree(widths, draft_fn)`: static shape, every node at depth d gets the widths[d] most probable
  draft tokens as children (ties by token id), deterministic as in EAGLE;
- `dynamic_tree(shape, draft_fn)`: EAGLE-2's dynamic tree (Li et al. 2024, "EAGLE-2: Faster Inference
  of Language Models with Dynamic Draft Trees", section 4): nodes are valued by their path probability
  under the draft (the product of q along the path); the root's top-k children form the first layer,
  and at each further depth the topk most valuable nodes of the last layer are expanded, each with its
  topk most probable children; after `depth` layers the `nodes` most valuable candidates are kept
  (ties by creation order, so a node's ancestors come first: the kept set is a tree). Deterministic
  given the prefix, as top-k trees are (proposal "topk");
- `chain_tree(chains, draft_fn, replacement)`: n sampled chains (`sample_chains` draws them from q
  with given uniforms), kept unmerged: chains that share a prefix share nothing in the tree, and
  verification treats all nodes with the same path as one position (`TokenTree.same_path`). With
  replacement the chains are i.i.d. from q; without, the first tokens are drawn from q without
  replacement (distinct) and the rest i.i.d.

`proposal_probs` gives, per node, the law the node was drawn from given its earlier siblings: one-hot
of its token for deterministic children, q for i.i.d. ones, q with the earlier siblings' tokens
removed and renormalised for first tokens drawn without replacement. The lossless tree rule needs
exactly that law (docs/design/trees.md, 'Trees').
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from verispec.probability import normalize, sample_from
from verispec.spec import Param, parse_params, split

__all__ = ["DraftShape", "DynamicTree", "MultiDraft", "TokenTree", "TreeGrowth", "TreeWidths", "chain_tree",
           "check_depth", "dynamic_tree", "grow", "growth", "parse_shape", "sample_chains", "top_tokens",
           "topk_tree"]

DraftFn = Callable[[Sequence[tuple[int, ...]]], Tensor]

PROPOSALS = ("topk", "iid", "distinct")


@dataclass(frozen=True)
class TokenTree:
    """A drafted token tree (see the module docstring). N+1 nodes, node 0 the root.

    parents [N+1] long, depths [N+1] long, tokens [N+1] long, draft_probs [N+1, V] (q at the parent),
    proposal: "topk" (deterministic children), "iid" (sampled with replacement) or "distinct" (first
    tokens sampled without replacement, deeper ones i.i.d.).
    """

    parents: Tensor
    depths: Tensor
    tokens: Tensor
    draft_probs: Tensor
    proposal: str

    def __post_init__(self) -> None:
        n1 = self.parents.shape[0]
        if self.proposal not in PROPOSALS:
            raise ValueError(f"tree proposal must be one of {', '.join(PROPOSALS)}, got {self.proposal!r}")
        if (self.depths.shape != (n1,) or self.tokens.shape != (n1,) or self.draft_probs.ndim != 2
                or self.draft_probs.shape[0] != n1 or n1 < 1):
            raise ValueError("a token tree needs parents, depths, tokens [N+1] and draft_probs [N+1, V], got "
                             f"{tuple(self.parents.shape)}, {tuple(self.depths.shape)}, "
                             f"{tuple(self.tokens.shape)}, {tuple(self.draft_probs.shape)}")
        if int(self.parents[0]) != -1 or int(self.tokens[0]) != -1 or int(self.depths[0]) != 0:
            raise ValueError("node 0 must be the root: parent -1, token -1, depth 0")
        idx = torch.arange(1, n1)
        if n1 > 1:
            par = self.parents[1:]
            if bool(((par < 0) | (par >= idx)).any()):
                raise ValueError("nodes must be in topological order: 0 <= parent < node for every node >= 1")
            if not torch.equal(self.depths[1:], self.depths[par] + 1):
                raise ValueError("depths must be parent depth + 1")
            v = self.draft_probs.shape[1]
            if bool(((self.tokens[1:] < 0) | (self.tokens[1:] >= v)).any()):
                raise ValueError(f"drafted tokens must lie in [0, {v})")

    @property
    def size(self) -> int:
        """N, the number of drafted nodes (the root excluded)."""
        return self.parents.shape[0] - 1

    @property
    def vocab(self) -> int:
        return self.draft_probs.shape[1]

    @property
    def depth(self) -> int:
        return int(self.depths.max())

    def children(self, nodes: Sequence[int]) -> list[int]:
        """Children of any of `nodes`, in node order (= proposal order among siblings)."""
        inside = torch.zeros(self.parents.shape[0], dtype=torch.bool)
        inside[list(nodes)] = True
        par = self.parents.clamp_min(0)
        hit = inside[par] & (self.parents >= 0)  # [N+1]
        return hit.nonzero().flatten().tolist()

    def path(self, node: int) -> tuple[int, ...]:
        """Tokens from below the root down to `node`."""
        out = []
        while node > 0:
            out.append(int(self.tokens[node]))
            node = int(self.parents[node])
        return tuple(reversed(out))

    def ancestry(self, node: int) -> tuple[int, ...]:
        """Nodes from below the root down to `node` (each the parent of the next)."""
        out = []
        while node > 0:
            out.append(node)
            node = int(self.parents[node])
        return tuple(reversed(out))

    def same_path(self, nodes: Sequence[int], token: int) -> list[int]:
        """The children of `nodes` carrying `token`: every node whose path is the frontier's path plus
        token (several only for unmerged sampled chains that share a prefix)."""
        return [c for c in self.children(nodes) if int(self.tokens[c]) == token]

    def proposal_probs(self) -> Tensor:
        """[N+1, V]: the law each node was drawn from given its earlier siblings (row 0 zeros)."""
        q = self.draft_probs
        if self.proposal == "topk":
            out = torch.zeros_like(q)
            out[1:].scatter_(-1, self.tokens[1:, None], 1.0)  # one-hot of each drafted token
            return out
        out = q.clone()
        if self.proposal == "distinct":
            firsts = (self.parents == 0).nonzero().flatten().tolist()
            removed = torch.zeros_like(q[0])
            for node in firsts:
                out[node] = normalize(q[node] * (1 - removed), q[node])
                removed[int(self.tokens[node])] = 1.0
        out[0] = 0
        return out


# ---------------------------------------------------------------------------------------------
# shapes: tree:widths=4,2,2,1 and drafts:n=3[,replacement=0][,depth=D]


@dataclass(frozen=True)
class TreeWidths:
    """Static top-k tree: every node at depth d gets widths[d] children (the draft's top widths[d])."""

    widths: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.widths or any(not isinstance(w, int) or w < 1 for w in self.widths):
            raise ValueError(f"tree widths must be one or more integers >= 1 (e.g. tree:widths=4,2,2,1), "
                             f"got {self.widths}")

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def nodes(self) -> int:
        """Number of drafted nodes: sum over depths of the product of the widths so far."""
        total, level = 0, 1
        for w in self.widths:
            level *= w
            total += level
        return total

    @property
    def spec(self) -> str:
        return "tree:widths=" + ",".join(map(str, self.widths))

    proposal = "topk"

    @property
    def widest(self) -> int:
        """The most children a node gets (checked against the vocabulary)."""
        return max(self.widths)


def _check_ints(kind: str, params: tuple[Param, ...], values: dict[str, object]) -> None:
    """ValueError unless each given value is an int (not a bool) that its parameter's check accepts."""
    for param in params:
        value = values.get(param.key)
        if param.key in values and (not isinstance(value, int) or isinstance(value, bool)
                                    or not param.check(value)):
            raise ValueError(f"{kind}: {param.key}={value!r} is out of range; allowed: {param.allowed}")


DYNAMIC_PARAMS = (
    Param("nodes", int, "nodes >= 1", lambda v: v >= 1, "drafted nodes kept for verification"),
    Param("depth", int, "depth >= 1", lambda v: v >= 1, "layers expanded"),
    Param("topk", int, "topk >= 1", lambda v: v >= 1, "nodes expanded per layer, and children per node"),
)


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic tree: `depth` layers of expansion, `topk` nodes expanded per layer with `topk`
    children each, the `nodes` candidates of highest draft path probability kept (module docstring)."""

    nodes: int
    depth: int
    topk: int

    def __post_init__(self) -> None:
        _check_ints("tree", DYNAMIC_PARAMS, {"nodes": self.nodes, "depth": self.depth, "topk": self.topk})
        if self.nodes > self.candidates(self.depth):
            raise ValueError(f"tree: nodes={self.nodes} exceeds the {self.candidates(self.depth)} candidates "
                             f"that depth={self.depth}, topk={self.topk} drafts (topk + (depth-1) * topk^2)")

    def candidates(self, depth: int) -> int:
        """The candidate pool after `depth` layers: topk at the first, topk^2 at each further one."""
        return self.topk + (depth - 1) * self.topk ** 2 if depth >= 1 else 0

    @property
    def spec(self) -> str:
        return f"tree:nodes={self.nodes},depth={self.depth},topk={self.topk}"

    proposal = "topk"

    @property
    def widest(self) -> int:
        return self.topk


MULTI_PARAMS = (
    Param("n", int, "n >= 1", lambda v: v >= 1, "number of sampled chains"),
    Param("replacement", int, "0 or 1 (default 1)", lambda v: v in (0, 1),
          "1: i.i.d. chains; 0: first tokens without replacement"),
    Param("depth", int, "depth >= 1 (default: the run's k)", lambda v: v >= 1, "tokens per chain"),
)


@dataclass(frozen=True)
class MultiDraft:
    """n chains sampled from the draft (SpecInfer / SpecTr multi-draft), depth tokens each."""

    n: int
    replacement: int = 1
    depth: int | None = None

    def __post_init__(self) -> None:
        values = {"n": self.n, "replacement": self.replacement}
        if self.depth is not None:
            values["depth"] = self.depth
        _check_ints("drafts", MULTI_PARAMS, values)

    @property
    def spec(self) -> str:
        extra = f",depth={self.depth}" if self.depth is not None else ""
        return f"drafts:n={self.n},replacement={self.replacement}{extra}"

    @property
    def proposal(self) -> str:
        return "iid" if self.replacement else "distinct"


DraftShape = TreeWidths | DynamicTree | MultiDraft


def parse_shape(spec: str) -> DraftShape:
    """`tree:widths=4,2,2,1`, `tree:nodes=16,depth=5,topk=4` (EAGLE-2 dynamic) or
    `drafts:n=3[,replacement=0][,depth=4]` (the grammar of verispec.spec; `widths` takes the rest of
    the spec, a comma-separated list)."""
    name, args = split(spec, "draft shape", "tree:widths=4,2,2,1")
    if name == "tree":
        key, eq, text = (s.strip() for s in args.partition("="))
        if key in ("nodes", "depth", "topk"):
            try:
                values = parse_params("draft shape", "tree", args, DYNAMIC_PARAMS,
                                      required=("nodes", "depth", "topk"))
            except ValueError as err:
                raise ValueError(f"{err} (tree:nodes=N,depth=D,topk=K is EAGLE-2's dynamic tree; tree:widths="
                                 "W1,W2,... a static one; drafts:n=N,depth=D sampled chains)") from None
            return DynamicTree(**values)  # type: ignore[arg-type]
        if key != "widths" or not eq:
            raise ValueError(f"draft shape 'tree' takes widths=W1,W2,... (a static top-k tree, e.g. "
                             f"tree:widths=4,2,2,1) or nodes=N,depth=D,topk=K (EAGLE-2's dynamic tree, e.g. "
                             f"tree:nodes=16,depth=5,topk=4), got {args!r}")
        try:
            widths = tuple(int(w) for w in text.split(","))
        except ValueError:
            raise ValueError(f"tree widths must be integers >= 1 separated by commas, got {text!r}") from None
        return TreeWidths(widths)
    if name == "drafts":
        values = parse_params("draft shape", "drafts", args, MULTI_PARAMS, required=("n",))
        return MultiDraft(**values)  # type: ignore[arg-type]
    raise ValueError(f"unknown draft shape {name!r}; known: tree (tree:widths=4,2,2,1 or "
                     "tree:nodes=16,depth=5,topk=4), drafts (drafts:n=3[,replacement=0])")


def check_depth(depth: int, room: int) -> None:
    """ValueError unless a tree of `depth` fits in the `room` positions left in the context."""
    if depth > room:
        raise ValueError(f"tree depth {depth} exceeds the {room} positions left in the context; "
                         "use fewer widths (or a smaller depth) or a shorter prompt")


# ---------------------------------------------------------------------------------------------
# drafting


def top_tokens(q: Tensor, width: int) -> Tensor:
    """q [n, V] -> [n, width]: each row's `width` most probable tokens, ties by token id: exactly the first
    `width` of a stable descending sort, without sorting the vocabulary (the tokens at least as probable
    as the width-th largest value, in id order, then stably sorted)."""
    kth = torch.topk(q, width, dim=-1).values[:, -1:]  # [n, 1], the width-th largest value of each row
    out = []
    for row, bound in zip(q, kth):
        idx = (row >= bound).nonzero().flatten()  # [m >= width], in token id order
        out.append(idx[torch.sort(row[idx], descending=True, stable=True).indices[:width]])
    return torch.stack(out) if out else torch.zeros(0, width, dtype=torch.long)


class TreeGrowth:
    """A deterministic tree (top-k or dynamic) grown step by step: `wanted` lists the nodes whose draft
    distribution the next `step` needs (empty when done); `tree()` is the result. Nodes are numbered in
    creation order (a parent before its children, siblings by decreasing q, ties by token id)."""

    def __init__(self, layers: int) -> None:
        self.parents, self.depths, self.tokens = [-1], [0], [-1]
        self.rows: list[Tensor | None] = [None]  # per node, q at its parent
        self.layers = layers  # how many steps (draft passes) the tree takes
        self.wanted: list[int] = [0] if layers > 0 else []
        self.done = 0

    def path(self, node: int) -> tuple[int, ...]:
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return tuple(reversed(out))

    def scored(self) -> list[int]:
        """The nodes a draft pass must score for `wanted`: those and their ancestors, in node order."""
        keep = set()
        for node in self.wanted:
            while node >= 0 and node not in keep:
                keep.add(node)
                node = self.parents[node]
        return sorted(keep)

    def _expand(self, q: Tensor, width: int) -> list[int]:
        """Give each wanted node its `width` most probable children under q [len(wanted), V]."""
        if width > q.shape[-1]:
            raise ValueError(f"tree width {width} at depth {self.done + 1} exceeds the vocabulary "
                             f"({q.shape[-1]} tokens)")
        top = top_tokens(q, width)  # [len(wanted), width]
        new = []
        for i, node in enumerate(self.wanted):
            for tok in top[i].tolist():
                self.parents.append(node)
                self.depths.append(self.depths[node] + 1)
                self.tokens.append(tok)
                self.rows.append(q[i])
                new.append(len(self.parents) - 1)
        self.done += 1
        return new

    def step(self, q: Tensor) -> None:
        raise NotImplementedError

    def _build(self, keep: Sequence[int], vocab: int) -> TokenTree:
        index = {node: i for i, node in enumerate(keep)}  # keep: sorted, ancestor-closed, 0 first
        rows = [self.rows[n] if n else None for n in keep]
        zero = torch.zeros(vocab, dtype=rows[1].dtype) if len(rows) > 1 else torch.zeros(vocab)
        return TokenTree(parents=torch.tensor([-1] + [index[self.parents[n]] for n in keep[1:]]),
                         depths=torch.tensor([self.depths[n] for n in keep]),
                         tokens=torch.tensor([self.tokens[n] for n in keep]),
                         draft_probs=torch.stack([zero if r is None else r for r in rows]), proposal="topk")

    def tree(self, vocab: int) -> TokenTree:
        return self._build(range(len(self.parents)), vocab)  # type: ignore[arg-type]


class _TopkGrowth(TreeGrowth):
    def __init__(self, shape: TreeWidths) -> None:
        super().__init__(shape.depth)
        self.widths = shape.widths

    def step(self, q: Tensor) -> None:
        new = self._expand(q, self.widths[self.done])
        self.wanted = new if self.done < self.layers else []


class _DynamicGrowth(TreeGrowth):
    def __init__(self, shape: DynamicTree, layers: int) -> None:
        super().__init__(layers)
        self.topk, self.budget = shape.topk, shape.nodes
        self.value = [1.0]  # per node, its path probability under the draft (float64 products)

    def step(self, q: Tensor) -> None:
        new = self._expand(q, self.topk)
        for node in new:  # q <= 1, so a child's value never exceeds its parent's (also in rounding)
            self.value.append(self.value[self.parents[node]] * float(self.rows[node][self.tokens[node]]))
        ranked = sorted(new, key=lambda n: -self.value[n])  # stable: ties by creation order
        # expanded in value order, as EAGLE-2's code does (its children are created in that order, which
        # decides later ties); node ids stay topological (children are always created after parents)
        self.wanted = ranked[: self.topk] if self.done < self.layers else []

    def tree(self, vocab: int) -> TokenTree:
        ranked = sorted(range(1, len(self.parents)), key=lambda n: -self.value[n])  # ties: creation order
        keep = sorted([0, *ranked[: self.budget]])
        assert all(self.parents[n] in keep for n in keep[1:]), "reranking kept a node without its parent"
        return self._build(keep, vocab)


def growth(shape: TreeWidths | DynamicTree, depth: int | None = None) -> TreeGrowth:
    """A fresh growth of a deterministic shape, cut to `depth` layers (None: the shape's own)."""
    layers = shape.depth if depth is None else max(0, min(depth, shape.depth))
    if layers == 0:
        return TreeGrowth(0)  # the root alone
    if isinstance(shape, TreeWidths):
        return _TopkGrowth(TreeWidths(shape.widths[:layers]))
    return _DynamicGrowth(shape, layers)


def grow(state: TreeGrowth, draft_fn: DraftFn, vocab: int | None = None) -> TokenTree:
    """Run a growth to the end, one `draft_fn` call per step on the wanted nodes' paths."""
    while state.wanted:
        q = draft_fn([state.path(n) for n in state.wanted])  # [len(wanted), V]
        vocab = q.shape[-1]
        state.step(q)
    if vocab is None:
        raise ValueError("a tree without layers needs the vocabulary size")
    return state.tree(vocab)


def topk_tree(widths: TreeWidths | Sequence[int], draft_fn: DraftFn) -> TokenTree:
    """Expand the static top-k tree: depth by depth, one `draft_fn` call on all nodes of the level."""
    shape = widths if isinstance(widths, TreeWidths) else TreeWidths(tuple(widths))
    return grow(growth(shape), draft_fn)


def dynamic_tree(shape: DynamicTree, draft_fn: DraftFn) -> TokenTree:
    """EAGLE-2's dynamic tree (module docstring): `shape.depth` calls of `draft_fn`, on the root and then
    on the topk most valuable nodes of each new layer."""
    return grow(growth(shape), draft_fn)


def chain_tree(chains: Tensor, draft_fn: DraftFn, replacement: bool = True) -> TokenTree:
    """The tree of n drafted chains [n, D], unmerged: node 1 + i*D + j is token j of chain i."""
    n, d = chains.shape
    parents, depths, tokens = [-1], [0], [-1]
    levels = [draft_fn([tuple(chains[i, :j].tolist()) for i in range(n)]) for j in range(d)]  # D x [n, V]
    rows = [torch.zeros_like(levels[0][0])]  # the root's row, never read
    for i in range(n):
        for j in range(d):
            parents.append(0 if j == 0 else 1 + i * d + j - 1)
            depths.append(j + 1)
            tokens.append(int(chains[i, j]))
            rows.append(levels[j][i])  # q after chain i's first j tokens
    return TokenTree(parents=torch.tensor(parents), depths=torch.tensor(depths), tokens=torch.tensor(tokens),
                     draft_probs=torch.stack(rows), proposal="iid" if replacement else "distinct")


def sample_chains(n: int, depth: int, draft_fn: DraftFn, uniforms: Tensor,
                  replacement: bool = True) -> Tensor:
    """n chains of `depth` tokens from the draft, by inverse-CDF sampling with uniforms [n, depth]:
    chain i's token j is drawn with uniforms[i, j] from q after its first j tokens. Without
    replacement the first tokens are drawn in chain order from q with the earlier ones removed."""
    if uniforms.shape != (n, depth):
        raise ValueError(f"sample_chains needs uniforms [n, depth] = [{n}, {depth}], "
                         f"got {tuple(uniforms.shape)}")
    chains = torch.zeros(n, depth, dtype=torch.long)
    for j in range(depth):
        q = draft_fn([tuple(chains[i, :j].tolist()) for i in range(n)])  # [n, V]
        if j == 0 and not replacement:
            support = int((q[0] > 0).sum())
            if n > support:
                raise ValueError(f"drafts without replacement: n={n} exceeds the {support} tokens the draft "
                                 "gives positive probability")
            removed = torch.zeros_like(q[0])
            for i in range(n):
                law = normalize(q[0] * (1 - removed), q[0])
                chains[i, 0] = sample_from(law[None], uniforms[i, :1])[0]
                removed[chains[i, 0]] = 1.0
            continue
        chains[:, j] = sample_from(q, uniforms[:, j])
    return chains
