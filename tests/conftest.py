from __future__ import annotations

import os
import sys
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


_SECONDS = {"quick": 0.0, "slow": 0.0}


def pytest_runtest_logreport(report):
    """Add up each test's setup + call + teardown time, split by the slow marker."""
    _SECONDS["slow" if "slow" in report.keywords else "quick"] += report.duration


def pytest_terminal_summary(terminalreporter):
    """Print the time of the quick loop (`-m "not slow"`) and of the slow tests, and the fuzz suite's
    input count (tests/test_fuzz.py), in the terminal summary: CI's log shows both budgets (README,
    'For contributors')."""
    terminalreporter.write_line(f"verispec test times: not slow {_SECONDS['quick']:.0f} s, "
                                f"slow {_SECONDS['slow']:.0f} s (setup + call + teardown, summed)")
    for name, module in list(sys.modules.items()):
        if name.endswith("test_fuzz") and getattr(module, "COUNT", None):
            count = module.COUNT
            total = sum(count.values())
            terminalreporter.write_line(f"verispec fuzz: {total} generated inputs ({dict(count)})")


# Whole modules that start a Ray instance (several seconds each, even when they refuse early) belong to the
# full suite, not to the quick `pytest -m "not slow"` loop (README, 'For contributors').
SLOW_MODULES = {"test_ray_sweep.py", "test_ray_serve.py", "test_ray_cluster.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
