"""Batched verification: per-row generators, rows with K = 0 drafts, ragged draft lengths (-1 padding).

The convention (docs/design/rules.md, section 'Token roles'): row i has k_i real drafts then -1; it uses
uniforms[i, :k_i] for its drafts and uniforms[i, k_i] for its recovered/bonus token, and with per-row
generators draws exactly k_i + 1 uniforms from its own generator. So a row verified in a batch equals
the same row verified alone (B=1, K=k_i) with the same generator state; padded rows of draft_probs and
of target_probs after position k_i are never used. Chi-square checks of the laws on the new paths use
a Bonferroni-corrected alpha (as tests/test_rules_sampling.py) and a power check on broken variants.
"""

from __future__ import annotations

import itertools

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from helpers import SPECS, dirichlet
from stats import chisquare_pvalue
from verispec.rules import names, parse
from verispec.rules.hsd import hsd_levels
from verispec.rules.lossless import Lossless

BATCH_SPECS = SPECS + ["honest:speccascade:min_p=0.2"]


def test_batch_specs_cover_every_registered_rule():
    assert set(names()) <= {s.partition(":")[0] for s in BATCH_SPECS}


# ---------------------------------------------------------------------------------------------
# random ragged batches


def ragged_batch(seed: int, b: int = 8, k: int = 4, v: int = 6, sparsity: float = 0.0):
    """p [B, K+1, V], q [B, K, V], x [B, K] (-1 after k_i real drafts), k_i [B] (both 0 and K occur)."""
    rng = np.random.default_rng(seed)

    def dist(shape):
        a = rng.dirichlet(np.full(v, 0.5), size=shape)
        if sparsity:
            a = a * (rng.random(a.shape) > sparsity)
            a[..., 0] += a.sum(-1) == 0  # keep every row a distribution
            a = a / a.sum(-1, keepdims=True)
        return torch.tensor(a)

    p, q = dist((b, k + 1)), dist((b, k))
    num_drafts = torch.tensor(rng.integers(0, k + 1, size=b))
    num_drafts[0], num_drafts[-1] = 0, k
    x = torch.multinomial(q.view(-1, v), 1, generator=torch.Generator().manual_seed(seed)).view(b, k)
    x[torch.arange(k) >= num_drafts[:, None]] = -1
    return p, q, x, num_drafts


def fill_padding(p, q, num_drafts, how: str, seed: int = 0):
    """Copies of p, q whose unused rows (p after position k_i, q from k_i on) hold `how`."""
    b, k1, v = p.shape
    rng = np.random.default_rng(seed)
    p, q = p.clone(), q.clone()
    unused_p = torch.arange(k1) > num_drafts[:, None]  # [B, K+1]
    unused_q = torch.arange(k1 - 1) >= num_drafts[:, None]  # [B, K]
    for probs, unused in ((p, unused_p), (q, unused_q)):
        n = int(unused.sum())
        if how == "zeros":
            fill = torch.zeros(n, v, dtype=p.dtype)
        elif how == "distributions":
            fill = torch.tensor(rng.dirichlet(np.full(v, 0.3), size=n))
        elif how == "garbage":  # not distributions at all: negative, unnormalised, NaN, inf
            fill = torch.tensor(rng.normal(size=(n, v)) * 3)
            if n:
                fill[0, 0], fill[-1, -1] = math.nan, math.inf
        else:
            raise ValueError(how)
        probs[unused] = fill.to(p.dtype)
    return p, q


def assert_row_equals_alone(batched, alone, i: int, k_i: int):
    assert int(batched.num_drafts[i]) == k_i == int(alone.num_drafts[0])
    assert int(batched.num_accepted[i]) == int(alone.num_accepted[0])
    assert bool(batched.bonus[i]) == bool(alone.bonus[0])
    assert torch.equal(batched.tokens[i, : k_i + 1], alone.tokens[0])
    assert (batched.tokens[i, k_i + 1 :] == -1).all()
    assert torch.equal(batched.accept_probs[i, :k_i], alone.accept_probs[0])
    assert (batched.accept_probs[i, k_i:] == 0).all()


