"""Exact tests of the rule catalogue: enumeration of the first emitted token, closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import SPECS, TOKEN_SPECS, cases
from verispec.diagnostics import tv
from verispec.rules import names, parse
from verispec.rules.budget import budget_target

TOL = 1e-12


def enumerated_law(rule, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Law of the emitted token by enumerating the drafted token x ~ q and integrating the coin."""
    accept = rule.accept(p, q)
    law = torch.zeros_like(p)
    for x in range(len(q)):
        if q[x] == 0:
            continue
        law[x] += q[x] * accept[x]
        residual = rule.residual_after(p, q, torch.tensor(x))
        law += q[x] * (1 - accept[x]) * residual
    return law


def test_specs_cover_every_registered_rule():
    covered = {s.partition(":")[0] for s in SPECS}
    missing = set(names()) - covered
    assert not missing, f"rules without exact tests: {missing}"


@pytest.mark.parametrize("spec", TOKEN_SPECS)
@pytest.mark.parametrize("v", [2, 3, 4, 5])
def test_emitted_equals_enumeration(spec, v):
    rule = parse(spec)
    for name, p, q in cases(v):
        law = rule.emitted(p, q)
        assert law.dtype == torch.float64
        assert (law >= 0).all(), (name, law)
        assert abs(law.sum().item() - 1) < TOL, (name, law)
        accept = rule.accept(p, q)
        assert ((accept >= 0) & (accept <= 1)).all(), (name, accept)
        torch.testing.assert_close(law, enumerated_law(rule, p, q), rtol=0, atol=TOL, msg=f"{spec} {name}")
        if rule.lossless:
            torch.testing.assert_close(law, p, rtol=0, atol=TOL, msg=f"lossless {spec} {name}")


@pytest.mark.parametrize("spec", TOKEN_SPECS)
def test_law_and_expected_acceptance_equal_their_definitions(spec):
    """The diagnostics' one call (budget computes its law once for both) gives `emitted` and
    sum_x q(x) accept(x), batched over rows."""
    rule = parse(spec)
    cs = cases(5, seed=11)
    p, q = torch.stack([c[1] for c in cs]), torch.stack([c[2] for c in cs])  # [N, V]
    law, expected = rule.law_and_expected_acceptance(p, q)
    torch.testing.assert_close(law, rule.emitted(p, q), rtol=0, atol=TOL)
    torch.testing.assert_close(expected, (q * rule.accept(p, q)).sum(-1), rtol=0, atol=TOL)
    assert expected.shape == (len(cs),)


@pytest.mark.parametrize("spec", [s for s in SPECS if not s.startswith("fly")])  # fly: no per-position law
def test_emitted_batched_matches_rows(spec):
    rule = parse(spec)
    cs = cases(5, seed=7)
    p = torch.stack([c[1] for c in cs])  # [N, V]
    q = torch.stack([c[2] for c in cs])
    batched = rule.emitted(p.view(-1, 1, 5), q.view(-1, 1, 5)).view(-1, 5)  # leading dims [N, 1]
    rows = torch.stack([rule.emitted(p[i], q[i]) for i in range(len(cs))])
    torch.testing.assert_close(batched, rows, rtol=0, atol=TOL)
    f32 = rule.emitted(p.float(), q.float())
    assert f32.dtype == torch.float32
    torch.testing.assert_close(f32.double(), rows, rtol=0, atol=1e-5)


def test_lossless_rules_are_flagged():
    flagged = {s for s in SPECS if parse(s).lossless}
    assert flagged == {"lossless", "hsd", "lenience:l=1", "cos:w=0", "fuzzy:threshold=0", "budget:tv=0"}


def test_lenience_piecewise_closed_form():
    for v in (2, 3, 4, 5):
        for name, p, q in cases(v):
            for lam in (0.1, 0.5, 0.9):
                law = parse(f"lenience:l={lam}").emitted(p, q)
                dist = tv(p, q).item()
                d = (q - p / lam).clamp_min(0).sum() / dist if dist > 0 else torch.tensor(0.0, dtype=p.dtype)
                expected = torch.where(q <= p, d * p + (1 - d) * q, torch.where(q < p / lam, q, p / lam))
                torch.testing.assert_close(law, expected, rtol=0, atol=TOL, msg=f"{name} l={lam}")
                assert (law <= p / lam + TOL).all()


def test_cos_is_the_mixture():
    for name, p, q in cases(4):
        for w in (0.0, 0.3, 1.0):
            law = parse(f"cos:w={w}").emitted(p, q)
            torch.testing.assert_close(law, (1 - w) * p + w * q, rtol=0, atol=TOL, msg=name)


@pytest.mark.parametrize("tv_budget,ratio",
                         [(0.0, 2.0), (0.02, 2.0), (0.1, 1.5), (0.3, 4.0), (1.0, math.inf), (0.5, 1.0)])
