"""The Ray executor of a sweep (`verispec bench --executor ray`): work units decoded by Ray actors.

How the work splits (docs/design/evaluation.md, 'Sweeps on Ray'):

- **Workers.** Each worker is a Ray actor (`SweepWorker`) that loads the model pair once, exactly as
  `run_sweep` does (`resolve_target` / `resolve_drafter`, the sweep's device and dtypes), encodes the
  prompts and checks them against the context. The driver (this process) loads no weights: it takes
  the backend name and the context check from the workers' reports (they must all agree), so a big
  pair's weights live only on the workers and the driver can be a small CPU head node.
- **Work units.** One configuration on up to `batch_size` (prompt, seed) rows: exactly the batches
  the local executor decodes (`units.work_units`), through the same code (`units.decode_rows`), so
  every row, its tokens and its per-row generator (seeded by seed * 1_000_003 + prompt index) are
  those of the local executor; only timings differ.
- **Flow.** At most `max_in_flight` units per worker (2: one decoding, one queued), so a slow worker
  holds little work; rows are appended as their unit returns (`ray.wait`), by the driver alone,
  through `ResultsFile`: crash safety, deduplication and `--resume` are the local executor's.
- **Lost workers.** A unit whose actor died (`RayActorError`; or Ray's memory monitor or a node
  failure killed it) goes back to the front of the queue and is redone by a live worker; a unit is
  never handed out again once its rows landed. A worker Ray restarted (`max_restarts`) stays in the
  pool (it reloads the pair on its next unit). With no worker left the sweep stops with a clear
  error; the rows written stay and `--resume` continues.

Ray is optional (`pip install "verispec[ray]"`) and imported only on this path; joining the cluster
(`verispec.ray_cluster`) is shared with `verispec serve --ray`.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from verispec import ray_cluster
from verispec.evaluation.sandbox import UNSAFE_ENV, unsafe_allowed
from verispec.evaluation.store import ResultsFile
from verispec.evaluation.units import (backend_of, check_contexts, decode_rows, load_pair, unit_key, warm_up,
                                       work_units)
from verispec.evaluation.units import progress as unit_progress
from verispec.models.hf import proc_kib_field
from verispec.ray_cluster import RayOptions

log = logging.getLogger(__name__)

LOCAL_OBJECT_STORE_BYTES = 150 * 1024**2  # rows are kilobytes: the local instance needs little
MAX_ATTEMPTS = 3  # a unit whose worker died this many times stops the sweep (it may be what kills them)


class RayExecutorError(RuntimeError):
    """The Ray executor cannot go on; the message says why and what to do. Rows already written stay,
    and `--resume` continues the sweep (with either executor)."""


def import_ray():
    """The `ray` module, or a RayExecutorError naming the extra to install."""
    try:
        return ray_cluster.require("ray", "--executor ray")
    except ImportError as err:
        raise RayExecutorError(str(err)) from None


def check_ray_spec(spec) -> None:
    """The sweep settings the Ray executor supports: each worker runs on the CPU or on its own GPU."""
    if spec.device not in ("cpu", "cuda"):
        raise ValueError(f"with --executor ray the device must be cpu or cuda (each worker gets its own "
                         f"GPU from Ray), got {spec.device!r}")


def connect(ray, address: str | None) -> bool:
    """Connect this process to Ray (`ray_cluster.connect`: `address`, else $RAY_ADDRESS, else a new local
    instance); True when this call connected, so the caller disconnects. Workers' logs stay in Ray's files."""
    return ray_cluster.connect(ray, address, "--ray-address", LOCAL_OBJECT_STORE_BYTES, quiet=True)


def plan_workers(ray, options: RayOptions, device: str) -> int:
    """How many workers to start: `options.workers`, or as many as the free resources fit; a
    ValueError naming what is available when they do not fit (before any actor is created)."""
    def fitting(resources: dict) -> int:
        fit = int(resources.get("CPU", 0.0) / options.worker_cpus + 1e-9)
        return min(fit, int(resources.get("GPU", 0.0) + 1e-9)) if device == "cuda" else fit

    total = ray.cluster_resources()
    deadline = time.monotonic() + min(10.0, options.ready_timeout_s)
    while True:
        free = ray.available_resources()
        fit = fitting(free)
        want = options.workers or 1
        if want <= fit:
            return options.workers or fit
        # resources a finished job (or this process's previous sweep) held come back within moments
        if want > fitting(total) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    cpus, gpus = free.get("CPU", 0.0), free.get("GPU", 0.0)
    have = f"{cpus:g} of {total.get('CPU', 0.0):g} CPUs"
    if device == "cuda":
        have += f" and {gpus:g} of {total.get('GPU', 0.0):g} GPUs"
    each = f"{options.worker_cpus:g} CPU" + (" + 1 GPU" if device == "cuda" else "")
    fix = (f"use --workers {fit} or fewer, or add nodes" if fit >= 1
           else "free some, add nodes, or lower --ray-cpus")
    raise ValueError(f"not enough Ray resources for {want} worker(s) of {each} each: the cluster has {have} "
                     f"available; {fix}")


def _reason(err: BaseException) -> str:
    """The telling line of a Ray error: the remote exception ("XError: ...") if there is one."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException) and not type(cause).__module__.startswith("ray"):
        return f"{type(cause).__name__}: {cause}"
    text = str(getattr(err, "error_msg", None) or err)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b.*:", line):
            return line
    # no remote exception (killed, out of memory, node lost): Ray's own words, less its id lines
    words = " ".join(line for line in text.splitlines() if line.strip() and not line.startswith("\t"))
    return (words[:500] + " ...") if len(words) > 500 else (words or type(err).__name__)