def check_result_shape(res, x, p):
    b, k = x.shape
    assert res.tokens.shape == (b, k + 1) and res.accept_probs.shape == (b, k)
    assert torch.equal(res.num_drafts, (x >= 0).sum(-1))
    assert torch.equal(res.bonus, res.num_accepted == res.num_drafts)
    assert (res.num_accepted <= res.num_drafts).all()
    for i in range(b):
        n = int(res.num_accepted[i])
        assert torch.equal(res.tokens[i, :n], x[i, :n])
        assert 0 <= res.tokens[i, n] < p.shape[-1]
        assert (res.tokens[i, n + 1 :] == -1).all()


# ---------------------------------------------------------------------------------------------
# batch independence and inert padding


@pytest.mark.parametrize("spec", BATCH_SPECS)
def test_per_row_generators_match_rows_alone(spec):
    rule = parse(spec)
    for seed in range(4):
        p, q, x, num_drafts = ragged_batch(seed, sparsity=0.3 if seed % 2 else 0.0)
        p, q = fill_padding(p, q, num_drafts, "zeros")
        gens = [torch.Generator().manual_seed(1000 * seed + i) for i in range(len(x))]
        batched = rule.verify(p, q, x, gens)
        check_result_shape(batched, x, p)
        for i, k_i in enumerate(num_drafts.tolist()):
            alone = rule.verify(p[i : i + 1, : k_i + 1], q[i : i + 1, :k_i], x[i : i + 1, :k_i],
                                torch.Generator().manual_seed(1000 * seed + i))
            assert_row_equals_alone(batched, alone, i, k_i)
            # a one-element list of generators draws the same numbers as the generator itself
            listed = rule.verify(p[i : i + 1, : k_i + 1], q[i : i + 1, :k_i], x[i : i + 1, :k_i],
                                 [torch.Generator().manual_seed(1000 * seed + i)])
            assert torch.equal(listed.tokens, alone.tokens)


@pytest.mark.parametrize("spec", BATCH_SPECS)
def test_padding_is_inert(spec):
    rule = parse(spec)
    for seed in range(3):
        p, q, x, num_drafts = ragged_batch(10 + seed)
        uniforms = torch.rand(len(x), x.shape[1] + 1, generator=torch.Generator().manual_seed(seed),
                              dtype=torch.float64)
        ref = rule.verify_with_uniforms(*fill_padding(p, q, num_drafts, "zeros"), x, uniforms)
        for how in ("distributions", "garbage"):
            pp, qq = fill_padding(p, q, num_drafts, how, seed)
            for res in (rule.verify_with_uniforms(pp, qq, x, uniforms),
                        rule.verify_with_uniforms(pp, qq, x, uniforms, validate=False)):
                assert torch.equal(res.tokens, ref.tokens), how
                assert torch.equal(res.num_accepted, ref.num_accepted), how
                assert torch.equal(res.bonus, ref.bonus), how
                assert torch.equal(res.accept_probs, ref.accept_probs), how
        # the uniform columns after k_i are ignored too
        noisy = uniforms.clone()
        unused = torch.arange(x.shape[1] + 1) > num_drafts[:, None]
        noisy[unused] = torch.rand(int(unused.sum()), dtype=torch.float64,
                                   generator=torch.Generator().manual_seed(99))
        assert torch.equal(rule.verify_with_uniforms(p, q, x, noisy).tokens, ref.tokens)


@pytest.mark.parametrize("spec", ["lossless", "greedy", "hsd", "honest:topk:k=2",
                                  "sglang:single=0.9,acc=0.5"])