def test_budget_constraints_and_optimal_acceptance(tv_budget, ratio):
    rule = parse(f"budget:tv={tv_budget},ratio={ratio}")
    for v in (2, 3, 4, 5):
        for name, p, q in cases(v, seed=3):
            r = rule.emitted(p, q)
            assert tv(r, p).item() <= tv_budget + TOL, name
            cap = torch.where(p > 0, ratio * p, torch.zeros_like(p))
            assert (r <= cap + TOL).all(), name
            assert (r[p == 0] == 0).all(), name
            acceptance = (q * rule.accept(p, q)).sum().item()
            room = (torch.minimum(q, cap) - p).clamp_min(0).sum().item()
            expected = 1 - tv(p, q).item() + min(tv_budget, room, tv(p, q).item())
            assert abs(acceptance - expected) < TOL, (name, acceptance, expected)
            torch.testing.assert_close(budget_target(p, q, tv_budget, ratio), r, rtol=0, atol=0)


def test_budget_beats_lossless_acceptance_and_never_exceeds_its_bound():
    rng = np.random.default_rng(0)
    for _ in range(50):
        p = torch.tensor(rng.dirichlet(np.full(6, 0.5)))
        q = torch.tensor(rng.dirichlet(np.full(6, 0.5)))
        base = (q * parse("lossless").accept(p, q)).sum()
        acc = (q * parse("budget:tv=0.1,ratio=3").accept(p, q)).sum()
        assert acc >= base - TOL
        assert acc <= base + 0.1 + TOL


def test_truncation_emitted_formula_and_baseline():
    for spec in ("speccascade:min_p=0.3", "typical:eps=0.2", "topk:k=2", "topp:p=0.7",
                 "relaxed:n=3,delta=0.2"):
        for resample in ("target", "truncated", "greedy"):
            rule = parse(f"{spec},resample={resample}")
            for name, p, q in cases(5):
                gate = rule.gate(p).double()
                assert gate[p.argmax()] == 1
                base = rule.baseline(p)
                torch.testing.assert_close(base, p * gate / (p * gate).sum(), rtol=0, atol=TOL)
                residual = {"target": p, "truncated": base,
                            "greedy": torch.eye(5, dtype=p.dtype)[p.argmax()]}[resample]
                expected = q * gate + (1 - (q * gate).sum()) * residual
                torch.testing.assert_close(rule.emitted(p, q), expected, rtol=0, atol=TOL,
                                           msg=f"{rule.spec} {name}")
                honest = parse(f"honest:{rule.spec}")  # the honest baseline samples p_A exactly
                torch.testing.assert_close(honest.emitted(p, q), base, rtol=0, atol=TOL)
                torch.testing.assert_close(honest.baseline(p), base, rtol=0, atol=0)


def test_non_truncation_rules_have_no_baseline():
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    for spec in ("lossless", "lenience:l=0.5", "cos:w=0.2", "fuzzy:threshold=0.1",
                 "sglang:single=0.9,acc=0.5", "budget:tv=0.1"):
        assert parse(spec).baseline(p) is None


def test_greedy_emits_argmax():
    for name, p, q in cases(4):
        torch.testing.assert_close(parse("greedy").emitted(p, q), torch.eye(4, dtype=p.dtype)[p.argmax()])


def test_sglang_closed_form_by_hand():
    p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    # single=0.5, acc=0.5: a = [1, 0.6, 0.2]
    law = parse("sglang:single=0.5,acc=0.5").emitted(p, q)
    a = torch.tensor([1.0, 0.6, 0.2], dtype=torch.float64)
    rej = q * (1 - a)  # rejection mass of each drafted token
    expected = q * a
    for x in range(3):
        others = p.clone()
        others[x] = 0
        expected += rej[x] * others / others.sum()
    torch.testing.assert_close(law, expected, rtol=0, atol=TOL)


@pytest.mark.parametrize("spec", TOKEN_SPECS)
def test_fast_accept_at_equals_reference(spec):
    """The fast path (acceptance at the drafted tokens only) equals gathering the full accept."""
    rule = parse(spec)
    cs = cases(5, seed=11)
    p = torch.stack([c[1] for c in cs])[None]  # [1, N, V]
    q = torch.stack([c[2] for c in cs])[None]
    for tok in range(5):
        x = torch.full((1, len(cs)), tok)
        ok = q.gather(-1, x[..., None]).squeeze(-1) > 0  # only tokens that can be drafted
        fast = rule._accept_at(p, q, x)[ok]
        slow = rule._accept(p, q).gather(-1, x[..., None]).squeeze(-1)[ok]
        assert torch.equal(fast, slow), (spec, tok)
