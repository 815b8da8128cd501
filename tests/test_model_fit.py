"""Named models on the path that fits the machine (`verispec.models.fit`): the Qwen names load their fast
int4 models unless a dtype is given, and a load that cannot fit in the memory available now is refused
before anything loads, with its size and the smaller path."""

from __future__ import annotations

import pytest

from verispec.cli import main
from verispec.models import fit


def test_the_qwen_names_take_the_fast_path_unless_a_dtype_is_given():
    name, dtype, note = fit.fast_path("qwen2.5-coder-1.5b", None)
    assert (name, dtype) == ("qwen2.5-coder-1.5b-int4", "float32") and "--dtype" in note
    assert fit.fast_path("qwen2.5-coder-1.5b", "float32") == ("qwen2.5-coder-1.5b", "float32", None)
    assert fit.fast_path("qwen2.5-coder-0.5b", "bfloat16") == ("qwen2.5-coder-0.5b", "bfloat16", None)
    assert fit.fast_path("default", None) == ("default", "float32", None)
    assert fit.fast_path("ngram:n=3", None) == ("ngram:n=3", "float32", None)


def test_check_fits_refuses_with_the_size_and_the_smaller_path(monkeypatch):
    monkeypatch.delenv(fit.SKIP_ENV, raising=False)
    loads = [("qwen2.5-coder-0.5b", "float32")]
    with pytest.raises(MemoryError, match=r"needs about 7\.0 GB .* 2\.0 GB is available .*0\.5b-int4"):
        fit.check_fits(loads, available=2.0)
    fit.check_fits(loads, available=64.0)  # fits
    fit.check_fits([("some/local/path", "float32")], available=0.1)  # not measured: no check
    monkeypatch.setenv(fit.SKIP_ENV, "1")
    fit.check_fits(loads, available=0.1)  # skipped on request


def test_run_is_refused_before_loading_when_the_pair_cannot_fit(monkeypatch, capsys):
    monkeypatch.delenv(fit.SKIP_ENV, raising=False)
    monkeypatch.setattr(fit, "available_gb", lambda: 1.0)  # as on a machine whose memory others hold
    code = main(["run", "--target", "qwen2.5-coder-0.5b", "--dtype", "float32", "--draft", "none",
                 "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "needs about 7.0 GB resident and 1.0 GB is available" in err
    assert "qwen2.5-coder-0.5b-int4" in err
    code = main(["run", "--target", "qwen2.5-coder-0.5b", "--draft", "none", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "the fast path, qwen2.5-coder-0.5b-int4" in err and "needs about 2.2 GB" in err
