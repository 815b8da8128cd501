"""`verispec serve` driven by requests written to lm-evaluation-harness's documented request shape
(its `local-completions` model; running lm-eval itself needs the network for its tasks, README.md
'Serving'), parsed the way lm-eval parses them, against a real server on 127.0.0.1.

The request payloads and the parsing below are ported from lm-eval's
`lm_eval/models/openai_completions.py` (`LocalCompletionsAPI._create_payload`, `parse_logprobs`,
`parse_generations`) and `lm_eval/api/model.py` (`TemplateLM._encode_pair`): loglikelihood sends
prompt = [context + continuation token ids], echo true, max_tokens 1, logprobs 1, temperature 0,
and reads `token_logprobs[ctxlen:-1]` (summed) and `top_logprobs[ctxlen:-1]` (is_greedy: every
continuation token's log-prob equals the max of its top_logprobs). The log-likelihood is checked
against the target's log-probabilities computed directly with transformers' own forward pass of the
same weights (an independent path from the server's LeanLlama kernels).

Also: `echo` with `max_tokens` 0 and > 0 (the prompt's entries first, then the generated ones, equal
to the same request without echo), streamed echo, the 400s of what is refused, and the server's
log_ratio against the library's for the same seed (the rollouts of tests/test_importance_default_pair.py
are the library's)."""

from __future__ import annotations

import copy
import json
import math

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")

from test_serve import PROMPT, Running  # noqa: E402

from verispec.decode import DecodeConfig, decode_prompts  # noqa: E402
from verispec.logprobs import behaviour_rows  # noqa: E402
from verispec.rules import parse  # noqa: E402
from verispec.serving.config import ServeConfig  # noqa: E402

# transformers' forward vs the server's LeanLlama forward, both float32: logits agree to ~1e-5 (different
# matmul blocking, AVX-512 or AVX2), so a log-probability to ~2e-5 and a sum over the <= 8 tokens here to
# < 2e-4; a wrong position (an off-by-one) moves a log-probability by > 0.1.
TOL = 2e-4
LOSSY = "lenience:l=0.5"


@pytest.fixture(scope="module")
def srv():
    running = Running(ServeConfig(target="default", draft="default-draft", max_batch=8,
                                  max_queue=8, default_max_tokens=64))
    running.http = httpx.Client(timeout=120)
    running.target = running.app.state.server.target
    yield running
    running.http.close()
    running.close()


