"""`verispec serve` under hostile input and faults (issue 26): every malformed body gets a 4xx in OpenAI's
error shape; admission counts free batch rows; `/health` answers 503 once the engine thread is dead;
an engine exception, a client that stalls reading a stream, and SIGTERM under load (a real
`python -m verispec serve` subprocess) each end with every request answered or cleanly cut, and
nothing left running. Loopback only; every wait is bounded in count and time."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_serve import PROMPT, Running, free_port  # noqa: E402

from verispec.decode import BatchDecoder  # noqa: E402
from verispec.serving.config import ServeConfig  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def small():
    """4 batch rows, 8 queue places, short responses by default."""
    running = Running(ServeConfig(target="default", draft="default-draft", max_batch=4, max_queue=8,
                                  default_max_tokens=4, max_tokens_limit=1000))
    yield running
    running.close()
    assert running.app.state.server.engine.running == 0


def openai_error(resp: httpx.Response) -> dict:
    """The error object of an OpenAI-shaped error response (asserts the shape)."""
    assert resp.headers["content-type"].startswith("application/json"), resp.text[:200]
    err = resp.json()["error"]
    assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"], err
    return err


DEEP = 100_000
MALFORMED = [  # (endpoint, raw body, param of the error)
    ("completions", b"[" * DEEP + b"]" * DEEP, None),  # JSON nested 100,000 deep
    ("completions", b'{"prompt": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}", None),
    ("completions", b'{"prompt": "x", "user": ' + b"[" * 40 + b"]" * 40 + b"}", "user"),  # past 32 levels
    ("completions", b'{"prompt": "KING\\ud800"}', "prompt"),  # a lone surrogate: valid JSON, not text
    ("completions", b'{"prompt": "KING", "stop": ["\\udfff"]}', "stop"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "KING\\ud800"}]}', "messages"),
    ("completions", b'{"prompt": "x", "\\ud800": 1}', None),
    ("completions", b'{"prompt": "\xff\xfe"}', None),  # not UTF-8
    ("completions", b"", None),
    ("completions", b"null", None),
    ("completions", b'"prompt"', None),
    ("completions", b'{"prompt": "x", "temperature": Infinity}', "temperature"),
    ("completions", json.dumps({"prompt": 5}).encode(), "prompt"),
    ("completions", json.dumps({"prompt": {"text": "x"}}).encode(), "prompt"),
    ("completions", json.dumps({"prompt": [[1, 2], "a"]}).encode(), "prompt"),  # prompts of two kinds
    ("completions", json.dumps({"prompt": [1, -1]}).encode(), "prompt"),
    ("completions", json.dumps({"prompt": [2**70]}).encode(), "prompt"),
    ("completions", json.dumps({"prompt": [True, False]}).encode(), "prompt"),
    ("chat/completions", json.dumps({"messages": "hi"}).encode(), "messages"),
    ("chat/completions", json.dumps({"messages": [{"role": 1, "content": "x"}]}).encode(), "messages"),
    ("chat/completions", json.dumps({"messages": [["user", "x"]]}).encode(), "messages"),
    ("completions", json.dumps({"prompt": "x", "max_tokens": 1.5}).encode(), "max_tokens"),
    ("completions", json.dumps({"prompt": "x", "max_tokens": True}).encode(), "max_tokens"),
    ("completions", json.dumps({"prompt": "x", "temperature": "hot"}).encode(), "temperature"),
    ("completions", json.dumps({"prompt": "x", "top_p": []}).encode(), "top_p"),
    ("completions", json.dumps({"prompt": "x", "top_k": 2.5}).encode(), "top_k"),
    ("completions", json.dumps({"prompt": "x", "seed": 1.0}).encode(), "seed"),
    ("completions", json.dumps({"prompt": "x", "seed": 2**64}).encode(), "seed"),
    ("completions", json.dumps({"prompt": "x", "stop": 5}).encode(), "stop"),
    ("completions", json.dumps({"prompt": "x", "stream": "yes"}).encode(), "stream"),
    ("completions", json.dumps({"prompt": "x", "n": True}).encode(), "n"),  # was taken as n = 1
    ("completions", json.dumps({"prompt": "x", "n": 1.0}).encode(), "n"),
    ("completions", json.dumps({"prompt": "x", "n": 0}).encode(), "n"),
    ("completions", json.dumps({"prompt": "x", "verification": {"k": "4"}}).encode(), "k"),
    ("completions", json.dumps({"prompt": "x", "verification": {"rule": 5}}).encode(), "verification.rule"),
    ("completions", json.dumps({"prompt": "x", "verification": {"rule": "honest:" * 1000 + "lossless"}}
                               ).encode(), "verification.rule"),  # a rule spec nested 1,000 deep
    ("completions", json.dumps({"prompt": "x", "verification": {"rule": "(" * 5000}}).encode(),
     "verification.rule"),
]


@pytest.mark.slow
def test_every_malformed_body_gets_a_4xx_in_openai_shape(small):
    with httpx.Client(timeout=60) as client:
        for endpoint, raw, param in MALFORMED:
            resp = client.post(f"{small.url}/v1/{endpoint}", content=raw,
                               headers={"content-type": "application/json"})
            assert 400 <= resp.status_code < 500, (raw[:80], resp.status_code, resp.text[:300])
            err = openai_error(resp)
            assert err["type"] == "invalid_request_error", err
            if param is not None:
                assert err["param"] == param, (raw[:80], err)
        assert client.get(small.url + "/health").status_code == 200
        ok = client.post(small.url + "/v1/completions", json={"prompt": PROMPT, "seed": 1})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


@pytest.mark.slow
def test_admission_counts_free_rows(small):
    """An idle server with 4 batch rows and 8 queue places takes 12 simultaneous requests (the free rows
    fill only between blocks: the queue alone would have refused 4 of them); with 12 long streams in, a
    13th request is refused with 503 queue_full."""
    small.wait_until(lambda h: h["running"] == 0 and h["waiting"] == 0)
    barrier = threading.Barrier(12)

    def send(i):
        with httpx.Client(timeout=120) as client:
            barrier.wait(30)
            return client.post(small.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3,
                                                                     "seed": i, "ignore_eos": True})

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(send, range(12), timeout=180))
    assert [r.status_code for r in answers] == [200] * 12, [r.text[:200] for r in answers]
    # 12 long streams fill every place; one more is refused at once; closing them frees everything
    clients = [open_stream(small.port, {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "seed": i})
               for i in range(12)]
    try:
        small.wait_until(lambda h: h["running"] + h["waiting"] == 12, seconds=60)
        extra = httpx.post(small.url + "/v1/completions", json={"prompt": PROMPT}, timeout=30)
        assert extra.status_code == 503 and openai_error(extra)["code"] == "queue_full"
    finally:
        for sock in clients:
            sock.close()
    small.wait_until(lambda h: h["running"] == 0 and h["waiting"] == 0)


def open_stream(port: int, body: dict) -> socket.socket:
    """A raw client that sends a streaming request and reads only the status line."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    raw = json.dumps({**body, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    assert sock.recv(15).startswith(b"HTTP/1.1 200")
    return sock


