"""lm-evaluation-harness itself against `verispec serve`: its `local-completions` model on two tiny tasks
defined from a local jsonl (a `multiple_choice` task: lm-eval's `loglikelihood` requests, echo with
logprobs; a `generate_until` task), offline (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE), as a client of
vLLM's server runs it: batch_size 4 and lm-eval's default tokenizer backend, which finds the server's
/tokenizer_info and uses its /tokenize and /detokenize. Every log-likelihood lm-eval reports equals the
continuation's log-probability under the target computed directly (transformers' forward, log softmax)
within 2e-4 (tests/test_serve_lm_eval.py gives the bound), its is_greedy flag equals the direct argmax
check, and each generation (non-empty) equals argmax decoding cut at the task's stop string. A real
server on 127.0.0.1."""

from __future__ import annotations

import json
import math
import os

import pytest

# before lm_eval imports `datasets`, which reads them once: no hub lookups for the local json task
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("fastapi")
pytest.importorskip("tenacity")  # lm-eval's API models need it (lm-eval[api])
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.tasks import TaskManager  # noqa: E402
from test_serve import Running  # noqa: E402
from test_serve_lm_eval import TOL, direct_logprobs, encode_pair, greedy_ids  # noqa: E402

from verispec.serving.config import ServeConfig  # noqa: E402

DOCS = [
    {"context": "KING.\nWhat says the queen?", "choices": ["\nQUEEN.", "\nMadam, I am not well."],
     "label": 0},
    {"context": "HAMLET.\nTo be, or not to be,", "choices": [" that is the question.", " my lord."],
     "label": 0},
]
CHOICE_TASK = """task: verispec_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GENERATE_TASK = """task: verispec_tiny_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 10
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """lm-eval's results with its per-request samples, and the server's target."""
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    data = folder / "tiny.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / "choice.yaml").write_text(CHOICE_TASK.format(data=data))
    (folder / "generate.yaml").write_text(GENERATE_TASK.format(data=data))
    running = Running(ServeConfig(target="default", draft="default-draft", max_batch=8,
                                  max_queue=8, default_max_tokens=64))
    try:
        from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

        target = running.app.state.server.target
        # lm-eval's own check and tokenizer: the server's answers are the target's tokenizer
        assert check_remote_tokenizer_support(running.url + "/v1/completions")
        remote = RemoteTokenizer(running.url + "/v1/completions")
        text = "KING RICHARD. Now is the winter"
        assert remote.encode(text) == target.encode(text) and remote.decode(target.encode(text)) == text
        assert remote.eos_token == target.tokenizer.eos_token and remote.eos_token_id == target.eos_token_id
        # as a client of vLLM's server runs it: lm-eval's default ("auto") tokenizer backend finds the
        # server's /tokenizer_info and /tokenize (no tokenizer files of its own), four prompts a request
        results = lm_eval.simple_evaluate(
            model="local-completions", batch_size=4,
            model_args={"base_url": running.url + "/v1/completions", "model": "default", "max_retries": 1},
            tasks=["verispec_tiny_choice", "verispec_tiny_generate"],
            task_manager=TaskManager(include_path=str(folder), include_defaults=False), log_samples=True)
    finally:
        running.close()
    return results, target


@pytest.mark.slow
def test_lm_eval_loglikelihoods_are_the_targets(evaluated):
    results, target = evaluated
    samples = results["samples"]["verispec_tiny_choice"]
    assert len(samples) == len(DOCS)
    checked = 0
    for sample in samples:
        doc = sample["doc"]
        for choice, (loglik, is_greedy) in zip(doc["choices"], sample["filtered_resps"]):
            context_enc, continuation_enc = encode_pair(target.encode, doc["context"], choice)
            tokens = context_enc + continuation_enc
            rows = direct_logprobs(target, tokens)  # [L, V]
            span = range(len(context_enc), len(tokens))
            assert loglik == pytest.approx(math.fsum(float(rows[i - 1, tokens[i]]) for i in span), abs=TOL)
            assert is_greedy == all(int(rows[i - 1].argmax()) == tokens[i] for i in span)
            checked += 1
    assert checked == 2 * len(DOCS)
    # lm-eval's accuracy is what those log-likelihoods give (the larger one picked)
    picks = [max(range(2), key=lambda j: s["filtered_resps"][j][0]) for s in samples]
    acc = results["results"]["verispec_tiny_choice"]["acc,none"]
    assert acc == sum(p == s["doc"]["label"] for p, s in zip(picks, samples)) / len(samples)


@pytest.mark.slow
def test_lm_eval_generations_are_argmax_decoding(evaluated):
    results, target = evaluated
    samples = results["samples"]["verispec_tiny_generate"]
    assert len(samples) == len(DOCS)
    for sample in samples:
        [text] = sample["filtered_resps"] if isinstance(sample["filtered_resps"], list) else \
            [sample["filtered_resps"]]
        full = target.decode(greedy_ids(target, target.encode(sample["doc"]["context"]), 10))
        cut = full.find(".")
        assert text == (full if cut < 0 else full[:cut]) and text  # a non-empty generation
