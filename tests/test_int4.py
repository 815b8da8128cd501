"""Weight-only int4 in the lean forward (verispec.models.int4): the kernel against its dequantised
reference, rows that do not depend on how many rows share the call, the GGUF's Q4_K codes decoded bit for
bit, and decoding with int4 models (greedy speculative decoding equals greedy decoding but at near ties;
rows of a batch score like rows alone up to bf16 rounding)."""

from __future__ import annotations

import pytest
import torch

import verispec
from verispec.models import DEFAULT_PAIR, int4, qwen
from verispec.models.hf import HFModel, load_hf
from verispec.models.int4 import Int4Linear, Q4KPlan, dequantize, gguf_name, q4k_codes, requantize
from verispec.models.lean import LeanLlama
from verispec.rules import parse
from verispec.sampling import SamplingConfig, process

pytestmark = pytest.mark.skipif(not int4.available(), reason="this torch build has no CPU int4 kernels")

PROMPTS = ["KING.\nWhat says the queen?\n", "To be", "ROMEO.\nBut soft, what light"]


def _linear(out: int, inp: int, seed: int = 0) -> tuple[Int4Linear, torch.Tensor, torch.Tensor]:
    """An int4 projection with a bias, its dequantised weight [out, in] and the bias [out]."""
    gen = torch.Generator().manual_seed(seed)
    codes = requantize([], torch.randn(out, inp, generator=gen) * 0.05)
    bias = torch.randn(out, generator=gen)
    return Int4Linear(*codes, bias), dequantize(*codes), bias


def test_kernel_equals_its_dequantised_reference():
    lin, ref, bias = _linear(96, 64)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 96)
    want = x.float() @ ref.t() + bias.bfloat16().float()
    # the kernel rounds its float32 sum to bf16 (8 significant bits), then adds the bf16 bias
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=2 ** -7 * float(want.abs().max()))


def test_requantize_is_within_half_a_step():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(48, 96, generator=gen)
    codes, scales, mins = requantize([], weight)
    assert codes.dtype == torch.uint8 and int(codes.min()) >= 0 and int(codes.max()) <= 15
    err = (dequantize(codes, scales, mins) - weight).abs().view(48, 3, 32)  # [out, groups, 32]
    assert bool((err <= scales[..., None] / 2 + 1e-6).all())
    assert requantize([], torch.randn(16, 33)) is None  # not a whole number of groups: stays dense
    assert requantize([], torch.randn(8, 64)) is None  # outputs not in blocks of 16: stays dense


