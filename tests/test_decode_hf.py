"""The decode loop on real transformers models: the embedded default pair."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from stats import chisquare_pvalue
from verispec.api import generate
from verispec.cli import main
from verispec.decode import DecodeConfig, autoregressive_decode, decode_prompts, speculative_decode
from verispec.models import load_drafter, load_model
from verispec.rules import names, parse
from verispec.sampling import SamplingConfig, process

pytestmark = pytest.mark.slow  # loads the default pair; CLI tests start subprocesses

TARGET = os.environ.get("VERISPEC_TEST_TARGET", "default")
DRAFT = os.environ.get("VERISPEC_TEST_DRAFT", "default-draft")
PROMPTS = ["To be, or not to be", "KING.\nWhat says the queen?", "Enter HAMLET"]


@pytest.fixture(scope="module")
def pair():
    target = load_model(TARGET)
    return target, load_drafter(DRAFT, target)


def full_forward_probs(model, ids: list[int], sampling: SamplingConfig) -> torch.Tensor:
    """Processed next-token distributions at every position, without any cache: [L, V]."""
    with torch.inference_mode():
        logits = model.model(input_ids=torch.tensor([ids])).logits[0].float()
    return process(logits, sampling)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_speculative_equals_plain_greedy(pair, k):
    target, drafter = pair
    config = DecodeConfig(k=k, max_new_tokens=40, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    for prompt in PROMPTS:
        ids = target.encode(prompt)
        plain = autoregressive_decode(target, ids, config)
        for rule in ("greedy", "lossless", "hsd"):
            spec = speculative_decode(target, drafter, ids, rule, config, torch.Generator().manual_seed(0))
            assert spec.token_ids == plain.token_ids, (prompt, rule, k)
            assert spec.target_calls < plain.target_calls or k == 1


def test_caches_follow_the_committed_sequence(pair):
    """Every target/draft distribution used while decoding equals a cache-free full forward pass on the
    final sequence: stale keys/values of rejected draft tokens would make them differ."""
    target, drafter = pair
    sampling = SamplingConfig(temperature=1.0)
    config = DecodeConfig(k=4, max_new_tokens=60, sampling=sampling, keep_probs=True, stop_at_eos=False)
    ids = target.encode(PROMPTS[0])
    gen = speculative_decode(target, drafter, ids, "lossless", config, torch.Generator().manual_seed(1))
    assert sum(b.accepted for b in gen.blocks) > 0 and any(b.accepted < b.proposed for b in gen.blocks)
    seq = list(gen.prompt_ids) + list(gen.token_ids)
    n0 = len(gen.prompt_ids)
    p_full = full_forward_probs(target, seq, sampling)[n0 - 1 : -1]  # predicts each generated token
    q_full = full_forward_probs(drafter.model, seq, sampling)[n0 - 1 : -1]
    p_used = torch.cat(gen.probs["target"])
    torch.testing.assert_close(p_used, p_full, rtol=0, atol=2e-5)
    pos = 0
    for block, q in zip(gen.blocks, gen.probs["draft"]):
        torch.testing.assert_close(q, q_full[pos : pos + q.shape[0]], rtol=0, atol=2e-5)
        pos += block.emitted


@pytest.mark.parametrize("rule", [None, "lossless", "cos:w=0.9", "speccascade:min_p=0.1"])
def test_recorded_log_likelihood_is_a_cache_free_pass(pair, rule):
    """The per-token log-likelihood a row's score is made of (steps 'log_target_raw': the raw target,
    temperature 1, no truncation, whatever the sampling settings; the MT-Bench score is its mean) equals
    a cache-free full forward pass on the final sequence, for plain decoding, lossless SD and lossy rules
    whose tokens the target did not sample; 'log_target' is the same under the processed target. Prompts
    of different lengths decode in one batch as sweep rows do, each cut by a stop condition inside a
    block (here the end of the second line), as a reply's stop is."""
    target, drafter = pair

    def second_line_ends(tokens: list[int]) -> int | None:
        ends = [i + 1 for i, t in enumerate(tokens) if "\n" in target.decode([t])]
        return ends[1] if len(ends) > 1 else None

    sampling = SamplingConfig(temperature=0.7, min_p=0.05)
    config = DecodeConfig(k=4, max_new_tokens=48, sampling=sampling, stop_check=second_line_ends)
    prompts = [target.encode(text) for text in PROMPTS]
    generators = [torch.Generator().manual_seed(3 + i) for i in range(len(PROMPTS))]
    gens = decode_prompts(target, prompts, generators, config, drafter if rule else None, rule)
    assert sum(gen.finish == "stop" for gen in gens) >= 2  # cut by the stop condition
    for gen in gens:
        seq = list(gen.prompt_ids) + list(gen.token_ids)
        n0, tokens = len(gen.prompt_ids), torch.tensor(gen.token_ids)
        with torch.inference_mode():
            logits = target.model(input_ids=torch.tensor([seq])).logits[0].float()[n0 - 1 : -1]  # [n, V]
        raw = torch.log_softmax(logits, dim=-1)[torch.arange(len(tokens)), tokens]
        processed = torch.log(process(logits, sampling)[torch.arange(len(tokens)), tokens])
        torch.testing.assert_close(torch.tensor(gen.steps["log_target_raw"]), raw, rtol=0, atol=1e-4)
        torch.testing.assert_close(torch.tensor(gen.steps["log_target"]), processed, rtol=0, atol=1e-4)
        assert gen.stats()["target_nll"] == pytest.approx(-raw.mean().item(), abs=1e-4)
    assert any((torch.tensor(g.steps["log_target_raw"]) < torch.tensor(g.steps["log_target"]) - 0.1).any()
               for g in gens)  # temperature and min-p do change the processed law


