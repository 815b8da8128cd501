"""Batched sessions: many rows in one forward pass, each row with its own cache length.

The lean batched forward (`verispec.models.lean.forward_batch`) must give each row the logits it
gets alone: through ragged prefills, speculative-style rollbacks of different lengths, rows leaving
and joining, and on a self-draft. The only allowed difference is float rounding of different matmul
shapes (oneDNN's packed GEMM for B*m > 1 vs the GEMV for one token, different SDPA shapes).
"""

from __future__ import annotations

import logging

import pytest
import torch

from verispec.models import load_model
from verispec.models.base import PerRowBatchSession, batch_session
from verispec.models.drafters import ModelDrafter
from verispec.models.hf import HFModel
from verispec.models.lean import LeanBatchSession
from verispec.models.toy import TabularModel
from verispec.sampling import SamplingConfig

# Float32 tolerances. Measured over the tests below (B = 1, 3, 8, lengths 1..300, logits of magnitude
# ~10-20): batched vs batch-1 session logits max abs difference 1.05e-5; batched vs transformers'
# cache-free full pass 1.43e-5. The tolerances leave 5-7x headroom over what was measured.
TOL = 5e-5
TOL_FULL = 1e-4


@pytest.fixture(scope="module")
def target():
    return load_model("default")


@pytest.fixture(scope="module")
def draft():
    return load_model("default-draft")


def prompts(model, count: int, seed: int = 0) -> list[torch.Tensor]:
    """Real text of very different lengths (1 and ~300 tokens among them), plus random ids."""
    text = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the "
            "slings and arrows of outrageous fortune, or to take arms against a sea of troubles, and by "
            "opposing end them. To die, to sleep, no more; and by a sleep to say we end the heart-ache and "
            "the thousand natural shocks that flesh is heir to. ") * 4
    ids = torch.tensor(model.encode(text))
    assert ids.shape[0] >= 300
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 300, 7, 64, 2, 150, 31, 12][:count]
    out = []
    for i, length in enumerate(lengths):
        if i % 2 == 0:
            out.append(ids[:length].clone())
        else:
            out.append(torch.randint(0, model.vocab_size, (length,), generator=gen))
    return out


def full_logits(model: HFModel, seq: torch.Tensor) -> torch.Tensor:
    """Cache-free transformers forward over the whole sequence: [L, V]."""
    with torch.inference_mode():
        return model.model(input_ids=seq[None]).logits[0].float()


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32 and got.device.type == "cpu"
    diff = (got - want).abs().max().item()
    assert diff <= tol, diff
    top2 = want.topk(2, -1).values  # [n, 2]
    clear = (top2[:, 0] - top2[:, 1]) > tol  # positions where rounding cannot flip the greedy token
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_batched_logits_match_single_rows(target, batch):
    seqs = prompts(target, batch) if batch > 1 else prompts(target, 2)[1:]  # B = 1: the 300-token row
    n = [min(4, s.shape[0]) for s in seqs]
    session = target.batch_session()
    assert isinstance(session, LeanBatchSession)
    calls = target.calls
    got = session.logits_for(list(range(len(seqs))), seqs, n)
    assert target.calls == calls + 1  # one batched pass
    for seq, count, logits in zip(seqs, n, got):
        alone = target.session().logits_for(seq[None], count)[0]  # [count, V]
        assert_rows_close(logits, alone, TOL)
    # then a decode step: one new token per row, all in one pass
    nxt = [torch.cat([s, g.argmax(-1)[-1:]]) for s, g in zip(seqs, got)]
    got = session.logits_for(list(range(len(seqs))), nxt, [1] * len(seqs))
    for seq, logits in zip(nxt, got):
        assert_rows_close(logits, target.session().logits_for(seq[None], 1)[0], TOL)


def test_a_row_joining_decoding_rows_feeds_its_prompt_in_a_pass_of_its_own(target):
    """Continuous batching: a new row beside rows already decoding would pad every row of the pass to
    its prompt, so its context goes in a pass of its own (one extra call) and every row's last position
    in one batched pass; each row scores as it does alone. Rows that all start together (a static
    batch) share one pass (test_batched_logits_match_single_rows)."""
    seqs = prompts(target, 4)[2:]  # 7 and 64 tokens
    session = target.batch_session()
    got = session.logits_for([0, 1], seqs, [1, 1])
    nxt = [torch.cat([s, g.argmax(-1)]) for s, g in zip(seqs, got)]
    joining = prompts(target, 2)[1]  # 300 tokens
    calls = target.calls
    got = session.logits_for([0, 1, 2], [*nxt, joining], [1, 1, 1])
    assert target.calls == calls + 2  # the joining row's context, then one batched pass
    for seq, logits in zip([*nxt, joining], got):
        assert_rows_close(logits, target.session().logits_for(seq[None], 1)[0], TOL)