def test_chunked_requantising_and_packing_equal_the_whole():
    """requantize and Int4Linear work ROWS rows at a time (bounded temporaries): the same codes as one
    pass over the whole weight, and packed chunks side by side are the kernel's packing of the whole
    (its 64-row blocks), also with a tail of 16 rows."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(2 * 64 + 16, 96, generator=gen)  # [144, 96]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(int4, "ROWS", 64)
        chunked = requantize([], weight)
        linear = Int4Linear(*chunked)
    whole = int4._requantize_rows(weight)
    assert all(torch.equal(a, b) for a, b in zip(chunked, whole))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(whole[0].to(torch.int32), 1)
    assert torch.equal(linear.packed, packed)


def test_rows_do_not_depend_on_the_row_count():
    """What makes greedy SD equal greedy decoding with int4 weights: a row's output is the same bits
    whether it comes alone (a decoding step), with k others (a verification pass) or in a batch."""
    lin, _, _ = _linear(256, 128, seed=3)
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    full = lin(x)  # [64, 256]
    for m in (1, 2, 3, 4, 5, 7, 8, 16, 33):
        assert torch.equal(lin(x[:m]), full[:m]), m
    assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(64)]), full)


def test_bad_input_is_refused():
    codes, scales, mins = requantize([], torch.randn(16, 64))
    with pytest.raises(ValueError, match="out % 16"):
        Int4Linear(codes[:8], scales[:8], mins[:8])
    with pytest.raises(ValueError, match="0..15"):
        Int4Linear(codes + 1, scales, mins)
    with pytest.raises(ValueError, match="one scale/min per group"):
        Int4Linear(codes, scales[:, :1], mins[:, :1])
    dense = load_hf(DEFAULT_PAIR / "draft")  # float32
    with pytest.raises(ValueError, match="bf16 compute"):
        LeanLlama(dense.model, torch.float32, int4=requantize)
    with pytest.raises(ValueError, match="lean backend only"):
        HFModel(dense.model, dense.tokenizer, "x", backend="hf", int4=requantize)
    # a dtype for a named model whose weights fix it is refused before anything loads, not ignored
    from verispec.evaluation.units import SweepSpec
    from verispec.models import load_model

    with pytest.raises(ValueError, match="int4 weights with bf16 compute: a dtype does not apply"):
        load_model("qwen2.5-coder-1.5b-int4", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype does not apply"):
        SweepSpec(suite="capitals", target="qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b-int4",
                  draft_dtype="bfloat16").validate()
    with pytest.raises(ValueError, match="llama.cpp's quantized weights"):
        SweepSpec(suite="capitals", target="qwen2.5-coder-1.5b-gguf", dtype="bfloat16").validate()


@pytest.fixture(scope="module")
def int4_pair():
    target = load_hf(DEFAULT_PAIR / "target", dtype=torch.bfloat16)
    draft = load_hf(DEFAULT_PAIR / "draft", dtype=torch.bfloat16)
    return (target, target.with_int4(requantize, "default-int4"),
            draft.with_int4(requantize, "default-draft-int4"))


def test_default_pair_in_int4_decodes_like_its_bf16_self(int4_pair):
    dense, target, _ = int4_pair
    ids = torch.tensor([dense.encode(PROMPTS[0] + PROMPTS[2])])  # [1, L]
    n = ids.shape[1]
    a, b = dense.session().logits_for(ids, n)[0], target.session().logits_for(ids, n)[0]  # [L, V]
    assert all(isinstance(layer["gate_up"], Int4Linear) for layer in target._lean_model().layers)
    tv = 0.5 * (a.softmax(-1) - b.softmax(-1)).abs().sum(-1)  # [L]
    # requantising every projection to 4 bits moves the next-token law, but not far: measured mean TV
    # 0.027, max 0.049 over these positions (a broken code layout gives a law near unrelated to it)
    assert float(tv.mean()) < 0.1, tv


def test_int4_weights_hold_no_private_dense_copy(int4_pair):
    """Memory (issue 22): an int4 projection's dense twin for prompts is transformers' own tensors (a
    model loaded from safetensors keeps them as the file's shared, memory-mapped pages), not a fused
    copy, and a bf16 dense projection keeps oneDNN's packed weights only. The twin computes the fused
    projection: its parts side by side, each with its own slice of the bias."""
    _, target, _ = int4_pair
    hf = target.model
    layer, attn = target._lean_model().layers[0], hf.model.layers[0].self_attn
    twin = layer["qkv"].dense
    assert [w.data_ptr() for w in twin.weights] == [
        attn.q_proj.weight.data_ptr(), attn.k_proj.weight.data_ptr(), attn.v_proj.weight.data_ptr()]
    x = torch.randn(1, 20, twin.weights[0].shape[1], generator=torch.Generator().manual_seed(5)).bfloat16()
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    fused = torch.cat([p.weight.detach() for p in projections])  # [nq + 2 nkv, d]
    bias = None if attn.q_proj.bias is None else torch.cat([p.bias.detach() for p in projections])
    want = torch.nn.functional.linear(x.float(), fused.float(), None if bias is None else bias.float())
    got = twin(x).float()  # [1, 20, nq + 2 nkv]: float32 sums rounded to bf16 once
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * float(want.abs().max()))
    dense = LeanLlama(hf, torch.bfloat16)  # the same model without int4: packed copies only
    packed = [dense.head, *(w[n] for w in dense.layers for n in ("qkv", "o", "gate_up", "down"))]
    assert all(lin.packed is not None and lin.weight_t is None and lin.weight is None for lin in packed)


def _resident_kib(directory) -> int:
    """Resident KiB of this process's mappings of files under `directory` (/proc/self/smaps)."""
    root, total, inside = str(directory) + "/", 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            inside = len(fields) >= 6 and fields[5].startswith(root)
        elif fields[0] == "Rss:" and inside:
            total += int(fields[1])
    return total


def test_drop_file_pages_leaves_the_resident_set_and_keeps_the_bytes(tmp_path):
    """Low-memory models (issue 22): pages of a copy-on-write file mapping (as torch maps safetensors)
    leave the resident set and read back the same bytes; a mapping with a written page is left alone
    (dropping it would bring the file's bytes back)."""
    import mmap

    data = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "weights.bin"
    path.write_bytes(data.numpy().tobytes())
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # MAP_PRIVATE, rw-p
    view = torch.frombuffer(mapped, dtype=torch.uint8)
    assert int(view.sum()) == int(data.sum())  # every page read: resident
    assert _resident_kib(tmp_path) >= 4 << 10
    assert int4.drop_file_pages(tmp_path) >= 4 << 20
    assert _resident_kib(tmp_path) == 0
    assert torch.equal(view, data)  # read back from the file: the same bytes
    view[0] = (int(data[0]) + 1) % 256  # a written page: the mapping now holds bytes the file does not
    assert int4.drop_file_pages(tmp_path) == 0
    assert int(view[0]) == (int(data[0]) + 1) % 256
    del view
    mapped.close()


def test_low_memory_int4_runs_prompts_through_the_int4_kernel(int4_pair):
    """dense_prompts=False (the -lowmem models): no dense twins, so a long prompt scores exactly as the
    twin model does when its context passes are kept off the twins, and a prompt of at most DENSE_ABOVE
    tokens (no twin either way) exactly as the twin model."""
    from verispec.models import lean

    dense, target, _ = int4_pair
    low = dense.with_int4(requantize, "default-int4-lowmem", dense_prompts=False)
    assert all(layer[key].dense is None for layer in low._lean_model().layers
               for key in ("qkv", "o", "gate_up", "down"))
    long = dense.encode(PROMPTS[0] * 3)
    short = long[: int4.DENSE_ABOVE]
    assert len(long) > int4.DENSE_ABOVE + 1
    for ids in (short, long):
        batch = torch.tensor([ids])  # [1, L]
        got = low.session().logits_for(batch, 2)
        if len(ids) > int4.DENSE_ABOVE:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(lean, "DENSE_ABOVE", 10**9)
                want = target.session().logits_for(batch, 2)
            assert not torch.equal(got, target.session().logits_for(batch, 2))  # the twins round otherwise
        else:
            want = target.session().logits_for(batch, 2)
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="int4 weights only"):
        HFModel(dense.model, dense.tokenizer, "x", dense_prompts=False)