class SweepWorker:
    """One worker's state: the model pair, loaded once, and the prompts (RayPool makes it an actor)."""

    def __init__(self, spec, suite, max_new: int, num_threads: int):
        torch.set_num_threads(max(1, num_threads))  # the actor's num_cpus
        self.spec, self.suite, self.max_new = spec, suite, max_new
        self.models = None
        self.backend = self.context_error = None

    def ping(self) -> dict:
        import ray

        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "rss_bytes": proc_kib_field("/proc/self/status", "VmRSS")}

    def load(self) -> dict:
        """Load the pair (once), encode the prompts, check them against the context, warm up."""
        if self.models is None:
            target, drafter, prompts = load_pair(self.spec, self.suite)
            try:
                check_contexts(self.suite, prompts, target, drafter, self.max_new)
            except ValueError as err:
                self.context_error = str(err)
            else:
                warm_up(target, drafter, prompts[0])
            self.models, self.backend = (target, drafter, prompts), backend_of(target)
        return {**self.ping(), "backend": self.backend, "context_error": self.context_error}

    def decode(self, spec, config, rows: list[tuple[int, int]], slots: int | None = None) -> list[dict]:
        """The finished rows of one work unit: `config` on the (prompt index, seed) `rows`, at most
        `slots` at once (continuous batching; None: all at once)."""
        self.load()  # a worker Ray restarted loads the pair again here
        if spec.backend != self.backend:
            raise ValueError(f"this worker runs the {self.backend} backend but the sweep is on "
                             f"{spec.backend}: set VERISPEC_BACKEND the same on every node")
        target, drafter, prompts = self.models
        members = [(index, self.suite.items[index], seed, config) for index, seed in rows]
        return decode_rows(spec, self.suite, target, drafter, prompts, members, config, self.max_new, slots)


@dataclass
class _Worker:
    index: int
    handle: object
    where: str = "starting"
    pid: int | None = None
    in_flight: int = 0
    alive: bool = True
    restarts: int = 0


@dataclass
class _Unit:
    config: object
    members: list  # (prompt index, item, seed, config), as in units.work_units
    attempts: int = 0
    keys: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"{self.config.id} on (prompt, seed) {[(m[0], m[2]) for m in self.members]}"