def test_realised_acceptance_matches_expected(pair):
    """Realised acceptance of a long lossless run vs sum(min(p, q)) recomputed without a cache."""
    target, drafter = pair
    sampling = SamplingConfig(temperature=1.0)
    config = DecodeConfig(k=4, max_new_tokens=400, sampling=sampling, stop_at_eos=False)
    ids = target.encode(PROMPTS[1])
    gen = speculative_decode(target, drafter, ids, "lossless", config, torch.Generator().manual_seed(2))
    seq = list(gen.prompt_ids) + list(gen.token_ids)
    n0 = len(gen.prompt_ids)
    p = full_forward_probs(target, seq, sampling)[n0 - 1 : -1]
    q = full_forward_probs(drafter.model, seq, sampling)[n0 - 1 : -1]
    expected = torch.minimum(p, q).sum(-1).double()  # [n]
    roles = np.array(gen.steps["role"])
    decided = (roles == "accepted") | (roles == "recovered")  # positions where the rule decided on a draft
    np.testing.assert_allclose(np.array(gen.steps["expected_accept"])[decided], expected.numpy()[decided],
                               atol=1e-4)
    a = expected.numpy()[decided]
    accepted = (roles == "accepted").sum()
    z = (accepted - a.sum()) / math.sqrt((a * (1 - a)).sum())
    assert abs(z) < 4, (accepted, a.sum(), z)
    assert 0.3 < a.mean() < 0.95


def test_sampled_lossless_first_tokens_follow_the_target(pair):
    target, drafter = pair
    sampling = SamplingConfig(temperature=1.0)
    ids = target.encode(PROMPTS[2])
    config = DecodeConfig(k=3, max_new_tokens=2, sampling=sampling, diagnostics=False)
    gen = torch.Generator().manual_seed(3)
    runs = [speculative_decode(target, drafter, ids, "lossless", config, gen).token_ids for _ in range(500)]
    first = np.array([r[0] for r in runs])
    p1 = full_forward_probs(target, ids, sampling)[-1].double().numpy()
    assert chisquare_pvalue(np.bincount(first, minlength=len(p1)), p1 / p1.sum()) > 1e-4
    top = np.bincount(first).argmax()
    second = np.array([r[1] for r in runs if r[0] == top])
    p2 = full_forward_probs(target, ids + [int(top)], sampling)[-1].double().numpy()
    assert len(second) > 50
    assert chisquare_pvalue(np.bincount(second, minlength=len(p2)), p2 / p2.sum()) > 1e-4


