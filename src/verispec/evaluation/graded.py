"""A difficulty-graded task with exact answers, generated deterministically (suite `graded`).

Five levels, 40 problems each, from one fixed seed: (1) a two-number sum, (2) two operations,
(3) a four-operation expression with an exact division, (4) a two-to-three-step word problem,
(5) a four-to-five-step word problem with exact divisions. Every answer is an integer computed while
the problem is built, and every problem carries the arithmetic expression of its solution (`meta
["expression"]`), which tests evaluate independently. Scored by exact match of the final number
(`scorers.numeric_match`: the number after '####', else the last number). It tests the claim that a
truncation verifier falls further behind truncation sampling as problems get harder (the
report prints the gap per level: `comparisons.level_table`).

A second graded task (suite `graded-steps`) grades by the number of dependent steps: level L is a
chain of 2L operations (add or subtract 3-49, multiply by a digit, exact division by a digit) on a
starting number, every intermediate a positive integer below 1000, every step drawn by the same rule.
The shown start is itself reached by BURN_IN hidden steps, so the numbers a step acts on have the same
spread at every level (a chain started at a small number would do harder arithmetic the longer it
runs), and no step undoes the one before. Each step is one more chance to slip; whether that makes
the levels difficulty levels on a given model is measured, not assumed (docs/findings.md, 'A second graded
task'). The first task's levels change the kind of problem too, and on the Qwen coder they are not
ordered by difficulty (docs/findings.md, 'The graded task on the Qwen pair').

A held-out set of the second task (suite `graded-steps-heldout`): the same rule from another seed, 80
problems a level, none of whose questions is in `graded-steps`. It exists so that a pattern first seen on
`graded-steps` can be tested confirmatorily on problems it was not seen on (a pattern of 200 fixed
problems repeats on every sampling seed, so new seeds alone cannot confirm it).
"""

from __future__ import annotations

import random
import re
from functools import partial
from typing import Callable, Sequence

SEED = 20260
LEVELS = 5
PER_LEVEL = 40
INSTRUCTION = "\nSolve it step by step, then give the final answer as a number on the last line after '####'."

