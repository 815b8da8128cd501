"""Truncation gates against brute-force references, sampling processors against transformers'
logits warpers, and the distance functions on known values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from verispec import gates
from verispec.diagnostics import js, kl, max_ratio, shift, tail_mass, tv
from verispec.sampling import SamplingConfig, process


def rows(seed: int = 0):
    rng = np.random.default_rng(seed)
    out = [rng.dirichlet(np.full(7, a)) for a in (0.3, 1.0, 3.0) for _ in range(5)]
    ties = rng.choice([0.0, 1.0, 2.0, 2.0, 4.0], size=(10, 7))
    ties[:, 0] += 1
    out += list(ties / ties.sum(-1, keepdims=True))
    out.append(np.full(7, 1 / 7))
    out.append(np.eye(7)[3])
    return [torch.tensor(r) for r in out]


def brute(p: np.ndarray, kind: str, *args) -> np.ndarray:
    v = len(p)
    if kind == "top_k":
        kth = np.sort(p)[::-1][min(args[0], v) - 1]
        return (p >= kth) & (p > 0)
    if kind == "top_p":
        return np.array([p[p > p[x]].sum() < args[0] for x in range(v)]) & (p > 0)
    if kind == "min_p":
        return p >= args[0] * p.max()
    if kind == "eta":
        eps, alpha = args
        h = -sum(pi * math.log(pi) for pi in p if pi > 0)
        return (p > min(eps, alpha * math.exp(-h))) | (p == p.max())
    if kind == "relaxed":
        return brute(p, "top_k", args[0]) & (p >= p.max() - args[1])
    raise KeyError(kind)


@pytest.mark.parametrize(
    "kind,args",
    [("top_k", (1,)), ("top_k", (3,)), ("top_k", (9,)), ("top_p", (0.5,)), ("top_p", (0.9,)),
     ("top_p", (1.0,)), ("min_p", (0.1,)), ("min_p", (0.6,)), ("eta", (0.09, 0.3)),
     ("eta", (0.3, math.sqrt(0.3))), ("relaxed", (3, 0.2)), ("relaxed", (5, 0.8))],
)
def test_gates_match_brute_force(kind, args):
    fn = {"top_k": gates.top_k_mask, "top_p": gates.top_p_mask, "min_p": gates.min_p_mask,
          "eta": gates.eta_mask, "relaxed": gates.relaxed_mask}[kind]
    batch = torch.stack(rows())
    mask = fn(batch, *args)
    for i, p in enumerate(batch):
        expected = brute(p.numpy(), kind, *args)
        if kind == "top_p":  # a token whose mass-above equals top_p is a float coin toss: skip those
            clear = np.array([abs(p[p > p[x]].sum().item() - args[0]) > 1e-9 for x in range(len(p))])
            mask_i, expected = mask[i].numpy()[clear], expected[clear]
        else:
            mask_i = mask[i].numpy()
        assert mask_i.tolist() == expected.tolist(), (kind, args, p)
        assert mask[i][p.argmax()]  # argmax always kept


def test_top_p_on_a_real_vocabulary_in_float32():
    """top_p = 1 keeps every token of positive probability (a float32 cumulative sum over 151,936
    tokens reaches 1.0 early, and `< 1.0` once cut ~40k tail tokens); below 1 the mask equals a float64
    reference on the same float32 probabilities."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(2, 151_936, generator=gen) * 6, -1)  # float32, like a model's
    assert (probs > 0).sum() > 250_000
    assert torch.equal(gates.top_p_mask(probs, 1.0), probs > 0)
    for top_p in (0.9, 0.999, 0.99999):
        mask = gates.top_p_mask(probs, top_p)
        for row, row_mask in zip(probs.double(), mask):
            desc = row.sort(descending=True).values
            before = desc.cumsum(0) - desc  # float64 exclusive mass, ties aside (none at this scale)
            keep = int((before < top_p).sum())
            assert int(row_mask.sum()) == keep and bool(row_mask[row.argsort(descending=True)[:keep]].all())
    # the diagnostics stay finite: a draft from the same logits, top_p = 1 sampling, a mixture rule
    from verispec.rules import parse

    target = process(probs.log(), SamplingConfig(top_p=1.0))[:1]
    noisy = probs + 1e-6 * torch.rand(probs.shape, generator=gen)
    draft = process(noisy.log(), SamplingConfig(top_p=1.0))[:1]
    law = parse("cos:w=0.5").emitted(target[0].double(), draft[0].double())
    assert math.isfinite(kl(law, target[0].double()).item())


def test_processors_match_transformers_warpers():
    transformers = pytest.importorskip("transformers")
    g = transformers.generation.logits_process
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0)) * 3
    configs = [
        (SamplingConfig(temperature=0.7), [g.TemperatureLogitsWarper(0.7)]),
        (SamplingConfig(top_k=5), [g.TopKLogitsWarper(5)]),
        (SamplingConfig(top_p=0.8), [g.TopPLogitsWarper(0.8)]),
        (SamplingConfig(min_p=0.1), [g.MinPLogitsWarper(0.1)]),
        (SamplingConfig(eta=0.05), [g.EtaLogitsWarper(0.05)]),
        (SamplingConfig(temperature=1.3, top_k=20, top_p=0.9, min_p=0.05),
         [g.TemperatureLogitsWarper(1.3), g.TopKLogitsWarper(20), g.TopPLogitsWarper(0.9),
          g.MinPLogitsWarper(0.05)]),
    ]
    ids = torch.zeros(16, 1, dtype=torch.long)
    for config, warpers in configs:
        hf = logits.clone()
        for w in warpers:
            hf = w(ids, hf)
        torch.testing.assert_close(process(logits, config, torch.float64), hf.double().softmax(-1), rtol=0,
                                   atol=1e-6, msg=str(config))


