"""Several prompts through `verispec.generate` and `verispec run`: each row equals its prompt alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import verispec

PROMPTS = ["KING.\nWhat says the queen?\n", "To be", "ROMEO.\nBut soft, what light"]


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["auto", None])
def test_generate_several_prompts_equals_each_alone(draft):
    rule = "lenience:l=0.5" if draft else "lossless"  # plain decoding (draft None) refuses a lossy rule
    many = verispec.generate(PROMPTS, draft=draft, rule=rule, seed=5, max_new_tokens=24, batch_size=2)
    assert isinstance(many, list) and len(many) == len(PROMPTS)
    for i, (prompt, result) in enumerate(zip(PROMPTS, many)):
        alone = verispec.generate(prompt, draft=draft, rule=rule, seed=5 + i, max_new_tokens=24)
        assert result.token_ids == alone.token_ids
        assert result.stats["acceptance_rate"] == pytest.approx(alone.stats["acceptance_rate"], nan_ok=True)
        # per-token rounding of batched matmuls: the bound of tests/test_bench.py
        assert abs(result.stats["mean_tv"] - alone.stats["mean_tv"]) <= 1e-5
    explicit = verispec.generate(PROMPTS[:2], draft=draft, seed=[7, 3], max_new_tokens=8)
    assert explicit[1].token_ids == verispec.generate(PROMPTS[1], draft=draft, seed=3,
                                                      max_new_tokens=8).token_ids


def test_generate_several_prompts_bad_input():
    with pytest.raises(ValueError, match="one seed per prompt"):
        verispec.generate(PROMPTS, seed=[1, 2])
    with pytest.raises(ValueError, match="batch_size"):
        verispec.generate(PROMPTS, batch_size=0)
    with pytest.raises(TypeError, match="item 1"):
        verispec.generate([[1, 2], [3, 4.5]])


@pytest.mark.slow
def test_cli_run_several_prompts_prints_one_json_line_each():
    cmd = [sys.executable, "-m", "verispec", "run", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
           "--max-new-tokens", "8", "--seed", "2", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 2
    alone = verispec.generate(PROMPTS[1], seed=3, max_new_tokens=8)
    assert rows[1]["token_ids"] == alone.token_ids
