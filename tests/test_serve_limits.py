"""`verispec serve`'s bounded inputs: a body over --max-body-bytes gets 413 (at once when its
Content-Length says so, after the limit when it is sent in chunks) without holding up /health; a body
that never finishes gets 408 after --body-timeout and its connection is closed; a large prompt is
tokenized off the event loop; /tokenize refuses `prompt` and `messages` together. Loopback only; every
wait is bounded."""

from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_serve import Running  # noqa: E402

from verispec.serving.config import ServeConfig  # noqa: E402


@pytest.fixture(scope="module")
def limited():
    running = Running(ServeConfig(target="default", draft="default-draft", max_batch=4, max_queue=8,
                                  default_max_tokens=4, max_body_bytes=4 * 2**20, body_timeout=2.0))
    yield running
    running.close()


def _health_seconds(url: str) -> float:
    started = time.monotonic()
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    return time.monotonic() - started


@pytest.mark.slow
def test_a_50_mb_body_gets_413_at_once_without_delaying_health(limited):
    body = b'{"prompt": "' + b"a" * (50 * 2**20) + b'"}'
    slowest, done = [], threading.Event()

    def watch() -> None:
        while not done.is_set():
            slowest.append(_health_seconds(limited.url))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        started = time.monotonic()
        with httpx.Client(timeout=30) as client:
            resp = client.post(limited.url + "/v1/completions", content=body,
                               headers={"content-type": "application/json"})
        took = time.monotonic() - started
    finally:
        done.set()
        watcher.join()
    assert resp.status_code == 413 and "--max-body-bytes" in resp.json()["error"]["message"], resp.text[:300]
    assert took < 10  # refused from the header: the body is not read
    assert slowest and max(slowest) < 2.0, max(slowest)  # before the limit: 43 s for a 50 MB prompt


def test_a_chunked_body_past_the_limit_gets_413(limited):
    def chunks():
        for _ in range(8):
            yield b"a" * 2**20

    with httpx.Client(timeout=30) as client:
        resp = client.post(limited.url + "/v1/completions", content=chunks(),
                           headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large", resp.text[:300]


@pytest.mark.slow
def test_a_body_that_never_finishes_gets_408_and_its_connection_closes(limited):
    with socket.create_connection(("127.0.0.1", limited.port), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        started = time.monotonic()
        data = b""
        while True:
            part = conn.recv(65536)
            if not part:
                break
            data += part
        took = time.monotonic() - started
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert 1.5 < took < 8, took  # --body-timeout 2 s, then the server closes the connection


@pytest.mark.slow
def test_a_large_prompt_is_tokenized_off_the_event_loop(limited, monkeypatch):
    """A 3 MB prompt (under the body limit; the length check that would refuse it for this small
    context is switched off here) takes the tokenizer a while; /health answers meanwhile."""
    monkeypatch.setattr(limited.app.state.server, "max_prompt_chars", None)
    prompt = "KING RICHARD: " + "my lord, " * 330_000
    result = {}

    def post() -> None:
        with httpx.Client(timeout=120) as client:
            result["resp"] = client.post(limited.url + "/tokenize", json={"prompt": prompt})

    poster = threading.Thread(target=post)
    started = time.monotonic()
    poster.start()
    times = []
    while poster.is_alive() and len(times) < 200:
        times.append(_health_seconds(limited.url))
        time.sleep(0.02)
    poster.join(120)
    took = time.monotonic() - started
    assert result["resp"].status_code == 200 and result["resp"].json()["count"] > 100_000
    # on the event loop, /health would wait for the whole tokenization (1.8 s alone here, longer under
    # load); off it, well under half of the request's time whatever the machine's load
    assert times and max(times) < 0.5 * took, (max(times), took)


def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing(limited):
    """No token of the default pair is longer than 29 characters, so a 60,000-character prompt cannot fit
    its 2,048-token context: refused from its length, not after tokenizing it."""
    server = limited.app.state.server
    assert server.context == 2048 and server.max_prompt_chars == 2048 * 29
    for path, body in (("/v1/completions", {"prompt": "a" * 60_000}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 60_000}]}),
                       ("/tokenize", {"prompt": "a" * 60_000})):
        resp = httpx.post(limited.url + path, json=body, timeout=30)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "context_length_exceeded", resp.text
    fits = httpx.post(limited.url + "/tokenize", json={"prompt": "a" * 50_000}, timeout=30)
    assert fits.status_code == 200  # under the bound: tokenized (its tokens decide)


def test_tokenize_refuses_prompt_and_messages_together(limited):
    resp = httpx.post(limited.url + "/tokenize", timeout=10,
                      json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text


def test_bad_limits_are_refused():
    for bad in ({"max_body_bytes": 0}, {"max_body_bytes": 1.5}, {"body_timeout": 0},
                {"body_timeout": float("inf")}, {"body_timeout": True}):
        with pytest.raises(ValueError, match="--max-body-bytes|--body-timeout"):
            ServeConfig(target="default", draft="default-draft", **bad)


def test_a_max_batch_the_backend_cannot_hold_is_refused_at_start():
    """The llama.cpp backend's batched KV sessions hold `max_rows` rows: a larger --max-batch would
    answer 500 to the row past them; it is refused when the server starts instead."""
    from verispec.models import load_model
    from verispec.serving.app import Server

    model = load_model("default")
    model.max_rows = 8  # as LlamaCppModel's default
    try:
        with pytest.raises(ValueError, match=r"--max-batch 32 is more rows than the target model's batched "
                                             r"sessions hold \(8"):
            Server(ServeConfig(target="default", draft=None), target=model)
        assert Server(ServeConfig(target="default", draft=None, max_batch=8), target=model).engine  # starts
        auto = Server(ServeConfig(target="default", draft=None, max_batch_auto=True), target=model)
        assert auto.config.max_batch == 8  # --max-batch not given: lowered to what the backend holds
    finally:
        del model.max_rows
