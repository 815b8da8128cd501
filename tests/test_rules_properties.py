"""Properties of `verify` for every rule (hypothesis, derandomised in CI) and bad-input errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import SPECS
from verispec.probability import check_probs
from verispec.rules import parse


@st.composite
def blocks(draw):
    b = draw(st.integers(1, 4))
    k = draw(st.integers(1, 4))
    v = draw(st.integers(2, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    sparsity = draw(st.sampled_from([0.0, 0.3]))
    rng = np.random.default_rng(seed)

    def dist(shape):
        a = rng.dirichlet(np.full(v, 0.5), size=shape)
        if sparsity:
            a = a * (rng.random(a.shape) > sparsity)
            a[..., 0] += (a.sum(-1) == 0)  # keep every row a distribution
            a = a / a.sum(-1, keepdims=True)
        return torch.tensor(a)

    p = dist((b, k + 1))  # [B, K+1, V]
    q = dist((b, k))  # [B, K, V]
    x = torch.multinomial(q.view(-1, v), 1, generator=torch.Generator().manual_seed(seed)).view(b, k)
    return p, q, x, seed


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
@given(data=blocks())
def test_verify_properties(spec, data):
    rule = parse(spec)
    p, q, x, seed = data
    b, k = x.shape
    res = rule.verify(p, q, x, torch.Generator().manual_seed(seed))
    assert res.tokens.shape == (b, k + 1) and res.num_accepted.shape == (b,)
    assert ((res.accept_probs >= 0) & (res.accept_probs <= 1)).all()
    assert ((res.num_accepted >= 0) & (res.num_accepted <= k)).all()
    for i in range(b):
        n = int(res.num_accepted[i])
        assert torch.equal(res.tokens[i, :n], x[i, :n])  # accepted tokens are the draft's
        assert 0 <= res.tokens[i, n] < p.shape[-1]  # then one recovered or bonus token
        assert (res.tokens[i, n + 1 :] == -1).all()  # then padding
        if n == k:
            law = rule._bonus(p[i, k])
        elif rule.block_level:  # hsd, fly: the law after n accepted drafts, from the block law
            law = rule.block_law(p[i : i + 1], q[i : i + 1], x[i : i + 1]).last_laws[0, n]
        else:
            law = rule.residual_after(p[i, n], q[i, n], x[i, n])
        assert law[res.tokens[i, n]] > 0  # never a token with zero probability
    # same seed, same output
    again = rule.verify(p, q, x, torch.Generator().manual_seed(seed))
    assert torch.equal(res.tokens, again.tokens)
    # a batch equals its rows one at a time, given the same noise
    uniforms = torch.rand(b, k + 1, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    batched = rule.verify_with_uniforms(p, q, x, uniforms)
    for i in range(b):
        row = rule.verify_with_uniforms(p[i : i + 1], q[i : i + 1], x[i : i + 1], uniforms[i : i + 1])
        assert torch.equal(row.tokens[0], batched.tokens[i])
        torch.testing.assert_close(row.accept_probs[0], batched.accept_probs[i], rtol=0, atol=0)


def good_block():
    p = torch.full((1, 3, 4), 0.25, dtype=torch.float64)
    q = torch.full((1, 2, 4), 0.25, dtype=torch.float64)
    x = torch.tensor([[1, 2]])
    return p, q, x


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda p, q, x: (p.index_fill(2, torch.tensor([0]), math.nan), q, x), "NaN or inf"),
        (lambda p, q, x: (p, q.index_fill(2, torch.tensor([0]), math.inf), x), "NaN or inf"),
        (lambda p, q, x: (p * 1.01, q, x), "sum to 1"),
        (lambda p, q, x: (p, q - 0.3 * torch.eye(4, dtype=q.dtype)[0] + 0.3 * torch.eye(4, dtype=q.dtype)[1],
                          x), "negative"),
        (lambda p, q, x: (p[:, :2], q, x), "shape"),
        (lambda p, q, x: (p, q[..., :3] / q[..., :3].sum(-1, keepdim=True), x), "shape"),
        (lambda p, q, x: (p, q, x[:, :1]), "shape"),
        (lambda p, q, x: (p, q, torch.tensor([[1, 4]])), "outside the vocabulary"),
        (lambda p, q, x: (p, q, torch.tensor([[-1, 0]])), "padding at position 0 is followed by a real"),
        (lambda p, q, x: (p, q, torch.tensor([[-2, 0]])), "outside the vocabulary"),
        (lambda p, q, x: (p.float(), q, x), "float32"),
        (lambda p, q, x: (p.half(), q.half(), x), "float32 or float64"),
        (lambda p, q, x: (p, torch.eye(4, dtype=q.dtype)[[0, 0]][None], x), "zero probability"),
        (lambda p, q, x: (p[:, :0], q[:, :0], x[:, :0]), "shape"),  # K = 0 is allowed, K + 1 = 0 is not
    ],
)
def test_verify_rejects_bad_input(mutate, message):
    p, q, x = mutate(*good_block())
    for spec in ("lossless", "lenience:l=0.5", "topk:k=2"):
        with pytest.raises(ValueError, match=message):
            parse(spec).verify(p, q, x, torch.Generator().manual_seed(0))


def test_emitted_rejects_bad_input():
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    with pytest.raises(ValueError, match="NaN"):
        parse("lossless").emitted(torch.tensor([math.nan, 1.0], dtype=torch.float64), p)
    with pytest.raises(ValueError, match="sum to 1"):
        parse("cos:w=0.5").emitted(torch.tensor([0.5, 0.6], dtype=torch.float64), p)
    with pytest.raises(ValueError, match="same shape"):
        parse("lenience:l=0.5").emitted(p, torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match="must be a torch.Tensor"):
        parse("lossless").emitted([0.5, 0.5], p)
    assert parse("lossless").emitted(p, p).sum() == 1  # the good input still works


@pytest.mark.parametrize(
    "spec,fragments",
    [
        ("nosuchrule", ["unknown rule", "nosuchrule", "lossless"]),
        ("lenience:l=0", ["lenience", "l=0", "0 < l <= 1"]),
        ("lenience:l=1.5", ["lenience", "0 < l <= 1"]),
        ("lenience", ["lenience", "needs", "l"]),
        ("lenience:lam=0.5", ["lenience", "lam", "parameters: l"]),
        ("lenience:l=abc", ["lenience", "l=", "not a plain decimal number"]),
        ("lenience:l=nan", ["lenience", "not a plain decimal number"]),
        ("lenience:l=", ["lenience", "needs a value"]),
        ("lenience:l=0.5,l=0.4", ["given twice"]),
        ("budget:tv=-0.1", ["budget", "tv", "0 <= tv <= 1"]),
        ("budget:tv=0.1,ratio=0.5", ["budget", "ratio", "ratio >= 1"]),
        ("cos:w=2", ["cos", "w", "0 <= w <= 1"]),
        ("topk:k=0", ["topk", "k", ">= 1"]),
        ("topk:k=2.5", ["topk", "k", "not a valid int"]),
        ("topp:p=0", ["topp", "0 < p <= 1"]),
        ("speccascade:min_p=0", ["speccascade", "min_p"]),
        ("speccascade:min_p=0.5,resample=magic", ["speccascade", "resample", "target | truncated | greedy"]),
        ("typical:eps=1.5", ["typical", "eps", "0 < eps < 1"]),
        ("typical:eps=0.1,alpha=2", ["typical", "alpha"]),
        ("relaxed:n=3,delta=2", ["relaxed", "delta"]),
        ("fuzzy:threshold=-1", ["fuzzy", "threshold"]),
        ("fuzzy:threshold=0.1,div=hellinger", ["fuzzy", "div", "js | tv | kl"]),
        ("sglang:single=0,acc=0.5", ["sglang", "single"]),
        ("sglang:single=0.9,acc=0", ["sglang", "acc"]),
        ("greedy:x=1", ["greedy", "no parameter", "none"]),
        ("honest", ["honest", "needs a truncation rule"]),
        ("honest:lenience:l=0.5", ["honest", "wraps a truncation rule", "lenience"]),
        ("", ["non-empty"]),
    ],
)
def test_parse_errors_name_rule_key_and_range(spec, fragments):
    with pytest.raises(ValueError) as err:
        parse(spec)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


@pytest.mark.parametrize("spec", SPECS)
def test_spec_round_trips(spec):
    rule = parse(spec)
    assert parse(rule.spec) == rule


def test_float32_softmax_rows_pass_the_sum_check_at_large_vocabularies():
    """The row-sum tolerance is a worst-case bound for float32 softmax (verispec.probability, the derivation
    beside `_sum_tolerance`), so rows a model produces pass at Qwen's vocabulary (151,936), flat or peaked;
    a row scaled by 1.01 still fails."""
    vocab = 151_936
    gen = torch.Generator().manual_seed(0)
    for scale in (0.0, 1.0, 5.0, 20.0):
        logits = scale * torch.randn(8, vocab, generator=gen)  # [8, V]
        check_probs("target_probs", torch.softmax(logits, -1))
        check_probs("target_probs", torch.softmax(logits.bfloat16().float(), -1))
    with pytest.raises(ValueError, match="sum to 1"):
        check_probs("target_probs", torch.softmax(torch.randn(2, vocab, generator=gen), -1) * 1.01)
