"""Smaller reliability cases: a k given with a tree that fixes its own depth is refused (not ignored),
and the secondary tables name a temperature exactly (T = 1.0000001 is not 'T=1', another config)."""

from __future__ import annotations

import pytest

import verispec
from verispec.cli import main
from verispec.evaluation.comparisons import canonical_side, config_name


@pytest.mark.parametrize("shape", [{"tree": "2,2"}, {"tree": "nodes=8,depth=3,topk=2"},
                                   {"drafts": "n=2,depth=3"}])
def test_generate_refuses_k_with_a_shape_of_its_own_depth(shape):
    with pytest.raises(ValueError, match="leave k out"):
        verispec.generate("To be", target="default", k=7, max_new_tokens=2, **shape)


def test_run_refuses_k_with_a_tree(capsys):
    assert main(["run", "--prompt", "To be", "--tree", "2,2", "--k", "7", "--max-new-tokens", "2"]) == 2
    assert "leave k out" in capsys.readouterr().err


def test_a_shape_without_a_depth_takes_k():
    out = verispec.generate("To be", target="default", k=3, max_new_tokens=4, drafts="n=2")
    assert len(out.token_ids) == 4


def test_temperatures_are_named_exactly_in_comparison_tables():
    assert config_name(("plain", 0, 1.0000001, None)) == "plain T=1.0000001"
    assert config_name(("lossless", 4, 1.0, None)) == "lossless k=4 T=1"
    assert config_name(("lossless", 4, 0.7, None)) == "lossless k=4 T=0.7"
    assert canonical_side("lossless k=4 T=1.0000001").endswith("T=1.0000001")