def test_whole_call_with_zero_drafts(spec):
    """draft_tokens [B, 0], target_probs [B, 1, V]: only the bonus token, from the bonus law of p[:, 0]."""
    rule = parse(spec)
    p = torch.tensor(np.random.default_rng(0).dirichlet(np.full(5, 0.5), size=(6, 1)))  # [B, 1, V]
    q = torch.zeros(6, 0, 5, dtype=torch.float64)
    x = torch.zeros(6, 0, dtype=torch.int64)
    res = rule.verify(p, q, x, torch.Generator().manual_seed(0))
    assert res.tokens.shape == (6, 1) and res.accept_probs.shape == (6, 0)
    assert (res.num_accepted == 0).all() and (res.num_drafts == 0).all() and res.bonus.all()
    law = rule.bonus_law(p[:, 0])
    assert (law.gather(-1, res.tokens) > 0).all()
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    per_row = rule.verify(p, q, x, gens)
    for i in range(6):  # one uniform per row, from its own generator
        u = torch.rand(1, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        alone = rule.verify_with_uniforms(p[i : i + 1], q[i : i + 1], x[i : i + 1], u[None])
        assert torch.equal(per_row.tokens[i], alone.tokens[0])


def test_single_generator_is_unchanged():
    """One generator: one [B, K+1] draw, as before (a ragged row reads its columns :k_i and k_i)."""
    rule = parse("lenience:l=0.5")
    p, q, x, num_drafts = ragged_batch(3)
    res = rule.verify(p, q, x, torch.Generator().manual_seed(5))
    uniforms = torch.rand(len(x), x.shape[1] + 1, generator=torch.Generator().manual_seed(5),
                          dtype=torch.float64)
    assert torch.equal(res.tokens, rule.verify_with_uniforms(p, q, x, uniforms).tokens)


# ---------------------------------------------------------------------------------------------
# hsd: ragged rows equal their unpadded verification


@pytest.mark.parametrize("sparsity", [0.0, 0.4])
def test_hsd_ragged_rows_equal_unpadded(sparsity):
    rule = parse("hsd")
    for seed in range(60):
        v = 2 + seed % 4
        p, q, x, num_drafts = ragged_batch(seed, b=6, k=1 + seed % 4, v=v, sparsity=sparsity)
        if seed % 3 == 0:  # p == q at some positions: the 0/0 corner of HSD
            q[:, 0] = p[:, 0]
            x[:, 0] = torch.where(x[:, 0] >= 0, p[:, 0].argmax(-1), -1)
        pp, qq = fill_padding(p, q, num_drafts, "garbage", seed)
        uniforms = torch.rand(len(x), x.shape[1] + 1, generator=torch.Generator().manual_seed(seed),
                              dtype=torch.float64)
        batched = rule.verify_with_uniforms(pp, qq, x, uniforms, validate=False)
        h, _ = hsd_levels(pp, qq, x)
        for i, k_i in enumerate(num_drafts.tolist()):
            row = slice(i, i + 1)
            alone = rule.verify_with_uniforms(p[row, : k_i + 1], q[row, :k_i], x[row, :k_i],
                                              uniforms[row, : k_i + 1])
            assert_row_equals_alone(batched, alone, i, k_i)
            h_alone, _ = hsd_levels(p[row, : k_i + 1], q[row, :k_i], x[row, :k_i])
            assert torch.equal(h[i, : k_i + 1], h_alone[0])
            assert (h[i, k_i + 1 :] == 0).all()


# ---------------------------------------------------------------------------------------------
# exact laws on the new paths (chi-square)

V, K, ROWS = 5, 3, 20_000  # ROWS per group: k_i = 0, 1, 2, 3 in one ragged batch, plus a K = 0 call
FITS = 5
ALPHA = 1e-4 / (len(BATCH_SPECS) * FITS)


def law_block():
    """Distinct p_j per position (so p[k_i] and p[K] differ), q_j, and garbage distributions to pad."""
    rng = np.random.default_rng(21)
    p = torch.tensor(np.stack([dirichlet(rng, V, 0.6) for _ in range(K + 1)]))  # [K+1, V]
    q = torch.tensor(np.stack([dirichlet(rng, V, 0.6) for _ in range(K)]))  # [K, V]
    junk = torch.tensor(np.stack([dirichlet(rng, V, 0.3) for _ in range(K + 1)]))  # [K+1, V]
    return p, q, junk


def ragged_rows(seed: int = 0):
    """4 * ROWS rows, k_i = i % 4 (0..K): real positions from p, q; padding from the junk laws."""
    p, q, junk = law_block()
    gen = torch.Generator().manual_seed(seed)
    n = 4 * ROWS
    num_drafts = torch.arange(n) % (K + 1)
    x = torch.multinomial(q, n, replacement=True, generator=gen).T.contiguous()  # [N, K]
    x[torch.arange(K) >= num_drafts[:, None]] = -1
    used_p = torch.arange(K + 1) <= num_drafts[:, None]  # [N, K+1]
    pb = torch.where(used_p[..., None], p, junk)  # [N, K+1, V]
    qb = torch.where((x >= 0)[..., None], q, junk[:K])  # [N, K, V]
    return p, q, pb, qb, x, num_drafts, gen


def first_token_law(rule, p: torch.Tensor, q: torch.Tensor, kk: int) -> np.ndarray:
    """A block rule's law of a block's first token with kk drafts drawn from q (the same p, q at every
    position), by enumerating the drafts through `block_law`: x_0 if a draft is kept, else the
    recovered token."""
    drafts = torch.tensor(list(itertools.product(range(V), repeat=kk)))  # [V^kk, kk]
    weight = q[torch.arange(kk), drafts].prod(-1)  # [V^kk]
    n = len(drafts)
    law = rule.block_law(p[: kk + 1].expand(n, kk + 1, V), q[:kk].expand(n, kk, V), drafts)
    stop = law.num_accepted_probs[:, 0]  # [V^kk]
    out = torch.zeros(V, dtype=torch.float64)
    out.index_add_(0, drafts[:, 0], weight * (1 - stop))
    out += (weight * stop) @ law.last_laws[:, 0]
    return out.numpy()


def ragged_fit_pvalues(rule, seed: int = 0) -> dict[str, float]:
    p, q, pb, qb, x, num_drafts, gen = ragged_rows(seed)
    res = rule.verify(pb, qb, x, gen)
    tokens, n_acc, k_i = res.tokens.numpy(), res.num_accepted.numpy(), num_drafts.numpy()
    out = {}
    rows = k_i == 0
    out["k_i = 0: token ~ bonus law of p0"] = chisquare_pvalue(
        np.bincount(tokens[rows, 0] % V, minlength=V), rule.bonus_law(p[0]).numpy())
    rows = k_i >= 1
    first = (np.mean([first_token_law(rule, p, q, kk) for kk in range(1, K + 1)], 0) if rule.block_level
             else rule.emitted(p[0], q[0]).numpy())  # rows k_i = 1, 2, 3 in equal numbers
    out["k_i >= 1: first token ~ emitted(p0, q0)"] = chisquare_pvalue(
        np.bincount(tokens[rows, 0] % V, minlength=V), first)
    for kk in (1, 2):
        rows = (k_i == kk) & (n_acc == kk)
        after = tokens[rows, np.minimum(n_acc[rows], K)]
        out[f"k_i = {kk}, all accepted: bonus ~ bonus law of p{kk}"] = chisquare_pvalue(
            np.bincount(after % V, minlength=V), rule.bonus_law(p[kk]).numpy())
    # a whole call with K = 0
    zero = rule.verify(p[:1].expand(ROWS, 1, V), q[:0].expand(ROWS, 0, V), x[:ROWS, :0], gen)
    out["K = 0 call: token ~ bonus law of p0"] = chisquare_pvalue(
        np.bincount(zero.tokens[:, 0].numpy() % V, minlength=V), rule.bonus_law(p[0]).numpy())
    assert len(out) == FITS
    return out


@pytest.mark.slow
@pytest.mark.parametrize("spec", BATCH_SPECS)
def test_ragged_laws(spec):
    rule = parse(spec)
    for what, pvalue in ragged_fit_pvalues(rule).items():
        assert pvalue > ALPHA, f"{spec} {what}: p-value {pvalue:.3g} <= {ALPHA:.3g}"


@dataclass(frozen=True, kw_only=True)
class PaddingAccepted(Lossless):
    """Broken: padded positions are verified as if they were drafts of token 0."""

    name = "broken-padding"

    def _verify(self, p, q, x, uniforms):
        return super()._verify(p, q, x.clamp_min(0), uniforms)


@dataclass(frozen=True, kw_only=True)
class WrongColumn(Lossless):
    """Broken: the recovered/bonus token reuses the first draft's uniform instead of column k_i."""

    name = "broken-column"

    def _verify(self, p, q, x, uniforms):
        uniforms = uniforms.clone()
        k_i = (x >= 0).sum(-1)
        uniforms[torch.arange(len(x)), k_i] = uniforms[:, 0].clone()
        return super()._verify(p, q, x, uniforms)


@pytest.mark.slow
@pytest.mark.parametrize("broken", [PaddingAccepted(), WrongColumn()])
def test_power_broken_batching_fails(broken):
    pvalues = ragged_fit_pvalues(broken)
    assert min(pvalues.values()) < ALPHA, pvalues


# ---------------------------------------------------------------------------------------------
# cases ported from vLLM's rejection sampler tests (tests/v1/sample/test_rejection_sampler.py):
# greedy target (one-hot p at the target's argmax token), draft q one-hot at the drafted token;
# vLLM's PLACEHOLDER_TOKEN_ID is verispec's -1, and its ragged spec_tokens become -1 padding.


def one_hot_case(spec_tokens: list[list[int]], output_tokens: list[list[int]], v: int = 10):
    """p [B, K+1, V] one-hot at output_tokens (zeros after), q one-hot at the drafts, x padded with -1."""
    b, k = len(spec_tokens), max(len(s) for s in spec_tokens)
    p = torch.zeros(b, k + 1, v, dtype=torch.float64)
    q = torch.zeros(b, k, v, dtype=torch.float64)
    x = torch.full((b, k), -1, dtype=torch.int64)
    for i, (drafts, outputs) in enumerate(zip(spec_tokens, output_tokens)):
        assert len(outputs) == len(drafts) + 1
        for j, tok in enumerate(outputs):
            p[i, j, tok] = 1.0
        for j, tok in enumerate(drafts):
            q[i, j, tok] = 1.0
            x[i, j] = tok
    return p, q, x


VLLM_CASES = [
    # test_perfect_match
    ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),
    # test_early_mismatch
    ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5, -1, -1]]),
    # test_multiple_sequences (ragged: draft lengths 2 and 1)
    ([[1, 2], [3]], [[1, 2, 5], [3, 4]], [[1, 2, 5], [3, 4, -1]]),
    # test_single_token_sequence
    ([[1]], [[1, 2]], [[1, 2]]),
    # test_empty_sequence (K = 0)
    ([[]], [[5]], [[5]]),
    # test_multiple_mismatches
    ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 9]], [[1, 2, 7, -1], [4, 8, -1, -1]]),
    # test_parametrized_cases: perfect match with bonus, first mismatch (all rejected), mixed matches
    ([[1, 2]], [[1, 2, 3]], [[1, 2, 3]]),
    ([[1]], [[2, 3]], [[2, -1]]),
    ([[1, 2], [3, 4]], [[1, 5, 6], [3, 4, 7]], [[1, 5, -1], [3, 4, 7]]),
    # not in vLLM's file: all rows rejected at once, and empty drafts next to non-empty ones (K = 0 rows)
    ([[1, 2], [3, 4]], [[6, 2, 3], [7, 4, 5]], [[6, -1, -1], [7, -1, -1]]),
    ([[1, 2], [], [3]], [[1, 2, 4], [8], [3, 9]], [[1, 2, 4], [8, -1, -1], [3, 9, -1]]),
]


