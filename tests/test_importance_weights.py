"""The behaviour log-probabilities the decode loop records per token (`steps["log_law"]`, returned by
`verispec serve` as `behaviour_logprobs`) give an unbiased importance weight against the target
(docs/design/diagnostics.md, 'Log-probabilities and importance weights'): from lossy rollouts on the toy pair,
the mean of exp(-log_ratio) * f(x) estimates E_target[f(x)]. Checked against the target's exact law
(enumeration) within 4 standard errors; the unweighted estimate and a deliberately wrong weight (the
sign of log_ratio flipped) must fail the same check (power). Fixed seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from streams import joint_law, stream_law
from test_decode_toy import V, law_fn, toy_pair

from verispec.decode import BatchDecoder, DecodeConfig
from verispec.models import ModelDrafter
from verispec.rules import parse

K, LENGTH, PROMPT = 2, 3, [1]
Z_MAX = 4.0  # |estimate - truth| / its standard error: exceeded with probability ~6e-5 by chance
# Rollouts per rule, sized by the power checks (the unweighted estimate and the wrong weight must give
# |z| > Z_MAX): their expected |z| is d * sqrt(runs), with d = (mean - truth) / sd per rollout of the
# unweighted estimate, the weaker of the two: d = 0.20 (budget) and 0.76 (lenience) on the toy pair.
# 2000 and 1000 runs put the expected |z| at 9.1 and 24, so a miss (z below 4) needs a 5-sigma draw;
# 4000 (the former size) only doubled the time.
RUNS = {"budget:tv=0.1,ratio=2": 2000, "lenience:l=0.4": 1000}


def rollouts(spec: str) -> list:
    """RUNS[spec] generations of LENGTH tokens under `spec`, each row with its own seeded generator."""
    target, draft = toy_pair()
    dec = BatchDecoder(target, ModelDrafter(draft), parse(spec), DecodeConfig(k=K, max_new_tokens=LENGTH))
    for seed in range(RUNS[spec]):
        dec.add(PROMPT, torch.Generator().manual_seed(seed))
    gens = []
    while dec.active:
        gens += [gen for _, gen in dec.step()]
    return gens


def z_score(values: np.ndarray, truth: float) -> float:
    return (values.mean() - truth) / (values.std(ddof=1) / math.sqrt(len(values)))


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["budget:tv=0.1,ratio=2", "lenience:l=0.4"])
def test_importance_weighted_lossy_rollouts_estimate_the_target(spec):
    target, draft = toy_pair()
    truth = joint_law(law_fn(target, PROMPT), V, LENGTH)
    law = stream_law(parse(spec), law_fn(target, PROMPT), law_fn(draft, PROMPT), V, K, LENGTH, shrink_k=True)
    # unbiasedness needs the behaviour law to cover the target's support
    assert all(law.get(seq, 0.0) > 0 for seq, pr in truth.items() if pr > 0)
    gens = rollouts(spec)
    assert all(len(g.token_ids) == LENGTH for g in gens)
    log_ratio = np.array([g.log_ratio for g in gens])
    # the recorded per-token laws are the decode loop's: log_ratio = sum(log_law - log_target)
    g = gens[0]
    assert g.log_ratio == pytest.approx(math.fsum(g.steps["log_law"]) - math.fsum(g.steps["log_target"]))
    seqs = [tuple(g.token_ids) for g in gens]
    # quantities with a known target value: the probability of the sequence the rule shifts most, and
    # the expected count of token 0
    most = max(truth, key=lambda s: abs(law.get(s, 0.0) - truth[s]))
    zeros = sum(pr * s.count(0) for s, pr in truth.items())
    quantities = [(np.array([s == most for s in seqs], float), truth[most]),
                  (np.array([s.count(0) for s in seqs], float), zeros)]
    for f, exact in quantities:
        assert abs(z_score(np.exp(-log_ratio) * f, exact)) < Z_MAX  # the importance weight
    f, exact = quantities[0]
    assert abs(z_score(f, exact)) > Z_MAX  # unweighted: the rule's law, not the target's
    assert abs(z_score(np.exp(log_ratio) * f, exact)) > Z_MAX  # a wrong weight is detected
