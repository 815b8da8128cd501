"""What `token_logprobs` shows in each logprobs mode (vLLM's `logprobs_mode`; `verispec serve
--logprobs-mode`, docs/design/diagnostics.md, 'Log-probabilities and importance weights'), checked against the
target's logits recomputed from scratch for the generated sequence: raw log-probs (the default),
processed log-probs (the sampling settings applied), raw logits and processed logits (divided by the
temperature, -inf outside the processed law's support); the top values are each row's largest; the
processed and behaviour log-probs and the sums do not depend on the mode."""

from __future__ import annotations

import math

import pytest
import torch
from test_decode_toy import toy_pair

from verispec.decode import DecodeConfig, decode_prompts
from verispec.logprobs import MODES, token_logprobs, totals
from verispec.models import ModelDrafter
from verispec.rules import parse
from verispec.sampling import SamplingConfig

def generation(temperature: float = 0.7):
    target, draft = toy_pair()
    sampling = SamplingConfig(temperature=temperature, top_k=3)  # raw and processed differ; a support
    [gen] = decode_prompts(target, [[1, 2]], [torch.Generator().manual_seed(3)],
                           DecodeConfig(k=3, max_new_tokens=9, keep_probs=True, sampling=sampling),
                           drafter=ModelDrafter(draft), rule=parse("lenience:l=0.5"))
    full = torch.tensor([[1, 2, *gen.token_ids]])  # [1, L]
    rows = torch.stack([target.context_logits(full[:, : 2 + i])[0] for i in range(gen.num_tokens)])  # [n, V]
    return gen, rows.double(), sampling


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_each_mode_shows_its_values_and_the_rest_stays(temperature):
    gen, logits, sampling = generation(temperature)
    n, tokens = gen.num_tokens, torch.tensor(gen.token_ids)
    processed = torch.cat(gen.probs["target"]).double()  # [n, V], the loop's processed law
    support = processed > 0
    expected = {"raw_logprobs": logits.log_softmax(-1), "raw_logits": logits,
                "processed_logprobs": (processed / processed.sum(-1, keepdim=True)).log(),
                "processed_logits": (logits / temperature if temperature else logits).masked_fill(~support,
                                                                                                 -math.inf)}
    base = token_logprobs(gen, n, top=2, mode="processed_logprobs", temperature=temperature)
    for mode in MODES:
        entries = token_logprobs(gen, n, top=2, mode=mode, temperature=temperature)
        rows = expected[mode]
        assert [e["logprob"] for e in entries] == pytest.approx(
            rows.gather(-1, tokens[:, None])[:, 0].tolist(), abs=1e-5), mode
        for e, row in zip(entries, rows):
            values, ids = row.topk(2)
            assert [v for _, v in e["top"]] == pytest.approx(values.tolist(), abs=1e-5), mode
            assert {t for t, _ in e["top"]} <= set(torch.nonzero(row >= values[-1] - 1e-6)[:, 0].tolist())
        for key in ("processed_logprob", "behaviour_logprob", "raw_logprob", "role", "top_behaviour"):
            assert [e[key] for e in entries] == [e[key] for e in base], (mode, key)
        assert totals(entries) == totals(base)
    assert [e["raw_logprob"] for e in base] == pytest.approx(
        logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0].tolist(), abs=1e-5)
    if temperature == 0:
        assert all(e["processed_logprob"] == 0.0 for e in base)  # one token in the support


def test_a_window_of_tokens_equals_the_same_entries_of_the_whole():
    gen, _, _ = generation()
    whole = token_logprobs(gen, gen.num_tokens, top=2, mode="raw_logprobs")
    assert token_logprobs(gen, 7, top=2, mode="raw_logprobs", start=3) == whole[3:7]


def test_an_unknown_mode_is_refused():
    from verispec.serving.config import ServeConfig

    gen, _, _ = generation()
    with pytest.raises(ValueError, match="raw_logprobs"):
        token_logprobs(gen, 2, mode="logits")
    with pytest.raises(ValueError, match="--logprobs-mode"):
        ServeConfig(target="default", logprobs_mode="raw")


def test_the_token_value_equals_its_top_entry_and_needs_no_rows_without_top():
    """With top_logprobs the token's value is read from the same float64 row as the top ones (a greedy
    token equals the largest top value exactly, as lm-eval's is_greedy compares); without, the logits
    modes read the tokens' own logits (keep_token_logits) and agree with the rows to float32."""
    target, draft = toy_pair()
    sampling = SamplingConfig(temperature=0.7, top_k=3)
    config = DecodeConfig(k=3, max_new_tokens=9, sampling=sampling, keep_token_logits=True)
    [lean] = decode_prompts(target, [[1, 2]], [torch.Generator().manual_seed(3)], config,
                            drafter=ModelDrafter(draft), rule=parse("lenience:l=0.5"))
    gen, _, _ = generation()  # the same seed and settings, with the V-sized rows kept
    assert lean.token_ids == gen.token_ids and gen.token_logits is None and lean.probs is None
    for mode in MODES:
        with_rows = token_logprobs(gen, gen.num_tokens, top=5, mode=mode, temperature=0.7)
        for e in with_rows:
            if e["token_id"] in dict(e["top"]):
                assert e["logprob"] == dict(e["top"])[e["token_id"]]  # the very same number
        record = token_logprobs(lean, lean.num_tokens, mode=mode, temperature=0.7)
        assert [e["logprob"] for e in record] == pytest.approx([e["logprob"] for e in with_rows], abs=1e-5)
    [bare] = decode_prompts(target, [[1, 2]], [torch.Generator().manual_seed(3)],
                            DecodeConfig(k=3, max_new_tokens=9, sampling=sampling),
                            drafter=ModelDrafter(draft), rule=parse("lenience:l=0.5"))
    with pytest.raises(ValueError, match="keep_token_logits"):
        token_logprobs(bare, 2, mode="raw_logits")