NAMES = ("Ada", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas")


def _level1(rng: random.Random) -> tuple[str, str, int]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"What is {a} + {b}?", f"{a} + {b}", a + b


def _level2(rng: random.Random) -> tuple[str, str, int]:
    a, b, c = rng.randint(11, 99), rng.randint(3, 9), rng.randint(5, 60)
    return f"What is {a} * {b} - {c}?", f"{a} * {b} - {c}", a * b - c


def _level3(rng: random.Random) -> tuple[str, str, int]:
    a, b, c = rng.randint(10, 60), rng.randint(10, 60), rng.randint(3, 12)
    e = rng.randint(2, 9)
    d = e * rng.randint(3, 30)  # divisible by e: the division is exact
    return (f"What is ({a} + {b}) * {c} - {d} / {e}?", f"({a} + {b}) * {c} - {d} // {e}",
            (a + b) * c - d // e)


def _level4(rng: random.Random) -> tuple[str, str, int]:
    name = rng.choice(NAMES)
    if rng.random() < 0.5:
        trays, per_tray = rng.randint(3, 12), rng.randint(6, 24)
        sold = rng.randint(5, trays * per_tray // 2)
        given = rng.randint(1, trays * per_tray - sold - 1)
        text = (f"{name} bakes {trays} trays of {per_tray} cookies each, sells {sold} cookies and gives "
                f"{given} cookies to friends. How many cookies are left?")
        return text, f"{trays} * {per_tray} - {sold} - {given}", trays * per_tray - sold - given
    price, count, paid_extra = rng.randint(3, 19), rng.randint(2, 9), rng.randint(1, 30)
    paid = price * count + paid_extra
    text = (f"{name} buys {count} notebooks at {price} dollars each and pays with {paid} dollars. How many "
            "dollars of change does {name} get?").replace("{name}", name)
    return text, f"{paid} - {count} * {price}", paid - count * price


def _level5(rng: random.Random) -> tuple[str, str, int]:
    name = rng.choice(NAMES)
    if rng.random() < 0.5:
        classes, students = rng.randint(2, 6), rng.randint(3, 9)
        each, reserve = rng.randint(2, 7), rng.randint(1, 9)
        per_class = reserve + students * each
        total = per_class * classes
        box = rng.choice([d for d in range(4, 25) if total % d == 0] or [1])
        boxes = total // box
        text = (f"A school orders {boxes} boxes of {box} pencils. The pencils are shared equally among "
                f"{classes} classes. Each class keeps {reserve} pencils in reserve and shares the rest "
                f"equally among its {students} students. How many pencils does each student get?")
        return text, f"(({boxes} * {box}) // {classes} - {reserve}) // {students}", each
    weeks, per_week = rng.randint(3, 10), rng.randint(5, 25)
    spent, friends = rng.randint(5, 40), rng.randint(2, 5)
    saved = weeks * per_week
    gift = rng.randint(1, 20)
    left = saved + gift - spent
    left -= left % friends  # make the split exact: adjust what was spent
    spent = saved + gift - left
    text = (f"{name} saves {per_week} dollars a week for {weeks} weeks and gets a {gift}-dollar gift. "
            f"{name} then spends {spent} dollars on a game and splits the rest equally among "
            f"{friends} friends. How many dollars does each friend get?")
    return text, f"({weeks} * {per_week} + {gift} - {spent}) // {friends}", left // friends


GENERATORS = (_level1, _level2, _level3, _level4, _level5)

STEPS_SEED = 20261
STEPS_HELDOUT_SEED = 20262
STEPS_HELDOUT_PER_LEVEL = 80
STEPS_PER_LEVEL = (2, 4, 6, 8, 10)
CHAIN_LIMIT = 1000  # every intermediate value lies in 1 .. CHAIN_LIMIT - 1
BURN_IN = 10  # hidden steps before the shown start: every level's steps act on numbers alike
STEPS_INSTRUCTION = ("\nWork it out by hand, step by step, without writing code, then give the final answer "
                     "as a number on the last line after '####'.")
_OPS = {"add": ("+", "Add"), "sub": ("-", "Subtract"), "mul": ("*", "Multiply by"),
        "div": ("//", "Divide by")}
_INVERSE = {"add": "sub", "sub": "add", "mul": "div", "div": "mul"}

Step = tuple[str, int, int]  # (operation, operand, the value after it)
Maker = Callable[[random.Random], tuple[str, str, int]]  # rng -> (question, expression, answer)


def _step(rng: random.Random, value: int, previous: tuple[str, int] | None) -> Step:
    """One operation on `value`, drawn uniformly among those whose result is a positive integer below
    CHAIN_LIMIT (division only when exact), never the exact inverse of the previous step (e.g. add 18
    right after subtract 18); operands are redrawn until some operation is allowed."""
    while True:
        operands = {"add": rng.randint(3, 49), "sub": rng.randint(3, 49), "mul": rng.randint(2, 9),
                    "div": rng.randint(2, 9)}
        results = {"add": value + operands["add"], "sub": value - operands["sub"],
                   "mul": value * operands["mul"], "div": value // operands["div"]}
        allowed = [op for op in _OPS if 1 <= results[op] < CHAIN_LIMIT
                   and (op != "div" or (value % operands["div"] == 0 and results[op] >= 2))
                   and (previous is None or (_INVERSE[previous[0]], previous[1]) != (op, operands[op]))]
        if allowed:
            op = rng.choice(allowed)
            return op, operands[op], results[op]


def _chain(rng: random.Random, steps: int) -> tuple[str, str, int]:
    """A chain of `steps` operations (`_step`) on a start reached by BURN_IN hidden steps from a number in
    2..30, so that the shown steps of every level act on numbers of the same sizes."""
    value, previous = rng.randint(2, 30), None
    for _ in range(BURN_IN):
        op, operand, value = _step(rng, value, previous)
        previous = (op, operand)
    start, expression, lines = value, str(value), []
    for n in range(1, steps + 1):
        op, operand, value = _step(rng, value, previous)
        previous = (op, operand)
        symbol, word = _OPS[op]
        expression = f"({expression}) {symbol} {operand}" if n > 1 else f"{expression} {symbol} {operand}"
        lines.append(f"{n}. {word} {operand}.")
    text = f"Start with {start} and apply these steps in order:\n" + "\n".join(lines) + \
        "\nWhat number do you end with?"
    return text, expression, value


_STEP_MAKERS = tuple(partial(_chain, steps=steps) for steps in STEPS_PER_LEVEL)


def _generate(makers: Sequence[Maker], prefix: str, instruction: str, seed: int,
              per_level: int, exclude: frozenset[str] | set[str] = frozenset()) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for level, make in enumerate(makers, start=1):
        seen: set[str] = set()
        while len([p for p in out if p["level"] == level]) < per_level:
            question, expression, answer = make(rng)
            if question in seen or question in exclude or answer <= 0:
                continue
            seen.add(question)
            n = len(seen)
            out.append({"id": f"{prefix}-L{level}-{n:02d}", "level": level, "question": question,
                        "prompt": question + instruction, "answer": answer, "expression": expression})
    return out


def generate(seed: int = SEED, per_level: int = PER_LEVEL) -> list[dict]:
    """The problems, level by level: dicts with id ('graded-L<level>-<nn>'), level, question, prompt,
    answer (an int) and expression (the solution's arithmetic, in Python)."""
    return _generate(GENERATORS, "graded", INSTRUCTION, seed, per_level)


def generate_steps(seed: int = STEPS_SEED, per_level: int = PER_LEVEL) -> list[dict]:
    """The `graded-steps` problems, as `generate` (ids 'graded-steps-L<level>-<nn>'): level L chains
    STEPS_PER_LEVEL[L - 1] operations; the prompt asks for working by hand (STEPS_INSTRUCTION)."""
    return _generate(_STEP_MAKERS, "graded-steps", STEPS_INSTRUCTION, seed, per_level)


def generate_steps_heldout(seed: int = STEPS_HELDOUT_SEED,
                           per_level: int = STEPS_HELDOUT_PER_LEVEL) -> list[dict]:
    """The `graded-steps-heldout` problems (ids 'graded-steps-heldout-L<level>-<nn>'): `generate_steps`'s
    rule from another seed, with every question that `generate_steps()` also drew left out, so the two
    sets share no problem."""
    seen = {p["question"] for p in generate_steps()}
    return _generate(_STEP_MAKERS, "graded-steps-heldout", STEPS_INSTRUCTION, seed, per_level, exclude=seen)


def interleaved(problems: list[dict], key: str = "level") -> list[dict]:
    """The problems with the values of `key` (the level by default), in sorted order, taken in turn (the
    first problem of each, then the second of each, ...), so that any prefix is balanced across them (to
    one problem)."""
    groups: dict[object, list[dict]] = {}
    for p in problems:
        groups.setdefault(p[key], []).append(p)
    queues = [groups[value] for value in sorted(groups)]
    return [q[n] for n in range(max(map(len, queues), default=0)) for q in queues if n < len(q)]


_LEVEL_ID = re.compile(r"graded(?:-steps(?:-heldout)?)?-L(\d+)-")


def level_of(prompt_id: str) -> int | None:
    """The level of a graded problem from its id ('graded-L3-07', 'graded-steps-L3-07',
    'graded-steps-heldout-L3-07' -> 3); None for other ids."""
    found = _LEVEL_ID.match(prompt_id) if isinstance(prompt_id, str) else None
    return int(found.group(1)) if found else None
