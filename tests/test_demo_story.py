"""`verispec demo` opens with what its run showed, in words with that run's numbers (the truncation gates
against honest truncation, the collaborative rules by overshoot, the budget rule against its bound),
then one compact table; the HTML report leads with the same lines and the speed-vs-shift plot."""

from __future__ import annotations

import re

import pytest

from verispec.cli import main


@pytest.mark.slow
def test_the_demo_states_its_findings_in_its_first_lines(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "demo"), "--prompts", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    head = out[:15]
    assert head[0] == "what this run showed:"
    for lead in ("- truncation gate speccascade:min_p=0.1: ", "- truncation gate typical:",
                 "- collaborative lenience:l=0.5: overshoot p95 ",
                 "- collaborative cos:w=0.5: overshoot p95 ", "- bounded budget:tv=0.05,ratio=2.0: TV ",
                 "- lossless: TV 0.000 (exact)"):
        assert any(line.startswith(lead) for line in head), (lead, head)
    gate = next(line for line in head if line.startswith("- truncation gate speccascade"))
    assert re.search(r"[\d.]+x plain's speed, TV 0\.\d{3} from the target; .* against honest speccascade",
                     gate)
    lenience = next(line for line in head if line.startswith("- collaborative lenience"))
    p95 = float(re.search(r"overshoot p95 ([\d.]+) \(capped at 1/l\)", lenience).group(1))
    assert p95 <= 2.0  # the rule's cap, 1/l, whatever the tokens (its value is the run's)
    budget = next(line for line in head if line.startswith("- bounded budget"))
    assert "(within its bound 0.05)" in budget  # the rule's guarantee, measured
    assert any(line.startswith("config ") and "overshoot p95" in line for line in out[:20])  # compact table
    assert "planned comparisons:" not in "\n".join(out)  # the full tables are behind --full
    html = (tmp_path / "demo" / "report.html").read_text()
    assert html.index("What this run showed") < html.index("Speed, shift and quality per rule")
    assert "speed_vs_fidelity_lead" in html
