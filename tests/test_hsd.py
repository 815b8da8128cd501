"""Exact tests of the block-level `hsd` rule: the law of the generated stream, by enumeration.

The emitted tokens of one block are variable in number and correlated with n, so the lossless
property is about the stream: iterating blocks (each drafting K tokens from q given the current
context), the law of the first L generated tokens must equal the target's joint law, for L past a
block boundary. p and q are context-dependent tables (with zeros and p == q contexts) for V <= 4,
K <= 3. Token-wise `lossless` passes the same test; the authors' uncapped full-block acceptance
(min(1, R_K)) must fail it (power check).
"""

from __future__ import annotations

import itertools
from functools import lru_cache

import numpy as np
import pytest
import torch

from stats import chisquare_pvalue
from streams import joint_law, stream_law
from verispec.rules import parse
from verispec.rules.hsd import hsd_levels


class Tables:
    """Context-dependent random conditionals p(.|ctx), q(.|ctx) over V tokens."""

    def __init__(self, v: int, seed: int, zeros: bool):
        self.v, self.seed, self.zeros = v, seed, zeros

    @lru_cache(maxsize=None)
    def get(self, which: str, ctx: tuple[int, ...]) -> np.ndarray:
        # not hash(): salted per process
        rng = np.random.default_rng([self.seed, {"p": 1, "q": 2}[which], len(ctx), *ctx])
        w = rng.integers(0 if self.zeros else 1, 10, self.v).astype(float)
        if w.sum() == 0:
            w[0] = 1.0
        if self.zeros and which == "q" and rng.random() < 0.2:
            return self.get("p", ctx)  # p == q at some contexts (the 0/0 corner of HSD)
        return w / w.sum()

    def p(self, ctx: tuple[int, ...]) -> np.ndarray:
        return self.get("p", ctx)

    def q(self, ctx: tuple[int, ...]) -> np.ndarray:
        return self.get("q", ctx)


CONFIGS = [(2, 1, 3), (2, 3, 6), (3, 2, 5), (4, 2, 4), (3, 3, 5)]  # (V, K, L), L > K + 1 where affordable


@pytest.mark.slow
@pytest.mark.parametrize("v,k,length", CONFIGS)
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("rule_name", ["hsd", "lossless"])
def test_stream_law_is_the_target(rule_name, v, k, length, zeros):
    tables = Tables(v, seed=10 * v + k, zeros=zeros)
    law = stream_law(parse(rule_name), tables.p, tables.q, v, k, length)
    expected = joint_law(tables.p, v, length)
    worst = max(abs(law.get(s, 0.0) - pr) for s, pr in expected.items())
    assert worst < 1e-12, worst
    assert abs(sum(law.values()) - 1) < 1e-12


@pytest.mark.slow
def test_uncapped_variant_is_lossy():
    tables = Tables(3, seed=32, zeros=False)
    law = stream_law(parse("hsd"), tables.p, tables.q, 3, 2, 5, uncapped=True)
    expected = joint_law(tables.p, 3, 5)
    assert max(abs(law.get(s, 0.0) - pr) for s, pr in expected.items()) > 1e-3


def test_sun_et_al_toy_example_expected_length():
    """Binary p = (1/3, 2/3), q = (2/3, 1/3) at every context, K = 2: Sun et al. 2024 report expected
    accepted drafts 10/9 token-wise and 11/9 with block verification; HSD must match the latter."""
    p = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    q = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    expected = {"hsd": 0.0, "lossless": 0.0}
    for x in itertools.product(range(2), repeat=2):
        weight = float(q[x[0]] * q[x[1]])
        h, _ = hsd_levels(p.expand(1, 3, 2), q.expand(1, 2, 2), torch.tensor(x)[None])
        h = h[0].numpy()
        expected["hsd"] += weight * (2 * h[2] + 1 * (1 - h[2]) * h[1])
        a = [min(1.0, float(p[t] / q[t])) for t in x]
        expected["lossless"] += weight * (a[0] + a[0] * a[1])
    assert abs(expected["lossless"] - 10 / 9) < 1e-12
    assert abs(expected["hsd"] - 11 / 9) < 1e-12


@pytest.mark.slow
def test_verify_samples_the_block_law():
    """Chi-square: sampled (n, last token) of `verify` against the exact block law of hsd_levels."""
    rng = np.random.default_rng(5)
    v, k, rows = 4, 3, 200_000
    p = torch.tensor(rng.dirichlet(np.full(v, 0.7), size=k + 1))
    q = torch.tensor(rng.dirichlet(np.full(v, 0.7), size=k))
    x = torch.tensor([[0, 1, 2]])
    h, res = hsd_levels(p[None], q[None], x)
    h, res = h[0].numpy(), res[0].numpy()
    probs, reach = [], 1.0
    for level in range(k, -1, -1):
        dist = p[k].numpy() if level == k else res[level]
        probs.extend(reach * h[level] * dist)
        reach *= 1 - h[level]
    result = parse("hsd").verify(p.expand(rows, k + 1, v), q.expand(rows, k, v), x.expand(rows, k),
                                 torch.Generator().manual_seed(0))
    n = result.num_accepted.numpy()
    last = result.tokens.numpy()[np.arange(rows), n]
    cell = (k - n) * v + last  # the same cell order as `probs`
    assert chisquare_pvalue(np.bincount(cell, minlength=len(probs)), np.array(probs)) > 1e-4
