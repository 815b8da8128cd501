"""Engine presets (`verispec.rules.engines`): each preset's rule reproduces the engine's documented
acceptance rule on toy laws. The engines' rules are written out here from their documentation and
kernels, independently of the rule classes: SGLang's target-only kernel, TensorRT-LLM's relaxed
acceptance, vLLM's p/q sampler and V0 typical acceptance sampler (argmax recovery), MAX's residual
sampler, llama.cpp's sample-and-compare, and vLLM's FLy pre-pass (tests/test_fly.py's literal port)."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from test_fly import random_block, reference_num_accepted_probs, row_inputs
from verispec.cli import main
from verispec.rules.engines import engine_names, from_engine, parse_flags


def toy_laws(seed: int, v: int = 6, n: int = 40):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(v, 0.5), size=n)
    q = rng.dirichlet(np.full(v, 0.5), size=n)
    return torch.tensor(p), torch.tensor(q)


def sglang_kernel(p: np.ndarray, x: int, single: float, acc: float) -> tuple[float, np.ndarray]:
    """sgl-kernel TreeSpeculativeSamplingTargetOnly, one child: accept iff coin <= p(x)/acc or
    p(x) >= single; after a rejection sample p with the rejected child's mass removed."""
    accept = 1.0 if p[x] >= single else min(1.0, p[x] / acc)
    rest = p.copy()
    rest[x] = 0
    return accept, rest / rest.sum()


@pytest.mark.parametrize("single,acc", [(0.5, 0.3), (1.0, 1.0), (0.2, 0.9)])
def test_sglang_preset_is_its_kernel(single, acc):
    preset = from_engine("sglang", f"--speculative-accept-threshold-single {single} "
                                   f"--speculative-accept-threshold-acc {acc}")
    p, q = toy_laws(1)
    accept = preset.rule.accept(p, q)
    for i in range(len(p)):
        for x in range(p.shape[1]):
            a, residual = sglang_kernel(p[i].numpy(), x, single, acc)
            assert accept[i, x].item() == pytest.approx(a, abs=1e-12)
            np.testing.assert_allclose(preset.rule.residual_after(p[i], q[i], torch.tensor(x)).numpy(),
                                       residual, atol=1e-12)
    if (single, acc) == (1.0, 1.0):  # the defaults: lossless in law
        assert preset.lossless
        torch.testing.assert_close(preset.rule.emitted(p, q), p, rtol=0, atol=1e-12)


def test_sglang_backends_that_verify_greedily():
    assert from_engine("sglang", "device=cpu").rule.name == "greedy"
    assert from_engine("sglang", "device=hip").rule.name == "greedy"
    assert from_engine("sglang", "device=hip --speculative-use-rejection-sampling").rule.name == "lossless"
    with pytest.raises(ValueError, match="thresholds at 1.0"):
        from_engine("sglang", "--speculative-use-rejection-sampling --speculative-accept-threshold-acc 0.5")


@pytest.mark.parametrize("topk,delta", [(1, 0.0), (3, 0.2), (10, 0.6)])
def test_tensorrt_relaxed_preset_is_its_rule(topk, delta):
    preset = from_engine("tensorrt-llm", {"use_relaxed_acceptance_for_thinking": True, "relaxed_topk": topk,
                                          "relaxed_delta": delta})
    p, q = toy_laws(2)
    accept = preset.rule.accept(p, q).numpy()
    for i in range(len(p)):
        order = np.argsort(-p[i].numpy(), kind="stable")
        for x in range(p.shape[1]):
            documented = x in order[:topk] and p[i, x] >= p[i].max() - delta
            assert accept[i, x] == float(documented)
    assert from_engine("tensorrt-llm").lossless  # exact-match verification


def test_vllm_standard_and_max_residual_are_speculative_sampling():
    p, q = toy_laws(3)
    documented = torch.minimum(torch.ones_like(p), p / q)  # accept iff u <= p/q
    residual = (p - q).clamp_min(0)
    residual = residual / residual.sum(-1, keepdim=True)
    for preset in (from_engine("vllm"), from_engine("max", "rejection_sampling_strategy=residual")):
        torch.testing.assert_close(preset.rule.accept(p, q), documented, rtol=0, atol=1e-12)
        torch.testing.assert_close(preset.rule.residual(p, q), residual, rtol=0, atol=1e-12)


def test_vllm_typical_acceptance_sampler_is_its_rule():
    preset = from_engine("vllm", "spec_decoding_acceptance_method=typical_acceptance_sampler")
    p, q = toy_laws(4)
    entropy = -(p * p.log()).sum(-1, keepdim=True)
    documented = (p > torch.minimum(torch.full_like(entropy, 0.09), 0.3 * torch.exp(-entropy))).double()
    torch.testing.assert_close(preset.rule.accept(p, q), documented, rtol=0, atol=0)
    recovered = preset.rule.residual(p, q)
    assert torch.equal(recovered.argmax(-1), p.argmax(-1)) and torch.allclose(recovered.amax(-1),
                                                                              torch.ones(len(p)).double())