def test_greedy_and_bad_settings():
    logits = torch.tensor([[0.1, 2.0, -1.0]])
    assert process(logits, SamplingConfig(temperature=0)).tolist() == [[0.0, 1.0, 0.0]]
    for bad in (dict(temperature=-1), dict(top_k=0), dict(top_p=0), dict(top_p=1.5), dict(min_p=0),
                dict(eta=1), dict(temperature=math.nan)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingConfig(**bad)
    with pytest.raises(ValueError, match="NaN"):
        process(torch.tensor([[0.0, math.nan]]), SamplingConfig())
    with pytest.raises(ValueError, match="inf"):
        process(torch.tensor([[-math.inf, -math.inf]]), SamplingConfig())


def test_distances_known_values():
    a = torch.tensor([0.5, 0.5, 0.0])
    b = torch.tensor([0.25, 0.25, 0.5])
    assert tv(a, b).item() == pytest.approx(0.5)
    assert kl(a, b).item() == pytest.approx(math.log(2))
    assert kl(b, a).item() == math.inf  # b has mass where a has none
    m = (a.double() + b.double()) / 2
    assert js(a, b).item() == pytest.approx(0.5 * (kl(a, m) + kl(b, m)).item())
    assert 0 <= js(a, b).item() <= math.log(2)
    assert max_ratio(a, b).item() == pytest.approx(2.0)
    assert max_ratio(b, a).item() == math.inf
    assert tail_mass(b, torch.tensor([0.6, 0.3999, 0.0001]), 1e-3).item() == pytest.approx(0.5)
    same = torch.tensor([[0.2, 0.8], [1.0, 0.0]], dtype=torch.float64)
    for fn in (tv, kl, js):
        out = fn(same, same)
        assert out.dtype == torch.float64 and out.shape == (2,) and (out == 0).all()
    assert not torch.isnan(kl(torch.eye(3), torch.eye(3)[[1, 2, 0]])).any()
    with pytest.raises(ValueError, match="same shape"):
        tv(a, b[:2])


@pytest.mark.parametrize("mix", ["dense", "sparse", "mixed"])
def test_shift_distances_equal_the_separate_functions(mix, monkeypatch):
    """The diagnostics' fused distances (one ratio law/p shared by KL and the overshoot) equal tv, kl,
    max_ratio, tail_mass of `verispec.probability` within float64 rounding, +inf cases included: rows
    where p has zeros (law has mass there: inf; law has none: finite) or entries below 1e-300, laws with
    zeros, law == p. Rows with p >= 1e-300 take the fused path, the others the separate functions."""
    n, v = 12, 2000

    def dirichlet(alpha: float) -> torch.Tensor:
        g = torch.distributions.Gamma(torch.full((n, v), alpha, dtype=torch.float64), 1.0).sample()
        return g / g.sum(-1, keepdim=True)

    torch.manual_seed(3)
    p, law, base = dirichlet(0.05), dirichlet(0.3), dirichlet(1.0)
    p[4:] = p[4:].clamp_min(1e-40)  # tiny but >= 1e-300: the fused path
    p[4:] /= p[4:].sum(-1, keepdim=True)
    law[0] = p[0]  # no shift: tv = kl = 0, ratio 1
    law[1] = torch.where(p[1] >= 0.1 * p[1].max(), p[1], 0.0)  # a truncated law (zeros in law)
    law[1] /= law[1].sum()
    p[2:4] = torch.where(torch.rand(2, v) < 0.3, 0.0, p[2:4] + 1e-30)  # zeros in p
    p[2:4] /= p[2:4].sum(-1, keepdim=True)
    law[3] = torch.where(p[3] > 0, law[3], 0.0)  # ... where law has no mass: finite KL and ratio
    law[3] /= law[3].sum()
    p[11, :5] = 1e-305  # below the separate functions' clamp (1e-300): they decide
    rows = {"dense": [0, 1, 4, 5, 6], "sparse": [2, 3, 11], "mixed": list(range(n))}[mix]
    law, p, base = law[rows], p[rows], base[rows]
    separate = []  # rows the separate functions see
    monkeypatch.setattr(shift, "kl", lambda a, b: separate.append(len(a)) or kl(a, b))
    got = shift.shift_distances(law, p, base)
    assert sum(separate) == {"dense": 0, "sparse": 3, "mixed": 3}[mix]
    want = {"tv": tv(law, p), "kl": kl(law, p), "max_ratio": max_ratio(law, p),
            "tail_mass": tail_mass(law, p), "tv_baseline": tv(law, base)}
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-12, atol=1e-15, msg=name)
    if mix != "dense":
        assert math.isinf(got["kl"][rows.index(2)]) and math.isinf(got["max_ratio"][rows.index(2)])
        assert math.isfinite(got["kl"][rows.index(3)])
    if mix != "sparse":
        assert got["kl"][0] == 0 and got["tv"][0] == 0 and got["max_ratio"][0] == 1
    assert torch.isnan(shift.shift_distances(law, p, None)["tv_baseline"]).all()
