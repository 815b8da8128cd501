from __future__ import annotations

import fcntl
import os
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))

# Property tests are derandomised (fixed examples) so CI is reproducible; set
# VERISPEC_HYPOTHESIS=explore locally to search new examples.
settings.register_profile("ci", derandomize=True, max_examples=60, deadline=None, print_blob=True)
settings.register_profile("explore", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("VERISPEC_HYPOTHESIS", "ci"))

# One torch thread in every process the tests start (CLI subprocesses, servers, workers): tiny models gain
# nothing from more, a shared 2-core machine loses a lot, and the thread check stays quiet. Tests of the
# default thread count remove it themselves.
os.environ.setdefault("VERISPEC_THREADS", "1")
# ... and in the xdist workers themselves (the same `$VERISPEC_THREADS`): torch's default (every core) in
# each of two workers put four threads on two cores, and two model-loading modules side by side then took
# twice as long as one after the other (tests/test_int4.py with tests/test_models_batched.py: 38 s
# together, 18 s in turn, on the 2-core Intel Xeon). Not in the controller, which runs no test.
if os.environ.get("PYTEST_XDIST_WORKER"):
    from verispec.threads import configure_threads

    configure_threads()


# The code sandbox fails closed where bubblewrap cannot start. The tests' own programs are written here, so
# there they run with the resource limits only (as --unsafe-no-sandbox would), and the tests that run
# committed model output (`helpers.needs_bwrap`) skip; the fail-closed test removes this itself.
if os.environ.get("VERISPEC_UNSAFE_NO_SANDBOX") is None:
    from verispec.evaluation.sandbox import isolation

    if isolation()[0] != "bwrap":
        os.environ["VERISPEC_UNSAFE_NO_SANDBOX"] = "1"


def pytest_report_header(config):
    from verispec.evaluation.sandbox import isolation

    kind, how = isolation()
    return [f"code sandbox: {how}" + ("" if kind == "bwrap" else
                                      " (the tests' own programs run with resource limits only; tests of "
                                      "committed model output skip)")]


_SECONDS = {"quick": 0.0, "slow": 0.0}


def pytest_runtest_logreport(report):
    """Add up each test's setup + call + teardown time, split by the slow marker."""
    _SECONDS["slow" if "slow" in report.keywords else "quick"] += report.duration


_FUZZ: Counter = Counter()  # tests/test_fuzz.py's input counts, from this process or from xdist workers


def _fuzz_count() -> Counter:
    for name, module in list(sys.modules.items()):
        if name.endswith("test_fuzz") and getattr(module, "COUNT", None):
            return module.COUNT
    return Counter()


# time Ray modules spent waiting for another worker's Ray module (`one_ray_module_at_a_time`), and how
# many took the lock: under xdist the workers report theirs (`workeroutput`), the controller adds them up
_RAY_WAIT = {"seconds": 0.0, "modules": 0}


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand its counts to the controller
        session.config.workeroutput["verispec_fuzz"] = dict(_fuzz_count())
        session.config.workeroutput["verispec_ray_wait"] = dict(_RAY_WAIT)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _FUZZ.update(getattr(node, "workeroutput", {}).get("verispec_fuzz", {}))
    for key, value in getattr(node, "workeroutput", {}).get("verispec_ray_wait", {}).items():
        _RAY_WAIT[key] += value


def pytest_terminal_summary(terminalreporter):
    """Print the time of the quick loop (`-m "not slow"`) and of the slow tests, and the fuzz suite's
    input count (tests/test_fuzz.py), in the terminal summary: CI's log shows both budgets
    (docs/contributing.md, 'For contributors'). Under xdist the times are summed over the workers."""
    terminalreporter.write_line(f"verispec test times: not slow {_SECONDS['quick']:.0f} s, "
                                f"slow {_SECONDS['slow']:.0f} s (setup + call + teardown, summed)"
                                + (f"; {_RAY_WAIT['modules']} Ray module(s) waited "
                                   f"{_RAY_WAIT['seconds']:.0f} s for one another's lock"
                                   if _RAY_WAIT["modules"] else ""))
    count = _FUZZ + _fuzz_count()
    if count:
        terminalreporter.write_line(f"verispec fuzz: {sum(count.values())} generated inputs ({dict(count)})")


# Whole modules that start a Ray instance (several seconds each, even when they refuse early) belong to the
# full suite, not to the quick `pytest -m "not slow"` loop (docs/contributing.md, 'For contributors').
SLOW_MODULES = {"test_ray_sweep.py", "test_ray_serve.py", "test_ray_cluster.py"}


# The modules that take longest in the full suite, heaviest first, in seconds of setup + call + teardown
# summed over their tests (a full run on the 2-core Intel Xeon, 2026-12-06: `pytest --durations=0`, summed
# by file). Under `--dist loadfile` with `--no-loadscope-reorder` (pyproject.toml) xdist hands out modules
# in collection order, so these go first and the many short modules fill in at the end: longest-first
# keeps one worker from starting a 30 s module as the other runs out of work (xdist's default order, by
# test count, sent the one-test 28 s module last and left the other worker idle for it). A module missing
# here only runs later; the figures order, they gate nothing. Sized for the full suite on two workers
# (`-m "not slow"` keeps the order, though most of these modules' tests are then deselected): the Ray
# modules (the first and fourth) then fall to one worker in turn; with three or more workers the second
# Ray module can be handed out while the first holds the Ray lock, and its worker waits.
HEAVY_FIRST = {
    "test_ray_sweep.py": 110, "test_tree_rules.py": 78, "test_bench.py": 64, "test_ray_serve.py": 58,
    "test_decode_trees.py": 43, "test_sandbox.py": 31, "test_decode_hf.py": 30,
    "test_importance_default_pair.py": 28, "test_rules_batched.py": 27, "test_smollm2.py": 27,
    "test_fuzz.py": 26, "test_suites.py": 24, "test_rules_sampling.py": 23, "test_decode_toy.py": 23,
    "test_decode_batched.py": 20, "test_int4.py": 18, "test_hsd.py": 16,
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    # heaviest modules first, each module's tests kept together and in their order (a stable sort)
    items.sort(key=lambda item: -HEAVY_FIRST.get(item.path.name, 0))


@pytest.fixture(scope="module", autouse=True)
def one_ray_module_at_a_time(request, tmp_path_factory):
    """Under pytest-xdist (`-n auto --dist loadfile`, pyproject.toml) each module runs on one worker, in
    order, so its module-scoped fixtures (a loaded pair, a started server) are built once and a module's
    last test can check what the ones before it did (tests/test_fuzz.py's input count). The Ray modules
    take a lock shared by the workers, so two local Ray instances never compete for the same two cores
    and ports. (xdist's `loadgroup` would say this with marks, but its grouping rewrites node ids in a way
    pytest 9 no longer honours.)"""
    if request.node.path.name not in SLOW_MODULES:
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent  # the workers' common parent (one dir without xdist)
    with open(shared / "verispec-ray.lock", "w") as lock:
        start = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)
        _RAY_WAIT["seconds"] += time.monotonic() - start
        _RAY_WAIT["modules"] += 1
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most VERISPEC_TEST_WORKERS (default 2). Each worker loads its own
    models (the default pair, SmolLM2, the llama.cpp pair: about 4 GB at most), so a many-core machine
    does not get dozens of copies; a machine of this project's kind has 2 cores."""
    cap = int(os.environ.get("VERISPEC_TEST_WORKERS", "2"))
    return max(1, min(cap, os.cpu_count() or 1))
