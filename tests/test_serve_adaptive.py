"""`verispec serve --k auto`: the pair's pass costs measured at start (before /health says ready), each
request's k chosen per block from them and its own acceptance at the batch's size (0 = plain decoding),
a request's own verification.k pinning its k, and the settings refused that cannot apply. At temperature
0 an adaptive lossless request is the target's greedy decoding token for token (k changes how many
tokens are drafted, never the law)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_serve import Running  # noqa: E402

from verispec.serving.config import ServeConfig  # noqa: E402

PROMPT = "KING.\nWhat says the queen?\n"


def test_k_auto_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="--draft none"):
        ServeConfig(target="default", draft="none", k="auto")
    with pytest.raises(ValueError, match="--tree"):
        ServeConfig(target="default", draft="default-draft", k="auto", tree="tree:widths=2,2",
                    rule="traversal")
    with pytest.raises(ValueError, match="or auto"):
        ServeConfig(target="default", draft="default-draft", k="sometimes")


@pytest.mark.slow
def test_a_k_auto_server_adapts_unpinned_requests_and_keeps_pinned_ones():
    import verispec

    running = Running(ServeConfig(target="default", draft="default-draft", k="auto", max_batch=8))
    try:
        assert running.app.state.server.engine.policy is not None  # measured during the warm-up
        body = {"prompt": PROMPT, "max_tokens": 40, "seed": 3, "temperature": 0}
        adaptive = httpx.post(running.url + "/v1/completions", json=body, timeout=120).json()
        spec = adaptive["verification"]["speculation"]
        assert spec["policy"] == "adaptive"
        assert len(spec["k_per_block"]) == adaptive["verification"]["target_calls"]  # one k per block
        assert all(0 <= k <= spec["k_max"] for k in spec["k_per_block"]) and spec["costs"]["1"]["c"] > 0
        greedy = verispec.generate(PROMPT, target="default", draft=None, max_new_tokens=40, temperature=0,
                                   chat=False)
        assert adaptive["token_ids"] == list(greedy.token_ids)  # lossless at T = 0: the target's greedy
        pinned = httpx.post(running.url + "/v1/completions", timeout=120,
                            json={**body, "verification": {"k": 3}}).json()
        assert pinned["verification"]["speculation"] is None and pinned["token_ids"] == adaptive["token_ids"]
        auto = httpx.post(running.url + "/v1/completions", timeout=120,
                          json={**body, "verification": {"k": "auto"}}).json()
        assert auto["verification"]["speculation"]["policy"] == "adaptive"
    finally:
        running.close()


@pytest.mark.slow
def test_a_long_prompt_is_fed_in_chunks_beside_short_requests_and_stops_when_its_client_leaves():
    """--prefill-chunk 2: a 1,500-token prompt takes hundreds of engine steps to feed; short requests sent
    after it finish meanwhile (each step also runs their blocks), and when its client leaves, the row is
    cancelled at the next chunk, long before its prompt would be in. --max-prompt-tokens refuses longer
    prompts with 400."""
    import threading
    import time

    from test_serve import cancelled_count

    running = Running(ServeConfig(target="default", draft="default-draft", prefill_chunk=2,
                                  max_prompt_tokens=1600))
    try:
        target = running.app.state.server.target
        ids = target.encode("ROMEO.\n" + "But soft, what light through yonder window breaks? " * 120)[:1500]
        long_body = {"prompt": ids, "max_tokens": 4, "seed": 1}
        engine = running.app.state.server.engine
        seen_prefilling = []

        def watch(stop):
            while not stop.is_set():
                for dec in list(engine._groups.values()):
                    if any(dec.prefilling(row) for row in dec.active):
                        seen_prefilling.append(time.monotonic())
                time.sleep(0.005)

        stop = threading.Event()
        watcher = threading.Thread(target=watch, args=(stop,))
        watcher.start()
        before = cancelled_count(running)
        gave_up = []

        def long_request():  # the client gives up while its prompt is still being fed
            try:
                httpx.post(running.url + "/v1/completions", json=long_body, timeout=2.0)
            except httpx.TimeoutException:
                gave_up.append(True)

        client = threading.Thread(target=long_request)
        try:
            client.start()
            time.sleep(0.3)
            short = httpx.post(running.url + "/v1/completions", timeout=60,
                               json={"prompt": PROMPT, "max_tokens": 8, "seed": 2})
            short_done = time.monotonic()
            assert short.status_code == 200 and len(short.json()["token_ids"]) == 8
            client.join()
            assert gave_up
            running.wait_until(lambda h: h["running"] == 0, seconds=10)
        finally:
            stop.set()
            watcher.join()
        # the short request finished while the long prompt was still being fed
        assert seen_prefilling and max(seen_prefilling) > short_done
        assert cancelled_count(running) == before + 1  # cancelled mid-prefill, not run to its end
        too_long = httpx.post(running.url + "/v1/completions", timeout=30,
                              json={"prompt": ids + ids[:200], "max_tokens": 4})
        assert too_long.status_code == 400
        assert "--max-prompt-tokens 1600" in too_long.json()["error"]["message"]
    finally:
        running.close()


def test_streamed_entries_wait_for_a_character_split_across_tokens():
    """`tokens_within`: with byte-level tokens, a character split over two tokens decodes to U+FFFD until
    its last byte comes; the count passes it once the text holds the whole character, and goes on after
    it (it used to stop there for the rest of the stream)."""
    from verispec.serving.engine import tokens_within

    pieces = [b"A", "中".encode()[:2], "中".encode()[2:], b"C", b"D"]

    def decode(ids):
        return b"".join(pieces[i] for i in ids).decode("utf-8", "replace")

    ids = list(range(len(pieces)))
    assert tokens_within("A", ids, 0, decode) == 1
    assert tokens_within("A中", ids, 1, decode) == 3
    assert tokens_within("A中CD", ids, 1, decode) == 5
    assert tokens_within("A中C", ids, 3, decode) == 4
