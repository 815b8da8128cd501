"""One spec grammar and one small generic registry, for rules, models, drafters, suites and divergences.

A spec string is `NAME` or `NAME:ARGS`. For most entries ARGS is `key=value,...`, parsed against
the entry's declared `Param`s (type, allowed range in words, check); a few entries take ARGS whole
(a wrapped rule spec for `honest:<rule>`, a file path for `gsm8k:PATH`). Every failure is a
`ValueError` in one shape: an unknown name lists the known ones, an unknown key lists the allowed
keys, a bad value names the key and its allowed range. See docs/design.md, section 'Layering'.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Param:
    """One parameter of a spec: its key, type (int, float or str), allowed range in words, and check."""

    key: str
    kind: type
    allowed: str
    check: Callable[[Any], bool]
    help: str = ""


def split(spec: object, kind: str, example: str) -> tuple[str, str]:
    """`NAME[:ARGS]` -> (name, args text); a non-string or empty spec is a ValueError."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a {kind} spec must be a non-empty string like {example!r}, got {spec!r}")
    name, _, args = spec.strip().partition(":")
    return name.strip(), args.strip()


# A number as the grammar writes it: ASCII digits, an optional point and exponent, or inf. Python's
# float()/int() also take underscores (`0_5` is 5.0) and non-ASCII digits: refused, not guessed.
NUMBER = re.compile(r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf|infinity)", re.ASCII | re.IGNORECASE)


def convert(kind: str, name: str, param: Param, text: str) -> object:
    """The value of `key=text` as the parameter's type (integers may be written 3 or 3.0)."""
    if param.kind in (int, float) and not NUMBER.fullmatch(text):
        hint = " (digit separators '_' are not allowed)" if "_" in text else ""
        raise ValueError(f"{kind} '{name}': {param.key}={text!r} is not a plain decimal number{hint}; "
                         f"allowed: {param.allowed}")
    try:
        if param.kind is int:
            value = float(text)
            if not value.is_integer():
                raise ValueError
            return int(value)
        if param.kind is float:
            value = float(text)
            if math.isnan(value):
                raise ValueError
            return value
        return text
    except (ValueError, OverflowError):
        raise ValueError(
            f"{kind} '{name}': {param.key}={text!r} is not a valid {param.kind.__name__}; "
            f"allowed: {param.allowed}"
        ) from None


def parse_params(kind: str, name: str, args: str, params: tuple[Param, ...],
                 required: tuple[str, ...] = ()) -> dict[str, object]:
    """Parse `key=value,...` against `params`; checks types, ranges and that `required` keys are given."""
    by_key = {p.key: p for p in params}
    values: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in args.split(","))):
        key, eq, text = (s.strip() for s in item.partition("="))
        if key not in by_key:
            raise ValueError(f"{kind} '{name}' has no parameter '{key}'; "
                             f"its parameters: {', '.join(by_key) or 'none'}")
        if not eq or not text:
            raise ValueError(f"{kind} '{name}': parameter '{key}' needs a value ({key}=...; "
                             f"allowed: {by_key[key].allowed})")
        if key in values:
            raise ValueError(f"{kind} '{name}': parameter '{key}' given twice")
        values[key] = convert(kind, name, by_key[key], text)
    missing = [k for k in required if k not in values]
    if missing:
        allowed = "; ".join(f"{k}: {by_key[k].allowed}" for k in missing)
        raise ValueError(f"{kind} '{name}' needs parameter(s) {', '.join(missing)} ({allowed})")
    check_ranges(kind, name, params, values)
    return values


def check_ranges(kind: str, name: str, params: tuple[Param, ...], values: dict[str, object]) -> None:
    """ValueError naming the key and its allowed range for the first value its check refuses."""
    for param in params:
        if param.key in values and not param.check(values[param.key]):
            raise ValueError(f"{kind} '{name}': {param.key}={values[param.key]!r} is out of range; "
                             f"allowed: {param.allowed}")


class Registry(Generic[T]):
    """Names -> entries of one kind ("rule", "model", ...), in registration order."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        if name in self._entries:
            raise RuntimeError(f"{self.kind} name '{name}' registered twice")
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add`."""
        return lambda entry: self.add(name, entry)

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.kind} {name!r}; "
                             f"known {self.kind}s: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)