@pytest.mark.slow
def test_max_queue_zero_serves_up_to_the_batch_rows():
    """--max-queue 0 no longer refuses everything: requests up to the free rows are admitted."""
    srv = Running(ServeConfig(target="default", draft="default-draft", max_batch=2,
                              max_queue=0, default_max_tokens=64))
    try:
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda i: httpx.post(srv.url + "/v1/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": 3, "seed": i}), range(2)))
        assert [r.status_code for r in answers] == [200, 200]
    finally:
        srv.close()


@pytest.mark.slow
def test_a_stalled_stream_reader_blocks_no_one_and_is_cut_cleanly(small):
    """A client reads the headers of a long stream, then stops reading: the other requests are served
    meanwhile; when it goes away, its row is freed and nothing is left running."""
    sock = open_stream(small.port, {"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True})  # then it stalls
    try:
        started = time.monotonic()
        others = [httpx.post(small.url + "/v1/completions", json={"prompt": PROMPT, "seed": i}, timeout=60)
                  for i in range(3)]
        assert [r.status_code for r in others] == [200] * 3 and time.monotonic() - started < 60
    finally:
        sock.close()
    state = small.wait_until(lambda h: h["running"] == 0 and h["waiting"] == 0, seconds=60)
    assert state["status"] == "ok"


@pytest.mark.slow
def test_an_engine_exception_fails_its_requests_and_health_says_503(monkeypatch):
    """Fault injection, twice. (1) A decoding block raises: its group's requests get a 500 in OpenAI's
    shape (a stream: a final error chunk) and the server goes on. (2) The engine thread itself dies:
    every request it held is answered, `/health` answers 503, new requests get 503 engine_failed."""
    srv = Running(ServeConfig(target="default", draft="default-draft", max_batch=4,
                              max_queue=4, default_max_tokens=64))
    real = BatchDecoder.step
    try:
        def failing_block(self):
            raise RuntimeError("block failed on purpose")

        monkeypatch.setattr(BatchDecoder, "step", failing_block)
        resp = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8}, timeout=60)
        assert resp.status_code == 500 and "block failed on purpose" in openai_error(resp)["message"]
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 8, "stream": True}) as streamed:
            events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
        assert "block failed on purpose" in json.loads(events[-1])["error"]["message"]
        monkeypatch.setattr(BatchDecoder, "step", real)
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3},
                          timeout=60).status_code == 200

        class EngineCrash(BaseException):  # not an Exception: escapes the per-block handler
            pass

        def crash(self):
            raise EngineCrash("the engine thread dies")

        monkeypatch.setattr(BatchDecoder, "step", crash)
        with ThreadPoolExecutor(3) as pool:
            held = [pool.submit(httpx.post, srv.url + "/v1/completions", timeout=60,
                                json={"prompt": PROMPT, "max_tokens": 8, "seed": i}) for i in range(3)]
            answers = [f.result(timeout=90) for f in held]
        assert all(r.status_code in (500, 503) for r in answers), [r.text for r in answers]
        assert {openai_error(r)["code"] for r in answers} <= {"engine_failed"}
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "engine_failed"
        after = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT}, timeout=30)
        assert after.status_code == 503 and openai_error(after)["code"] == "engine_failed"
    finally:
        monkeypatch.setattr(BatchDecoder, "step", real)
        srv.close()


