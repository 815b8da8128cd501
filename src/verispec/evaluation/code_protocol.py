"""The code-task protocol: stop at the end of the first fenced code block, score the sanitised program.

Instruct models asked for a function in a code block often append example calls, prints or asserts of
their own, and a length cap can cut such a self-test mid-token: the whole program is then a
SyntaxError, and a correct function fails through length, not through wrong code. The
protocol removes that confound in two places (docs/design/evaluation.md, 'Code-task protocol'):

- `fence_stop(decode)`: a `DecodeConfig.stop_check` that ends a row at the token completing the
  closing ``` of the reply's first fenced code block (that token is kept even when it carries more
  text), so decoding stops where the answer ends;
- `sanitize(code, entry_points)`: evalplus-style, keeps imports and the function, class and variable
  definitions the entry points need (dependency closure by names), and drops top-level calls, prints,
  asserts and `if __name__ == "__main__"` blocks; trailing lines that do not parse (a reply cut by the
  cap) are cut, so it never raises.
"""

from __future__ import annotations

import ast
import re
from typing import Callable, Iterable

# an opening fence: a line of (at most 3 spaces and) three backticks and an optional info string, complete
_OPEN = re.compile(r"^ {0,3}```[^`\n]*\n", re.M)
# a closing fence: three backticks at the start of a line (indented at most 3 spaces)
_CLOSE = re.compile(r"^ {0,3}```", re.M)

StopCheck = Callable[[list[int]], "int | None"]


def fenced_block_end(text: str) -> int | None:
    """The offset just past the three backticks that close the first fenced code block, None if the
    text has no complete fenced block (no opening fence line, or not yet closed)."""
    opening = _OPEN.search(text)
    if opening is None:
        return None
    closing = _CLOSE.search(text, opening.end())
    return None if closing is None else closing.end()


def first_code_block(text: str) -> str:
    """The contents of the first fenced code block (up to its closing fence, or to the end of the text
    when it is never closed), or the whole text when it has no opening fence."""
    opening = _OPEN.search(text)
    if opening is None:
        return text
    closing = _CLOSE.search(text, opening.end())
    return text[opening.end(): closing.start() if closing else len(text)]


def text_stop(decode: Callable[[list[int]], str], end_of: Callable[[str], int | None]) -> StopCheck:
    """A `DecodeConfig.stop_check` from a condition on the decoded text: `end_of(text)` is None until the
    reply must end. The check returns the length of the shortest prefix of the emitted ids whose text
    already meets the condition (found by bisection: decoding a longer prefix only appends text), so the
    token that completes it is kept whatever else it carries, and a prefix that does not meet it gives
    None (as `DecodeConfig.stop_check` requires of prefixes it saw before)."""

    def check(ids: list[int]) -> int | None:
        if end_of(decode(list(ids))) is None:
            return None
        lo, hi = 0, len(ids)  # invariant: ids[:lo] does not meet the condition, ids[:hi] does
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if end_of(decode(list(ids[:mid]))) is None:
                lo = mid
            else:
                hi = mid
        return hi

    return check


def fence_stop(decode: Callable[[list[int]], str]) -> StopCheck:
    """Stop at the token that completes the closing fence of the reply's first fenced code block."""
    return text_stop(decode, fenced_block_end)


def parseable_prefix(code: str) -> tuple[str, ast.Module]:
    """The longest prefix of whole lines of `code` that parses, and its tree (the empty module at worst):
    a reply cut mid-line by the length cap loses its broken tail, not the function before it."""
    lines = code.splitlines()
    for n in range(len(lines), -1, -1):
        source = "\n".join(lines[:n])
        try:
            return source, ast.parse(source)
        except (SyntaxError, ValueError):  # ValueError: null bytes in the source
            continue
    return "", ast.parse("")


_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_ASSIGNMENTS = (ast.Assign, ast.AnnAssign, ast.AugAssign)


def _names_used(node: ast.stmt) -> set[str]:
    """The global names a statement may read: every name it loads, less (in a function) its parameters
    and the names it binds itself, which are local unless declared global."""
    loads = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return loads
    local = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
    local |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    declared = {name for n in ast.walk(node) if isinstance(n, ast.Global) for name in n.names}
    return (loads - local) | (loads & declared)


def _names_defined(node: ast.stmt) -> set[str]:
    if isinstance(node, _DEFINITIONS):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]  # type: ignore[attr-defined]
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def _segment(lines: list[str], source: str, node: ast.stmt) -> str:
    """A statement's source: whole lines for a definition (its decorators included), the exact segment
    for a simple statement (so `x = 1; print(x)` keeps only `x = 1`)."""
    if isinstance(node, _DEFINITIONS):
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        return "\n".join(lines[first - 1: node.end_lineno])
    return ast.get_source_segment(source, node) or ""


def sanitize(code: str, entry_points: Iterable[str]) -> str:
    """The program evalplus's sanitiser would keep from `code`: every import, and the function, class and
    assignment statements that define a name the entry points need, transitively (a statement is kept
    when it defines a needed name; the names it uses are then needed too); top-level calls, prints,
    asserts, loops and `if __name__ == "__main__"` blocks are dropped. With no entry point defined in
    the code every definition is kept. Trailing lines that do not parse are cut first (`parseable_prefix`).
    Statements keep their order and source text; a name defined twice keeps both (the later one wins
    when run, as in the original)."""
    source, tree = parseable_prefix(code)
    lines = source.splitlines()
    kept: dict[int, ast.stmt] = {}
    candidates: list[tuple[int, ast.stmt, set[str]]] = []
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            kept[i] = node
        elif isinstance(node, _DEFINITIONS + _ASSIGNMENTS):
            candidates.append((i, node, _names_defined(node)))
    defined = set().union(*(names for _, _, names in candidates))
    needed = set(entry_points) & defined
    if not needed:
        needed = defined
    changed = True
    while changed:
        changed = False
        for i, node, names in candidates:
            if i not in kept and names & needed:
                kept[i] = node
                needed |= _names_used(node)
                changed = True
    pieces = [_segment(lines, source, kept[i]) for i in sorted(kept)]
    return "\n".join(pieces) + "\n" if pieces else ""


def called_names(tests: Iterable[str]) -> set[str]:
    """The names of the functions test statements call (e.g. an MBPP assert `assert f(1) == 2` -> {f}):
    the entry points of a sanitised MBPP program. Tests that do not parse contribute nothing."""
    out: set[str] = set()
    for test in tests:
        try:
            tree = ast.parse(test)
        except (SyntaxError, ValueError):
            continue
        out |= {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return out


def humaneval_sanitized_program(prompt: str, reply: str, test: str, entry_point: str) -> str:
    """The HumanEval program of the sanitised protocol: the prompt (its imports, helper functions and the
    entry point's stub) followed by the reply's first code block, sanitised for the entry point, then the
    benchmark's test. The reply may restate the whole function (its definition, later, wins) or continue
    the prompt's body (the block is then the body of the stub)."""
    body = sanitize(prompt + "\n" + first_code_block(reply), [entry_point])
    return f"{body}\n\n{test}\n\ncheck({entry_point})\n"


def mbpp_sanitized_program(setup: str, reply: str, tests: list[str]) -> str:
    """The MBPP program of the sanitised protocol: setup code, the reply's first code block sanitised for
    the functions the tests call, then the tests."""
    code = sanitize(first_code_block(reply), called_names(tests))
    return "\n".join([setup, code, *tests]) + "\n"

