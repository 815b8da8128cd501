"""`verispec serve --ray`: the app of `verispec.serving.app.create_app` as a Ray Serve deployment.

N replicas behind Ray Serve's HTTP proxy on --host/--port; each replica is a Ray actor that loads the
target and draft once and runs its own continuous-batching `Engine`, so the endpoints, responses and
errors are the local server's. The proxy routes each request to one replica (least loaded of two
sampled); every response names its replica in the `x-verispec-replica` header, and `/metrics` is the
Prometheus text of the replica that served the request (its own registry).

The app is built inside each replica (`serve.ingress` with a builder function, evaluated at replica
start), and Ray Serve runs the FastAPI lifespan there: startup starts the replica's engine thread, and
replica shutdown (the `__del__` of the ingress wrapper) stops it.

Options are `verispec.ray_cluster.RayOptions` (the same as the Ray sweep executor's): `workers` is the
number of replicas (None: 1), `worker_cpus` each replica's CPUs (`--ray-cpus`), `ready_timeout_s` the
deploy timeout. Before deploying: the cluster is reachable (a TCP check of --ray-address, since
`ray.init` retries an unreachable address for minutes), and it has the CPUs for replicas x CPUs.
While deploying: the application's status is polled until RUNNING, DEPLOY_FAILED (a replica that
cannot start: its exception is in the error) or the deploy timeout.
"""

from __future__ import annotations

import logging
import math
import re
import signal
import sys
import threading
import time

import torch

from verispec import ray_cluster
from verispec.ray_cluster import RayOptions
from verispec.serving.app import create_app
from verispec.serving.config import ServeConfig

APP_NAME = "verispec"
DEPLOYMENT_NAME = "VerispecServer"

log = logging.getLogger(__name__)


class RayServeError(RuntimeError):
    """`verispec serve --ray` could not start: the message says why and what to do."""


LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2  # a local instance's object store (serving barely uses it)


def replicas(options: RayOptions) -> int:
    return 1 if options.workers is None else options.workers


def import_ray():
    """(ray, ray.serve), or RayServeError naming the extra to install."""
    needed_by = "`verispec serve --ray`"
    try:
        return ray_cluster.require("ray", needed_by), ray_cluster.require("ray.serve", needed_by, "Ray Serve")
    except ImportError as err:
        raise RayServeError(str(err)) from None


# -- the cluster -----------------------------------------------------------------------------------


def connect(ray, options: RayOptions) -> bool:
    """Join the cluster at `options.address` (else $RAY_ADDRESS, else start a local instance:
    `ray_cluster.connect`). True if this call initialised Ray (the caller then calls `ray.shutdown()`);
    False for a driver already connected (e.g. a test's `ray.init`), which is used as is."""
    try:
        return ray_cluster.connect(ray, options.address, "--ray-address", LOCAL_OBJECT_STORE_BYTES)
    except (ConnectionError, ValueError) as err:
        raise RayServeError(str(err)) from None


def check_capacity(ray, options: RayOptions) -> None:
    """RayServeError, before anything is deployed, if the cluster lacks the CPUs for every replica."""
    n = replicas(options)
    need = n * options.worker_cpus
    total = ray.cluster_resources().get("CPU", 0.0)
    free = ray.available_resources().get("CPU", 0.0)
    if need > free + 1e-9:
        raise RayServeError(
            f"not enough CPUs for {n} replica(s) x {options.worker_cpus:g} CPU(s) = {need:g} "
            f"CPUs: the Ray cluster has {free:g} of its {total:g} CPUs available; use fewer --replicas, "
            "a smaller --ray-cpus, or add nodes (`ray start --address ...` on each)")


# -- the deployment --------------------------------------------------------------------------------


def build_application(config: ServeConfig, options: RayOptions):
    """The Ray Serve application: `create_app(config)` built in each of `replicas(options)` replicas."""
    from ray import serve

    def build():  # runs in the replica, after its actor starts: loads the models there
        from ray import serve as replica_serve

        torch.set_num_threads(max(1, math.floor(options.worker_cpus)))  # the CPUs Ray reserved for it
        return create_app(config, replica=replica_serve.get_replica_context().replica_tag)

    class VerispecReplica:
        def check_health(self) -> None:  # Ray Serve restarts a replica whose engine thread died
            error = self.app.state.server.engine.error
            if error is not None:
                raise RuntimeError(f"the verispec engine failed: {error!r}")

    ingress = serve.ingress(build)(VerispecReplica)
    deployment = serve.deployment(
        ingress, name=DEPLOYMENT_NAME, num_replicas=replicas(options),
        ray_actor_options={"num_cpus": options.worker_cpus},
        # the engine's own limits apply in each replica (503 queue_full past them); the proxy keeps at
        # most max_queue more per caller, then answers 503 itself
        max_ongoing_requests=config.max_batch + config.max_queue, max_queued_requests=config.max_queue,
    )
    return deployment.bind()


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b.*$",
                             re.MULTILINE)


def root_cause(message: str) -> str | None:
    """The last `SomeError: ...` line of a traceback-bearing status message (a replica's own error)."""
    found = [m.group(0) for m in _EXCEPTION_LINE.finditer(message)]
    return found[-1].strip() if found else None


def _failure(app_status) -> str:
    """The application's message plus every deployment's (a replica's traceback is in the latter)."""
    parts = [app_status.message] if app_status.message else []
    for name, dep in getattr(app_status, "deployments", {}).items():
        if dep.message:
            parts.append(f"{name}: {dep.message}")
    return "\n".join(parts) or str(app_status.status)