def post(srv, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return srv.http.post(srv.url + path, json=body)


def direct_logprobs(target, ids: list[int]) -> torch.Tensor:
    """log softmax of transformers' own forward over `ids`, [len(ids), V]: row i predicts token i + 1."""
    with torch.no_grad():
        logits = target.model(torch.tensor([ids])).logits[0]  # [L, V]
    return torch.log_softmax(logits.double(), dim=-1)


# -- lm-eval's logic, ported (lm_eval/api/model.py and lm_eval/models/openai_completions.py) -----------


def encode_pair(encode, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """TemplateLM._encode_pair: trailing spaces of the context move to the continuation; the pair is
    encoded whole and split at the context's length."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = encode(context + continuation)
    context_enc = encode(context)
    return context_enc, whole[len(context_enc):]


def loglikelihood_payload(model: str, tokens: list[int], seed: int = 1234) -> dict:
    """LocalCompletionsAPI._create_payload(generate=False) with batch_size 1 (tokenized requests)."""
    return {"model": model, "prompt": [tokens], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": seed, "echo": True}


def generate_payload(model: str, tokens: list[int], until: list[str], max_gen_toks: int,
                     seed: int = 1234) -> dict:
    """LocalCompletionsAPI._create_payload(generate=True): gen_kwargs until / max_gen_toks / temperature."""
    return {"prompt": [tokens], "model": model, "max_tokens": max_gen_toks, "temperature": 0,
            "stop": until, "seed": seed}


def parse_logprobs(outputs, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """LocalCompletionsAPI.parse_logprobs."""
    res = []
    if not isinstance(outputs, list):
        outputs = [outputs]
    for out in outputs:
        for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
            assert ctxlen > 0, "Context length must be greater than 0"
            logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
            tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
            top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
            is_greedy = True
            for tok, top in zip(tokens_logprobs, top_logprobs):
                if tok != max(top.values()):
                    is_greedy = False
                    break
            res.append((logprobs, is_greedy))
    return res


def parse_generations(outputs) -> list[str]:
    """LocalCompletionsAPI.parse_generations."""
    res = []
    if not isinstance(outputs, list):
        outputs = [outputs]
    for out in outputs:
        tmp = [None] * len(out["choices"])
        for choices in out["choices"]:
            tmp[choices["index"]] = choices["text"]
        res = res + tmp
    return res


# -- the checks --------------------------------------------------------------------------------------


def greedy_ids(target, ids: list[int], n: int) -> list[int]:
    """n tokens of argmax decoding with transformers' forward (the target's law at temperature 0)."""
    out = list(ids)
    for _ in range(n):
        out.append(int(direct_logprobs(target, out)[-1].argmax()))
    return out[len(ids):]


@pytest.mark.slow
def test_lm_eval_loglikelihood_requests(srv):
    target = srv.target
    context = PROMPT
    greedy = target.decode(greedy_ids(target, target.encode(context), 3))
    for continuation, expect_greedy in ((greedy, True), (" Madam, I am not well", False)):
        context_enc, continuation_enc = encode_pair(target.encode, context, continuation)
        tokens = context_enc + continuation_enc
        reply = post(srv, loglikelihood_payload("default", tokens))
        assert reply.status_code == 200, reply.text
        [(loglik, is_greedy)] = parse_logprobs(reply.json(), [len(context_enc)])
        rows = direct_logprobs(target, tokens)  # [L, V]
        exact = math.fsum(float(rows[i - 1, tokens[i]]) for i in range(len(context_enc), len(tokens)))
        assert loglik == pytest.approx(exact, abs=TOL)
        assert is_greedy is expect_greedy
        assert is_greedy == all(int(rows[i - 1].argmax()) == tokens[i]
                                for i in range(len(context_enc), len(tokens)))
        lp = reply.json()["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(tokens) + 1  # the prompt's, then the one generated token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts it
        assert lp["tokens"][:len(tokens)] == [target.decode([t]) for t in tokens]


@pytest.mark.slow
def test_lm_eval_generate_until_requests(srv):
    target = srv.target
    context_enc = target.encode(PROMPT)
    until = ["\n\n", "QUEEN"]
    reply = post(srv, generate_payload("default", context_enc, until, max_gen_toks=12))
    assert reply.status_code == 200, reply.text
    [text] = parse_generations(reply.json())
    full = target.decode(greedy_ids(target, context_enc, 12))
    cut = min([i for i in (full.find(s) for s in until) if i >= 0], default=len(full))
    assert text == full[:cut]


@pytest.mark.slow
def test_echo_with_and_without_generation(srv):
    target = srv.target
    ids = target.encode(PROMPT)
    reply = post(srv, {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 2})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    choice, lp = body["choices"][0], body["choices"][0]["logprobs"]
    assert choice["text"] == target.decode(ids) and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert body["token_ids"] == [] and body["verification"]["tokens"] == 0
    assert lp["token_roles"] == ["prompt"] * len(ids)
    assert lp["behaviour_logprobs"] == [None] * len(ids)  # not sampled: no behaviour law
    assert lp["raw_logprobs"] == lp["token_logprobs"]
    assert lp["sum_logprob"] == 0 and lp["log_importance_weight"] == 0  # the sums cover sampled tokens
    rows = direct_logprobs(target, ids)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(float(rows[i - 1, ids[i]]), abs=TOL)
        assert len(lp["top_logprobs"][i]) == 2
        assert max(lp["top_logprobs"][i].values()) == pytest.approx(float(rows[i - 1].max()), abs=TOL)
    text_only = post(srv, {"prompt": PROMPT, "echo": True, "max_tokens": 0}).json()["choices"][0]
    assert text_only["text"] == target.decode(ids) and text_only["logprobs"] is None
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets

    # with generation (a lossy rule, 3 tokens): the prompt's entries, then exactly the non-echo response's
    request = {"prompt": PROMPT, "max_tokens": 3, "logprobs": 1, "seed": 7, "temperature": 1,
               "verification": {"rule": LOSSY, "k": 2}}
    plain = post(srv, request).json()
    echoed = post(srv, {**request, "echo": True}).json()
    assert echoed["choices"][0]["text"] == target.decode(ids) + plain["choices"][0]["text"]
    a, b = plain["choices"][0]["logprobs"], echoed["choices"][0]["logprobs"]
    n = len(ids)
    assert b["token_roles"][:n] == ["prompt"] * n and b["token_roles"][n:] == a["token_roles"]
    assert b["tokens"][n:] == a["tokens"] and b["behaviour_logprobs"][n:] == a["behaviour_logprobs"]
    assert b["token_logprobs"][n:] == a["token_logprobs"] and b["top_logprobs"][n:] == a["top_logprobs"]
    assert b["sum_logprob"] == a["sum_logprob"] and b["log_importance_weight"] == a["log_importance_weight"]
    assert b["text_offset"][n] == len("".join(b["tokens"][:n]))

    # streamed: the prompt's text comes first; each chunk carries the entries of the tokens it completes
    # (the prompt's in the first that carries any), and they join into the whole response's
    with srv.http.stream("POST", srv.url + "/v1/completions", json={**request, "echo": True,
                                                                    "stream": True}) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks[0]["choices"][0]["text"] == target.decode(ids)
    assert "".join(c["choices"][0]["text"] for c in chunks) == echoed["choices"][0]["text"]
    carried = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset", "token_roles",
                "behaviour_logprobs"):
        assert [v for lp in carried for v in lp[key]] == b[key], key
    assert carried[-1]["sum_logprob"] == b["sum_logprob"]  # the sums, of every token, in the last
    assert all("sum_logprob" not in lp for lp in carried[:-1])
    only_prompt = {"prompt": PROMPT, "echo": True, "max_tokens": 0, "stream": True}
    with srv.http.stream("POST", srv.url + "/v1/completions", json=only_prompt) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert [c["choices"][0]["text"] for c in chunks] == [target.decode(ids), ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "echo": 1}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
])
def test_echo_refusals(srv, path, body, param):
    reply = post(srv, body, path)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


@pytest.mark.slow
def test_server_log_ratio_equals_the_library(srv):
    """The Monte Carlo check of tests/test_importance_default_pair.py runs on the library's rollouts; the
    server returns the same log_ratio (and importance weight, and top tokens of each behaviour law) for
    the same prompt, rule and seed, to
    float32 rounding of batched vs batch-1 forward passes (~1e-5 per token; 3 tokens here)."""
    server = srv.app.state.server
    ids = server.target.encode(PROMPT)
    seeds = [0, 1, 2]
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    gens = decode_prompts(server.target, [ids] * len(seeds), generators,
                          DecodeConfig(k=2, max_new_tokens=3, keep_probs=True),
                          drafter=copy.copy(server.drafter), rule=parse(LOSSY))
    for seed, gen in zip(seeds, gens):
        body = post(srv, {"prompt": PROMPT, "max_tokens": 3, "seed": seed, "logprobs": 3,
                          "verification": {"rule": LOSSY, "k": 2}}).json()
        # the top tokens of each token's behaviour law (emitted(p, q) / bonus law), the library's
        laws = behaviour_rows(gen, gen.num_tokens)  # [tokens, V]
        for row, top in zip(laws, body["choices"][0]["logprobs"]["top_behaviour_logprobs"]):
            values = sorted(top.values(), reverse=True)
            assert values == pytest.approx(row.topk(3).values.log().tolist(), abs=1e-4)
        assert body["token_ids"] == list(gen.token_ids)
        assert body["verification"]["log_ratio"] == pytest.approx(gen.log_ratio, abs=1e-4)
        lp = body["choices"][0]["logprobs"]
        assert lp["log_importance_weight"] == pytest.approx(-gen.log_ratio, abs=1e-4)
        assert lp["behaviour_logprobs"] == pytest.approx(gen.steps["log_law"], abs=1e-4)


@pytest.mark.slow
def test_lm_eval_batches_of_four_equal_their_requests_one_at_a_time(srv):
    """lm-eval's local-completions with batch_size 4: one request carries four tokenized prompts (echo,
    max_tokens 1); parsed as lm-eval parses it, each log-likelihood equals its prompt sent alone, and a
    batched generation request gives each prompt's own generation."""
    target = srv.target
    pairs = [encode_pair(target.encode, PROMPT, c) for c in (" Madam", " my lord", " I pray", " Good night")]
    batch = [c + k for c, k in pairs]
    payload = {**loglikelihood_payload("default", batch[0]), "prompt": batch}
    reply = post(srv, payload)
    assert reply.status_code == 200, reply.text
    together = parse_logprobs(reply.json(), [len(c) for c, _ in pairs])
    alone = [parse_logprobs(post(srv, loglikelihood_payload("default", t)).json(), [len(c)])[0]
             for t, (c, _) in zip(batch, pairs)]
    assert together == alone
    gen = {**generate_payload("default", batch[0], ["\n\n"], 6), "prompt": batch}
    texts = parse_generations(post(srv, gen).json())
    assert texts == [parse_generations(post(srv, generate_payload("default", t, ["\n\n"], 6)).json())[0]
                     for t in batch]