def env() -> dict:
    out = os.environ.copy()
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), out.get("PYTHONPATH")) if p)
    out["OMP_NUM_THREADS"] = "1"
    return out


def read_stream(url: str, body: dict) -> tuple[int, list[str]]:
    with httpx.stream("POST", url, json=body, timeout=120) as resp:
        return resp.status_code, [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


@pytest.mark.slow
def test_sigterm_under_load_answers_every_request_and_exits():
    """`verispec serve` in a subprocess, 2 rows decoding long responses (streams and not) and 6 waiting;
    SIGTERM: the 6 waiting get 503 shutting_down at once, the 2 decoding ones after the 1 s grace (a
    stream: a final error chunk, no [DONE]), and the process ends within seconds with no traceback."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "verispec", "serve", "--port", str(port), "--max-batch",
                             "2", "--max-queue", "6", "--shutdown-grace", "1", "--log-level", "warning"],
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        long = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}
        with ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(read_stream, url + "/v1/completions", {**long, "stream": True, "seed": i})
                       for i in range(4)]
            plain = [pool.submit(httpx.post, url + "/v1/completions", json={**long, "seed": i}, timeout=120)
                     for i in range(4)]
            deadline = time.monotonic() + 60
            while True:
                state = httpx.get(url + "/health", timeout=5).json()
                if state["running"] == 2 and state["waiting"] == 6:
                    break
                assert time.monotonic() < deadline, state
                time.sleep(0.05)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            stream_results = [f.result(timeout=60) for f in streams]
            plain_results = [f.result(timeout=60) for f in plain]
            answered = time.monotonic() - signalled
        _, stderr = proc.communicate(timeout=30)
        exited = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    for resp in plain_results:
        assert resp.status_code == 503 and openai_error(resp)["code"] == "shutting_down", resp.text[:300]
    for status, events in stream_results:
        # decoding or waiting, a stream ends with one final error chunk (none finished 1000 tokens)
        assert status == 200 and events and "[DONE]" not in events
        assert json.loads(events[-1])["error"]["code"] == "shutting_down"
    # uvicorn re-raises the signal it caught once its shutdown is done: the status says "ended by SIGTERM"
    assert answered < 15 and exited < 20 and proc.returncode == -signal.SIGTERM, (answered, exited,
                                                                                  proc.returncode)
    assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr[-3000:]
