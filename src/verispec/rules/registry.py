"""The rule registry and spec-string parsing: `NAME[:key=value,...]`."""

from __future__ import annotations

import math
from dataclasses import MISSING, fields

from verispec.rules.base import Rule

_REGISTRY: dict[str, type[Rule]] = {}


def register(cls: type[Rule]) -> type[Rule]:
    """Class decorator: make a rule addressable by its `name`."""
    if cls.name in _REGISTRY:
        raise RuntimeError(f"rule name '{cls.name}' registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    """Names of every registered rule, in catalogue order."""
    return list(_REGISTRY)


def rule_class(name: str) -> type[Rule]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown rule '{name}'; known rules: {', '.join(names())}") from None


def _convert(rule: str, key: str, kind: type, text: str, allowed: str) -> object:
    try:
        if kind is int:
            value = float(text)
            if not value.is_integer():
                raise ValueError
            return int(value)
        if kind is float:
            value = float(text)
            if math.isnan(value):
                raise ValueError
            return value
        return text
    except ValueError:
        raise ValueError(f"rule '{rule}': {key}={text!r} is not a valid {kind.__name__}; allowed: {allowed}") from None


def parse(spec: str) -> Rule:
    """Build a rule from its spec string, e.g. `lenience:l=0.5` or `typical:eps=0.09,alpha=0.3`.

    Raises ValueError naming the rule, the key and the allowed range on any bad input.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a rule spec must be a non-empty string like 'lossless' or 'lenience:l=0.5', got {spec!r}")
    name, _, arg_text = spec.strip().partition(":")
    cls = rule_class(name.strip())
    if cls.name == "honest":  # wraps a whole rule spec: honest:<truncation rule spec>
        if not arg_text.strip():
            raise ValueError("rule 'honest' needs a truncation rule to wrap, e.g. honest:speccascade:min_p=0.1")
        return cls(inner=parse(arg_text))
    by_key = {p.key: p for p in cls.params}
    kwargs: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in arg_text.split(","))):
        key, eq, text = (s.strip() for s in item.partition("="))
        if key not in by_key:
            allowed = ", ".join(by_key) or "none"
            raise ValueError(f"rule '{cls.name}' has no parameter '{key}'; its parameters: {allowed}")
        if not eq or not text:
            raise ValueError(f"rule '{cls.name}': parameter '{key}' needs a value ({key}=...; allowed: {by_key[key].allowed})")
        if key in kwargs:
            raise ValueError(f"rule '{cls.name}': parameter '{key}' given twice")
        param = by_key[key]
        kwargs[key] = _convert(cls.name, key, param.kind, text, param.allowed)
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in kwargs]
    if missing:
        allowed = "; ".join(f"{k}: {by_key[k].allowed}" for k in missing)
        raise ValueError(f"rule '{cls.name}' needs parameter(s) {', '.join(missing)} ({allowed})")
    return cls(**kwargs)  # range checks happen in Rule.__post_init__
