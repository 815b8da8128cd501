"""`verispec serve` behind a gateway: an API key (401 in OpenAI's shape without it, /health open, the
openai client's own header accepted), CORS for the allowed origins (a browser's preflight answered), a
request id echoed (the client's or a new one), `max_model_len` in /v1/models, and chat content given as
OpenAI's list of text parts. Loopback only."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from test_serve import Running  # noqa: E402

from verispec.serving.config import ServeConfig  # noqa: E402

KEY = "sk-test-0123"


@pytest.fixture(scope="module")
def gated():
    running = Running(ServeConfig(target="default", draft="default-draft", max_batch=4, max_queue=8,
                                  default_max_tokens=4, api_key=KEY,
                                  allowed_origins=("https://app.example",)))
    yield running
    running.close()


def test_the_api_key_is_required_but_for_health(gated):
    assert httpx.get(gated.url + "/health", timeout=10).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        resp = httpx.post(gated.url + "/v1/completions", json={"prompt": "KING", "max_tokens": 2},
                          headers=headers, timeout=30)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", resp.text
    assert httpx.get(gated.url + "/v1/models", timeout=10).status_code == 401
    client = openai.OpenAI(base_url=gated.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    out = client.completions.create(model="default", prompt="KING", max_tokens=3, seed=1)
    assert out.choices[0].text is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gated.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_cors_preflight_and_headers_for_allowed_origins_only(gated):
    preflight = httpx.options(gated.url + "/v1/completions", timeout=10, headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(gated.url + "/v1/completions", timeout=10, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert other.headers.get("access-control-allow-origin") != "https://evil.example"


def test_a_request_id_is_echoed_or_made(gated):
    auth = {"Authorization": f"Bearer {KEY}"}
    mine = httpx.get(gated.url + "/v1/models", headers={**auth, "X-Request-Id": "abc-123"}, timeout=10)
    assert mine.headers["x-request-id"] == "abc-123"
    made = httpx.get(gated.url + "/v1/models", headers=auth, timeout=10)
    assert len(made.headers["x-request-id"]) == 16
    assert httpx.get(gated.url + "/health", timeout=10).headers["x-request-id"]
    models = made.json()["data"][0]
    assert models["max_model_len"] == 2048


def test_chat_content_as_a_list_of_text_parts(gated):
    auth = {"Authorization": f"Bearer {KEY}"}
    parts = [{"role": "user", "content": [{"type": "text", "text": "KING "},
                                          {"type": "text", "text": "LEAR"}]}]
    plain = [{"role": "user", "content": "KING LEAR"}]
    tokens = [httpx.post(gated.url + "/tokenize", json={"messages": m}, headers=auth,
                         timeout=30).json()["tokens"] for m in (parts, plain)]
    assert tokens[0] == tokens[1]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    resp = httpx.post(gated.url + "/v1/chat/completions", json={"messages": image, "max_tokens": 2},
                      headers=auth, timeout=30)
    assert resp.status_code == 400 and "text parts" in resp.json()["error"]["message"], resp.text


def test_a_blank_api_key_is_refused():
    with pytest.raises(ValueError, match="--api-key"):
        ServeConfig(target="default", draft="default-draft", api_key="  ")


def test_logprobs_are_numbers_at_temperature_0(gated):
    """At temperature 0 the processed law rules every token but one out: their log-probabilities (the
    processed and behaviour ones verispec adds) are vLLM's -9999.0, numbers a typed client accepts,
    never the string "-inf"; token_logprobs are the raw model's (vLLM's default logprobs_mode)."""
    body = {"prompt": "KING", "max_tokens": 3, "temperature": 0, "logprobs": 3}
    resp = httpx.post(gated.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60)
    lp = resp.json()["choices"][0]["logprobs"]
    values = [v for top in lp["top_logprobs"] + lp["top_behaviour_logprobs"] for v in top.values()]
    values += lp["token_logprobs"] + lp["processed_logprobs"]
    assert all(isinstance(v, float) for v in values), values
    assert -9999.0 in values and lp["processed_logprobs"] == [0.0] * 3 and max(lp["token_logprobs"]) < 0
    client = openai.OpenAI(base_url=gated.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    chat = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "KING"}],
                                          max_tokens=2, temperature=0, logprobs=True, top_logprobs=2)
    assert all(isinstance(t.logprob, float) for c in chat.choices[0].logprobs.content for t in c.top_logprobs)


@pytest.mark.slow  # decodes the default model's whole context
def test_vllms_default_max_tokens_and_more_stop_strings():
    """A request without max_tokens decodes to the context left after its prompt (vLLM's default, within
    --max-tokens-limit); up to 64 stop strings are accepted (OpenAI's 4 is not a limit vLLM keeps)."""
    running = Running(ServeConfig(target="default", draft="default-draft", max_tokens_limit=4096))
    try:
        models = httpx.get(running.url + "/v1/models", timeout=10).json()["data"][0]
        context = models["max_model_len"]
        out = httpx.post(running.url + "/v1/completions", json={"prompt": "KING RICHARD:", "seed": 3},
                         timeout=300).json()
        usage, finish = out["usage"], out["choices"][0]["finish_reason"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] <= context
        assert finish == "stop" or usage["prompt_tokens"] + usage["completion_tokens"] == context, usage
        stops = [f"zz{i}" for i in range(64)]
        ok = httpx.post(running.url + "/v1/completions", json={"prompt": "KING", "max_tokens": 2,
                                                               "stop": stops}, timeout=60)
        assert ok.status_code == 200, ok.text
        refused = httpx.post(running.url + "/v1/completions", json={"prompt": "KING", "max_tokens": 2,
                                                                    "stop": stops + ["one more"]}, timeout=60)
        assert refused.status_code == 400 and "up to 64" in refused.json()["error"]["message"]
    finally:
        running.close()


def test_a_list_of_prompts_gets_each_prompts_choices_in_order(gated):
    """lm-evaluation-harness with batch_size > 1 sends several prompts in one request: the choices come in
    prompt order, n per prompt, each the one its prompt alone gives with the same seed."""
    headers = {"Authorization": f"Bearer {KEY}"}
    prompts = ["KING RICHARD:", "ROMEO:", "First Citizen:"]
    body = {"prompt": prompts, "max_tokens": 3, "seed": 5, "n": 2}
    out = httpx.post(gated.url + "/v1/completions", json=body, headers=headers, timeout=120).json()
    assert [c["index"] for c in out["choices"]] == list(range(6))
    for p, prompt in enumerate(prompts):
        alone = httpx.post(gated.url + "/v1/completions", json={**body, "prompt": prompt}, headers=headers,
                           timeout=120).json()
        for j in range(2):
            assert out["choices"][2 * p + j]["token_ids"] == alone["choices"][j]["token_ids"]
            assert out["choices"][2 * p + j]["text"] == alone["choices"][j]["text"]
    assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in out["choices"])
    ids = httpx.post(gated.url + "/tokenize", json={"prompt": "ROMEO:"}, headers=headers, timeout=30).json()
    by_ids = httpx.post(gated.url + "/v1/completions", json={**body, "n": 1, "prompt": [ids["tokens"]] * 2},
                        headers=headers, timeout=120).json()
    assert len(by_ids["choices"]) == 2  # token-id lists too
    refused = httpx.post(gated.url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                         timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"


def test_vllm_metric_names_for_existing_dashboards():
    """--metrics-names vllm: vLLM's spec-decode counter names, with model_name on every request metric,
    so a dashboard query written for vLLM reads this server."""
    running = Running(ServeConfig(target="default", draft="default-draft", default_max_tokens=4,
                                  metrics_names="vllm"))
    try:
        out = httpx.post(running.url + "/v1/completions", json={"prompt": "KING", "seed": 1}, timeout=60)
        assert out.status_code == 200
        text = httpx.get(running.url + "/metrics", timeout=10).text
        for name in ("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total",
                     "vllm:spec_decode_num_draft_tokens_total", "vllm:generation_tokens_total"):
            assert f'{name}{{model_name="default"' in text, name
        assert 'vllm:e2e_request_latency_seconds_count{model_name="default"}' in text
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):  # vLLM's dashboard panels
            assert f'{gauge}{{model_name="default"}}' in text, gauge
        assert "verispec:" not in text
        # the dashboard's draft acceptance rate: accepted / draft tokens, summed over the model's series
        from prometheus_client.parser import text_string_to_metric_families

        sums = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("model_name") == "default":
                    sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
        ver = out.json()["verification"]
        assert sums["vllm:spec_decode_num_accepted_tokens_total"] == ver["accepted_tokens"]
        assert sums["vllm:spec_decode_num_draft_tokens_total"] == ver["drafted_tokens"] > 0
    finally:
        running.close()
    with pytest.raises(ValueError, match="--metrics-names"):
        ServeConfig(metrics_names="prom")


def test_health_says_warming_up_until_the_engine_is_warm(monkeypatch):
    """Readiness: /health is 503 `warming_up` while the engine runs its warm-up (a request sent then waits
    in the queue and is answered after it), 200 after; /live is 200 throughout (liveness)."""
    import threading

    from verispec.serving.engine import Engine

    gate, real = threading.Event(), Engine._warm_up
    monkeypatch.setattr(Engine, "_warm_up", lambda self: (gate.wait(60), real(self)))
    running = Running(ServeConfig(target="default", draft="default-draft", default_max_tokens=2),
                      wait_ready=False)
    try:
        health = httpx.get(running.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "warming_up"
        assert httpx.get(running.url + "/live", timeout=10).status_code == 200
        with httpx.Client(timeout=60) as client:
            waiting = threading.Thread(target=lambda: setattr(
                running, "reply", client.post(running.url + "/v1/completions", json={"prompt": "KING"})))
            waiting.start()
            time.sleep(0.5)
            assert waiting.is_alive()  # queued behind the warm-up
            gate.set()
            waiting.join(60)
        assert running.reply.status_code == 200
        assert httpx.get(running.url + "/health", timeout=10).json()["status"] == "ok"
    finally:
        gate.set()
        running.close()
