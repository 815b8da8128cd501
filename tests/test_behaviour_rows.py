"""`verispec.logprobs.behaviour_rows`: the full behaviour law of each emitted token (what
`top_behaviour_logprobs` of `verispec serve` reports), on the toy pair. Each row is a probability law,
its value at the token is the decode loop's own record `exp(steps["log_law"])`, it is the target's row
for a lossless rule and plain decoding, and differs from it under a lossy rule where a draft was made;
`token_logprobs`' top_behaviour is that row's top (docs/design/diagnostics.md, 'Log-probabilities and
importance weights')."""

from __future__ import annotations

import math

import pytest
import torch
from test_decode_toy import toy_pair

from verispec.decode import DecodeConfig, decode_prompts
from verispec.logprobs import behaviour_rows, token_logprobs
from verispec.models import ModelDrafter
from verispec.probability import renormalised_f64
from verispec.rules import parse


def generations(spec: str | None, runs: int = 6):
    target, draft = toy_pair()
    drafter = None if spec is None else ModelDrafter(draft)
    return decode_prompts(target, [[1]] * runs, [torch.Generator().manual_seed(s) for s in range(runs)],
                          DecodeConfig(k=3, max_new_tokens=7, keep_probs=True), drafter=drafter,
                          rule=None if spec is None else parse(spec))


@pytest.mark.parametrize("spec", ["lenience:l=0.4", "budget:tv=0.1,ratio=2", "lossless", None])
def test_behaviour_rows_are_the_laws_the_loop_recorded(spec):
    moved = 0
    for gen in generations(spec):
        n = gen.num_tokens
        laws = behaviour_rows(gen, n)  # [n, V]
        assert laws.shape == (n, laws.shape[1]) and laws.dtype == torch.float64
        assert torch.allclose(laws.sum(-1), torch.ones(n, dtype=torch.float64), atol=1e-12)
        at_token = laws.gather(-1, torch.tensor(gen.token_ids)[:, None]).squeeze(-1)  # [n]
        # the same float64 maths as the loop's record: equal to rounding
        assert at_token.log().tolist() == pytest.approx(gen.steps["log_law"], abs=1e-12)
        target = renormalised_f64(torch.cat(gen.probs["target"])[:n])  # [n, V]
        gap = (laws - target).abs().sum(-1)  # [n]: 2 x TV per token
        if spec in (None, "lossless"):
            assert gap.max() == 0
        else:
            assert gap.tolist() == pytest.approx([2 * t for t in gen.steps["tv"]], abs=1e-12)
            moved += int((gap > 1e-6).sum())
        entries = token_logprobs(gen, n, top=2)
        for entry, row in zip(entries, laws):
            values, ids = row.topk(2)
            assert [t for t, _ in entry["top_behaviour"]] == ids.tolist()
            assert [lp for _, lp in entry["top_behaviour"]] == pytest.approx([math.log(v) for v in values])
    if spec not in (None, "lossless"):
        assert moved > 0  # the lossy rule's law is not the target's somewhere: the check has power
