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
    torch.set_num_threads(1)  # tiny tensors (and small models on a shared machine): threads add overhead
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


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def gens(b: int, seed: int) -> list[torch.Generator]:
    return [seeded(seed + i) for i in range(b)]


def assert_same(batched, single):
    """Same tokens, blocks, finish, call counts and every diagnostic field (exactly)."""
    assert batched.token_ids == single.token_ids
    assert batched.blocks == single.blocks
    assert batched.finish == single.finish
    assert batched.rule == single.rule
    assert (batched.target_calls, batched.draft_calls) == (single.target_calls, single.draft_calls)
    if batched.steps is None and single.steps is None:  # decoded without diagnostics (fly)
        return
    assert batched.steps is not None and single.steps is not None
    assert batched.steps.keys() == single.steps.keys()
    for key in single.steps:
        a, b = batched.steps[key], single.steps[key]
        assert len(a) == len(b), key
        for x, y in zip(a, b):
            assert x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)), (key, x, y)


QUICK = {"lossless", "greedy", "hsd", "speccascade:min_p=0.3", "budget:tv=0.05,ratio=2"}


@pytest.mark.parametrize("spec", [s if s in QUICK else pytest.param(s, marks=pytest.mark.slow)
                                  for s in SPECS])
def test_every_rule_batched_equals_batch1(spec):
    target, draft = toy_pair()
    rule = parse(spec)
    # a lossy block rule (fly) has no per-position law: decoded without diagnostics
    config = DecodeConfig(k=3, max_new_tokens=12, diagnostics=not (rule.block_level and not rule.lossless))
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
        single = speculative_decode(target, NGramDrafter(2, V), prompt, spec, config, seeded(7 + i))
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
            assert_same(out, autoregressive_decode(target, prompt, config, seeded(50 + i)))


def test_sampling_settings_batched_equals_batch1():
    target, draft = toy_pair()
    sampling = SamplingConfig(temperature=0.7, top_p=0.8)
    config = DecodeConfig(k=2, max_new_tokens=9, sampling=sampling, keep_probs=True)
    ps = prompts(5, seed=4)
    batched = speculative_decode_batch(target, ModelDrafter(draft), ps, "typical:eps=0.2", config, gens(5, 3))
    for i, (prompt, out) in enumerate(zip(ps, batched)):
        single = speculative_decode(target, ModelDrafter(draft), prompt, "typical:eps=0.2", config,
                                    torch.Generator().manual_seed(3 + i))
        assert_same(out, single)
        for key in ("target", "draft"):
            assert all(torch.equal(x, y) for x, y in zip(out.probs[key], single.probs[key]))


MIXED = [SamplingConfig(), SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.6, top_k=3),
         SamplingConfig(temperature=1.3, top_p=0.7), SamplingConfig(temperature=0.8, min_p=0.2)]


@pytest.mark.parametrize("spec", ["lossless", "lenience:l=0.5", None])
def test_rows_with_different_sampling_settings_batched_equal_each_alone(spec):
    """One decoder, rows with their own temperature / top-k / top-p / min-p (the server batches mixed
    requests so): every row gives exactly what it gives alone with its own settings, processed laws
    included (`sampling.process_rows`)."""
    target, draft = toy_pair()
    ps = prompts(len(MIXED), seed=9)
    dec = (BatchDecoder(target) if spec is None else
           BatchDecoder(target, ModelDrafter(draft), spec, DecodeConfig(k=3)))
    rows = {dec.add(prompt, seeded(40 + i), DecodeConfig(k=3, max_new_tokens=11, sampling=sampling,
                                                         keep_probs=True)): i
            for i, (prompt, sampling) in enumerate(zip(ps, MIXED))}
    done = {}
    while dec.active:
        done.update({rows[row]: gen for row, gen in dec.step()})
    for i, sampling in enumerate(MIXED):
        config = DecodeConfig(k=3, max_new_tokens=11, sampling=sampling, keep_probs=True)
        single = (autoregressive_decode(target, ps[i], config, seeded(40 + i)) if spec is None else
                  speculative_decode(target, ModelDrafter(draft), ps[i], spec, config, seeded(40 + i)))
        assert_same(done[i], single)
        for key in ("target", "draft", "raw"):
            assert all(torch.equal(x, y) for x, y in zip(done[i].probs[key], single.probs[key])), (i, key)


