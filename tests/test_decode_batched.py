"""Batched decoding (`BatchDecoder`, `speculative_decode_batch`, `autoregressive_decode_batch`).

Each row draws from its own generator in batch-1 order, so a batched row must be token-identical to
decoding that prompt alone with the same seed, with identical diagnostics, for every rule; rows
that leave early (EOS, max tokens) or join late must not disturb the others. The sequence law per
row is checked against exact enumeration (tests/streams.py), and on the default pair greedy batched
output must equal batch-1 greedy output up to float ties.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import SPECS
from stats import chisquare_pvalue
from streams import joint_law, stream_law
from verispec.decode import (BatchDecoder, DecodeConfig, autoregressive_decode, autoregressive_decode_batch,
                             speculative_decode, speculative_decode_batch)
from verispec.models import ModelDrafter, NGramDrafter, TabularModel
from verispec.rules import parse
from verispec.sampling import SamplingConfig

V = 5
EOS = 4


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    yield
    torch.set_num_threads(threads)


def toy_pair(eos: int | None = EOS):
    target = TabularModel.random(V, order=2, seed=11, name="toy-target", eos_token_id=eos)
    draft = TabularModel.random(V, order=1, seed=12, name="toy-draft")
    target.table[..., EOS] -= 1.5  # EOS rarer: some rows stop early, others run to max tokens
    draft.table[..., EOS] -= 1.5
    return target, draft


def prompts(b: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths, 1 to 12 tokens (prompts of ~1000 tokens have their own test)."""
    rng = np.random.default_rng(seed)
    lengths = [1, 12, 3, 7, 1, 9, 5, 2][:b]
    return [rng.integers(0, V - 1, n).tolist() for n in lengths]  # no EOS inside prompts


def gens(b: int, seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(b)]


def assert_same(batched, single):
    """Same tokens, blocks, finish, call counts and every diagnostic field (exactly)."""
    assert batched.token_ids == single.token_ids
    assert batched.blocks == single.blocks
    assert batched.finish == single.finish
    assert batched.rule == single.rule
    assert (batched.target_calls, batched.draft_calls) == (single.target_calls, single.draft_calls)
    assert batched.steps is not None and single.steps is not None
    assert batched.steps.keys() == single.steps.keys()
    for key in single.steps:
        a, b = batched.steps[key], single.steps[key]
        assert len(a) == len(b), key
        for x, y in zip(a, b):
            assert x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)), (key, x, y)


QUICK = {"lossless", "greedy", "hsd", "speccascade:min_p=0.3", "budget:tv=0.05,ratio=2"}


@pytest.mark.parametrize("spec", [s if s in QUICK else pytest.param(s, marks=pytest.mark.slow) for s in SPECS])
def test_every_rule_batched_equals_batch1(spec):
    target, draft = toy_pair()
    rule = parse(spec)
    config = DecodeConfig(k=3, max_new_tokens=12)
    for b in (1, 3, 8):
        ps = prompts(b, seed=b)
        batched = speculative_decode_batch(target, ModelDrafter(draft), ps, rule, config, gens(b, 100 * b))
        finishes = set()
        for i, (prompt, out) in enumerate(zip(ps, batched)):
            single = speculative_decode(target, ModelDrafter(draft), prompt, rule, config,
                                        torch.Generator().manual_seed(100 * b + i))
            assert_same(out, single)
            finishes.add(out.finish)
        if b == 8 and rule.lossless:
            assert finishes == {"eos", "length"}  # some rows leave early, others run to max tokens