def test_greedy_speculative_decoding_equals_greedy_decoding_but_at_near_ties(int4_pair):
    """int4 matmuls give a row the same bits in a step and in a verification pass, attention does not
    (torch's CPU SDPA rounds a query differently by the query count: bf16 at multiples of 16 keys), so
    greedy SD equals greedy decoding except where the target's top two logits are within that rounding."""
    _, target, draft = int4_pair
    prompt_ids = [verispec.api.encode_prompt(target, p) for p in PROMPTS]
    for prompt, ids in zip(PROMPTS, prompt_ids):
        plain = verispec.generate(prompt, target=target, draft=None, temperature=0, max_new_tokens=40)
        for k in (1, 3, 4):
            spec = verispec.generate(prompt, target=target, draft=draft, temperature=0, k=k,
                                     max_new_tokens=40)
            if spec.token_ids == plain.token_ids:
                continue
            i = next(j for j, (a, b) in enumerate(zip(spec.token_ids, plain.token_ids)) if a != b)
            session = target.session()
            for j in range(i + 1):  # plain decoding's own steps up to the first difference
                logits = session.logits_for(torch.tensor([ids + list(plain.token_ids[:j])]), 1)[0, -1]
            top = logits.topk(2).values
            margin = float(top[0] - top[1])
            assert margin <= two_bf16_steps(top[0]), (prompt, k, i, margin)


def two_bf16_steps(logit) -> float:
    """Two bf16 rounding steps at this logit's size (a step is at most |x| / 2^7: 8 significant bits):
    the bound on how far attention's rounding by query count moves a bf16 model's logit, on any CPU."""
    return 2 * float(abs(logit)) * 2 ** -7


