"""`verispec serve --ray`: the server as a Ray Serve deployment, on one local Ray instance this module
starts (2 CPUs, a small object store). The server runs as a real subprocess, `python -m verispec serve
--ray --replicas 2`, joining that instance; the official `openai` client gets the same responses as
`verispec.generate` for the same seed, from both replicas (the `x-verispec-replica` header), each
replica's `/metrics` is valid Prometheus text, and SIGTERM removes every Serve actor and frees the CPUs.
Errors are clear and quick: Ray missing, no cluster at the address, too few CPUs, a replica that cannot
load its model (its exception in the message). Every wait is bounded."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from test_serve import LOSSY, PROMPT, local_generate, same_report  # noqa: E402

from verispec.cli import main  # noqa: E402
from verispec.rules import parse  # noqa: E402
from verispec.serving.app import REPLICA_HEADER  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    """The subprocess imports this checkout's verispec (and Ray's workers inherit it from the raylet)."""
    out = os.environ.copy()
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), out.get("PYTHONPATH")) if p)
    out.pop("RAY_ADDRESS", None)
    return out


@pytest.fixture(scope="module")
def cluster():
    """One local Ray instance for the module; its GCS address, which the subprocesses join."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    info = ray.init(address="local", num_cpus=2, object_store_memory=150 * 1024**2, include_dashboard=False,
                    log_to_driver=False)
    yield info.address_info["gcs_address"]
    ray.shutdown()


def serve_actors() -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve"]


def free_cpus_become(n: float, seconds: float = 60) -> None:
    import ray

    deadline = time.monotonic() + seconds
    while ray.available_resources().get("CPU", 0) != n:
        assert time.monotonic() < deadline, f"CPUs not freed: {ray.available_resources()}"
        time.sleep(0.2)


# -- errors ----------------------------------------------------------------------------------------


def test_too_many_replicas_for_the_cpus_is_refused_before_deploying(cluster, capsys):
    started = time.monotonic()
    assert main(["serve", "--ray", "--replicas", "3", "--port", str(free_port())]) == 1
    err = capsys.readouterr().err
    assert "not enough CPUs for 3 replica(s) x 1 CPU(s) = 3 CPUs" in err and "of its 2 CPUs available" in err
    assert main(["serve", "--ray", "--replicas", "1", "--ray-cpus", "2.5"]) == 1
    assert "= 2.5 CPUs" in capsys.readouterr().err
    assert main(["serve", "--ray", "--replicas", "1", "--num-cpus-per-replica", "2.5"]) == 1  # old spelling
    err = capsys.readouterr().err
    assert "= 2.5 CPUs" in err and "--num-cpus-per-replica is deprecated; use --ray-cpus" in err
    assert time.monotonic() - started < 10 and serve_actors() == []  # nothing was deployed