def wait_running(serve, timeout: float, stop: threading.Event | None = None, poll: float = 0.5) -> None:
    """Poll the application's status until RUNNING; RayServeError on DEPLOY_FAILED, after `timeout`, or
    when `stop` is set (a signal while deploying)."""
    deadline = time.monotonic() + timeout
    while True:
        last = serve.status().applications.get(APP_NAME)
        status = str(getattr(last, "status", ""))
        if status.endswith("RUNNING"):
            return
        if status.endswith("DEPLOY_FAILED"):
            detail = _failure(last)
            cause = root_cause(detail)
            raise RayServeError(f"a replica could not start: {cause or 'see below'}\n\nRay Serve's status "
                                f"of the verispec deployment:\n{detail}")
        if time.monotonic() > deadline:
            detail = _failure(last) if last is not None else "no status yet"
            raise RayServeError(f"the verispec deployment is not running after {timeout:g} s (every replica "
                                f"must load the models; raise --ray-deploy-timeout if they are large); "
                                f"last status:\n{detail}")
        if stop is not None and stop.wait(poll):
            raise RayServeError("interrupted while deploying; the deployment was removed")
        elif stop is None:
            time.sleep(poll)


def shut_down(serve) -> None:
    """Delete the verispec application; shut Serve down too if no other application is left on it."""
    try:
        serve.delete(APP_NAME)
        if not serve.status().applications:
            serve.shutdown()
    except Exception as err:  # noqa: BLE001  best effort: the cluster may be gone already
        log.warning("shutting Ray Serve down: %s", err)


def logging_config(log_level: str) -> dict:
    """Ray Serve's logging config for a `--log-level` (uvicorn's names): access logs at info and below."""
    level = {"trace": "DEBUG", "critical": "CRITICAL"}.get(log_level.lower(), log_level.upper())
    return {"log_level": level, "enable_access_log": level in ("DEBUG", "INFO")}


def http_address(host: str, port: int) -> tuple[str, int]:
    """Where Ray Serve's proxies listen: (host, port) asked for, unless Serve already ran on the cluster
    with other HTTP options (which `serve.start` keeps, with a warning)."""
    try:
        from ray.serve.context import _get_global_client  # private, hence the fallback

        http = _get_global_client().http_config
        return http.host, int(http.port)
    except Exception:  # noqa: BLE001
        return host, port


def deploy(serve, config: ServeConfig, options: RayOptions, host: str = "127.0.0.1", port: int = 8000,
           stop: threading.Event | None = None, log_level: str = "info") -> tuple[str, int]:
    """Deploy on the connected cluster and wait until every replica runs; returns where the proxies
    listen. On any failure (or `stop` set meanwhile) the deployment is removed before the error
    propagates."""
    if APP_NAME in serve.status().applications:
        raise RayServeError(f"a Ray Serve application named '{APP_NAME}' already runs on this cluster "
                            "(another `verispec serve --ray`?); stop it first (`serve shutdown`)")
    try:
        serve.start(http_options={"host": host, "port": port}, logging_config=logging_config(log_level))
        serve._run(build_application(config, options), _blocking=False, name=APP_NAME, route_prefix="/",
                   logging_config=logging_config(log_level))
        wait_running(serve, options.ready_timeout_s, stop)
    except BaseException:
        shut_down(serve)
        raise
    return http_address(host, port)


def start(config: ServeConfig, options: RayOptions, host: str = "127.0.0.1", port: int = 8000,
          stop: threading.Event | None = None, log_level: str = "info") -> tuple[object, object, bool]:
    """Connect (or start Ray), check capacity, deploy, wait until every replica runs. Returns (ray, serve,
    owns_ray): with owns_ray, `ray.shutdown()` is the caller's. On failure nothing is left behind."""
    options.validate()
    ray, serve = import_ray()
    owns_ray = connect(ray, options)
    try:
        check_capacity(ray, options)
        deploy(serve, config, options, host, port, stop, log_level)
    except BaseException:
        if owns_ray:
            ray.shutdown()
        raise
    return ray, serve, owns_ray


def serve_on_ray(config: ServeConfig, options: RayOptions, host: str = "127.0.0.1", port: int = 8000,
                 stop: threading.Event | None = None, log_level: str = "info") -> None:
    """`verispec serve --ray`: deploy, say where it serves, block until SIGINT/SIGTERM (or `stop` is set),
    then remove the deployment, shut Serve down and disconnect (stopping a Ray instance started here).

    The SIGINT/SIGTERM handlers go in after `ray.init`, which installs its own (SIGTERM: `sys.exit`, and
    the core worker's fatal-signal handler that aborts the process); they stay until the end, so a
    second signal does not cut the clean-up short."""
    stop = stop or threading.Event()
    options.validate()
    ray, serve = import_ray()
    owns_ray = connect(ray, options)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        check_capacity(ray, options)
        where = deploy(serve, config, options, host, port, stop, log_level)
        try:
            if where != (host, port):
                print(f"verispec serve: Ray Serve already ran on this cluster with its proxies on "
                      f"{where[0]}:{where[1]}, which it keeps (not --host {host} --port {port})",
                      file=sys.stderr, flush=True)
            print(f"verispec serve: {replicas(options)} replica(s) of '{config.target}' on Ray Serve at "
                  f"http://{where[0]}:{where[1]} (Ctrl-C to stop)", file=sys.stderr, flush=True)
            while not stop.wait(0.5):  # a timeout: the signal handler runs between waits
                pass
        finally:
            print("verispec serve: shutting down Ray Serve", file=sys.stderr, flush=True)
            shut_down(serve)
    finally:
        if owns_ray:
            ray.shutdown()
        for sig, handler in previous.items():
            if handler is not None:  # None: a handler installed outside Python, which cannot be restored
                signal.signal(sig, handler)