def test_rows_with_different_rules_batched_equal_each_alone():
    """One chain decoder, each row verified by its own rule (the server batches requests of different
    rules so), with its own sampling settings too: every row gives exactly what it gives alone, its
    report names its rule, and a row rule is refused where every row shares the decoder's."""
    target, draft = toy_pair()
    specs = ["lossless", "lenience:l=0.5", "speccascade:min_p=0.3", "budget:tv=0.05,ratio=2", "lossless"]
    ps = prompts(len(specs), seed=11)
    dec = BatchDecoder(target, ModelDrafter(draft), "lossless", DecodeConfig(k=3))
    rows = {}
    for i, (prompt, spec) in enumerate(zip(ps, specs)):
        config = DecodeConfig(k=3, max_new_tokens=12, sampling=MIXED[i])
        rows[dec.add(prompt, seeded(70 + i), config, rule=spec)] = i
    done = {}
    while dec.active:
        done.update({rows[row]: gen for row, gen in dec.step()})
    for i, spec in enumerate(specs):
        config = DecodeConfig(k=3, max_new_tokens=12, sampling=MIXED[i])
        single = speculative_decode(target, ModelDrafter(draft), ps[i], spec, config, seeded(70 + i))
        assert_same(done[i], single)
        assert done[i].rule_spec == parse(spec).spec
    with pytest.raises(ValueError, match="speculative chain decoder"):
        BatchDecoder(target).add([1], seeded(0), rule="lenience:l=0.5")
    with pytest.raises(ValueError, match="tree rule"):
        dec.add([1], seeded(0), rule="traversal")


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
    with pytest.raises(ValueError, match="prefill_chunk"):
        dec.add([1], None, DecodeConfig(prefill_chunk=0))


@pytest.mark.parametrize("spec", ["lossless", "lenience:l=0.5", None])
def test_chunked_prefill_interleaves_and_changes_no_token(spec):
    """Rows with long prompts fed 8 prompt tokens per step (`DecodeConfig.prefill_chunk`) beside short
    rows: the short rows decode a block in every step meanwhile (the long prompts hold nothing up), the
    long rows are fed the one with fewer tokens left first and start decoding once their prompt is in,
    and every row gives what it gives alone in one pass (the toy pair has no cache: exact)."""
    target, draft = toy_pair()
    rng = np.random.default_rng(4)
    ps = [rng.integers(0, V - 1, n).tolist() for n in (40, 2, 25, 3)]
    chunked = DecodeConfig(k=2, max_new_tokens=6, stop_at_eos=False, prefill_chunk=8)
    dec = BatchDecoder(target) if spec is None else BatchDecoder(target, ModelDrafter(draft), spec, chunked)
    rows = [dec.add(p, seeded(60 + i), chunked) for i, p in enumerate(ps)]
    assert [dec.prefilling(r) for r in rows] == [True, False, True, False]
    done, first = {}, {}
    for step in range(1, 40):
        for row, gen in dec.step():
            done[row] = gen
        for i, row in enumerate(rows):
            if i not in first and (row in done or dec.tokens(row)):
                first[i] = step
        if not dec.active:
            break
    assert first[1] == first[3] == 1  # the short rows decode from the first step
    # row 2's 24 context tokens first: 3 chunks, the 3rd step decoding too; then row 0's 39: 5 more
    assert first[2] == 3 and first[0] == 8
    for i, p in enumerate(ps):
        alone = DecodeConfig(k=2, max_new_tokens=6, stop_at_eos=False)
        single = (autoregressive_decode(target, p, alone, seeded(60 + i)) if spec is None else
                  speculative_decode(target, ModelDrafter(draft), p, spec, alone, seeded(60 + i)))
        assert_same(done[rows[i]], single)