def test_every_rule_runs_on_the_default_pair(pair):
    target, drafter = pair
    for name in names():
        spec = {"speccascade": "speccascade:min_p=0.1", "typical": "typical:eps=0.09,alpha=0.3",
                "topk": "topk:k=8", "topp": "topp:p=0.9", "relaxed": "relaxed:n=10,delta=0.6",
                "lenience": "lenience:l=0.5", "cos": "cos:w=0.4", "fuzzy": "fuzzy:threshold=0.1",
                "sglang": "sglang:single=0.9,acc=0.5", "budget": "budget:tv=0.05,ratio=2",
                "honest": "honest:speccascade:min_p=0.1"}.get(name, name)
        rule = parse(spec)
        per_position = not (rule.block_level and not rule.lossless)  # fly: no per-position law
        out = generate(PROMPTS[0], target=target, draft=drafter, rule=spec, max_new_tokens=12, seed=0,
                       diagnostics=per_position)
        assert 1 <= len(out.token_ids) <= 12 and out.stats["rule"] == rule.spec
        if rule.lossless:
            assert out.stats["log_ratio"] == 0.0


def test_stop_tokens_come_from_every_eos_setting(pair):
    """HFModel stops where transformers' generate stops: tokenizer eos, config and generation config
    eos_token_id (an int or a list), plus named stop tokens (Qwen's <|endoftext|>, lost by its GGUF)."""
    from verispec.models import DEFAULT_PAIR
    from verispec.models.hf import load_hf, stop_token_ids

    target, _ = pair
    assert target.stop_token_ids == {target.eos_token_id}
    gen_config = target.model.generation_config
    saved = gen_config.eos_token_id
    try:
        gen_config.eos_token_id = [target.eos_token_id, 7]
        assert stop_token_ids(target.model, target.tokenizer) == {target.eos_token_id, 7}
    finally:
        gen_config.eos_token_id = saved
    name = target.tokenizer.convert_ids_to_tokens(9)
    model = load_hf(DEFAULT_PAIR / "target", stop_tokens=(name,))
    assert model.stop_token_ids == {model.eos_token_id, 9}
    with pytest.raises(ValueError, match="not in the vocabulary"):
        load_hf(DEFAULT_PAIR / "target", stop_tokens=("<|no such token|>",))
    # a loaded Qwen model's set (<|im_end|> and <|endoftext|>): tests/test_qwen.py


def test_nan_logits_are_reported(pair):
    target, drafter = pair

    class NaNModel:
        """The real target whose logits turn NaN after the prompt (a broken backend)."""

        def __init__(self, inner):
            self.inner, self.name, self.vocab_size, self.eos_token_id, self.calls = (
                inner, "nan", inner.vocab_size, None, 0)

        def session(self):
            real = self.inner.session()

            class S:
                cached = property(lambda s: real.cached)

                def logits_for(s, tokens, n):
                    out = real.logits_for(tokens, n)
                    return out if tokens.shape[1] < 12 else out * math.nan

            return S()

    config = DecodeConfig(k=2, max_new_tokens=20)
    with pytest.raises(ValueError, match="NaN"):
        speculative_decode(NaNModel(target), drafter, target.encode("To be or not"), "lossless", config)
    with pytest.raises(ValueError, match="NaN"):
        autoregressive_decode(NaNModel(target), target.encode("To be or not"), config)


