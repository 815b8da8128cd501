"""Scorers: exact match, numeric and boxed-answer extraction, execution of code, and text statistics.

Execution scoring runs the program in the sandbox of `verispec.evaluation.sandbox` (a fresh `python -I`
under bubblewrap, read-only file system, no network, as nobody, with memory / process / file size / CPU
limits and a timeout). A timeout, a broken limit or any error counts as a failure.
"""

from __future__ import annotations

import re
from collections import Counter

from verispec.evaluation.sandbox import run_sandboxed

_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*|-?\.\d+")


def normalize_text(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^\w\s]", " ", text.lower())).strip()


def exact_match(output: str, answers: str | list[str]) -> float:
    """1.0 if any accepted answer appears in the output as whole words (case/punctuation-insensitive)."""
    answers = [answers] if isinstance(answers, str) else answers
    out = f" {normalize_text(output)} "
    return float(any(f" {normalize_text(a)} " in out for a in answers))


def extract_number(text: str) -> float | None:
    """The last number in the text (commas removed), GSM8K style; '#### 42' wins if present."""
    marked = re.findall(r"####\s*(-?[\d,]*\.?\d+)", text)
    candidates = marked or _NUMBER.findall(text)
    for raw in reversed(candidates):
        raw = raw.replace(",", "").rstrip(".")
        try:
            return float(raw)
        except ValueError:
            continue
    return None


def numeric_match(output: str, answer: float | str) -> float:
    got = extract_number(output)
    want = extract_number(str(answer)) if not isinstance(answer, (int, float)) else float(answer)
    return float(got is not None and want is not None and abs(got - want) <= 1e-6 * max(1.0, abs(want)))


def extract_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...} (balanced braces), MATH style."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def normalize_math(answer: str) -> str:
    answer = answer.replace("\\left", "").replace("\\right", "").replace("$", "").replace("\\!", "")
    answer = re.sub(r"\\text\{([^}]*)\}", r"\1", answer)
    answer = re.sub(r"\s+", "", answer).rstrip(".")
    answer = re.sub(r"^(-?\d+)\.0+$", r"\1", answer)
    return answer.replace("dfrac", "frac").replace("tfrac", "frac")


def boxed_match(output: str, answer: str) -> float:
    got = extract_boxed(output)
    want = extract_boxed(answer) if "\\boxed" in answer else answer
    return float(got is not None and want is not None and normalize_math(got) == normalize_math(want))


def run_program(program: str, timeout: float = 10.0) -> tuple[bool, str]:
    """Run Python source in the sandbox (`verispec.evaluation.sandbox`); (passed, reason). Never raises,
    never hangs; a broken limit's reason is its name ("memory limit", "process limit", ...)."""
    outcome = run_sandboxed(program, timeout=timeout)
    return outcome.passed, outcome.reason


def extract_code(output: str) -> str:
    """The first fenced code block of a chat answer, or the text itself."""
    match = re.search(r"```(?:python|py)?\s*\n(.*?)(?:```|$)", output, re.S)
    return match.group(1) if match else output


def humaneval_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    code = extract_code(completion)
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.M):
        imports = "\n".join(line for line in prompt.splitlines() if line.startswith(("import ", "from ")))
        body = imports + "\n" + code
    else:
        body = prompt + code
    return f"{body}\n\n{test}\n\ncheck({entry_point})\n"


def ngrams(tokens: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(text: str, n: int = 2) -> float:
    """Distinct n-grams / n-grams over whitespace words (1.0 = no repetition); NaN if too short."""
    grams = ngrams(text.split(), n)
    return len(set(grams)) / len(grams) if grams else float("nan")


def repetition(text: str, n: int = 4) -> float:
    """Fraction of word n-grams that repeat an earlier n-gram of the same text."""
    grams = ngrams(text.split(), n)
    if not grams:
        return float("nan")
    counts = Counter(grams)
    return sum(c - 1 for c in counts.values()) / len(grams)
