"""The sampling path (`verify`) agrees with the exact law (`emitted`): chi-square on 50k rows.

Alpha 1e-4 family-wise (Bonferroni across every case of this module); a deliberately broken rule
must fail the same test (power check).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from helpers import TOKEN_SPECS, dirichlet
from stats import chisquare_pvalue
from verispec.rules import parse
from verispec.rules.lossless import Lossless

CASES = ["flat", "peaked"]
N_TESTS = len(TOKEN_SPECS) * len(CASES) * 4  # four goodness-of-fit tests per case
ALPHA = 1e-4 / N_TESTS
# Sized by the power check below: the broken rule's first-token law b is at chi-square distance
# sum((b - p0)^2 / p0) = 0.054 (flat) and 0.010 (peaked) from the law it claims, so over ROWS rows the
# statistic is noncentral chi-square (4 df, lambda = ROWS * distance). At ALPHA = 3.7e-7 (critical value
# 35.5), 50k rows give lambda = 2700 / 500 and a miss probability below 1e-60; 10k rows would leave 1e-5
# in the peaked case, 200k (the former size) bought nothing but 4x the time.
ROWS = 50_000


def block(case: str, v: int = 5, k: int = 2):
    rng = np.random.default_rng({"flat": 11, "peaked": 12}[case])
    a = 1.0 if case == "flat" else 0.3
    p = np.stack([dirichlet(rng, v, a) for _ in range(k + 1)])
    q = np.stack([dirichlet(rng, v, a) for _ in range(k)])
    return torch.tensor(p), torch.tensor(q)


def run(rule, p, q, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k, v = q.shape
    x = torch.multinomial(q, ROWS, replacement=True, generator=gen).T.contiguous()  # [ROWS, K]
    pb = p.expand(ROWS, k + 1, v)  # [ROWS, K+1, V]
    qb = q.expand(ROWS, k, v)
    return rule.verify(pb, qb, x, gen)


def fit_pvalues(rule, p, q, result) -> dict[str, float]:
    v = p.shape[-1]
    tokens = result.tokens.numpy()
    n_acc = result.num_accepted.numpy()
    out = {}
    out["first token ~ emitted(p0, q0)"] = chisquare_pvalue(
        np.bincount(tokens[:, 0], minlength=v), rule.emitted(p[0], q[0]).numpy()
    )
    rows = n_acc >= 1
    out["second token | first accepted ~ emitted(p1, q1)"] = chisquare_pvalue(
        np.bincount(tokens[rows, 1], minlength=v), rule.emitted(p[1], q[1]).numpy()
    )
    rows = n_acc == 2
    bonus = rule._bonus(p[2])
    out["bonus token ~ bonus law"] = chisquare_pvalue(np.bincount(tokens[rows, 2], minlength=v),
                                                      bonus.numpy())
    accept0 = (q[0] * rule.accept(p[0], q[0])).sum().item()
    accepted = int((n_acc >= 1).sum())
    out["first acceptance ~ sum(q0 * accept)"] = chisquare_pvalue(
        np.array([accepted, ROWS - accepted]), np.array([accept0, 1 - accept0])
    )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("spec", TOKEN_SPECS)
def test_verify_matches_emitted_law(spec, case):
    rule = parse(spec)
    p, q = block(case)
    result = run(rule, p, q)
    assert (result.bonus == (result.num_accepted == 2)).all()
    for what, pvalue in fit_pvalues(rule, p, q, result).items():
        assert pvalue > ALPHA, f"{spec} [{case}] {what}: p-value {pvalue:.3g} <= {ALPHA:.3g}"


@dataclass(frozen=True, kw_only=True)
class BrokenLossless(Lossless):
    """Lossless with the classic bug: resample from the target instead of norm((p - q)+)."""

    name = "broken-lossless"

    def _residual(self, p, q):
        return p


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_power_broken_rule_fails(case):
    broken = BrokenLossless()
    p, q = block(case)
    result = run(broken, p, q)
    # The broken rule still claims emitted = p; its samples must be detected as not following p.
    pvalues = fit_pvalues(broken, p, q, result)
    assert pvalues["first token ~ emitted(p0, q0)"] < ALPHA, pvalues
