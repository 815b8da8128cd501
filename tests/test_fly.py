"""FLy (entropy-gated deferred verification, vLLM's rejection_sample_method="fly"): its exact block law.

- `block_law`'s forward recursion equals a slow reference that runs vLLM's pre-pass literally (its
  Triton kernel's loop, ported line by line) on each of the 2^k native accept/reject patterns;
- `verify` equals that reference given the same uniforms, and its samples follow the block law
  (chi-square), while a plausibly broken variant (the window read on kept drafts instead of native
  verdicts) is told apart at the same sample size (power);
- composed over blocks (tests/streams.py), the law of the generated stream is the target's when the
  entropy gate never opens, and measurably not the target's when it does; the full decode loop samples
  that stream law.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import Tensor

from stats import chisquare_pvalue
from streams import joint_law, stream_law
from verispec.rules import parse
from verispec.rules.fly import FLy, top_entropy


def vllm_prepass_kept(native: list[bool], draft_ok: list[bool], entropy: list[float], window: int,
                      threshold: float) -> list[bool]:
    """vLLM's `apply_fly_random_acceptance_kernel` for one request, then the native kernel's verdicts:
    a position is kept iff natively accepted or its uniform was set to 0 by the pre-pass. draft_ok[i]:
    the draft is valid with p(x) > 0 and q(x) > 0. Future verdicts are read before any are overwritten
    (the kernel reads positions after `pos` only)."""
    k = len(native)
    kept = list(native)
    for pos in range(k):
        can_defer = (not native[pos] and draft_ok[pos] and pos + window < k and entropy[pos] >= threshold)
        for offset in range(1, window + 1):
            in_bounds = pos + offset < k
            can_defer = can_defer and in_bounds and native[pos + offset]
        if can_defer:
            kept[pos] = True
    return kept


def reference_num_accepted_probs(a: list[float], draft_ok: list[bool], entropy: list[float], window: int,
                                 threshold: float) -> np.ndarray:
    """P(n = m) by enumerating every native pattern (2^k), each with its probability prod a or 1 - a."""
    k = len(a)
    out = np.zeros(k + 1)
    for pattern in itertools.product([False, True], repeat=k):
        weight = math.prod(a[i] if pattern[i] else 1 - a[i] for i in range(k))
        kept = vllm_prepass_kept(list(pattern), draft_ok, entropy, window, threshold)
        n = next((i for i in range(k) if not kept[i]), k)
        out[n] += weight
    return out


def random_block(seed: int, b: int, k: int, v: int, ragged: bool = True):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(v, 0.4), size=(b, k + 1))
    p[rng.random((b, k + 1, v)) < 0.15] = 0.0  # zeros in the target: p(x) = 0 drafts are never deferred
    p[..., 0] += 1e-3
    p /= p.sum(-1, keepdims=True)
    q = rng.dirichlet(np.full(v, 0.4), size=(b, k))
    x = np.stack([[rng.choice(v, p=q[i, j]) for j in range(k)] for i in range(b)])
    if ragged:
        for i in range(b):
            x[i, rng.integers(0, k + 1):] = -1
    return torch.tensor(p), torch.tensor(q), torch.tensor(x)


def row_inputs(p: Tensor, q: Tensor, x: Tensor, i: int,
               rule: FLy) -> tuple[list[float], list[bool], list[float]]:
    k_i = int((x[i] >= 0).sum())
    a, ok, h = [], [], []
    for j in range(k_i):
        t = int(x[i, j])
        a.append(min(1.0, float(p[i, j, t] / q[i, j, t])))
        ok.append(bool(p[i, j, t] > 0))
        h.append(float(top_entropy(p[i, j], rule.top_k)))
    return a, ok, h


SPECS = ["fly:window=1,threshold=0", "fly:window=2,threshold=0.3", "fly:window=3,threshold=0.1,top_k=2",
         "fly:window=1,threshold=0.6,top_k=4", "fly"]


@pytest.mark.parametrize("spec", SPECS)
def test_block_law_equals_vllm_prepass_enumeration(spec):
    rule = parse(spec)
    for seed, k in [(1, 3), (2, 5), (3, 7)]:
        p, q, x = random_block(seed, b=12, k=k, v=5)
        law = rule.block_law(p, q, x)
        for i in range(len(x)):
            a, ok, h = row_inputs(p, q, x, i, rule)
            expected = reference_num_accepted_probs(a, ok, h, rule.window, rule.threshold)
            got = law.num_accepted_probs[i, : len(a) + 1].numpy()
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12, err_msg=f"{spec} row {i}")
            assert law.num_accepted_probs[i, len(a) + 1:].abs().sum() == 0


@pytest.mark.parametrize("spec", SPECS)
def test_verify_equals_the_prepass_given_its_uniforms(spec):
    rule = parse(spec)
    p, q, x = random_block(4, b=400, k=8, v=4)  # k > 6: the default window defers too
    uniforms = torch.rand(len(x), 9, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    result = rule.verify_with_uniforms(p, q, x, uniforms)
    deferred = 0
    for i in range(len(x)):
        a, ok, h = row_inputs(p, q, x, i, rule)
        native = [float(uniforms[i, j]) < a[j] for j in range(len(a))]
        kept = vllm_prepass_kept(native, ok, h, rule.window, rule.threshold)
        n = next((j for j in range(len(a)) if not kept[j]), len(a))
        assert int(result.num_accepted[i]) == n, (spec, i)
        deferred += sum(kept[j] and not native[j] for j in range(n))
        eligible = np.array([ok[j] and j + rule.window < len(a) and h[j] >= rule.threshold
                             for j in range(len(a))])
        window_pass = np.array([math.prod(a[j + 1: j + 1 + rule.window]) for j in range(len(a))])
        expected_probs = np.array(a) + (1 - np.array(a)) * eligible * window_pass
        np.testing.assert_allclose(result.accept_probs[i, : len(a)].numpy(), expected_probs, atol=1e-12)
    if spec != "fly:window=1,threshold=0.6,top_k=4":
        assert deferred > 0, "the case must exercise deferral"


@dataclass(frozen=True, kw_only=True)
class WindowOnKept(FLy):
    """A plausible bug: the window reads the *kept* verdicts of the next drafts (deferrals included)
    instead of their native verdicts, so deferrals chain."""

    def _verify(self, p, q, x, uniforms):
        num = (x >= 0).sum(-1)
        b, k = x.shape
        from verispec.rules.base import blank_padding
        pp, qq = blank_padding(p, q, x, num)
        a, e, _ = self._parts(pp, qq, x)
        native = uniforms[:, :k] < a
        kept = native.clone()
        for i in range(k - 1, -1, -1):
            ahead = kept[:, i + 1: i + 1 + self.window]
            full = torch.full((b,), ahead.shape[1] == self.window)
            kept[:, i] |= e[:, i] & full & ahead.all(-1)
        forced = uniforms.clone()
        forced[:, :k] = torch.where(kept, 0.0, 1.0)  # a native lossless-style scan of these verdicts
        return FLy(window=1, threshold=math.inf)._verify(p, q, x, forced)


def block_cells(result, k: int, v: int) -> np.ndarray:
    n = result.num_accepted.numpy()
    last = result.tokens.numpy()[np.arange(len(n)), n]
    return np.bincount(n * v + last, minlength=(k + 1) * v)


@pytest.mark.slow
def test_verify_samples_the_block_law_and_a_broken_variant_is_caught():
    rng = np.random.default_rng(8)
    v, k, rows = 3, 4, 60_000
    p = torch.tensor(rng.dirichlet(np.full(v, 2.0), size=k + 1))  # high entropy: the gate is open
    q = torch.tensor(rng.dirichlet(np.full(v, 0.5), size=k))
    x = torch.tensor([[int(torch.argmax(q[j])) for j in range(k)]])
    rule = parse("fly:window=1,threshold=0.3")
    law = rule.block_law(p[None], q[None], x)
    expected = (law.num_accepted_probs[0][:, None] * law.last_laws[0]).reshape(-1).numpy()  # [(K+1) V]
    args = (p.expand(rows, k + 1, v), q.expand(rows, k, v), x.expand(rows, k))
    good = block_cells(rule.verify(*args, torch.Generator().manual_seed(1)), k, v)
    bug = WindowOnKept(window=1, threshold=0.3)
    broken = block_cells(bug.verify(*args, torch.Generator().manual_seed(1)), k, v)
    keep = expected > 0
    assert good[~keep].sum() == 0
    assert chisquare_pvalue(good[keep], expected[keep]) > 1e-4
    assert chisquare_pvalue(broken[keep], expected[keep]) < 1e-6  # power: the bug is seen at this size


class Tables:
    """Context-dependent conditionals over V tokens, high-entropy targets so the gate opens."""

    def __init__(self, v: int, seed: int):
        self.v, self.seed, self.cache = v, seed, {}

    def get(self, which: str, ctx: tuple[int, ...]) -> np.ndarray:
        key = (which, ctx)
        if key not in self.cache:
            rng = np.random.default_rng([self.seed, {"p": 1, "q": 2}[which], len(ctx), *ctx])
            self.cache[key] = rng.dirichlet(np.full(self.v, 3.0 if which == "p" else 0.4))
        return self.cache[key]

    def p(self, ctx):
        return self.get("p", ctx)

    def q(self, ctx):
        return self.get("q", ctx)


@pytest.mark.parametrize("v,k,length", [(2, 2, 4), (3, 3, 4)])
def test_stream_law_lossless_when_the_gate_never_opens(v, k, length):
    tables = Tables(v, seed=v + k)
    closed = parse(f"fly:window=1,threshold={math.log(3) + 0.01}")  # H over the top 3 is at most log 3
    law = stream_law(closed, tables.p, tables.q, v, k, length)
    expected = joint_law(tables.p, v, length)
    assert max(abs(law.get(s, 0.0) - pr) for s, pr in expected.items()) < 1e-12


@pytest.mark.parametrize("v,k,length", [(2, 2, 4), (3, 3, 4)])
def test_stream_law_shifts_when_the_gate_opens(v, k, length):
    tables = Tables(v, seed=v + k)
    law = stream_law(parse("fly:window=1,threshold=0"), tables.p, tables.q, v, k, length)
    expected = joint_law(tables.p, v, length)
    assert abs(sum(law.values()) - 1) < 1e-12
    tv = sum(abs(law.get(s, 0.0) - pr) for s, pr in expected.items()) / 2
    assert tv > 0.02, tv  # lossy: the kept-anyway drafts pull the stream towards the draft


def test_top_entropy_is_vllms_gate():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    full = -(probs * probs.log()).sum()
    assert torch.isclose(top_entropy(probs, 4), full)
    assert torch.isclose(top_entropy(probs, 1), -0.5 * math.log(0.5) * torch.ones((), dtype=torch.float64))
    assert torch.isclose(top_entropy(probs, 99), full)  # capped at the vocabulary
    assert top_entropy(torch.tensor([1.0, 0.0, 0.0]), 3) == 0  # 0 log 0 = 0


def test_bad_parameters_and_no_per_position_law():
    for spec, match in [("fly:window=0", "window >= 1"), ("fly:threshold=-1", "threshold >= 0"),
                        ("fly:top_k=0", "top_k >= 1"), ("fly:window=1.5", "window")]:
        with pytest.raises(ValueError, match=match):
            parse(spec)
    p = torch.full((1, 3), 1 / 3, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="block_law"):
        parse("fly").emitted(p, p)
    from verispec.api import generate
    with pytest.raises(ValueError, match="no per-position law"):  # before any model loads
        generate("hi", target="no-such-model", draft="none-such", rule="fly", diagnostics=True)


def test_a_server_with_diagnostics_refuses_fly():
    from verispec.serving.config import APIError, ServeConfig, check_policy
    with pytest.raises(APIError, match="no per-position law.*--no-diagnostics"):
        check_policy(parse("fly"), ServeConfig())
    check_policy(parse("fly"), ServeConfig(diagnostics=False))  # served without diagnostics: allowed