@pytest.mark.parametrize("spec", ["lossless", "hsd", "lenience:l=0.4", "greedy"])
def test_ngram_drafter_batched_equals_batch1(spec):
    """Prompt lookup proposes fewer than k tokens (or none) on some rows: ragged blocks."""
    target, _ = toy_pair()
    config = DecodeConfig(k=4, max_new_tokens=15)
    ps = prompts(8, seed=3)
    batched = speculative_decode_batch(target, NGramDrafter(2, V), ps, spec, config, gens(8, 7))
    proposed = set()
    for i, (prompt, out) in enumerate(zip(ps, batched)):
        single = speculative_decode(target, NGramDrafter(2, V), prompt, spec, config, torch.Generator().manual_seed(7 + i))
        assert_same(out, single)
        proposed |= {blk.proposed for blk in out.blocks}
    assert len(proposed) > 2  # ragged: several different draft lengths occurred


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_plain_batched_equals_batch1(temperature):
    target, _ = toy_pair()
    config = DecodeConfig(max_new_tokens=10, sampling=SamplingConfig(temperature=temperature))
    for b in (1, 3, 8):
        ps = prompts(b, seed=b + 1)
        batched = autoregressive_decode_batch(target, ps, config, gens(b, 50))
        for i, (prompt, out) in enumerate(zip(ps, batched)):
            assert_same(out, autoregressive_decode(target, prompt, config, torch.Generator().manual_seed(50 + i)))


def test_sampling_settings_batched_equals_batch1():
    target, draft = toy_pair()
    config = DecodeConfig(k=2, max_new_tokens=9, sampling=SamplingConfig(temperature=0.7, top_p=0.8), keep_probs=True)
    ps = prompts(5, seed=4)
    batched = speculative_decode_batch(target, ModelDrafter(draft), ps, "typical:eps=0.2", config, gens(5, 3))
    for i, (prompt, out) in enumerate(zip(ps, batched)):
        single = speculative_decode(target, ModelDrafter(draft), prompt, "typical:eps=0.2", config,
                                    torch.Generator().manual_seed(3 + i))
        assert_same(out, single)
        for key in ("target", "draft"):
            assert all(torch.equal(x, y) for x, y in zip(out.probs[key], single.probs[key]))


def test_continuous_batching_rows_join_and_leave():
    """Rows added between blocks, with their own max_new_tokens, and a cancelled row: every finished row
    equals its batch-1 run; a cancelled row's partial output is a prefix of its batch-1 run."""
    target, draft = toy_pair()
    base = DecodeConfig(k=3, max_new_tokens=12)
    dec = BatchDecoder(target, ModelDrafter(draft), "lossless", base)
    ps = prompts(8, seed=5)
    configs = [DecodeConfig(k=1 + i % 4, max_new_tokens=4 + 3 * i, stop_at_eos=i % 2 == 0) for i in range(8)]
    rows: dict[int, int] = {}  # row id -> prompt index
    done: dict[int, object] = {}
    cancelled = None
    for i in range(8):
        rows[dec.add(ps[i], torch.Generator().manual_seed(i), configs[i])] = i
        done.update(dec.step())
        if i == 3 and dec.active:
            cancelled = dec.active[0]
            done[cancelled] = dec.cancel(cancelled)
    while dec.active:
        done.update(dec.step())
    assert dec.step() == []
    assert set(done) == set(rows)
    for row, i in rows.items():
        single = speculative_decode(target, ModelDrafter(draft), ps[i], "lossless", configs[i],
                                    torch.Generator().manual_seed(i))
        if row == cancelled:
            assert done[row].finish == "cancelled"
            assert single.token_ids[: len(done[row].token_ids)] == done[row].token_ids
        else:
            assert_same(done[row], single)
    with pytest.raises(ValueError, match="no active row"):
        dec.cancel(cancelled)
    with pytest.raises(ValueError, match="sampling"):
        dec.add([1], None, DecodeConfig(sampling=SamplingConfig(temperature=0.5)))


def test_long_and_short_prompts_and_eos_first():
    """Prompts of 1 and ~1000 tokens in one batch; a row whose first token is EOS."""
    target, draft = toy_pair()
    # make EOS (almost) certain after token 3 twice: the row with prompt [3, 3] emits EOS first
    target.table[3, 3] = -30.0
    target.table[3, 3, EOS] = 30.0
    rng = np.random.default_rng(0)
    ps = [[1], rng.integers(0, V - 1, 1000).tolist(), [3, 3]]
    config = DecodeConfig(k=4, max_new_tokens=20)
    batched = speculative_decode_batch(target, ModelDrafter(draft), ps, "lossless", config, gens(3, 0))
    assert batched[2].token_ids == (EOS,) and batched[2].finish == "eos"
    for i, (prompt, out) in enumerate(zip(ps, batched)):
        assert_same(out, speculative_decode(target, ModelDrafter(draft), prompt, "lossless", config,
                                             torch.Generator().manual_seed(i)))
    plain = autoregressive_decode_batch(target, ps, config, gens(3, 0))
    assert plain[2].token_ids == (EOS,) and plain[2].finish == "eos"


