"""Tree attention cost: one `forward_tree` pass over M tree nodes vs one chain verification pass.

    python benchmarks/kernels/tree_forward.py [--target default] [--context 64] [--reps 30]

On the batch-1 `LeanCache` after a `--context`-token prefix: a chain pass feeds k + 1 tokens through
`LeanLlama.forward` (k drafts plus the last committed token), a tree pass feeds M nodes (the root,
the last committed token, plus the drafted nodes of `tree:widths=...`) through
`verispec.models.lean_tree.forward_tree`. The cache is rolled back before every call, so each call
is one full pass. Median over `--reps` calls, one torch thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec.models import load_model
from verispec.models.lean import LeanCache, LeanLlama
from verispec.models.lean_tree import forward_tree
from verispec.trees import TreeWidths

CHAINS = [1, 4, 6, 10]
TREES = [(1, 1, 1, 1, 1, 1), (3, 1), (2, 1, 1), (2, 2, 1), (3, 2, 1), (4, 2, 2, 1)]


def tree_parents(widths: tuple[int, ...]) -> torch.Tensor:
    """Parents [M] of the static tree with these widths, the root (parent -1) first."""
    parents, level = [-1], [0]
    for width in widths:
        nxt = []
        for node in level:
            for _ in range(width):
                parents.append(node)
                nxt.append(len(parents) - 1)
        level = nxt
    return torch.tensor(parents)


def median_ms(call, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lean = LeanLlama(load_model(args.target).model)
    vocab = lean.embed.shape[0]
    gen = torch.Generator().manual_seed(0)
    cache = LeanCache(lean)
    with torch.no_grad():
        lean.forward(torch.randint(0, vocab, (1, args.context), generator=gen), cache)
        prefix = cache.length

        def chain(k: int):
            tokens = torch.randint(0, vocab, (1, k + 1), generator=gen)  # [1, k+1]

            def call():
                cache.length = prefix
                lean.forward(tokens, cache)
            return call

        def tree(widths: tuple[int, ...]):
            parents = tree_parents(widths)[None]  # [1, M]
            tokens = torch.randint(0, vocab, parents.shape, generator=gen)

            def call():
                cache.length = prefix
                forward_tree(lean, tokens, parents, cache)
            return call

        print(f"{args.target}, prefix {args.context} tokens, 1 thread, median of {args.reps} calls")
        for k in CHAINS:
            print(f"  chain k={k:<2}  ({k + 1:>2} tokens): {median_ms(chain(k), args.reps):7.2f} ms")
        for widths in TREES:
            m = TreeWidths(widths).nodes + 1
            label = "tree:widths=" + ",".join(map(str, widths))
            print(f"  {label:<24} ({m:>2} nodes):  {median_ms(tree(widths), args.reps):7.2f} ms")


if __name__ == "__main__":
    main()
