"""One thread setting for every entry point (`--threads`, `$VERISPEC_THREADS`), and its checks."""

from __future__ import annotations

import os

import pytest
import torch

from verispec import threads
from verispec.cli import main
from verispec.models import load_model


def test_explicit_then_environment_then_default(monkeypatch):
    monkeypatch.delenv(threads.ENV, raising=False)
    assert threads.resolve_threads(3) == 3
    assert threads.resolve_threads("2") == 2
    default = threads.resolve_threads()
    usable = len(os.sched_getaffinity(0))
    assert 1 <= default <= usable  # never more threads than CPUs this process may run on
    cores = threads.physical_cores()
    assert cores is None or default <= cores
    monkeypatch.setenv(threads.ENV, "1")
    assert threads.resolve_threads() == 1
    assert threads.resolve_threads(2) == 2  # the flag wins over the environment


@pytest.mark.parametrize("bad", [0, -1, "two", "1.5", "1_0", True, 2.5])
def test_bad_thread_counts_are_refused(bad, monkeypatch):
    monkeypatch.delenv(threads.ENV, raising=False)
    with pytest.raises(ValueError, match="--threads must be a whole number"):
        threads.resolve_threads(bad)
    monkeypatch.setenv(threads.ENV, str(bad))
    with pytest.raises(ValueError, match=r"\$VERISPEC_THREADS"):
        threads.resolve_threads()


def test_configure_sets_torch_threads():
    before = torch.get_num_threads()
    try:
        assert threads.configure_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_check_compares_against_one_thread(monkeypatch):
    """The warning appears exactly when the measured many-thread time exceeds the one-thread time."""
    assert threads.check_threads(1) is None
    times = {1: 0.010, 2: 0.030}
    monkeypatch.setattr(threads, "matmul_seconds", lambda n, repeats=5: times[n])
    assert "slower than 1 thread" in threads.check_threads(2)
    times[2] = 0.006
    assert threads.check_threads(2) is None


def test_the_cli_refuses_a_bad_count_before_loading_anything(capsys):
    """In-process (no interpreter start-up): exit status 2, the message, and no model asked for."""
    before = load_model.cache_info()
    assert main(["run", "--prompt", "x", "--threads", "0"]) == 2
    assert "--threads must be a whole number of threads >= 1, got '0'" in capsys.readouterr().err
    after = load_model.cache_info()
    assert (after.hits, after.misses) == (before.hits, before.misses)  # load_model was never called