def test_rows_of_a_batch_score_like_rows_alone_up_to_bf16_rounding(int4_pair):
    """A batched pass (padding, a per-row mask) rounds attention differently from a row alone, and bf16
    activations make that visible in the last bits of a logit (measured here: 0.125 for int4 and 0.0625
    for the dense bf16 model, logits up to 16), so batch invariance holds for bf16 and int4 models up to
    two bf16 steps of a logit, not token for token (fp32 models: tests/test_api_batched.py)."""
    _, target, _ = int4_pair
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 4000, (length,), generator=gen) for length in (12, 30, 21)]
    batch = target.batch_session()
    for step in range(4):
        extra = torch.randint(0, 4000, (3 * step,), generator=torch.Generator().manual_seed(step))
        seqs = [torch.cat([row, extra]) for row in rows]
        together = batch.logits_for([0, 1, 2], seqs, [3, 3, 3])
        for seq, logits in zip(seqs, together):
            alone = target.batch_session().logits_for([0], [seq], [3])[0]  # [3, V]
            assert float((logits - alone).abs().max()) <= two_bf16_steps(alone.abs().max())


def test_rule_laws_on_int4_logits(int4_pair):
    """The rules' exact laws need valid full-vocabulary rows: int4 logits come back float32 [n, V], the
    lossless law is the target's and lossy laws are distributions (the rule suites check the laws
    themselves, on any rows)."""
    _, target, draft = int4_pair
    ids = torch.tensor([target.encode(PROMPTS[0])])  # [1, L]
    sampling = SamplingConfig(temperature=1.0)
    logits = target.session().logits_for(ids, 3)[0]  # [3, V]
    assert logits.dtype == torch.float32 and logits.shape == (3, target.vocab_size)
    target_probs = process(logits, sampling, torch.float64)
    draft_probs = process(draft.session().logits_for(ids, 3)[0], sampling, torch.float64)  # [3, V]
    assert float((parse("lossless").emitted(target_probs, draft_probs) - target_probs).abs().max()) < 1e-12
    for spec in ("lenience:l=0.5", "speccascade:min_p=0.1", "cos:w=0.9"):
        law = parse(spec).emitted(target_probs, draft_probs)  # checked inputs, exact law
        assert (law >= 0).all() and torch.allclose(law.sum(-1), torch.ones(3, dtype=torch.float64))


# -- the GGUF's own Q4_K codes (the Qwen 0.5B file: its ffn_down is Q4_K in half the layers) ------------


def test_gguf_names():
    assert gguf_name("model.layers.3.mlp.up_proj.weight") == "blk.3.ffn_up.weight"
    assert gguf_name("model.layers.12.self_attn.o_proj.weight") == "blk.12.attn_output.weight"
    assert gguf_name("lm_head.weight") == "output.weight"
    assert gguf_name("model.layers.3.input_layernorm.weight") is None


@pytest.mark.slow
@pytest.mark.skipif(not qwen.parts_installed(qwen.QWEN_0_5B), reason="the Qwen2.5-Coder-0.5B parts are not "
                    "installed: " + qwen.QWEN_0_5B.install_command)
def test_q4k_codes_reproduce_the_gguf_dequantisation_bit_for_bit():
    gguf = pytest.importorskip("gguf")
    plan = Q4KPlan(qwen.gguf_path(qwen.QWEN_0_5B))
    kinds = {}
    for name, tensor in plan.tensors.items():
        kinds.setdefault(tensor.tensor_type.name, name)
    assert {"Q4_K", "Q6_K", "Q5_0"} <= set(kinds)
    tensor = plan.tensors[kinds["Q4_K"]]
    out, inp = int(tensor.shape[1]), int(tensor.shape[0])
    reference = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())  # [out, in]
    assert torch.equal(dequantize(*q4k_codes(tensor.data, out, inp)), reference.view(out, inp))
    layer = kinds["Q4_K"].split(".")[1]
    hf = f"model.layers.{layer}.mlp.down_proj.weight"
    assert gguf_name(hf) == kinds["Q4_K"]  # the Q4_K tensors of this file are ffn_down ones
    dense = reference.view(out, inp).bfloat16()  # what transformers loads: the same values in bf16
    codes = plan([hf], dense)
    assert codes is not None and torch.equal(dequantize(*codes).bfloat16(), dense)
    assert plan([f"model.layers.{layer}.self_attn.q_proj.weight"], dense) is None  # Q5_0: stays dense
    plan.release()  # drops the memory map; the next call reopens it
    assert plan._tensors is None and plan([hf], dense) is not None
    tampered = dense.clone()
    tampered[0, 0] += 1
    with pytest.raises(ValueError, match="do not reproduce"):
        plan([hf], tampered)