def test_paced_prefill_is_sized_by_time_beside_decoding_rows_and_runs_full_chunks_alone():
    """`prefill_paced`: beside a decoding row, the first step feeds PREFILL_START prompt tokens, later
    chunks grow or shrink with the measured times (1 to the chunk; a step may feed none while the others'
    blocks pay for the last chunk); with nothing else decoding, whole chunks. The tokens are still those
    of the rows alone."""
    from verispec.decode import PREFILL_START

    target, draft = toy_pair()
    rng = np.random.default_rng(5)
    long, short = rng.integers(0, V - 1, 200).tolist(), [1, 2]
    paced = DecodeConfig(k=2, max_new_tokens=40, stop_at_eos=False, prefill_chunk=64, prefill_paced=True)
    dec = BatchDecoder(target, ModelDrafter(draft), "lossless", paced)
    s_row, l_row = dec.add(short, seeded(1), paced), dec.add(long, seeded(2), paced)
    dec.step()
    fed = [dec._rows[l_row].fed]
    while dec.prefilling(l_row):
        dec.step()
        fed.append(dec._rows[l_row].fed)
    assert fed[0] == PREFILL_START
    steps = [b - a for a, b in zip([0, *fed], fed)]
    chunks = [n for n in steps if n]  # a step whose blocks have not yet paid for the last chunk feeds none
    assert all(1 <= n <= 64 for n in chunks) and len(set(chunks)) > 1  # sized chunk by chunk
    done = {}
    while dec.active:
        done.update(dict(dec.step()))
    for row, prompt, seed in ((s_row, short, 1), (l_row, long, 2)):
        alone = speculative_decode(target, ModelDrafter(draft), prompt, "lossless",
                                   DecodeConfig(k=2, max_new_tokens=40, stop_at_eos=False), seeded(seed))
        assert done[row].token_ids == alone.token_ids
    lone = BatchDecoder(target, ModelDrafter(draft), "lossless", paced)
    row = lone.add(long, seeded(2), paced)
    lone.step()
    assert lone._rows[row].fed == 64  # nothing else decoding: a whole chunk


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


def test_every_stop_token_ends_a_row():
    """A model with two stop tokens (Qwen: <|im_end|> and <|endoftext|>): each path ends at the first
    of either, keeps it as the last token, and batched rows still equal batch-1."""
    target, draft = toy_pair()
    stop2 = 2
    target = TabularModel(target.table, name="toy-target", eos_token_id=EOS, stop_token_ids=(EOS, stop2))
    config = DecodeConfig(k=3, max_new_tokens=12)
    ps = prompts(8, seed=3)
    spec = speculative_decode_batch(target, ModelDrafter(draft), ps, "lossless", config, gens(8, 40))
    plain = autoregressive_decode_batch(target, ps, config, gens(8, 40))
    last = set()
    for i, (prompt, s, a) in enumerate(zip(ps, spec, plain)):
        alone = speculative_decode(target, ModelDrafter(draft), prompt, "lossless", config, seeded(40 + i))
        assert_same(s, alone)
        assert_same(a, autoregressive_decode(target, prompt, config, seeded(40 + i)))
        for out in (s, a):
            ids = list(out.token_ids)
            cut = [j for j, tok in enumerate(ids) if tok in (EOS, stop2)]
            assert cut == ([len(ids) - 1] if out.finish == "eos" else []), (ids, out.finish)
            if out.finish == "eos":
                last.add(ids[-1])
    assert last == {EOS, stop2}  # both stop tokens ended some row
    # without stop_at_eos neither token stops a row
    free = speculative_decode(target, ModelDrafter(draft), ps[0], "lossless",
                              DecodeConfig(k=3, max_new_tokens=40, stop_at_eos=False), seeded(1))
    assert free.finish == "length" and len(free.token_ids) == 40


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
        other = ModelDrafter(TabularModel.random(3))
        speculative_decode_batch(target, other, [[1]], "lossless", config, gens(1, 0))
    with pytest.raises(ValueError, match="unknown rule"):
        speculative_decode_batch(target, ModelDrafter(draft), [[1]], "nosuch", config, gens(1, 0))