class RayPool:
    """The workers of one sweep: connects to Ray, checks the resources, starts the actors, waits until
    every one is placed (with a time limit) and has loaded the pair (its own error if it cannot), and
    runs the units. Use as a context manager: the actors are killed, and a Ray instance this pool
    connected to is disconnected (a local one it started is stopped), on the way out."""

    def __init__(self, spec, suite, max_new: int, options: RayOptions | None = None):
        self.ray = import_ray()
        self.options = options or RayOptions()
        self.options.validate()
        self.workers: list[_Worker] = []
        self.max_new = max_new
        self._connected = connect(self.ray, self.options.address)
        try:
            self._start(spec, suite, max_new, plan_workers(self.ray, self.options, spec.device))
        except BaseException:
            self.close()
            raise

    def _start(self, spec, suite, max_new: int, count: int) -> None:
        ray, opts = self.ray, self.options
        # --unsafe-no-sandbox travels to workers on other machines too (they run the generated code)
        unsafe = {"runtime_env": {"env_vars": {UNSAFE_ENV: "1"}}} if unsafe_allowed() else {}
        actor = ray.remote(SweepWorker).options(
            num_cpus=opts.worker_cpus, num_gpus=1 if spec.device == "cuda" else 0,
            max_restarts=opts.max_restarts, max_task_retries=0, **unsafe)
        threads = max(1, int(opts.worker_cpus))
        self.workers = [_Worker(i, actor.remote(spec, suite, max_new, threads)) for i in range(count)]
        # placement: a time limit, so resources that never come are an error, not a hang
        pings = {w.handle.ping.remote(): w for w in self.workers}
        ready, late = ray.wait(list(pings), num_returns=len(pings), timeout=opts.ready_timeout_s)
        for ref in ready:
            worker = pings[ref]
            try:
                info = ray.get(ref)
            except ray.exceptions.RayError as err:
                raise RayExecutorError(f"Ray worker {worker.index} could not start: {_reason(err)}") from None
            worker.where, worker.pid = f"pid {info['pid']} on {info['node']}", info["pid"]
        if late:
            raise TimeoutError(
                f"{len(late)} of {count} Ray workers were not running after {opts.ready_timeout_s:g} s "
                f"(each asks for {opts.worker_cpus:g} CPU{' + 1 GPU' if spec.device == 'cuda' else ''}; "
                f"available now: {ray.available_resources()}): the cluster lacks the resources or a node "
                "is unreachable; use fewer --workers or add nodes")
        # loading: no time limit (a big pair takes a while); a failure is the worker's own exception
        loads = {w.handle.load.remote(): w for w in self.workers}
        waiting, self.infos = list(loads), []
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1)
            worker = loads[ready[0]]
            try:
                info = ray.get(ready[0])
            except ray.exceptions.RayError as err:
                raise RayExecutorError(f"Ray worker {worker.index} ({worker.where}) could not load the model "
                                       f"pair {spec.target} + {spec.draft}: {_reason(err)}") from None
            if info["context_error"]:
                raise ValueError(info["context_error"])
            self.infos.append(info)
        backends = sorted({info["backend"] for info in self.infos})
        if len(backends) > 1:
            raise RayExecutorError(f"the Ray workers run different backends ({', '.join(backends)}): set "
                                   "VERISPEC_BACKEND the same on every node")
        self.backend = backends[0]
        log.info("%d Ray workers ready (%s backend): %s", count, self.backend,
                 "; ".join(w.where for w in self.workers))

    def live(self) -> tuple:
        """The live workers' actor handles."""
        return tuple(w.handle for w in self.workers if w.alive)

    def run_units(self, spec, suite, units, results_path, progress: bool, batch_size: int,
                  on_row: Callable[[dict, tuple], None] | None = None, run: str = "",
                  chunk: int | None = None, on_start: Callable[[], None] | None = None) -> None:
        """Hand the units not yet in the results file to the workers; append their rows as they land,
        each marked with this sweep run's id (`run`, as the local executor's rows). `chunk` and
        `on_start`: as the local executor's (units of `chunk` rows, `batch_size` decoding at once;
        `on_start` called once before the first unit is handed out, not at all when none is left)."""
        ray = self.ray
        with ResultsFile(results_path, self.max_new) as store:
            work = work_units(units, store.done, spec, chunk or batch_size)
            queue = deque(_Unit(config, members, keys=[unit_key(spec, m[1], m[2], m[3]) for m in members])
                          for config, members in work)
            if queue and on_start is not None:
                on_start()  # before the bar exists, so an error here leaves nothing open
            bar = unit_progress(len(units), len(units) - sum(len(u.members) for u in queue), progress)
            in_flight: dict = {}  # object ref -> (worker, unit)
            try:
                while queue or in_flight:
                    self._hand_out(spec, queue, in_flight, store.done, batch_size)
                    if not in_flight:
                        if not queue:
                            break  # the last units' rows had all landed already
                        raise RayExecutorError(
                            f"all {len(self.workers)} Ray workers were lost; {len(store.done)} of "
                            f"{len(units)} rows are written in {results_path}: run the same command with "
                            "--resume to continue (with either executor)")
                    ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=1.0)
                    if not ready:
                        continue
                    worker, unit = in_flight.pop(ready[0])
                    worker.in_flight -= 1
                    try:
                        rows = ray.get(ready[0])
                    except self._lost_worker_errors() as err:
                        self._lost(worker, unit, err, queue)
                        continue
                    except ray.exceptions.RayError as err:
                        raise RayExecutorError(f"Ray worker {worker.index} ({worker.where}) failed on "
                                               f"{unit.describe()}: {_reason(err)}") from None
                    for row in rows:
                        store.append({**row, "run": run})
                        if bar is not None:
                            bar.update(1)
                        if on_row is not None:
                            on_row(row, self.live())
            finally:
                if bar is not None:
                    bar.close()

    def _lost_worker_errors(self) -> tuple:
        """Errors that mean the worker's process is gone (not that the decode raised): the actor died,
        Ray's memory monitor killed it, or its node died."""
        exceptions = self.ray.exceptions
        names = ("RayActorError", "OutOfMemoryError", "NodeDiedError", "WorkerCrashedError",
                 "LocalRayletDiedError")
        return tuple(getattr(exceptions, name) for name in names if hasattr(exceptions, name))

    def _hand_out(self, spec, queue: deque, in_flight: dict, done: set[str], slots: int) -> None:
        """Top every live worker up to `max_in_flight` units, one round at a time (fair shares)."""
        for slot in range(self.options.max_in_flight):
            for worker in self.workers:
                while worker.alive and worker.in_flight <= slot and queue:
                    unit = queue.popleft()
                    kept = [(m, k) for m, k in zip(unit.members, unit.keys) if k not in done]
                    if not kept:
                        continue  # its rows landed already: never hand it out again
                    unit.members, unit.keys = [m for m, _ in kept], [k for _, k in kept]
                    rows = [(m[0], m[2]) for m in unit.members]
                    in_flight[worker.handle.decode.remote(spec, unit.config, rows, slots)] = (worker, unit)
                    worker.in_flight += 1

    def _lost(self, worker: _Worker, unit: _Unit, err: BaseException, queue: deque) -> None:
        """A unit whose actor died goes back to the front of the queue; the worker stays only if Ray
        restarted it (and it answers: with --max-restarts the driver waits for that answer, the
        process restart, a few seconds; the pair reloads inside the worker's next unit)."""
        unit.attempts += 1
        if unit.attempts >= MAX_ATTEMPTS:
            raise RayExecutorError(f"{unit.describe()} lost its Ray worker {unit.attempts} times (last: "
                                   f"{_reason(err)}): the unit itself may be killing workers (out of "
                                   "memory?); the rows written stay, and --resume continues")
        queue.appendleft(unit)
        if not worker.alive:
            return
        pid = worker.pid
        if self.options.max_restarts > 0 and self._answers(worker):  # Ray counts the restarts it allows
            if worker.pid != pid:
                worker.restarts += 1
                log.warning("Ray worker %d was restarted (%s); its units are redone", worker.index,
                            _reason(err))
            return
        worker.alive = False
        self._kill(worker)
        log.warning("Ray worker %d (%s) was lost (%s); its units go to the %d remaining", worker.index,
                    worker.where, _reason(err), len(self.live()))

    def _answers(self, worker: _Worker) -> bool:
        """Whether a worker whose unit failed is (again) alive: Ray restarted it, or it is restarting
        (calls fail as 'unavailable' meanwhile) and comes back within the ready time limit."""
        exceptions = self.ray.exceptions
        deadline = time.monotonic() + self.options.ready_timeout_s
        while True:
            try:
                info = self.ray.get(worker.handle.ping.remote(),
                                    timeout=max(1.0, deadline - time.monotonic()))
            except exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.5)
                continue
            except (exceptions.RayError, TimeoutError):
                return False
            worker.where, worker.pid = f"pid {info['pid']} on {info['node']}", info["pid"]
            return True

    def _kill(self, worker: _Worker) -> None:
        try:
            self.ray.kill(worker.handle)
        except Exception:  # already gone
            pass

    def close(self) -> None:
        for worker in self.workers:
            self._kill(worker)
        self.workers = []
        if self._connected:
            self.ray.shutdown()
            self._connected = False

    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