def test_bad_inputs():
    target, draft = toy_pair()
    config = DecodeConfig()
    with pytest.raises(ValueError, match="non-empty list"):
        speculative_decode_batch(target, ModelDrafter(draft), [], "lossless", config, [])
    with pytest.raises(ValueError, match="non-empty list"):
        autoregressive_decode_batch(target, [], config, [])
    with pytest.raises(ValueError, match="one generator per prompt"):
        speculative_decode_batch(target, ModelDrafter(draft), [[1], [2]], "lossless", config, gens(1, 0))
    with pytest.raises(ValueError, match="one generator per prompt"):
        autoregressive_decode_batch(target, [[1], [2]], config, gens(3, 0))
    with pytest.raises(ValueError, match="empty prompt"):
        speculative_decode_batch(target, ModelDrafter(draft), [[1], []], "lossless", config, gens(2, 0))
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 5\)"):
        speculative_decode_batch(target, ModelDrafter(draft), [[1], [9]], "lossless", config, gens(2, 0))
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_decode_batch(target, ModelDrafter(TabularModel.random(3)), [[1]], "lossless", config, gens(1, 0))
    with pytest.raises(ValueError, match="unknown rule"):
        speculative_decode_batch(target, ModelDrafter(draft), [[1]], "nosuch", config, gens(1, 0))


# -- the sequence law of batched rows, against exact enumeration -------------------------------------

RUNS, BATCH = 3000, 8
LAW_CASES = [("lossless", 2, 3), ("lenience:l=0.4", 1, 3)]
ALPHA = 1e-4 / (2 * len(LAW_CASES))


def law_fn(model: TabularModel, prompt: list[int]):
    def fn(ctx: tuple[int, ...]) -> np.ndarray:
        logits = model.context_logits(torch.tensor([prompt + list(ctx)]))[0].double()
        return logits.softmax(-1).numpy()
    return fn


def as_vector(law: dict, v: int, length: int) -> np.ndarray:
    vec = np.zeros(v**length)
    for seq, pr in law.items():
        vec[int(np.ravel_multi_index(seq, (v,) * length))] += pr
    return vec


@pytest.mark.slow
@pytest.mark.parametrize("spec,k,length", LAW_CASES)
def test_batched_rows_follow_the_exact_law(spec, k, length):
    """3000 runs decoded as 375 batches of 8 rows (one generator per row, seeded per run)."""
    v = 3
    target = TabularModel.random(v, order=2, seed=1, name="toy-target")
    draft = TabularModel.random(v, order=1, seed=2, name="toy-draft")
    prompt, rule = [1], parse(spec)
    law = as_vector(stream_law(rule, law_fn(target, prompt), law_fn(draft, prompt), v, k, length, shrink_k=True),
                    v, length)
    truth = as_vector(joint_law(law_fn(target, prompt), v, length), v, length)
    config = DecodeConfig(k=k, max_new_tokens=length, diagnostics=False)
    drafter = ModelDrafter(draft)
    counts = np.zeros(v**length)
    for batch in range(RUNS // BATCH):
        outs = speculative_decode_batch(target, drafter, [prompt] * BATCH, rule, config, gens(BATCH, 10_000 + BATCH * batch))
        for out in outs:
            assert len(out.token_ids) == length
            counts[int(np.ravel_multi_index(out.token_ids, (v,) * length))] += 1
    assert chisquare_pvalue(counts, law) > ALPHA
    if np.abs(law - truth).sum() / 2 > 0.05:  # the lossy rule's shift is visible (power)
        assert chisquare_pvalue(counts, truth) < ALPHA
    assert rule.lossless or np.abs(law - truth).sum() / 2 > 0.05