def test_mismatched_vocabularies_are_refused(tmp_path, pair):
    from transformers import LlamaConfig, LlamaForCausalLM

    target, _ = pair
    small = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    small.save_pretrained(tmp_path / "small")
    target.tokenizer.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="vocabulary size 1000"):
        load_drafter(str(tmp_path / "small"), target)
    # same size, different token map: swap two tokens of the tokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = target.tokenizer.get_vocab()
    a, b = sorted(vocab, key=vocab.get)[100:102]
    import json

    spec = json.loads(target.tokenizer.backend_tokenizer.to_str())
    spec["model"]["vocab"][a], spec["model"]["vocab"][b] = (spec["model"]["vocab"][b],
                                                            spec["model"]["vocab"][a])
    from tokenizers import Tokenizer

    swapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    same = LlamaForCausalLM(LlamaConfig(vocab_size=target.vocab_size, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    same.save_pretrained(tmp_path / "same")
    swapped.save_pretrained(tmp_path / "same")
    with pytest.raises(ValueError, match="different token maps"):
        load_drafter(str(tmp_path / "same"), target)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "verispec", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_run_text_and_json(capsys):
    """JSON through the real `python -m verispec run`; the text output in-process (`cli.main`)."""
    out = run_cli("run", "--target", TARGET, "--draft", DRAFT, "--rule", "lenience:l=0.5",
                  "--prompt", "To be", "--max-new-tokens", "10", "--json")
    assert out.returncode == 0, out.stderr
    import json

    data = json.loads(out.stdout)
    assert len(data["token_ids"]) == 10 and data["stats"]["rule"] == "lenience:l=0.5"
    capsys.readouterr()
    assert main(["run", "--target", TARGET, "--draft", DRAFT, "--prompt", "To be", "--max-new-tokens", "5"]) \
        == 0
    assert "acceptance" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--target", "/no/such/model"], "model not found"),
        (["--draft", "/no/such/draft"], "model not found"),
        (["--k", "0"], "k (draft tokens per block) must be an integer >= 1"),
        (["--prompt", ""], "empty prompt"),
        (["--rule", "lenience:l=0"], "0 < l <= 1"),
        (["--draft", "self:layers=99"], "self-draft needs"),
        (["--temperature", "-1"], "temperature"),
    ],
)
def test_cli_bad_input_is_clear_and_prints_nothing(args, message, capsys):
    """In-process (`cli.main`, the models already loaded): exit status 2, the message, nothing on stdout."""
    base = {"--target": TARGET, "--draft": DRAFT, "--prompt": "To be"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    code = main(["run", *[x for kv in base.items() for x in kv], "--max-new-tokens", "4"])
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    assert out == ""
    assert message in err, err


def test_lean_backend_equals_transformers(pair):
    """The lean forward (preallocated cache, fused projections) gives transformers' logits, through
    prefill, single steps, multi-token verification passes and rollbacks."""
    from verispec.models.hf import HFModel

    target, drafter = pair
    for model in (target, drafter.model):
        lean = HFModel(model.model, model.tokenizer, "lean", backend="lean").session()
        ref = HFModel(model.model, model.tokenizer, "hf", backend="hf").session()
        ids = torch.tensor([target.encode("To be, or not to be, that is the question: whether 'tis nobler")])
        schedule = [(ids[:, :8], 1), (ids[:, :9], 1), (ids[:, :14], 5), (ids[:, :11], 2), (ids[:, :16], 3)]
        for tokens, n in schedule:
            torch.testing.assert_close(lean.logits_for(tokens, n), ref.logits_for(tokens, n),
                                       rtol=1e-4, atol=1e-4)


def test_default_tokenizer_round_trips_with_proper_spacing():
    if TARGET != "default":
        pytest.skip("checks the embedded default tokenizer")
    from verispec.evaluation.suites import load_suite

    target = load_model("default")
    texts = [item.prompt for item in load_suite("shakespeare").items]
    texts += ["To be, or not to be: that is the question.", "  two  spaces,\ttabs\nand 'quotes' -- dashes!",
              "émigré"]
    for text in texts:
        ids = target.encode(text)
        assert target.decode(ids) == text
    words = target.decode(target.encode("What says the queen?"))
    assert words == "What says the queen?"  # no spaces dropped or added around words and punctuation
    assert load_model("default") is target  # loaded once, reused


def test_lean_linear_kernels_agree():
    """The three matmul paths of the lean backend (W^T GEMV, oneDNN prepacked, F.linear fallback)
    give the same result for single-token and multi-token inputs, with and without bias."""
    from verispec.models.lean import Linear

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen)
    for bias in (None, torch.randn(96, generator=gen)):
        fast = Linear(weight, bias)
        fallback = Linear(weight, bias)
        fallback.weight_t, fallback.weight, fallback.packed = None, weight, None
        for m in (1, 5):
            x = torch.randn(1, m, 64, generator=gen)
            want = torch.nn.functional.linear(x, weight, bias)
            torch.testing.assert_close(fast(x), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fallback(x), want, rtol=0, atol=0)
    assert fast.packed is not None  # oneDNN packing works on this CPU build (else the test above is weaker)