# -- the sequence law of batched rows, against exact enumeration -------------------------------------

# Sized by the power check: lenience:l=0.4 is at chi-square distance 0.84 from the target law, so 2000
# runs give lambda = 1690 against the critical value 65 (23 df): a miss is impossible in practice.
RUNS, BATCH = 2000, 8
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
    """RUNS runs decoded as batches of 8 rows (one generator per row, seeded per run)."""
    v = 3
    target = TabularModel.random(v, order=2, seed=1, name="toy-target")
    draft = TabularModel.random(v, order=1, seed=2, name="toy-draft")
    prompt, rule = [1], parse(spec)
    exact = stream_law(rule, law_fn(target, prompt), law_fn(draft, prompt), v, k, length, shrink_k=True)
    law = as_vector(exact, v, length)
    truth = as_vector(joint_law(law_fn(target, prompt), v, length), v, length)
    config = DecodeConfig(k=k, max_new_tokens=length, diagnostics=False)
    drafter = ModelDrafter(draft)
    counts = np.zeros(v**length)
    for batch in range(RUNS // BATCH):
        outs = speculative_decode_batch(target, drafter, [prompt] * BATCH, rule, config,
                                        gens(BATCH, 10_000 + BATCH * batch))
        for out in outs:
            assert len(out.token_ids) == length
            counts[int(np.ravel_multi_index(out.token_ids, (v,) * length))] += 1
    assert chisquare_pvalue(counts, law) > ALPHA
    if np.abs(law - truth).sum() / 2 > 0.05:  # the lossy rule's shift is visible (power)
        assert chisquare_pvalue(counts, truth) < ALPHA
    assert rule.lossless or np.abs(law - truth).sum() / 2 > 0.05


# -- the default pair --------------------------------------------------------------------------------

# Greedy rows may differ between batched and batch-1 decoding only where the target's top two logits
# are tied within float32 noise: batched forward passes (padding, other GEMM shapes) change logits by
# ~1e-5 relative, so a flip is accepted only where |top1 - top2| <= GAP_TOL (absolute, in logits).
GAP_TOL = 1e-3


@pytest.fixture(scope="module")
def pair():
    from verispec.models import load_drafter, load_model

    target = load_model("default")
    return target, load_drafter("default-draft", target)


@pytest.fixture(scope="module")
def suite_prompts(pair):
    from verispec.evaluation.suites import load_suite

    target, _ = pair
    return [target.encode(item.prompt) for item in load_suite("shakespeare").items[:8]]


def full_forward_logits(model, ids: list[int]) -> torch.Tensor:
    """Next-token logits at every position, without any cache: [L, V]."""
    with torch.inference_mode():
        return model.model(input_ids=torch.tensor([ids])).logits[0].float()


def top2_gap(model, ids: list[int]) -> float:
    top = full_forward_logits(model, ids)[-1].topk(2).values
    return float(top[0] - top[1])


def compare_greedy(target, batched, single) -> list[str]:
    """Rows that differ: each must differ first where the target's top-2 gap is within GAP_TOL."""
    notes = []
    for i, (a, b) in enumerate(zip(batched, single)):
        if a.token_ids == b.token_ids:
            continue
        j = next((n for n, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                 min(len(a.token_ids), len(b.token_ids)))
        gap = top2_gap(target, list(a.prompt_ids) + list(a.token_ids[:j]))
        notes.append(f"row {i}: first difference at position {j}, target top-2 logit gap {gap:.3g}")
        assert gap <= GAP_TOL, notes[-1]
    return notes


@pytest.mark.slow
def test_default_pair_greedy_batched_equals_batch1(pair, suite_prompts):
    target, drafter = pair
    config = DecodeConfig(k=4, max_new_tokens=48, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    b = len(suite_prompts)
    assert b == 8
    plain_b = autoregressive_decode_batch(target, suite_prompts, config, gens(b, 0))
    plain_1 = [autoregressive_decode(target, p, config, torch.Generator().manual_seed(i))
               for i, p in enumerate(suite_prompts)]
    spec_b = speculative_decode_batch(target, drafter, suite_prompts, "lossless", config, gens(b, 0))
    spec_1 = [speculative_decode(target, drafter, p, "lossless", config, torch.Generator().manual_seed(i))
              for i, p in enumerate(suite_prompts)]
    notes = compare_greedy(target, plain_b, plain_1) + compare_greedy(target, spec_b, spec_1)
    assert len(notes) <= 2, notes  # ties within float noise are rare; more flips mean a real difference
    for out in spec_b + plain_b:
        assert len(out.token_ids) == 48


@pytest.mark.slow
def test_default_pair_chunked_prefill_agrees_with_one_pass(pair):
    """On a real model (the lean backend's cache): a 300-token prompt fed 64 tokens per step decodes
    the same greedy tokens as fed in one pass, with log-probabilities equal to float rounding (the
    chunks attend through the cache: a different summation order, not other maths)."""
    target, drafter = pair
    text = "KING RICHARD.\n" + "Now is the winter of our discontent made glorious summer. " * 30
    prompt = target.encode(text)[:300]
    outs = []
    for chunk in (None, 64):
        config = DecodeConfig(k=3, max_new_tokens=24, sampling=SamplingConfig(temperature=0),
                              stop_at_eos=False, prefill_chunk=chunk)
        dec = BatchDecoder(target, drafter, "lossless", config)
        dec.add(prompt, seeded(0), config)
        steps = 0
        while dec.active:
            finished = dec.step()
            steps += 1
        outs.append((finished[0][1], steps))
    (one, steps_one), (chunked, steps_chunked) = outs
    assert steps_chunked == steps_one + 4  # 299 context tokens: 5 chunks, the last step of them decodes too
    assert chunked.token_ids == one.token_ids
    assert chunked.steps["log_target_raw"] == pytest.approx(one.steps["log_target_raw"], abs=1e-4)


@pytest.mark.slow
def test_default_pair_realised_acceptance_per_row(pair, suite_prompts):
    """Per row: the acceptance the loop recorded equals sum(min(p, q)) recomputed without a cache
    (so each row's caches followed its own committed sequence), and the realised acceptance count
    agrees with it (z-test over all rows)."""
    from verispec.sampling import process

    target, drafter = pair
    sampling = SamplingConfig(temperature=1.0)
    config = DecodeConfig(k=4, max_new_tokens=48, sampling=sampling, stop_at_eos=False)
    outs = speculative_decode_batch(target, drafter, suite_prompts, "lossless", config, gens(8, 20))
    accepted, a_all = 0, []
    for out in outs:
        seq, n0 = list(out.prompt_ids) + list(out.token_ids), len(out.prompt_ids)
        p = process(full_forward_logits(target, seq), sampling)[n0 - 1 : -1]
        q = process(full_forward_logits(drafter.model, seq), sampling)[n0 - 1 : -1]
        expected = torch.minimum(p, q).sum(-1).double().numpy()  # [n]
        roles = np.array(out.steps["role"])
        decided = (roles == "accepted") | (roles == "recovered")
        recorded = np.array(out.steps["expected_accept"])
        np.testing.assert_allclose(recorded[decided], expected[decided], atol=1e-4)
        a_all.append(expected[decided])
        accepted += int((roles == "accepted").sum())
    a = np.concatenate(a_all)
    z = (accepted - a.sum()) / math.sqrt((a * (1 - a)).sum())
    assert abs(z) < 4, (accepted, a.sum(), z)


@pytest.mark.parametrize("spec", ["lossless", "hsd", "lenience:l=0.5", "typical:eps=0.09,alpha=0.3"])
def test_default_pair_batch_of_one_equals_speculative_decode(pair, suite_prompts, spec):
    target, drafter = pair
    config = DecodeConfig(k=4, max_new_tokens=24)
    [batched] = speculative_decode_batch(target, drafter, suite_prompts[:1], spec, config, gens(1, 5))
    single = speculative_decode(target, drafter, suite_prompts[0], spec, config, seeded(5))
    assert_same(batched, single)
    [plain_b] = autoregressive_decode_batch(target, suite_prompts[1:2], config, gens(1, 6))
    assert_same(plain_b, autoregressive_decode(target, suite_prompts[1], config, seeded(6)))


def test_a_row_beyond_the_context_is_refused_before_any_work():
    """Decision (docs in BatchDecoder.add / _run_batch): a row whose prompt + max_new_tokens exceeds the
    model's context refuses the whole call up front, naming the row; nothing is decoded."""
    target = TabularModel.random(V, order=2, seed=3, max_context=20)
    drafter = ModelDrafter(TabularModel.random(V, order=1, seed=4))
    config = DecodeConfig(k=2, max_new_tokens=8)
    prompts = [[1, 2], [0] * 15, [2]]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    with pytest.raises(ValueError, match=r"prompt 1: prompt \(15 tokens\) \+ max_new_tokens \(8\)"):
        speculative_decode_batch(target, drafter, prompts, "lossless", config, gens)
    assert target.calls == 0
    decoder = BatchDecoder(target, drafter, "lossless", config)
    with pytest.raises(ValueError, match="context of 20 tokens"):
        decoder.add([0] * 13, torch.Generator())
    assert decoder.active == []


def test_per_position_acceptance_has_vllms_semantics():
    """rate = accepted at position j / blocks with drafts (vLLM's per-position rate, non-increasing in j);
    rate_given_reached = accepted / blocks that drafted that far."""
    from verispec.decode import Block, Generation, verification_report

    blocks = (Block(4, 4, 5), Block(4, 1, 2), Block(2, 0, 1), Block(0, 0, 1))
    gen = Generation(prompt_ids=(1,), token_ids=(1,) * 9, blocks=blocks, steps=None, target_calls=4,
                     draft_calls=10, seconds=1.0, finish="length", rule=None)
    positions = verification_report(gen, k=4)["acceptance_per_position"]
    assert [p["drafts"] for p in positions] == [3] * 4
    assert [p["reached"] for p in positions] == [3, 3, 2, 2]
    assert [p["accepted"] for p in positions] == [2, 1, 1, 1]
    assert [p["rate"] for p in positions] == [2 / 3, 1 / 3, 1 / 3, 1 / 3]
    assert [p["rate_given_reached"] for p in positions] == [2 / 3, 1 / 3, 1 / 2, 1 / 2]


def test_a_certificate_that_certifies_nothing_says_so():
    from verispec.decode import Generation, verification_report
    from verispec.rules import parse

    gen = Generation(prompt_ids=(1,), token_ids=(1,) * 3, blocks=(), steps=None, target_calls=1,
                     draft_calls=0, seconds=1.0, finish="length", rule=parse("budget:tv=0.05"))
    vacuous = verification_report(gen, max_new_tokens=24)["certificate"]
    assert vacuous["tv_bound"] == 1.0 and "certifies nothing" in vacuous["warning"]
    assert "below 0.0417" in vacuous["warning"]
    useful = verification_report(gen, max_new_tokens=10)["certificate"]
    assert useful["tv_bound"] == pytest.approx(0.5) and useful["warning"] is None
