"""The importance weight exp(-log_ratio) of lossy rollouts on the default (Shakespeare) pair estimates
target expectations (docs/design/diagnostics.md, 'Log-probabilities and importance weights'); the toy-pair
check is tests/test_importance_weights.py.

Three tokens at k = 2, so the first block drafts positions 1 and 2 and both are verified by the lossy
rule (a one-token decode tests nothing: no draft is made for the last token). The quantities are
prefix indicators f(x) = 1[x starts with (a,)] and 1[x starts with (a, b)], (a, b) the target's greedy
pair, whose target values p(a) and p(a) p(b | a) are exact (two forward passes of the target). The
weighted mean must be within Z_MAX standard errors of them; the unweighted mean (the rule's law) and a
sign-flipped weight must not (power). Fixed seeds; rollouts batched through `decode_prompts`.

One lossy rule here, the budget rule (the most involved law): what this file adds to the toy-pair check
is the real pair's path (its vocabulary, batching, the decode loop's log_ratio), which every rule shares;
each rule's own weights, lenience's included, are checked there. Lenience ran here too until the full
suite passed its 10-minute budget (2000 rollouts are about 40 s a rule on a 2-core machine)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from verispec.api import resolve_drafter, resolve_target
from verispec.decode import DecodeConfig, decode_prompts
from verispec.rules import parse

PROMPT = "KING.\nWhat says the queen?\n"
RUNS, K, LENGTH = 2000, 2, 3
Z_MAX = 4.0  # exceeded by chance with probability ~6e-5 per check


@pytest.fixture(scope="module")
def pair():
    target = resolve_target("default", "cpu", torch.float32)
    return target, resolve_drafter("default-draft", target, "cpu", torch.float32)


def next_logprobs(target, ids: list[int]) -> torch.Tensor:
    """log p(. | ids) under the target (transformers' forward), [V], float64."""
    with torch.no_grad():
        return torch.log_softmax(target.model(torch.tensor([ids])).logits[0, -1].double(), dim=-1)


def z_score(values: np.ndarray, truth: float) -> float:
    return (values.mean() - truth) / (values.std(ddof=1) / math.sqrt(len(values)))


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["budget:tv=0.05"])  # one rule, deliberately (module docstring)
def test_importance_weights_on_the_default_pair(pair, spec):
    target, drafter = pair
    ids = target.encode(PROMPT)
    first = next_logprobs(target, ids)
    a = int(first.argmax())
    second = next_logprobs(target, ids + [a])
    b = int(second.argmax())
    exact = {(a,): math.exp(first[a]), (a, b): math.exp(first[a] + second[b])}
    gens = decode_prompts(target, [ids] * RUNS, [torch.Generator().manual_seed(s) for s in range(RUNS)],
                          DecodeConfig(k=K, max_new_tokens=LENGTH), drafter=drafter, rule=parse(spec),
                          batch_size=256)
    # the first block drafted both positions the quantities look at (a block proposes min(k, left - 1))
    assert all(g.blocks[0].proposed == K for g in gens)
    log_ratio = np.array([g.log_ratio for g in gens])
    z = {}
    for prefix, truth in exact.items():
        f = np.array([tuple(g.token_ids[:len(prefix)]) == prefix for g in gens], float)
        z[prefix] = (z_score(np.exp(-log_ratio) * f, truth), z_score(f, truth),
                     z_score(np.exp(log_ratio) * f, truth))
    for weighted, _, _ in z.values():
        assert abs(weighted) < Z_MAX, z
    assert abs(z[(a,)][1]) > Z_MAX, z  # unweighted: the rule's law, not the target's
    assert abs(z[(a, b)][2]) > Z_MAX, z  # a sign-flipped weight is detected