@pytest.mark.parametrize("spec", ["greedy", "lossless", "hsd"])
@pytest.mark.parametrize("spec_tokens,output_tokens,expected", VLLM_CASES)
def test_vllm_greedy_cases(spec, spec_tokens, output_tokens, expected):
    p, q, x = one_hot_case(spec_tokens, output_tokens)
    gens = [torch.Generator().manual_seed(i) for i in range(len(x))]
    for generator in (torch.Generator().manual_seed(0), gens):
        res = parse(spec).verify(p, q, x, generator)
        assert res.tokens.tolist() == expected
        lengths = torch.tensor([len(s) for s in spec_tokens])
        assert torch.equal(res.num_drafts, lengths)
        assert torch.equal(res.bonus, res.num_accepted == lengths)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("batch_size", [1, 4, 8])
def test_vllm_deterministic_when_seeded(k, batch_size):
    """vLLM's test_deterministic_when_seeded: seeded rows give the same output on every repetition
    (here also: whatever their neighbours, which are reseeded differently each time)."""
    v, n_rep = 1000, 5
    gen = torch.Generator().manual_seed(k * 100 + batch_size)
    p = torch.softmax(torch.rand(batch_size, k + 1, v, generator=gen, dtype=torch.float64), -1)
    q = torch.softmax(torch.rand(batch_size, k, v, generator=gen, dtype=torch.float64), -1)
    x = torch.randint(0, v, (batch_size, k), generator=gen)
    seeded = torch.arange(batch_size) % 2 == 0
    results = []
    for rep in range(n_rep):
        seeds = [i if seeded[i] else 10_000 * rep + i for i in range(batch_size)]
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        results.append(parse("lossless").verify(p, q, x, gens).tokens)
    for i in range(batch_size):
        if seeded[i]:
            for rep in range(1, n_rep):
                assert torch.equal(results[rep][i], results[0][i])