def speculative_rounds(model: HFModel, session, seqs: dict[int, torch.Tensor], rounds: int, seed: int,
                       subset: bool = True) -> None:
    """Per round, each (participating) row gets k+1 new tokens scored in one batched pass, then keeps a
    random prefix of them (a speculative block's accept + rollback); every returned logit row is
    checked against a cache-free full forward of the requested sequence."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        rows = [r for r in seqs if not subset or torch.rand(1, generator=gen).item() < 0.8] or list(seqs)[:1]
        asked, n = [], []
        for r in rows:
            k = int(torch.randint(0, 6, (1,), generator=gen))
            asked.append(torch.cat([seqs[r], torch.randint(0, model.vocab_size, (k + 1,), generator=gen)]))
            n.append(k + 1)
        got = session.logits_for(rows, asked, n)
        for r, seq, count, logits in zip(rows, asked, n, got):
            assert_rows_close(logits, full_logits(model, seq)[-count:], TOL_FULL)
            keep = int(torch.randint(0, count + 1, (1,), generator=gen))  # accepted drafts (+ bonus)
            seqs[r] = seq[: seq.shape[0] - count + keep]


@pytest.mark.slow
def test_caches_after_ragged_rollbacks(target):
    session = target.batch_session()
    seqs = dict(enumerate(prompts(target, 6, seed=1)))
    speculative_rounds(target, session, seqs, rounds=8, seed=2)
    # each row's committed sequence, asked again (pure rollback to a prefix it already holds)
    rows = list(seqs)
    got = session.logits_for(rows, [seqs[r] for r in rows], [1] * len(rows))
    for r, logits in zip(rows, got):
        assert_rows_close(logits, full_logits(target, seqs[r])[-1:], TOL_FULL)
        assert torch.equal(session.cached(r), seqs[r])


def test_keys_beyond_a_rows_length_never_leak(target):
    """Overwrite every cache entry beyond each row's length with large values: logits unchanged."""
    session = target.batch_session()
    seqs = prompts(target, 4, seed=3)
    rows = list(range(4))
    session.logits_for(rows, seqs, [1] * 4)
    shorter = [s[: max(1, s.shape[0] // 2)] for s in seqs]  # rolls every row back
    before = session.logits_for(rows, shorter, [1] * 4)
    cache = session.cache
    for store in (cache.k, cache.v):
        for layer in store:
            for slot in range(cache.slots):
                layer[slot, :, int(cache.lengths[slot]) :] = 1e4
    grown = [torch.cat([s, torch.tensor([5, 6])]) for s in shorter]
    after = session.logits_for(rows, grown, [3] * 4)
    for seq, b, a in zip(grown, before, after):
        assert_rows_close(a, full_logits(target, seq)[-3:], TOL_FULL)
        assert_rows_close(a[:1], b, TOL)


@pytest.mark.slow
def test_rows_leave_and_join(target):
    session = target.batch_session()
    seqs = dict(enumerate(prompts(target, 6, seed=4)))  # 6 rows > 1 initial slot: the slot count doubles
    speculative_rounds(target, session, seqs, rounds=3, seed=5, subset=False)
    slot = session._slot[2]
    session.release(2)
    del seqs[2]
    seqs[9] = torch.tensor(target.encode("ROMEO.\nBut soft, what light"))
    speculative_rounds(target, session, seqs, rounds=3, seed=6, subset=False)
    assert session._slot[9] == slot  # the new row took the free slot
    session.release(9)
    session.release(9)  # releasing an unknown row is a no-op
    del seqs[9]
    speculative_rounds(target, session, seqs, rounds=2, seed=7)


def test_passes_run_in_inference_mode_on_ordinary_cache_buffers(target):
    """The batch session's passes run in inference mode (no autograd bookkeeping per op: the engine's
    batch-1 speed, benchmarks/RESULTS.md 'One engine'), while the cache's buffers, grown inside a pass (a
    second and third slot, a capacity past 256 positions), stay ordinary tensors: rows are released and
    rolled back outside inference mode, where an inference tensor refuses in-place writes."""
    session = target.batch_session()
    long = torch.tensor(target.encode("KING.\n" * 150))[:300]  # [300] > the initial capacity 256
    seqs = [*prompts(target, 2, seed=11), long]
    got = session.logits_for([0, 1, 2], seqs, [1] * 3)
    assert all(logits.is_inference() for logits in got)
    cache = session.cache
    assert cache.slots >= 3 and cache.capacity >= 300
    assert not any(t.is_inference() for t in (*cache.k, *cache.v, cache.lengths))
    session.release(1)  # an in-place write to cache.lengths, outside inference mode
    rolled = [seqs[0], long[:-5]]  # row 2 rolled back by five positions
    again = session.logits_for([0, 2], rolled, [1, 1])
    assert_rows_close(again[1], target.session().logits_for(rolled[1][None], 1)[0], TOL)


def test_self_draft_batch_session(target):
    shallow = target.truncated(3)
    session = shallow.batch_session()
    assert isinstance(session, LeanBatchSession)
    seqs = prompts(target, 4, seed=8)
    got = session.logits_for([0, 1, 2, 3], seqs, [1] * 4)
    for seq, logits in zip(seqs, got):
        assert_rows_close(logits, shallow.session().logits_for(seq[None], 1)[0], TOL)
    speculative_rounds(shallow, session, dict(enumerate(seqs)), rounds=3, seed=9)


@pytest.mark.parametrize("make", ["lean", "toy"])
def test_bad_input_is_a_clear_value_error(target, make):
    session = target.batch_session() if make == "lean" else TabularModel.random(5, seed=0).batch_session()
    ok = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="at least one row"):
        session.logits_for([], [], [])
    with pytest.raises(ValueError, match="1 <= n <= len"):
        session.logits_for([0], [ok], [4])
    with pytest.raises(ValueError, match="1 <= n <= len"):
        session.logits_for([0, 1], [ok, ok[:0]], [1, 1])  # a 0-length row
    with pytest.raises(ValueError, match="1 <= n <= len"):
        session.logits_for([0], [ok], [0])
    with pytest.raises(ValueError, match="same length"):
        session.logits_for([0, 1], [ok], [1])
    with pytest.raises(ValueError, match="once per call"):
        session.logits_for([0, 0], [ok, ok], [1, 1])
    with pytest.raises(ValueError, match="1-D"):
        session.logits_for([0], [ok[None]], [1])


def test_transformers_backend_falls_back_row_by_row_and_says_so(target, caplog):
    hf = HFModel(target.model, target.tokenizer, "hf-twin", backend="hf")
    with caplog.at_level(logging.INFO, logger="verispec.models.hf"):
        first, second = hf.batch_session(), hf.batch_session()
    assert isinstance(first, PerRowBatchSession) and isinstance(second, PerRowBatchSession)
    assert sum("one by one" in r.getMessage() for r in caplog.records) == 1  # logged once
    seqs = prompts(target, 3, seed=10)
    got = first.logits_for([0, 1, 2], seqs, [1, 2, 2])
    lean = target.batch_session().logits_for([0, 1, 2], seqs, [1, 2, 2])
    for a, b in zip(got, lean):
        assert_rows_close(a, b, TOL_FULL)


def test_toy_batch_session_is_exact():
    model = TabularModel.random(7, order=2, seed=1)
    session = batch_session(model)
    seqs = [torch.tensor([1]), torch.tensor([2, 3, 4, 5]), torch.tensor([6, 0])]
    got = session.logits_for([0, 1, 2], seqs, [1, 3, 2])
    for seq, count, logits in zip(seqs, [1, 3, 2], got):
        want = torch.stack([model.context_logits(seq[None, :i])[0] for i in range(seq.shape[0] - count + 1,
                                                                                    seq.shape[0] + 1)])
        assert torch.equal(logits, want)


def test_propose_batch_equals_each_row_alone(target, draft):
    drafter = ModelDrafter(draft)
    drafter.start_batch()
    assert isinstance(drafter._batch, LeanBatchSession)
    sampling = SamplingConfig(temperature=1.0)
    contexts = prompts(target, 4, seed=11)
    ks = [4, 1, 3, 5]
    batched = drafter.propose_batch([0, 1, 2, 3], contexts, ks, sampling,
                                    [torch.Generator().manual_seed(100 + i) for i in range(4)])
    for i, (context, k) in enumerate(zip(contexts, ks)):
        alone = ModelDrafter(draft)
        alone.start_batch()
        [(tokens, probs)] = alone.propose_batch([7], [context], [k], sampling,
                                                [torch.Generator().manual_seed(100 + i)])
        assert torch.equal(batched[i][0], tokens)
        torch.testing.assert_close(batched[i][1], probs, rtol=0, atol=1e-5)
