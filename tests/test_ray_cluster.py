"""`verispec.ray_cluster`: address parsing and the fail-fast TCP probe shared by the Ray sweep executor
and `verispec serve --ray` (both end-to-end paths are in test_ray_sweep.py and test_ray_serve.py)."""

from __future__ import annotations

import socket

import pytest

from verispec import ray_cluster


@pytest.mark.parametrize("address, expected", [
    ("auto", None), ("local", None),
    ("10.0.0.5:6379", ("10.0.0.5", 6379)),
    ("ray://head", ("head", ray_cluster.RAY_CLIENT_PORT)),  # Ray Client's default port
    ("ray://head:12345", ("head", 12345)),
    ("[::1]:6379", ("::1", 6379)),
])
def test_host_port(address, expected):
    assert ray_cluster.host_port(address, "--address") == expected


@pytest.mark.parametrize("address", ["head", "head:port", ":6379", "ray://:10001", "ray://"])
def test_malformed_address_names_the_flag(address):
    with pytest.raises(ValueError, match=r"--ray-address must be auto, HOST:PORT or ray://HOST:PORT"):
        ray_cluster.host_port(address, "--ray-address")


def test_probe_fails_fast_naming_flag_and_address():
    with socket.socket() as sock:  # a port nothing listens on: bound, then closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    message = rf"no Ray cluster at --address 127.0.0.1:{port}: .*ray start --head"
    with pytest.raises(ConnectionError, match=message):
        ray_cluster.probe(f"127.0.0.1:{port}", "--address", timeout=2.0)


def test_probe_passes_where_something_listens():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        ray_cluster.probe(f"127.0.0.1:{server.getsockname()[1]}", "--address", timeout=2.0)
        ray_cluster.probe("auto", "--address")  # nothing to probe: ray.init finds the recorded cluster


def test_require_names_the_extra():
    with pytest.raises(ImportError, match=r'--executor ray needs Ray, which is not installed .*'
                                          r'pip install "verispec\[ray\]"'):
        ray_cluster.require("verispec_no_such_module", "--executor ray")
