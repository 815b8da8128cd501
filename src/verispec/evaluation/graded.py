"""A difficulty-graded task with exact answers, generated deterministically (suite `graded`).

Five levels, 40 problems each, from one fixed seed: (1) a two-number sum, (2) two operations,
(3) a four-operation expression with an exact division, (4) a two-to-three-step word problem,
(5) a four-to-five-step word problem with exact divisions. Every answer is an integer computed while
the problem is built, and every problem carries the arithmetic expression of its solution (`meta
["expression"]`), which tests evaluate independently. Scored by exact match of the final number
(`scorers.numeric_match`: the number after '####', else the last number). It tests the claim that a
truncation verifier falls further behind truncation sampling as problems get harder (issue 23; the
report prints the gap per level: `comparisons.level_table`).

A second graded task (suite `graded-steps`) grades by one thing only, the number of dependent steps:
level L is a chain of 2L operations (add, subtract, multiply by a digit, exact division by a digit) on
a starting number, every intermediate a positive integer below 1000. Each step is a chance to slip, so
a model's accuracy falls with the chain's length whatever the operations it finds easy, which is what
the first task's levels fail to do on a code model (README, 'The graded task on the Qwen pair').
"""

from __future__ import annotations

import random
import re

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
STEPS_PER_LEVEL = (2, 4, 6, 8, 10)
CHAIN_LIMIT = 1000  # every intermediate value lies in 1 .. CHAIN_LIMIT - 1


def _chain(rng: random.Random, steps: int) -> tuple[str, str, int]:
    """A chain of `steps` operations on a starting number, each allowed only where its result is a
    positive integer below CHAIN_LIMIT (division only when exact), drawn uniformly among those allowed."""
    start = value = rng.randint(2, 30)
    expression, lines = str(start), []
    for n in range(1, steps + 1):
        add, sub, mul, div = rng.randint(3, 49), rng.randint(3, 49), rng.randint(2, 9), rng.randint(2, 9)
        allowed = [op for op, ok in (("add", value + add < CHAIN_LIMIT), ("sub", value - sub >= 1),
                                     ("mul", value * mul < CHAIN_LIMIT),
                                     ("div", value % div == 0 and value // div >= 2)) if ok]
        op = rng.choice(allowed)  # "sub" or "add" is always allowed: value < CHAIN_LIMIT
        operand, symbol, word = {"add": (add, "+", "Add"), "sub": (sub, "-", "Subtract"),
                                 "mul": (mul, "*", "Multiply by"), "div": (div, "//", "Divide by")}[op]
        value = {"+": value + operand, "-": value - operand, "*": value * operand,
                 "//": value // operand}[symbol]
        expression = f"({expression}) {symbol} {operand}" if n > 1 else f"{expression} {symbol} {operand}"
        lines.append(f"{n}. {word} {operand}.")
    text = f"Start with {start} and apply these steps in order:\n" + "\n".join(lines) + \
        "\nWhat number do you end with?"
    return text, expression, value


def _steps_generators() -> tuple:
    return tuple((lambda rng, s=s: _chain(rng, s)) for s in STEPS_PER_LEVEL)


def _generate(makers: tuple, prefix: str, seed: int, per_level: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for level, make in enumerate(makers, start=1):
        seen: set[str] = set()
        while len([p for p in out if p["level"] == level]) < per_level:
            question, expression, answer = make(rng)
            if question in seen or answer <= 0:
                continue
            seen.add(question)
            n = len(seen)
            out.append({"id": f"{prefix}-L{level}-{n:02d}", "level": level, "question": question,
                        "prompt": question + INSTRUCTION, "answer": answer, "expression": expression})
    return out


def generate(seed: int = SEED, per_level: int = PER_LEVEL) -> list[dict]:
    """The problems, level by level: dicts with id ('graded-L<level>-<nn>'), level, question, prompt,
    answer (an int) and expression (the solution's arithmetic, in Python)."""
    return _generate(GENERATORS, "graded", seed, per_level)


def generate_steps(seed: int = STEPS_SEED, per_level: int = PER_LEVEL) -> list[dict]:
    """The `graded-steps` problems, as `generate` (ids 'graded-steps-L<level>-<nn>'): level L chains
    STEPS_PER_LEVEL[L - 1] operations."""
    return _generate(_steps_generators(), "graded-steps", seed, per_level)


def interleaved(problems: list[dict]) -> list[dict]:
    """The problems with the levels taken in turn (the first of each level, then the second of each, ...),
    so that any prefix is balanced across levels (to one problem)."""
    by_level: dict[int, list[dict]] = {}
    for p in problems:
        by_level.setdefault(p["level"], []).append(p)
    queues = [by_level[lv] for lv in sorted(by_level)]
    return [q[n] for n in range(max(map(len, queues), default=0)) for q in queues if n < len(q)]


_LEVEL_ID = re.compile(r"graded(?:-steps)?-L(\d+)-")


def level_of(prompt_id: str) -> int | None:
    """The level of a graded problem from its id ('graded-L3-07', 'graded-steps-L3-07' -> 3); None for
    other ids."""
    found = _LEVEL_ID.match(prompt_id) if isinstance(prompt_id, str) else None
    return int(found.group(1)) if found else None