def test_no_cluster_at_the_address_and_no_ray_are_clear_errors():
    port = free_port()  # nothing listens there
    cmd = [sys.executable, "-m", "verispec", "serve", "--ray", "--ray-address", f"127.0.0.1:{port}"]
    run = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and f"no Ray cluster at --ray-address 127.0.0.1:{port}" in run.stderr
    assert "ray start --head" in run.stderr
    no_ray = ("import sys; sys.modules['ray'] = None; sys.modules['ray.serve'] = None; "
              "from verispec.cli import main; sys.exit(main(['serve', '--ray']))")
    run = subprocess.run([sys.executable, "-c", no_ray], env=env(), capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 1 and 'pip install "verispec[ray]"' in run.stderr, run.stderr
    assert main(["serve", "--replicas", "2"]) == 2  # a Ray flag without --ray


@pytest.mark.slow
def test_a_replica_that_cannot_load_its_model_fails_the_deploy_with_its_error(cluster, capsys):
    assert main(["serve", "--ray", "--replicas", "1", "--target", "nosuchmodel", "--port", str(free_port()),
                 "--ray-deploy-timeout", "120"]) == 1
    err = capsys.readouterr().err
    first = err.split("verispec: error: ", 1)[1].splitlines()[0]
    assert first.startswith("a replica could not start: FileNotFoundError: model not found: 'nosuchmodel'")
    assert serve_actors() == []  # the deployment was removed and Serve shut down
    free_cpus_become(2)


# -- a real deployment -----------------------------------------------------------------------------


class RayServer:
    """`python -m verispec serve --ray --replicas 2` in a subprocess, joined to the module's Ray."""

    def __init__(self, address: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "verispec", "serve", "--ray", "--replicas", "2", "--ray-address",
                 address, "--port", str(self.port), "--max-batch", "64"],
                env=env(), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while True:
            assert self.proc.poll() is None, f"verispec serve exited:\n{self.tail()}"
            assert time.monotonic() < deadline, f"not serving after 240 s:\n{self.tail()}"
            if "(Ctrl-C to stop)" in self.log.read_text():  # every replica runs
                break
            time.sleep(0.5)
        assert f"Ray Serve at {self.url} (Ctrl-C to stop)" in self.log.read_text()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=120)

    def tail(self) -> str:
        return "\n".join(self.log.read_text().splitlines()[-40:])

    def stop(self, sig=signal.SIGTERM, seconds: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(seconds)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
                raise AssertionError(f"verispec serve did not exit {seconds} s after {sig!r}:\n{self.tail()}")
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(cluster, tmp_path_factory):
    running = RayServer(cluster, tmp_path_factory.mktemp("ray-serve") / "serve.log")
    yield running
    running.stop()


def metrics_of(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.slow
def test_openai_client_on_two_replicas_equals_generate(server):
    # one request per rule: the response equals verispec.generate with the same seed
    for rule in ("lossless", LOSSY):
        raw = server.client.completions.with_raw_response.create(
            model="default", prompt=PROMPT, max_tokens=20, seed=7,
            extra_body={"verification": {"rule": rule}})
        assert raw.headers[REPLICA_HEADER]
        r = raw.parse()
        local, report = local_generate(PROMPT, rule, 7, 20)
        assert r.model_extra["token_ids"] == local.token_ids and r.choices[0].text == local.text
        assert r.usage.completion_tokens == len(local.token_ids) and r.model_extra["seed"] == 7
        ver = r.model_extra["verification"]
        same_report(ver, report)
        assert ver["rule"] == parse(rule).spec and ver["lossless"] == (rule == "lossless")
        assert len(ver["acceptance_per_position"]) == 4
        if rule == LOSSY:
            assert ver["certificate"]["n"] == 20 and 0 < ver["mean_tv"] <= 0.01 + 1e-9
    # chat, then the same request streamed (SSE through Ray Serve's proxy)
    body = dict(model="default", messages=[{"role": "user", "content": "KING."}], max_tokens=16, seed=3,
                extra_body={"verification": {"rule": LOSSY}})
    chat = server.client.chat.completions.create(**body)
    chunks = list(server.client.chat.completions.create(stream=True, **body))
    assert len(chunks) > 2 and "".join(c.choices[0].delta.content or "" for c in chunks) == \
        chat.choices[0].message.content
    assert chunks[-1].model_extra["verification"] == chat.model_extra["verification"]
    assert [m.id for m in server.client.models.list().data] == ["default"]

    # 12 concurrent requests: both replicas serve, every response is generate's for its seed
    def send(seed):
        raw = server.client.completions.with_raw_response.create(
            model="default", prompt=PROMPT, max_tokens=12, seed=seed,
            extra_body={"verification": {"rule": LOSSY}})
        return raw.headers[REPLICA_HEADER], raw.parse()

    with ThreadPoolExecutor(12) as pool:
        served = list(pool.map(send, range(100, 112), timeout=300))
    replicas = {name for name, _ in served}
    assert len(replicas) == 2, f"one replica served all 12 requests: {replicas}"
    differ = 0
    for seed, (_, r) in zip(range(100, 112), served):
        local, report = local_generate(PROMPT, LOSSY, seed, 12)
        if r.model_extra["token_ids"] != local.token_ids:
            differ += 1  # float rounding of a batched forward pass may flip a rare sampled token
            continue
        same_report(r.model_extra["verification"], report)
    assert differ <= 1, f"{differ}/12 responses differ from generate"
    print(f"2 replicas {sorted(replicas)}: {12 - differ}/12 concurrent responses equal generate's")


def replica_metrics(server) -> dict[str, dict]:
    """Each replica's /metrics, parsed (the proxy picks a replica per request: ask until both answered)."""
    seen: dict[str, dict] = {}
    for _ in range(60):
        resp = httpx.get(server.url + "/metrics", timeout=10)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        seen[resp.headers[REPLICA_HEADER]] = metrics_of(resp.text)  # valid Prometheus text, or it raises
        if len(seen) == 2:
            return seen
    raise AssertionError(f"/metrics came from {list(seen)} only")


def served(samples: dict) -> float:
    return sum(v for (name, _), v in samples.items() if name == "verispec:request_success_total")


@pytest.mark.slow
def test_each_replica_serves_its_own_valid_metrics(server):
    before = replica_metrics(server)
    for name, samples in before.items():
        assert samples[("verispec:replica_info", (("replica", name),))] == 1  # the body names its replica
    with ThreadPoolExecutor(8) as pool:
        heads = list(pool.map(lambda seed: server.client.completions.with_raw_response.create(
            model="default", prompt=PROMPT, max_tokens=6, seed=seed).headers[REPLICA_HEADER], range(8),
            timeout=300))
    after = replica_metrics(server)
    assert after.keys() == before.keys() and set(heads) <= set(after)
    for name in after:  # each replica counted the requests its header says it served
        assert served(after[name]) - served(before[name]) == heads.count(name)
        assert total(after[name], "verispec:num_requests_running") == 0
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.json()["replica"] == health.headers[REPLICA_HEADER] in after


def total(samples: dict, name: str, **labels) -> float:
    """The sum of a metric's samples whose labels include `labels` (the counters carry model_name)."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def cancelled(samples: dict) -> float:
    return total(samples, "verispec:request_success_total", finished_reason="cancelled")


@pytest.mark.slow
def test_disconnect_mid_stream_frees_the_row_on_its_replica(server):
    before = replica_metrics(server)
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/completions",
                           json={"prompt": PROMPT, "max_tokens": 1000, "stream": True, "seed": 1,
                                 "ignore_eos": True}) as resp:
            assert resp.status_code == 200
            name = resp.headers[REPLICA_HEADER]
            lines = resp.iter_lines()
            assert len([x for _, x in zip(range(3), (y for y in lines if y.startswith("data:")))]) == 3
    deadline = time.monotonic() + 30  # the proxy cancels the replica's request; the engine frees the row
    while True:
        now = replica_metrics(server)[name]
        if total(now, "verispec:num_requests_running") == 0 and cancelled(now) == cancelled(before[name]) + 1:
            break
        assert time.monotonic() < deadline, "the row was not freed (not cancelled) within 30 s"
        time.sleep(0.2)
    assert total(now, "verispec:generation_tokens_total") < total(
        before[name], "verispec:generation_tokens_total") + 1000  # cancelled, not run to its 1000 tokens


@pytest.mark.slow
def test_sigterm_removes_the_deployment_and_frees_the_cpus(server):
    assert set(serve_actors()) >= {"SERVE_CONTROLLER_ACTOR"}
    assert server.stop(signal.SIGTERM) == 0
    assert "shutting down Ray Serve" in server.log.read_text()
    assert serve_actors() == []
    free_cpus_become(2)
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url + "/health", timeout=5)