def test_vllm_fly_preset_is_the_prepass():
    preset = from_engine("vllm", "rejection_sample_method=fly num_speculative_tokens=5 "
                                 "fly_entropy_threshold=0.2")
    assert preset.rule.spec == "fly:window=4,threshold=0.2,top_k=3" and preset.k == 5  # min(6, K - 1)
    p, q, x = random_block(7, b=10, k=5, v=4)
    law = preset.rule.block_law(p, q, x)
    for i in range(len(x)):
        a, ok, h = row_inputs(p, q, x, i, preset.rule)
        expected = reference_num_accepted_probs(a, ok, h, 4, 0.2)
        np.testing.assert_allclose(law.num_accepted_probs[i, : len(a) + 1].numpy(), expected, atol=1e-12)
    with pytest.raises(ValueError, match="give num_speculative_tokens"):
        from_engine("vllm", "rejection_sample_method=fly")
    with pytest.raises(ValueError, match=r"fly_window_size must be in \[1, num_speculative_tokens\)"):
        from_engine("vllm", "rejection_sample_method=fly,num_speculative_tokens=4,fly_window_size=4")
    with pytest.raises(ValueError, match="benchmark"):
        from_engine("vllm", "rejection_sample_method=synthetic")


def test_llama_cpp_sample_and_compare_is_lossless_for_its_sampler_chain():
    """llama.cpp samples t from its chain's law p' at each draft position and keeps the draft x iff
    t == x: kept with probability p'(x), else t ~ p' given t != x. That is speculative sampling with a
    one-hot q at x, which is what the preset's rule does with a greedy draft."""
    preset = from_engine("llama.cpp", "--spec-draft-n-max 4")
    assert preset.rule.name == "lossless" and preset.k == 4
    assert preset.sampling == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    p, _ = toy_laws(5)
    for x in range(p.shape[1]):
        one_hot = torch.zeros_like(p)
        one_hot[:, x] = 1
        kept = preset.rule.accept(p, one_hot)[:, x]
        torch.testing.assert_close(kept, p[:, x], rtol=0, atol=1e-12)
        others = p.clone()
        others[:, x] = 0
        torch.testing.assert_close(preset.rule.residual(p, one_hot), others / others.sum(-1, keepdim=True),
                                   rtol=0, atol=1e-12)
    assert from_engine("llama.cpp", "--temp 0").rule.name == "greedy"


def test_max_typical_needs_its_threshold_and_logit_comparison_is_refused():
    with pytest.raises(ValueError, match="posterior_threshold"):
        from_engine("max")
    preset = from_engine("max", "posterior_threshold=0.09")
    assert preset.rule.spec.startswith("typical:eps=0.09,alpha=0.3")
    with pytest.raises(ValueError, match="not in verispec's catalogue"):
        from_engine("max", "rejection_sampling_strategy=logit-comparison")
    assert from_engine("max", "use_relaxed_acceptance_for_thinking=true").rule.spec.startswith(
        "relaxed:n=10,delta=0.6")


def test_flag_spellings_and_bad_flags():
    same = [parse_flags("--speculative-accept-threshold-single 0.5"),
            parse_flags("--speculative_accept_threshold_single=0.5"),
            parse_flags("speculative-accept-threshold-single=0.5"),
            parse_flags('{"speculative_accept_threshold_single": 0.5}')]
    assert all(f == {"speculative_accept_threshold_single": "0.5"} for f in same)
    assert parse_flags("-md a.gguf --flag --x -1") == {"md": "a.gguf", "flag": "true", "x": "-1"}
    with pytest.raises(ValueError, match="unknown flag.*this preset knows"):
        from_engine("sglang", "--speculative-accept-threshold 0.5")
    with pytest.raises(ValueError, match="unknown engine 'vllmm'"):
        from_engine("vllmm")
    with pytest.raises(ValueError, match="must be a number"):
        from_engine("sglang", "--speculative-accept-threshold-acc high")
    with pytest.raises(ValueError, match="out of range"):
        from_engine("sglang", "--speculative-accept-threshold-acc 2")
    with pytest.raises(ValueError, match="neither"):
        parse_flags("fly 3")
    assert set(engine_names()) == {"vllm", "sglang", "tensorrt-llm", "max", "llama.cpp"}


def test_cli_prints_the_preset(capsys):
    assert main(["rules", "--from-engine", "sglang", "--engine-flags",
                 "--speculative-accept-threshold-single 0.5 --speculative-accept-threshold-acc 0.3"]) == 0
    out = capsys.readouterr().out
    assert "rule: sglang:single=0.5,acc=0.3 (lossy" in out and "verispec run --from-engine sglang" in out
    assert main(["rules", "--from-engine", "vllm", "--engine-flags",
                 "rejection_sample_method=fly,num_speculative_tokens=8", "--json"]) == 0
    preset = __import__("json").loads(capsys.readouterr().out)
    assert preset["rule"] == "fly:window=6,threshold=0.3,top_k=3" and preset["k"] == 8
    assert not preset["lossless"]
    assert main(["rules", "--from-engine", "max", "--engine-flags", "bogus=1"]) == 2
    assert "this preset knows" in capsys.readouterr().err
    assert main(["run", "--from-engine", "sglang", "--rule", "lossless", "--prompt", "hi"]) == 2
    assert "not both" in capsys.readouterr().err
