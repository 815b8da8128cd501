"""Joining a Ray cluster, shared by the Ray sweep executor (`verispec bench --executor ray`) and
`verispec serve --ray` (docs/design/evaluation.md, 'Sweeps on Ray' and 'Serving on Ray').

Ray is optional (`pip install "verispec[ray]"`) and imported only through `require`. An address is
checked with a TCP connection before `ray.init`, which would otherwise retry an unreachable address for
30 s (Ray Client) or for minutes (a GCS address). Errors are the standard ones (ImportError,
ValueError, ConnectionError) with messages that name the flag; each caller wraps them in its own type.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import socket
from dataclasses import dataclass

INSTALL_HINT = 'pip install "verispec[ray]"'
RAY_CLIENT_PORT = 10001
START_HINT = ("start one there with `ray start --head` (GCS port 6379, Ray Client port 10001; then "
              "`auto` on that machine), or leave the address unset to start a local Ray instance here")
AUTH_HINT = ("if the cluster uses token authentication (Ray's default for new local clusters since 2.59), "
             "set RAY_AUTH_MODE=token here too, with the cluster's token in ~/.ray/auth_token or "
             "RAY_AUTH_TOKEN")


@dataclass(frozen=True)
class RayOptions:
    """Where and how wide verispec runs on Ray, for `bench --executor ray` (sweep workers) and
    `serve --ray` (server replicas): one set of flags, `--ray-address` and `--ray-cpus` for both.
    None of it changes results (a sweep may be resumed with other options, or with the local executor)."""

    address: str | None = None  # None: $RAY_ADDRESS, else a new local instance; "auto"; HOST:PORT; ray://...
    workers: int | None = None  # sweep workers (None: as many as the free CPUs/GPUs fit) or server replicas
    worker_cpus: float = 1.0  # CPUs Ray reserves for each worker/replica (`--ray-cpus`); its torch threads
    max_restarts: int = 0  # bench: times Ray may restart a dead worker (its units are redone meanwhile)
    max_in_flight: int = 2  # bench: units handed to one worker at a time
    ready_timeout_s: float = 120.0  # every worker/replica must be placed, load its models and answer by then

    def validate(self) -> None:
        """ValueError naming the flag for an option no run can use."""
        if self.address is not None and (not isinstance(self.address, str) or not self.address.strip()):
            raise ValueError("--ray-address must be auto, HOST:PORT or ray://HOST:PORT, "
                             f"got {self.address!r}")
        for name, flag, low in (("workers", "--workers/--replicas", 1), ("max_restarts", "--max-restarts", 0),
                                ("max_in_flight", "max_in_flight", 1)):
            value = getattr(self, name)
            if value is None and name == "workers":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{flag} must be an integer >= {low}, got {value!r}")
        for name, flag in (("worker_cpus", "--ray-cpus"), ("ready_timeout_s", "the Ray ready timeout")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{flag} must be a number > 0, got {value!r}")


def require(module: str, needed_by: str, what: str = "Ray"):
    """Import `module` (ray, ray.serve), or ImportError naming what needs it and the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"{needed_by} needs {what}, which is not installed ({err}); install it with "
                          f"{INSTALL_HINT}") from None


def host_port(address: str, flag: str) -> tuple[str, int] | None:
    """(host, port) of "HOST:PORT", "ray://HOST:PORT" or "ray://HOST" (port 10001); None for auto/local
    (`ray.init` finds the cluster `ray start` recorded, or fails at once). ValueError if malformed."""
    if address in ("auto", "local"):
        return None
    client = address.startswith("ray://")
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep and client:
        host, port = rest, str(RAY_CLIENT_PORT)
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise ValueError(f"{flag} must be auto, HOST:PORT or ray://HOST:PORT, got {address!r}")
    return host, int(port)


def probe(address: str, flag: str, timeout: float = 5.0) -> None:
    """ConnectionError naming `flag` and the address when nothing listens there."""
    where = host_port(address, flag)
    if where is None:
        return
    try:
        socket.create_connection(where, timeout=timeout).close()
    except OSError as err:
        raise ConnectionError(f"no Ray cluster at {flag} {address}: cannot connect to {where[0]}:{where[1]} "
                              f"({err.strerror or err}); {START_HINT}") from None


def connect(ray, address: str | None, flag: str, local_object_store_bytes: int, quiet: bool = False) -> bool:
    """Connect this process to Ray; True when this call connected (the caller then calls
    `ray.shutdown()`, which also stops a local instance started here).

    A process already connected (a library user's or a test's own `ray.init`) keeps its connection,
    and then `address` must be None. Otherwise `address` (or $RAY_ADDRESS) names the cluster; with
    neither, a new local instance starts, sized to this machine's CPUs, with a small object store and
    no dashboard. `quiet`: Ray's own log lines at WARNING, and workers' output stays in Ray's log files."""
    if ray.is_initialized():
        if address is not None:
            raise ValueError(f"this process is already connected to Ray, so {flag} {address} cannot apply: "
                             "leave it unset to use that connection")
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # no per-worker FutureWarning
    options = {"logging_level": logging.WARNING, "log_to_driver": False} if quiet else {}
    if address is None:
        ray.init(address="local", num_cpus=os.cpu_count() or 1, object_store_memory=local_object_store_bytes,
                 include_dashboard=False, **options)
        return True
    probe(address, flag)
    try:
        ray.init(address=address, **options)
    except (ConnectionError, ValueError, RuntimeError) as err:
        why = str(err).rstrip(".")
        raise ConnectionError(f"cannot connect to a Ray cluster at {flag} {address}: {why}; {START_HINT}; "
                              f"{AUTH_HINT}") from None
    return True