# ---------------------------------------------------------------------------------------------
# malformed padding and generators


def good_ragged():
    p = torch.full((2, 3, 4), 0.25, dtype=torch.float64)
    q = torch.full((2, 2, 4), 0.25, dtype=torch.float64)
    x = torch.tensor([[1, 2], [3, -1]])
    return p, q, x


def _set(t, index, value):
    t = t.clone()
    t[index] = value
    return t


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda p, q, x: (p, q, torch.tensor([[1, 2], [-1, 3]])), "padding at position 0 is followed"),
        (lambda p, q, x: (p, q, torch.tensor([[-1, 2], [-1, -1]])), "row 0: -1 padding"),
        (lambda p, q, x: (p, q, torch.tensor([[1, 2], [3, -2]])), "outside the vocabulary"),
        (lambda p, q, x: (p, q, torch.tensor([[1, 4], [3, -1]])), "outside the vocabulary"),
        (lambda p, q, x: (p, _set(q, (1, 0), torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=q.dtype)), x),
         "zero probability"),
        (lambda p, q, x: (_set(p, (1, 1, 0), math.nan), q, x), "NaN or inf"),  # row 1 uses p[1, :2]
        (lambda p, q, x: (_set(p, (0, 2, 0), 0.5), q, x), "sum to 1"),
        (lambda p, q, x: (p, _set(q, (1, 0, 0), -0.5), x), "negative"),
        (lambda p, q, x: (p, q, x.float()), "integer"),
    ],
)
def test_bad_padding_is_rejected(mutate, message):
    p, q, x = mutate(*good_ragged())
    for spec in ("lossless", "hsd", "topk:k=2"):
        with pytest.raises(ValueError, match=message):
            parse(spec).verify(p, q, x, torch.Generator().manual_seed(0))
        with pytest.raises(ValueError, match=message):
            parse(spec).verify(p, q, x, [torch.Generator(), torch.Generator()])


def test_unused_rows_are_not_validated():
    p, q, x = good_ragged()
    p[1, 2] = math.nan  # after row 1's k_i = 1: never read
    q[1, 1] = -3.0
    res = parse("lossless").verify(p, q, x, torch.Generator().manual_seed(0))
    assert res.num_drafts.tolist() == [2, 1]


def test_bad_generators_and_uniforms():
    p, q, x = good_ragged()
    rule = parse("lossless")
    with pytest.raises(ValueError, match="got 1 generators for a batch of B = 2"):
        rule.verify(p, q, x, [torch.Generator()])
    with pytest.raises(TypeError, match="entry 1"):
        rule.verify(p, q, x, [torch.Generator(), 3])
    with pytest.raises(TypeError, match="torch.Generator"):
        rule.verify(p, q, x, 3)
    with pytest.raises(ValueError, match="uniforms must be a tensor of shape"):
        rule.verify_with_uniforms(p, q, x, torch.rand(2, 2, dtype=torch.float64))
